"""Benchmark, side by side in one run: generation tokens/s of the KV-cached loop (kiln.model.generate) against the
uncached loop it replaced (one full forward pass of the cropped context per new token), for both families at demo
size, and the RL stage's step with each loop: its rollout (sample_rollout: sampling the groups, their rewards and the
reference's log-probs; rollout tokens/s) and its update (rollout_policy_loss and its backward), timed apart.

Run: python bench/bench_generate.py [--repeat 2] [--threads N] [--out bench/results/STEM]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kiln.posttrain.sampling as sampling  # noqa: E402
from kiln.model.config import ModelConfig, padded_vocab, preset_fields  # noqa: E402
from kiln.model.families import build_model  # noqa: E402
from kiln.model.generate import generate  # noqa: E402
from kiln.posttrain.instructions import arithmetic, arithmetic_reward  # noqa: E402
from kiln.posttrain.logprobs import model_token_logps  # noqa: E402
from kiln.posttrain.rl import RlJob, rollout_policy_loss, sample_rollout  # noqa: E402
from kiln.tokens.tokenizer import train_bpe  # noqa: E402
from provenance import machine_line, write_results  # noqa: E402

CASES = [(1, 16, 64), (8, 16, 64), (8, 128, 64), (4, 224, 48)]  # (rows, prompt, new); the last runs 16 tokens past block 256
RL_SHAPES = {"demo": dict(prompts=8, group_size=8, max_new_tokens=16),  # RlJob's defaults (the demo preset sets none)
             "smoke": dict(prompts=4, group_size=4, max_new_tokens=10)}  # conf/presets/smoke.yaml rl_model


@torch.no_grad()
def uncached_loop(model, x, max_new_tokens, temperature, stop_token=None, generator=None, n_vocab=None):
    """The loop kiln.posttrain.sampling.sample ran before the KV cache: the whole cropped context every step."""
    done = torch.zeros(x.size(0), dtype=torch.bool, device=x.device)  # (B,)
    for _ in range(max_new_tokens):
        logits = model(x[:, -model.config.block_size :])[:, -1, :]  # (B, V)
        if n_vocab is not None:
            logits[:, n_vocab:] = float("-inf")
        if temperature <= 0:
            nxt = logits.argmax(dim=-1)  # (B,)
        else:
            nxt = torch.multinomial(F.softmax(logits / temperature, dim=-1), 1, generator=generator).squeeze(-1)
        if stop_token is not None:
            nxt = torch.where(done, torch.full_like(nxt, stop_token), nxt)
            done |= nxt == stop_token
        x = torch.cat([x, nxt[:, None]], dim=1)  # (B, L+1)
        if bool(done.all()):
            break
    return x


def timed(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def demo_model(family: str, vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(**preset_fields("demo", family), vocab_size=vocab)).eval()


def bench_tokens(family: str, vocab: int, repeat: int) -> list[dict]:
    """Greedy decoding of random prompts at each CASES shape, uncached then cached; tokens must agree."""
    model = demo_model(family, vocab)
    rows = []
    for b, t, n in CASES:
        x = torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(t))  # (B, T)
        generate(model, x[:, :4], 4)  # warm up
        t_old, old = timed(lambda: uncached_loop(model, x, n, 0.0), repeat)
        t_new, new = timed(lambda: generate(model, x, n), repeat)
        r = {"family": family, "rows": b, "prompt": t, "new": n, "same_tokens": bool(torch.equal(old, new)),
             "uncached_tok_s": b * n / t_old, "cached_tok_s": b * n / t_new, "speedup": t_old / t_new}
        print(f"{family:5} rows {b} prompt {t:3} new {n:3}: uncached {r['uncached_tok_s']:7.1f} tok/s, cached "
              f"{r['cached_tok_s']:7.1f} tok/s, x{r['speedup']:.2f}{'' if r['same_tokens'] else '  TOKENS DIFFER'}", flush=True)
        rows.append(r)
    return rows


def bench_rl(family: str, enc, repeat: int) -> list[dict]:
    """One RL step's work on the demo-size model, as the stage runs it: sample_rollout (the groups sampled, scored and
    scored by the reference) then rollout_policy_loss and its backward, with the uncached loop patched into
    ``complete`` and then the cached one; the rollout's and the update's seconds apart."""
    policy = demo_model(family, padded_vocab(enc.n_vocab))
    reference = demo_model(family, padded_vocab(enc.n_vocab))
    items = list(arithmetic(64, seed=3))
    old = lambda m, x, n, *, temperature, stop_token, n_vocab, generator, samples=1: uncached_loop(  # noqa: E731
        m, x.repeat_interleave(samples, 0), n, temperature, stop_token, generator, n_vocab)  # a row per sample

    def reference_logps(x, y):
        with torch.no_grad():
            return model_token_logps(reference, x, y)

    def step(shape: dict) -> tuple[float, float, float, float]:
        job = RlJob(group_size=shape["group_size"], max_new_tokens=shape["max_new_tokens"], temperature=1.0,
                    preference_coef=0.0)
        g = torch.Generator().manual_seed(11)
        t0 = time.perf_counter()
        rollout = sample_rollout(policy, reference_logps, enc, items[: shape["prompts"]],
                                 lambda text, it: arithmetic_reward(text, it["answer"]), job, g)
        t1 = time.perf_counter()
        loss, stats = rollout_policy_loss(policy, rollout, job)
        loss.backward()
        policy.zero_grad(set_to_none=True)
        return float(loss.detach()), stats["answer_tokens"], t1 - t0, time.perf_counter() - t1

    def best(shape: dict) -> tuple[float, float, float, float]:
        runs = [step(shape) for _ in range(repeat)]
        return min(runs, key=lambda r: r[2] + r[3])

    rows = []
    for name, shape in RL_SHAPES.items():
        with mock.patch.object(sampling, "generate", old):
            loss_old, answer, roll_old, upd_old = best(shape)
        loss_new, _, roll_new, upd_new = best(shape)
        sampled = shape["prompts"] * shape["group_size"] * answer  # answer tokens sampled in the step
        r = {"family": family, "shape": name, **shape, "answer_tokens_mean": answer, "same_loss": loss_old == loss_new,
             "uncached_rollout_s": roll_old, "cached_rollout_s": roll_new, "update_s": upd_new,
             "uncached_rollout_tok_s": sampled / roll_old, "cached_rollout_tok_s": sampled / roll_new,
             "uncached_step_s": roll_old + upd_old, "cached_step_s": roll_new + upd_new,
             "speedup": (roll_old + upd_old) / (roll_new + upd_new)}
        print(f"{family:5} {name:5} {r['prompts']} prompts x {r['group_size']}, {r['max_new_tokens']} new: rollout "
              f"uncached {roll_old:.3f} s ({r['uncached_rollout_tok_s']:.0f} tok/s), cached {roll_new:.3f} s "
              f"({r['cached_rollout_tok_s']:.0f} tok/s); update {upd_new:.3f} s; step x{r['speedup']:.2f}"
              f"{'' if r['same_loss'] else '  LOSS DIFFERS'}", flush=True)
        rows.append(r)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default="", help="write STEM.md and STEM.json (command, commit, date, machine inside)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from pydoc_data.topics import topics

    print(f"machine: {machine_line()}", flush=True)

    enc = train_bpe([" ".join(t.split()) for t in topics.values()], 4096)  # the demo tokenizer's size, no download
    vocab = padded_vocab(enc.n_vocab)
    print(f"demo-size models (4 layers, width 256, block 256, vocab {vocab}); CPU threads {args.threads}; "
          f"best of {args.repeat}; greedy", flush=True)
    gen = [r for fam in ("gpt2", "llama") for r in bench_tokens(fam, vocab, args.repeat)]
    print("RL step (sample_rollout, then rollout_policy_loss + backward; sampling at temperature 1, untrained model: "
          "answers run to max_new_tokens)")
    rl = [r for fam in ("gpt2", "llama") for r in bench_rl(fam, enc, args.repeat)]
    if args.out:
        lines = [f"Demo-size models (4 layers, width 256, block 256, vocabulary {vocab}), CPU threads {args.threads}, "
                 f"best of {args.repeat}.", "", "Greedy generation of random prompts, the uncached loop against "
                 "kiln.model.generate (KV cache); the tokens must agree:", "",
                 "| family | rows | prompt | new | uncached tokens/s | cached tokens/s | speedup | same tokens |",
                 "|---|---:|---:|---:|---:|---:|---:|---|"]
        lines += [f"| {r['family']} | {r['rows']} | {r['prompt']} | {r['new']} | {r['uncached_tok_s']:,.1f} | "
                  f"{r['cached_tok_s']:,.1f} | {r['speedup']:.2f}x | {r['same_tokens']} |" for r in gen]
        lines += ["", "One RL step as the stage runs it (sample_rollout, then rollout_policy_loss and its backward; "
                  "sampling at temperature 1 from an untrained model, so answers run to max_new_tokens; no replayed "
                  "preference pairs):", "",
                  "| family | shape | prompts x group, new | rollout s, uncached / cached | rollout tokens/s, uncached "
                  "/ cached | update s | step speedup |", "|---|---|---|---|---|---:|---:|"]
        lines += [f"| {r['family']} | {r['shape']} | {r['prompts']} x {r['group_size']}, {r['max_new_tokens']} | "
                  f"{r['uncached_rollout_s']:.3f} / {r['cached_rollout_s']:.3f} | {r['uncached_rollout_tok_s']:,.0f} / "
                  f"{r['cached_rollout_tok_s']:,.0f} | {r['update_s']:.3f} | {r['speedup']:.2f}x |" for r in rl]
        write_results(args.out, "Generation and the RL step: KV-cached against uncached", lines,
                      {"threads": args.threads, "repeat": args.repeat, "generation": gen, "rl_step": rl}, indent=2)
        print(f"wrote {args.out}.md and .json")


if __name__ == "__main__":
    main()
