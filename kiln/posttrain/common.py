"""Post-training parts shared by the DPO and RL jobs: job plumbing, log-probabilities, sampling, before/after measures.

Any training job:  python -m kiln.posttrain --config job.json   (runs kiln.train.loop, kiln.posttrain.dpo or kiln.posttrain.rl by the job's task)
Under torchrun:    python -m torch.distributed.run --nproc_per_node=2 -m kiln.posttrain --config job.json
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from kiln.train.checkpoint import latest_good_checkpoint, load_state, resolve_checkpoint, rng_state, save_checkpoint, set_rng_state
from kiln.common.config import from_dict
from kiln.model.lora import LoRAConfig, adapters_disabled, apply_lora, load_lora_state_dict, lora_state_dict, merged_state_dict, trainable_parameters
from kiln.model.gpt import GPT, GPTConfig
from kiln.posttrain.sft import IGNORE, chat_prompt_ids, encode_example, pad_rows, to_xy, trim_padding
from kiln.train.loop import DistInfo, OptimConfig, Reporter, broadcast_config, lr_lambda, make_logger, make_optimizer

ENTRY_POINTS = {"pretrain": "kiln.train.loop", "sft": "kiln.train.loop", "dpo": "kiln.posttrain.dpo", "rl": "kiln.posttrain.rl"}  # job task -> module


@dataclass
class PosttrainJob:
    task: str = ""  # "dpo" or "rl"
    out_dir: str = ""  # run folder: checkpoints/, result.json
    tokenizer: str = ""  # tokenizer.json copied into every checkpoint
    model: dict = field(default_factory=dict)  # GPTConfig fields (must match init_from's)
    optim: dict = field(default_factory=dict)  # kiln.train.loop.OptimConfig fields
    lora: dict = field(default_factory=dict)  # kiln.model.lora.LoRAConfig fields; enabled=true trains adapters only
    train_files: list = field(default_factory=list)  # one JSONL: preference pairs (dpo) or instruction pairs (rl)
    init_from: str = ""  # checkpoint the policy starts from (required)
    reference: str = ""  # frozen reference checkpoint; empty means init_from
    seq_len: int = 256  # longest prompt + response, in tokens
    micro_batch: int = 8  # pairs (dpo) or prompts (rl) per rank per forward
    grad_accum: int = 1  # micro-batches per optimizer step
    max_steps: int = 100  # optimizer steps
    eval_interval: int = 25  # steps between held-out passes
    ckpt_interval: int = 100  # steps between checkpoints (the last step is always saved)
    keep_last: int = 1  # checkpoints kept on disk
    log_interval: int = 10  # steps between progress lines
    seed: int = 1337  # seeds data order and sampling
    mlflow_tracking_uri: str = ""  # where rank 0 streams metrics
    mlflow_run_id: str = ""  # the MLflow run that receives them
    fail_at_step: int = -1  # testing aid: raise at this step once (simulates a crash)


def run_job(job_cls, train_fn: Callable[..., dict[str, Any]], doc: str, argv: list[str] | None,
            reporter: Reporter | None) -> dict[str, Any]:
    """Command line shared by the DPO and RL jobs: parse, join the process group, broadcast the job, train."""
    import argparse

    from kiln.train.loop import PrintReporter, setup_distributed

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help=f"job JSON file ({job_cls.__name__} fields), read by rank 0")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (the same on every rank)")
    parser.add_argument("--timeout-s", type=int, default=600, help="process-group timeout in seconds")
    args = parser.parse_args(argv)
    info = setup_distributed(args.device, args.timeout_s)
    try:
        return train_fn(broadcast_config(job_cls, args.config, info), info, reporter or PrintReporter())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def entry_point(argv: list[str]) -> Callable[..., dict[str, Any]]:
    """The ``main`` of the module that runs the job named by ``--config`` (its ``task`` key alone is read here)."""
    path = argv[argv.index("--config") + 1] if "--config" in argv else None
    task = json.loads(Path(path).read_text()).get("task", "pretrain") if path else "pretrain"
    if task not in ENTRY_POINTS:
        raise ValueError(f"{path}: task {task!r} is not one of {', '.join(ENTRY_POINTS)}")
    return importlib.import_module(ENTRY_POINTS[task]).main


# ---------------------------------------------------------------------------------------------- log-probabilities

def token_logps(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """logits (B, T, V), targets y (B, T) -> log p(y) (B, T) in float32, 0 where the target is IGNORE."""
    mask = y != IGNORE  # (B, T)
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    picked = logp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked * mask


def sequence_logps(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of each row's response tokens: (B, T, V), (B, T) -> (B,)."""
    return token_logps(logits, y).sum(-1)


