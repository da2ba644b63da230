"""A reward model: Kiln's backbone (gpt2 or llama) with a scalar head, trained on preference pairs (Bradley-Terry).

One process:  python -m kiln.posttrain.reward --config job.json        (RewardJob fields; init_from = the SFT checkpoint)
Several:      python -m torch.distributed.run --nproc_per_node=2 -m kiln.posttrain.reward --config job.json
The score of (prompt, response) is Linear(n_embd, 1) of the final hidden state at the last response token (the
chat template, no end-of-text). ``load_reward_model(ckpt)`` loads a checkpoint back; ``write_hf_reward(ckpt, dir)``
writes it as GPT2/Llama/Qwen3ForSequenceClassification (pad_token_id = end-of-text), which transformers scores alike.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Iterable, Iterator

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.common.config import ConfigError, Domain
from kiln.model.lora import LoRAConfig
from kiln.model.loss import head_inputs
from kiln.posttrain.common import PosttrainJob, read_preference_splits
from kiln.posttrain.sft import PackedLoader, chat_prompt_ids
from kiln.train.dist import DistInfo, all_mean
from kiln.train.entry import run_job
from kiln.train.telemetry import Reporter, format_duration
from kiln.train.trainer import Stage, StepReport, Trainer
from kiln.train.optim import OptimConfig


@dataclass
class RewardJob(PosttrainJob):
    task: str = "reward"
    pair_kinds: list[str] = field(default_factory=lambda: ["arithmetic"])  # preference kinds to train and hold out on (arithmetic, doc_section); empty: all
    max_steps: Annotated[int, Domain(1)] = 40  # optimizer steps
    micro_batch: Annotated[int, Domain(1)] = 16  # pairs per rank per forward
    eval_interval: Annotated[int, Domain(1)] = 10  # steps between held-out passes
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-4, warmup_steps=5, weight_decay=0.0))  # AdamW for the reward model
    eval_pairs: Annotated[int, Domain(1)] = 256  # held-out (split=val) pairs scored at each evaluation
    val_files: list = field(default_factory=list)  # the held-out pairs' JSONL (its split=val rows); empty: train_files[0]

    def check(self, where: str = "job") -> None:
        super().check(where)
        if self.lora.enabled:
            raise ConfigError(f"{where}.lora.enabled: the reward model trains every weight; drop the lora block")


class RewardModel(nn.Module):
    """backbone (a kiln.model GPT or Llama) + score = Linear(n_embd, 1, bias=False), read at each row's last token."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone, self.config = backbone, backbone.config
        self.score = nn.Linear(backbone.config.n_embd, 1, bias=False)  # the name and shape HF's *ForSequenceClassification use
        nn.init.normal_(self.score.weight, std=0.02)
        head, embed = backbone.lm_head.weight, backbone.get_submodule(_embedding_name(backbone)).weight
        if head is not embed:  # an untied vocabulary head is unused: keep it out of training (and out of DDP's way)
            head.requires_grad_(False)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) -> final hidden states (B, T, C) float32: the backbone's forward up to its vocabulary head
        (kiln.model.loss.head_inputs, the entry point the log-probs use; the head computes no logits)."""
        return head_inputs(self.backbone, idx)[0].float()  # (B, T, C)

    def forward(self, idx: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """idx (B, T), lengths (B,) real tokens per row -> rewards (B,) read at position lengths - 1."""
        h = self.hidden(idx)  # (B, T, C)
        last = h[torch.arange(idx.size(0), device=idx.device), lengths - 1]  # (B, C)
        return self.score(last.to(self.score.weight.dtype)).squeeze(-1).float()  # (B,)

    def num_params(self, non_embedding: bool = True) -> int:
        return self.backbone.num_params(non_embedding) + self.score.weight.numel()


def _embedding_name(backbone: nn.Module) -> str:
    from kiln.model.families import of

    return of(backbone.config).parts.embedding_module


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Rewards (B,), (B,) -> (mean of -log sigmoid(r_chosen - r_rejected), accuracy and mean margin)."""
    margin = chosen - rejected  # (B,)
    loss = -F.logsigmoid(margin).mean()
    return loss, {"loss": float(loss.detach()), "accuracy": float((margin > 0).float().mean()),
                  "margin": float(margin.detach().mean()), "chosen_reward": float(chosen.detach().mean()),
                  "rejected_reward": float(rejected.detach().mean())}


def reward_ids(enc, prompt: str, response: str, seq_len: int) -> list[int]:
    """The scored tokens of (prompt, response): the chat template with no end-of-text, cut to its last seq_len."""
    return (chat_prompt_ids(enc, prompt) + enc.encode_ordinary(response))[-seq_len:]


