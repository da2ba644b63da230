"""Benchmark, side by side in one run: peak memory of one DPO step at Llama 3's vocabulary (128,256) through the
chunked per-token head (kiln.model.loss.token_logprobs) against the full fp32 log-softmax over (batch, tokens,
vocab) it replaced, and the demo's RL step with the forked prefill and the chunked head against the old path.

Run: python bench/posttrain_memory.py [--runs 2] [--threads 2] [--json OUT.json]
Every measurement is its own subprocess (one variant, one run), so each peak is that process's own: the resident set
high-water mark (Linux VmHWM, reset before the step where the kernel allows) and its rise over the resident set just
before the step. The old implementations live here only (``naive_token_logps``, ``repeated_rows_generate``).
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

DPO = dict(vocab_size=128_256, seq_len=1024, pairs=2, prompt=256)  # Llama 3's vocabulary; 2 pairs = 4 rows of 1,024
RL = dict(prompts=8, group_size=8, max_new_tokens=16, temperature=0.7, partial_credit=0.2, kl_coef=0.1, vocab=4096)
# RL: the demo's rl_model (assets/alignment.py RlModelConfig defaults, RlJob's micro_batch and group_size) on the
# demo llama (conf/presets/demo.yaml) with the demo tokenizer's size (assets/tokens.py: 4,096)


# ---- the old paths, kept for the comparison only ------------------------------------------------------------------
def naive_token_logps(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """What kiln.posttrain.logprobs.token_logps computed for every stage before: a (B, T, V) fp32 log-softmax."""
    mask = y != -100
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    return logp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask


def repeated_rows_generate(model, idx, max_new_tokens, *, samples: int = 1, **kw):
    """What kiln.posttrain.sampling.complete decoded before: each prompt repeated ``samples`` times, every row
    prefilled."""
    from kiln.model.generate import generate

    return generate(model, idx.repeat_interleave(samples, dim=0), max_new_tokens, **kw)


# ---- memory of this process ---------------------------------------------------------------------------------------
def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB -> bytes
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


# ---- one DPO step --------------------------------------------------------------------------------------------------
def dpo_child(variant: str) -> dict:
    from kiln.model.config import ModelConfig, preset_fields
    from kiln.model.families import build_model
    from kiln.posttrain.dpo import pair_stats
    from kiln.posttrain.logprobs import model_sequence_logps

    cfg = ModelConfig(**{**preset_fields("demo", "llama"), "block_size": DPO["seq_len"]}, vocab_size=DPO["vocab_size"])
    torch.manual_seed(0)
    policy = build_model(cfg).train()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)  # the frozen reference (DpoStage without LoRA)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(1)
    rows = 2 * DPO["pairs"]  # chosen rows, then rejected rows
    x = torch.randint(0, cfg.vocab_size, (rows, DPO["seq_len"]), generator=g)  # (2B, T)
    y = torch.roll(x, -1, dims=1)
    y[:, : DPO["prompt"]] = -100  # the prompt carries no log-prob
    y[:, -1] = -100
    if variant == "old":
        ref_logps = lambda: naive_token_logps(ref(x), y).sum(-1)  # noqa: E731
        policy_logps = lambda: naive_token_logps(policy(x), y).sum(-1)  # noqa: E731
    else:
        ref_logps = lambda: model_sequence_logps(ref, x, y)  # noqa: E731
        policy_logps = lambda: model_sequence_logps(policy, x, y)  # noqa: E731
    before = _status("VmRSS")
    exact = reset_peak()
    t0 = time.perf_counter()
    with torch.no_grad():
        r = ref_logps()  # (2B,)
    from kiln.posttrain.preference_losses import LossSettings

    stats = pair_stats(policy_logps(), r, LossSettings(beta=0.1))  # DpoStage.loss
    stats["loss_tensor"].backward()
    norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), float("inf")))
    opt.step()
    opt.zero_grad(set_to_none=True)
    step_s = time.perf_counter() - t0
    peak = _status("VmHWM")
    return {"variant": variant, "peak_rss_mib": peak / 2**20, "rise_mib": (peak - before) / 2**20,
            "rss_before_mib": before / 2**20, "peak_reset": exact, "step_s": step_s, "loss": stats["loss"],
            "chosen_logp": stats["chosen_logp"], "grad_norm": norm}


# ---- the demo's RL step ---------------------------------------------------------------------------------------------
def rl_child(variant: str, steps: int) -> dict:
    from pydoc_data.topics import topics

    import kiln.posttrain.sampling as sampling
    from kiln.model.config import ModelConfig, padded_vocab, preset_fields
    from kiln.model.families import build_model
    from kiln.posttrain.instructions import arithmetic
    from kiln.posttrain.logprobs import model_token_logps
    from kiln.posttrain.rl import RlJob, make_reward, rollout_loss
    from kiln.tokens.tokenizer import train_bpe

    enc = train_bpe([" ".join(t.split()) for t in topics.values()], RL["vocab"])  # the demo's size, no download
    cfg = ModelConfig(**preset_fields("demo", "llama"), vocab_size=padded_vocab(enc.n_vocab))
    torch.manual_seed(0)
    policy = build_model(cfg).train()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    job = RlJob(micro_batch=RL["prompts"], group_size=RL["group_size"], max_new_tokens=RL["max_new_tokens"],
                temperature=RL["temperature"], partial_credit=RL["partial_credit"], kl_coef=RL["kl_coef"])
    reward = make_reward("arithmetic", RL["partial_credit"])
    items = list(arithmetic(RL["prompts"] * (steps + 1), seed=3))
    @torch.no_grad()
    def ref_logps(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # PosttrainStage.reference_logps, old or new
        return naive_token_logps(ref(x), y) if variant == "old" else model_token_logps(ref, x, y)

    times, rewards, tokens = [], [], []
    for i in range(steps + 1):  # step 0 warms up
        with ExitStack() as stack:
            if variant == "old":
                stack.enter_context(mock.patch.object(sampling, "generate", repeated_rows_generate))
                stack.enter_context(mock.patch("kiln.posttrain.rl.model_token_logps",
                                               lambda m, x, y: naive_token_logps(m(x), y)))
            t0 = time.perf_counter()
            loss, stats = rollout_loss(policy, policy, ref_logps, enc, items[i * RL["prompts"] : (i + 1) * RL["prompts"]],
                                       reward, job, torch.Generator().manual_seed(100 + i))
            loss.backward()
            policy.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
        if i:
            times.append(dt)
            rewards.append(stats["reward_mean"])
            tokens.append(stats["answer_tokens"])
    return {"variant": variant, "step_s": times, "mean_step_s": sum(times) / len(times), "reward_mean": rewards,
            "answer_tokens": tokens, "vocab": cfg.vocab_size}


def run_child(kind: str, variant: str, threads: int, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--variant", variant, "--threads", str(threads),
           "--steps", str(steps)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} {variant} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed RL steps per run (after one warm-up step)")
    ap.add_argument("--only", choices=("dpo", "rl"), default=None)
    ap.add_argument("--json", default="", help="also write the figures here")
    ap.add_argument("--child", choices=("dpo", "rl"), help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=("old", "new"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        out = dpo_child(args.variant) if args.child == "dpo" else rl_child(args.variant, args.steps)
        print(json.dumps(out), flush=True)
        return out
    res: dict = {"threads": args.threads, "torch": torch.__version__, "dpo": [], "rl": []}
    if args.only in (None, "dpo"):
        print(f"DPO step, demo llama (4 x 256) at vocabulary {DPO['vocab_size']:,}, {DPO['pairs']} pairs = "
              f"{2 * DPO['pairs']} rows x {DPO['seq_len']} tokens; {args.threads} threads", flush=True)
        print("run | variant | peak RSS MiB | rise over pre-step RSS MiB | step s | loss | grad norm", flush=True)
        for run in range(1, args.runs + 1):
            for variant in ("old", "new"):
                r = {"run": run, **run_child("dpo", variant, args.threads, args.steps)}
                res["dpo"].append(r)
                print(f"{run} | {variant} | {r['peak_rss_mib']:,.0f} | {r['rise_mib']:,.0f} | {r['step_s']:.2f} | "
                      f"{r['loss']:.6f} | {r['grad_norm']:.6f}{'' if r['peak_reset'] else ' (peak not reset)'}",
                      flush=True)
    if args.only in (None, "rl"):
        print(f"RL step (rollout_loss + backward), demo llama, {RL['prompts']} prompts x {RL['group_size']} samples, "
              f"{RL['max_new_tokens']} new tokens at temperature {RL['temperature']}; mean of {args.steps} steps "
              "after one warm-up", flush=True)
        print("run | variant | mean step s | steps s | mean reward per step | answer tokens per step", flush=True)
        for run in range(1, args.runs + 1):
            for variant in ("old", "new"):
                r = {"run": run, **run_child("rl", variant, args.threads, args.steps)}
                res["rl"].append(r)
                print(f"{run} | {variant} | {r['mean_step_s']:.3f} | {', '.join(f'{t:.3f}' for t in r['step_s'])} | "
                      f"{', '.join(f'{v:.4f}' for v in r['reward_mean'])} | "
                      f"{', '.join(f'{v:.2f}' for v in r['answer_tokens'])}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return res


if __name__ == "__main__":
    main()