def encode_rows(enc, prompts: list[str], responses: list[str], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (prompt, response) in the chat template as its own row: x (N, T), y (N, T) with IGNORE off the response."""
    tokens, mask = pad_rows((encode_example(enc, p, r) for p, r in zip(prompts, responses)), seq_len, enc.eot_token)
    return trim_padding(*to_xy(tokens, mask))


@torch.no_grad()
def score_responses(model: torch.nn.Module, enc, prompts: list[str], responses: list[str], seq_len: int,
                    batch_size: int = 16, device: torch.device | str = "cpu") -> tuple[list[float], list[int]]:
    """(summed response log-prob, response tokens) for each pair, the prompt given."""
    out, counts = [], []
    for i in range(0, len(prompts), batch_size):
        x, y = encode_rows(enc, prompts[i : i + batch_size], responses[i : i + batch_size], seq_len)
        x, y = x.to(device), y.to(device)
        out += sequence_logps(model(x), y).tolist()
        counts += (y != IGNORE).sum(-1).tolist()
    return out, counts


# ---------------------------------------------------------------------------------------------------- sampling

@torch.no_grad()
def sample(model: GPT, x: torch.Tensor, max_new_tokens: int, temperature: float, stop_token: int,
           generator: torch.Generator | None = None, n_vocab: int | None = None) -> torch.Tensor:
    """Extend x (B, L) by up to max_new_tokens; a row that emitted ``stop_token`` keeps emitting it, and sampling
    ends once every row has (GPT.generate stops only when all rows stop on the same step). Temperature 0 is greedy.
    Ids from ``n_vocab`` up (the embedding's padding past the tokenizer) are never drawn."""
    done = torch.zeros(x.size(0), dtype=torch.bool, device=x.device)  # (B,)
    for _ in range(max_new_tokens):
        logits = model(x[:, -model.config.block_size :])[:, -1, :]  # (B, V)
        if n_vocab is not None:
            logits[:, n_vocab:] = float("-inf")
        if temperature <= 0:
            nxt = logits.argmax(dim=-1)  # (B,)
        else:
            probs = F.softmax(logits / temperature, dim=-1)  # (B, V)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
        nxt = torch.where(done, torch.full_like(nxt, stop_token), nxt)
        x = torch.cat([x, nxt[:, None]], dim=1)  # (B, L+1)
        done |= nxt == stop_token
        if bool(done.all()):
            break
    return x


@torch.no_grad()
def complete(model: GPT, enc, prompts: list[str], max_new_tokens: int, temperature: float = 0.0, samples: int = 1,
             generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> list[list[list[int]]]:
    """``samples`` completions per prompt, each a token list ending at (and including) the first end-of-text.

    Prompts of the same token length share one batch (the model has no padding mask, so lengths must match).
    Returns completions[prompt][sample].
    """
    ids = [chat_prompt_ids(enc, p)[-(model.config.block_size - max_new_tokens):] for p in prompts]
    out: list[list[list[int]]] = [[] for _ in prompts]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(ids):
        by_len.setdefault(len(p), []).append(i)
    for length, members in sorted(by_len.items()):
        for start in range(0, len(members), max(1, 64 // samples)):
            group = members[start : start + max(1, 64 // samples)]
            x = torch.tensor([ids[i] for i in group for _ in range(samples)], device=device)  # (G*S, L)
            gen = sample(model, x, max_new_tokens, temperature, enc.eot_token, generator, enc.n_vocab)[:, length:].tolist()
            for k, i in enumerate(group):
                for row in gen[k * samples : (k + 1) * samples]:
                    out[i].append(row[: row.index(enc.eot_token) + 1] if enc.eot_token in row else row)
    return out


def decode_completion(enc, tokens: list[int]) -> str:
    return enc.decode([t for t in tokens if t != enc.eot_token])


# ------------------------------------------------------------------------------------------- before/after measures

MEASURES = {  # name -> what it is, shown beside the numbers
    "arithmetic_exact_match": "held-out arithmetic answered exactly (greedy; the RL task reward)",
    "preference_accuracy": "held-out preference pairs whose correct response is more likely than the wrong one",
    "preference_margin": "mean log p(correct) - log p(wrong) on held-out preference pairs (nats)",
    "response_loss": "masked response loss on held-out instruction pairs (nats/token)",
    "response_token_accuracy": "held-out response tokens predicted exactly (teacher forcing)",
}


@torch.no_grad()
def measure(model: GPT, enc, arithmetic: list[dict], preferences: list[dict], instructions: list[dict],
            max_new_tokens: int = 16, device: torch.device | str = "cpu") -> dict[str, float]:
    """Every before/after measure on fixed held-out items (the same lists for every stage give comparable rows)."""
    from kiln.posttrain.instructions import arithmetic_reward

    model.eval()
    seq_len = model.config.block_size - 1
    res: dict[str, float] = {}
    if arithmetic:
        outs = complete(model, enc, [a["prompt"] for a in arithmetic], max_new_tokens, device=device)
        res["arithmetic_exact_match"] = float(np.mean([arithmetic_reward(decode_completion(enc, o[0]), a["answer"])
                                                       for o, a in zip(outs, arithmetic)]))
    if preferences:
        prompts = [p["prompt"] for p in preferences]
        chosen, _ = score_responses(model, enc, prompts, [p["chosen"] for p in preferences], seq_len, device=device)
        rejected, _ = score_responses(model, enc, prompts, [p["rejected"] for p in preferences], seq_len, device=device)
        diff = np.array(chosen) - np.array(rejected)
        res["preference_accuracy"] = float(np.mean(diff > 0))
        res["preference_margin"] = float(np.mean(diff))
    if instructions:
        nll = correct = count = 0.0
        for i in range(0, len(instructions), 16):
            chunk = instructions[i : i + 16]
            x, y = encode_rows(enc, [c["prompt"] for c in chunk], [c["response"] for c in chunk], seq_len)
            x, y = x.to(device), y.to(device)
            logits = model(x)  # (B, T, V)
            keep = y != IGNORE
            nll += float(-token_logps(logits, y)[keep].sum())
            correct += float((logits.argmax(-1) == y)[keep].sum())
            count += float(keep.sum())
        res["response_loss"] = nll / max(count, 1)
        res["response_token_accuracy"] = correct / max(count, 1)
    return res


def comparison_rows(before: dict[str, float], after: dict[str, float]) -> list[dict[str, Any]]:
    """[{measure, before, after, change}] in MEASURES order, for metadata tables and model cards."""
    return [{"measure": m, "before": before[m], "after": after[m], "change": after[m] - before[m]}
            for m in MEASURES if m in before and m in after]


# --------------------------------------------------------------------------------------------------- job plumbing

class PosttrainRun:
    """The policy (optionally with LoRA), its frozen reference, optimizer, schedule, resume and checkpoints.

    The reference is the policy's own frozen base when LoRA is on and reference == init_from (no second copy);
    otherwise a separate GPT loaded from ``reference`` (default init_from) with gradients off.
    """

    def __init__(self, job: PosttrainJob, info: DistInfo, reporter: Reporter):
        if not job.init_from:
            raise ValueError(f"job.init_from is empty: a {job.task} job starts from a trained checkpoint (the SFT or DPO model)")
        self.job, self.info, self.reporter = job, info, reporter
        self.out = Path(job.out_dir)
        self.ckpt_root = self.out / "checkpoints"
        self.out.mkdir(parents=True, exist_ok=True)
        self.cfg = from_dict(GPTConfig, job.model, "job.model")
        self.opt_cfg = from_dict(OptimConfig, job.optim, "job.optim")
        self.lora_cfg = from_dict(LoRAConfig, job.lora, "job.lora")
        self.logger = make_logger(job, info)  # rank 0 alone tracks; MLflow is imported only there
        self.init_ckpt = resolve_checkpoint(job.init_from)
        torch.manual_seed(job.seed)
        self.model = GPT(self.cfg)
        self.model.load_state_dict(self._weights(self.init_ckpt))
        if self.lora_cfg.enabled:
            wrapped = apply_lora(self.model, self.lora_cfg)
            self.say(f"LoRA rank {self.lora_cfg.rank} on {len(wrapped)} layers: "
                     f"{trainable_parameters(self.model):,} trainable parameters")
        self.model.to(info.device)
        ref_path = resolve_checkpoint(job.reference) if job.reference else self.init_ckpt
        self.ref: GPT | None = None
        if not (self.lora_cfg.enabled and ref_path == self.init_ckpt):
            self.ref = GPT(self.cfg)
            self.ref.load_state_dict(self._weights(ref_path))
            self.ref.to(info.device).eval().requires_grad_(False)
        self.ref_path = ref_path
        self.optimizer = make_optimizer(self.model, self.opt_cfg, info.device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(self.opt_cfg, job.max_steps))
        self.step, self.history, self.resumed_from = 0, [], None
        self.extra_state: dict[str, Any] = {}
        latest = latest_good_checkpoint(self.ckpt_root, log=self.say)
        if latest is not None:
            state, meta = load_state(latest, "cpu")
            if self.lora_cfg.enabled:
                load_lora_state_dict(self.model, {k: v.to(info.device) for k, v in state["lora"].items()})
            else:
                self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            rngs = state["rng"]
            set_rng_state(rngs[info.rank] if info.rank < len(rngs) else rngs[0])
            self.step, self.history, self.resumed_from = state["step"], meta.get("history", []), str(latest)
            self.extra_state = state.get("extra", {})
            self.say(f"resumed from {latest} at step {self.step}")
        else:
            self.say(f"initialised weights from {self.init_ckpt}; reference {ref_path}")
            torch.manual_seed(job.seed + info.rank)
        self.raw = self.model
        self.ddp = DDP(self.model, device_ids=[info.local_rank] if info.device.type == "cuda" else None) \
            if info.world_size > 1 else self.model
        use_bf16 = info.device.type == "cuda" and torch.cuda.is_bf16_supported()
        self.autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext
        if info.is_main:
            self.logger.log_params({"job": {k: v for k, v in asdict(job).items() if k != "train_files"}})

    @staticmethod
    def _weights(path: Path) -> dict[str, torch.Tensor]:
        state, _ = load_state(path, "cpu")
        return state["model"]

    def say(self, message: str) -> None:
        if self.info.is_main:
            self.reporter.log(message)

    @torch.no_grad()
    def reference_logits(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T, V) logits of the frozen reference."""
        with self.autocast():
            if self.ref is not None:
                return self.ref(x)
            with adapters_disabled(self.raw):
                return self.raw(x)

    def optimizer_step(self) -> float:
        clip = self.opt_cfg.grad_clip if self.opt_cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if self.step == self.job.fail_at_step and not (self.out / ".failed_once").exists():
            if self.info.is_main:
                (self.out / ".failed_once").write_text(str(self.step))
            raise RuntimeError(f"injected failure at step {self.step} (fail_at_step)")
        return float(norm)

    def all_mean(self, values: dict[str, float]) -> dict[str, float]:
        """Average a dict of floats over ranks (the same keys on every rank)."""
        if self.info.world_size == 1:
            return values
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64,
                         device=self.info.device if self.info.device.type == "cuda" else "cpu")
        dist.all_reduce(t)
        return {k: v / self.info.world_size for k, v in zip(keys, t.tolist())}

    def save(self, extra: dict[str, Any] | None = None) -> Path | None:
        rngs = [None] * self.info.world_size
        if self.info.world_size > 1:
            dist.all_gather_object(rngs, rng_state())
        else:
            rngs = [rng_state()]
        path = None
        if self.info.is_main:
            state = {
                "model": merged_state_dict(self.raw) if self.lora_cfg.enabled else self.raw.state_dict(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "rng": rngs, "step": self.step, "extra": extra or {},
            }
            if self.lora_cfg.enabled:
                state["lora"] = lora_state_dict(self.raw)
            meta = {"model": asdict(self.cfg), "task": self.job.task, "seed": self.job.seed, "history": self.history,
                    "world_size": self.info.world_size, "init_from": str(self.init_ckpt), "reference": str(self.ref_path),
                    "lora": asdict(self.lora_cfg)}
            path = save_checkpoint(self.ckpt_root, self.step, state, meta, {"tokenizer.json": Path(self.job.tokenizer)},
                                   keep_last=self.job.keep_last)
        if self.info.world_size > 1:
            dist.barrier()
        return path

    def summary(self, last_ckpt: Path | None, t_start: float, **extra) -> dict[str, Any]:
        import time

        from kiln.common.files import atomic_write_json

        out = {"task": self.job.task, "steps": self.step, "history": self.history,
               "checkpoint": str(last_ckpt or latest_good_checkpoint(self.ckpt_root)),
               "resumed_from": self.resumed_from, "world_size": self.info.world_size, "device": self.info.device.type,
               "init_from": str(self.init_ckpt), "reference": str(self.ref_path), "lora": asdict(self.lora_cfg),
               "trainable_params": trainable_parameters(self.raw), "wall_s": time.time() - t_start, **extra}
        if self.info.is_main:
            atomic_write_json(self.out / "result.json", out)
        return out


def read_jsonl_split(path: str, split: str, kinds: Iterable[str] | None = None) -> list[dict]:
    """Rows of one split (and kinds) from a pairs JSONL; an empty result is an error naming the file."""
    from kiln.posttrain.sft import read_pairs

    rows = [r for r in read_pairs(path, split) if kinds is None or r.get("kind") in set(kinds)]
    if not rows:
        raise ValueError(f"{path}: no '{split}' rows{f' of kind {sorted(kinds)}' if kinds else ''}; rebuild the data asset")
    return rows


def main(argv: list[str] | None = None, reporter: Reporter | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    return entry_point(argv)(argv, reporter)


if __name__ == "__main__":
    main(sys.argv[1:])