def pad_ids(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> idx (N, W) right-padded with ``pad_id`` and lengths (N,)."""
    width = max(len(r) for r in rows)
    idx = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (N, W)
    for i, r in enumerate(rows):
        idx[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return idx, torch.tensor([len(r) for r in rows], dtype=torch.long)


def encode_pairs(enc, rows: list[dict], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Preference rows -> tokens (N, 2, W) and lengths (N, 2): [:, 0] chosen, [:, 1] rejected."""
    ids = [reward_ids(enc, r["prompt"], r[side], seq_len) for r in rows for side in ("chosen", "rejected")]
    idx, lengths = pad_ids(ids, enc.eot_token)  # (2N, W), (2N,)
    return idx.numpy().reshape(len(rows), 2, -1), lengths.numpy().reshape(len(rows), 2)


def pair_rows(tokens: np.ndarray, lengths: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 2, W), (B, 2) -> idx (2B, T), lengths (2B,): the chosen rows first, trailing padding cut."""
    n = torch.from_numpy(np.concatenate([lengths[:, 0], lengths[:, 1]]))  # (2B,)
    idx = torch.from_numpy(np.concatenate([tokens[:, 0], tokens[:, 1]]))[:, : int(n.max())]  # (2B, T)
    return idx, n


class RewardPairLoader(PackedLoader):
    """Shuffled, rank-disjoint, resumable batches of preference pairs (PackedLoader's order over pairs)."""

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.next_indices()
        return pair_rows(self.tokens[idx], self.mask[idx])


def score_pairs(model: nn.Module, x: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """The Bradley-Terry loss of a pair batch (2B rows, chosen first) and its statistics."""
    r = model(x, n)  # (2B,)
    b = r.size(0) // 2
    return bradley_terry_loss(r[:b], r[b:])


class RewardStage(Stage):
    """Preference pairs in a seeded order, the Bradley-Terry loss on a scalar head over the SFT backbone; held-out
    pair accuracy, margin and loss."""

    lora = LoRAConfig()

    def __init__(self, job: RewardJob, info: DistInfo):
        from kiln.tokens.tokenizer import load_encoding

        self.job, self.info = job, info
        self.enc = load_encoding(job.tokenizer)
        kinds = job.pair_kinds or None
        self.pairs = read_preference_splits(job.train_files, job.val_files, job.eval_pairs, kinds)
        self.train_rows, self.val_rows = self.pairs.train, self.pairs.val
        tt, tl = encode_pairs(self.enc, self.train_rows, job.seq_len)
        self.vt, self.vl = encode_pairs(self.enc, self.val_rows, job.seq_len)
        if len(self.train_rows) < job.micro_batch * info.world_size:
            raise ValueError(f"{', '.join(map(str, job.train_files))}: {len(self.train_rows)} training pairs cannot fill one batch of "
                             f"{job.micro_batch} x {info.world_size} ranks; lower micro_batch or add preference data")
        self.loader = RewardPairLoader(tt, tl, job.micro_batch, info.rank, info.world_size, job.seed)

    def setup(self, trainer: Trainer) -> None:
        trainer.raw = RewardModel(trainer.raw).to(trainer.info.device)  # the head is drawn from the seeded generator
        self.init_note = " (a new scalar head)"

    def describe(self, trainer: Trainer) -> str:
        kinds = ", ".join(self.job.pair_kinds) or "every kind"
        return (f"reward model on {len(self.train_rows)} pairs ({kinds}), {len(self.val_rows)} held out; "
                f"{self.info.world_size} x {self.info.device.type}, steps {trainer.run.step}->{self.job.max_steps}")

    def batches(self, index: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(self.job.grad_accum):
            yield self.loader.next_batch()

    def loss(self, trainer: Trainer, batch) -> tuple[torch.Tensor, dict[str, float]]:
        x, n = (t.to(trainer.info.device) for t in batch)  # (2B, T), (2B,)
        with trainer.autocast():
            return score_pairs(trainer.model, x, n)

    @torch.no_grad()
    def validate(self, trainer: Trainer) -> dict[str, float]:
        """Held-out loss, accuracy and margin; each rank scores its own share, then the means are averaged."""
        raw = trainer.raw
        raw.eval()
        rows = np.arange(self.info.rank, len(self.vt), self.info.world_size)
        totals: dict[str, float] = {}
        for i in range(0, len(rows), self.job.micro_batch):
            idx = rows[i : i + self.job.micro_batch]
            x, n = (t.to(self.info.device) for t in pair_rows(self.vt[idx], self.vl[idx]))
            with trainer.autocast():
                _, stats = score_pairs(raw, x, n)
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v * len(idx)
        raw.train()
        means = all_mean({k: v / max(len(rows), 1) for k, v in totals.items()}, self.info)
        return {f"val_{k}": v for k, v in means.items()}

    def history_row(self, step: int, train: dict[str, float], val: dict[str, float] | None) -> dict | None:
        if val is None:
            return None
        return {"step": step, **{f"train_{k}": train[k] for k in ("loss", "accuracy", "margin")}, **val}

    def start_line(self, val: dict[str, float]) -> str:
        return f"step 0: held-out accuracy {val['val_accuracy']:.3f}, margin {val['val_margin']:.3f}"

    def progress(self, r: StepReport) -> str:
        t, v = r.train, r.val
        held = f" | held-out acc {v['val_accuracy']:.3f} margin {v['val_margin']:.3f}" if v else ""
        return (f"step {r.step}/{r.max_steps}: loss {t['loss']:.4f} | acc {t['accuracy']:.2f} | margin {t['margin']:.3f}"
                f" | grad_norm {r.metrics['grad_norm']:.2f}{held} | {format_duration(r.left_s)} left")

    def meta(self) -> dict[str, Any]:
        return {"head": "reward", "init_from": self.job.init_from, "pad_token_id": self.enc.eot_token}

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        vals = [h for h in trainer.run.history if "val_loss" in h]
        strip = lambda h: {k[4:]: v for k, v in h.items() if k.startswith("val_")}  # noqa: E731
        return {**self.meta(), "lora": {"enabled": False}, "pairs": {"train": len(self.train_rows), "val": len(self.val_rows),
                                                                    "train_by_file": self.pairs.train_by_file},
                "initial_val": strip(vals[0]) if vals else None, "final_val": strip(vals[-1]) if vals else None,
                "final_train": trainer.last_stats or None}

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


def load_reward_model(path: str | Path, map_location: str = "cpu") -> tuple[RewardModel, Any, dict[str, Any]]:
    """(reward model in eval mode, its tokenizer, meta) from a reward checkpoint, its checkpoints root or run folder."""
    from kiln.model.config import ModelConfig
    from kiln.model.families import build_model
    from kiln.tokens.tokenizer import load_encoding
    from kiln.train.checkpoint import load_state, resolve_checkpoint

    ckpt = resolve_checkpoint(path)
    state, meta = load_state(ckpt, map_location)
    if meta.get("head") != "reward":
        raise ValueError(f"{ckpt}: not a reward model checkpoint (meta.json has no head 'reward'); give the reward_model's")
    model = RewardModel(build_model(ModelConfig(**meta["model"])))
    model.load_state_dict(state["model"])
    return model.eval(), load_encoding(ckpt / "tokenizer.json"), {**meta, "path": str(ckpt)}


@torch.no_grad()
def score_texts(model: RewardModel, enc, prompts: list[str], responses: list[str], seq_len: int,
                batch_size: int = 32, device: torch.device | str = "cpu") -> list[float]:
    """The reward of each (prompt, response)."""
    out: list[float] = []
    for i in range(0, len(prompts), batch_size):
        ids = [reward_ids(enc, p, r, seq_len) for p, r in zip(prompts[i : i + batch_size], responses[i : i + batch_size])]
        x, n = pad_ids(ids, enc.eot_token)
        out += model(x.to(device), n.to(device)).tolist()
    return out


def hf_reward_config(cfg, eot: int) -> dict[str, Any]:
    """config.json of the *ForSequenceClassification model matching ``cfg`` (one label, padding = end-of-text)."""
    from kiln.release.hf import hf_config

    out = hf_config(cfg, eot)
    out["architectures"] = [out["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")
                            .replace("LMHeadModel", "ForSequenceClassification")]
    return {**out, "num_labels": 1, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "pad_token_id": eot,
            "problem_type": "regression"}


def write_hf_reward(ckpt: str | Path, out_dir: str | Path) -> Path:
    """A reward checkpoint as a Hugging Face folder: model.safetensors, config.json and the tokenizer files."""
    from safetensors.torch import save_file

    from kiln.common.files import atomic_path, atomic_write_json
    from kiln.release.hf import to_hf_state_dict, write_hf_tokenizer

    model, enc, meta = load_reward_model(ckpt)
    cfg, out_dir = model.config, Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from kiln.model.families import of

    head = of(cfg).parts.head  # a sequence classifier has no LM head: the score replaces it
    backbone = {k: v for k, v in model.backbone.state_dict().items() if k != head}
    state = {**to_hf_state_dict(backbone, cfg), "score.weight": model.score.weight.detach().float().contiguous()}
    with atomic_path(out_dir / "model.safetensors") as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    atomic_write_json(out_dir / "config.json", hf_reward_config(cfg, enc.eot_token))
    write_hf_tokenizer(enc, out_dir, cfg.block_size)
    return out_dir


def main(argv: list[str] | None = None, reporter: Reporter | None = None, callbacks: Iterable = ()) -> dict[str, Any]:
    return run_job(RewardJob, RewardStage, __doc__, argv, reporter, callbacks)


if __name__ == "__main__":
    main(sys.argv[1:])
