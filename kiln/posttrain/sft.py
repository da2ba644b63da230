"""Supervised fine-tuning: the chat template, prompt-masked packing, a resumable loader, and the SFT stage.

Examples are ``<|user|>prompt<|assistant|>response<|endoftext|>``, or the encoding's own chat template when it carries
one (an imported model's, kiln.tokens.tokenizer.chat_template); loss falls on the response only (and the turn's end).
``python -m kiln.train --config job.json`` with task "sft" runs SftStage; the DPO and RL stages reuse the template.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from kiln.common.files import jsonl_objects
from kiln.tokens.tokenizer import chat_template
from kiln.train.dist import DistInfo
from kiln.train.job import JobConfig
from kiln.train.pretrain import NextTokenStage

IGNORE = -100  # target value cross-entropy skips


def chat_prompt_ids(enc, prompt: str) -> list[int]:
    """Token ids of the prompt side of the template, ending where the assistant's answer starts."""
    template = chat_template(enc)
    if template:
        from kiln.model.chat import render_ids

        return render_ids(enc, template, [{"role": "user", "content": prompt}])
    sp = enc._special_tokens
    return [sp["<|user|>"], *enc.encode_ordinary(prompt), sp["<|assistant|>"]]


def encode_example(enc, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """(ids, mask): mask is 1 where the token is part of the response (and the template's end of the turn)."""
    p = chat_prompt_ids(enc, prompt)
    template = chat_template(enc)
    if template:
        from kiln.model.chat import render_ids

        ids = render_ids(enc, template, [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
                         add_generation_prompt=False)
        if ids[: len(p)] != p:
            raise ValueError(f"chat template of {enc.name}: the conversation with an answer does not start with the "
                             "prompt the template gives for generation; it cannot mark the answer's tokens")
        return ids, [0] * len(p) + [1] * (len(ids) - len(p))
    r = [*enc.encode_ordinary(response), enc.eot_token]
    return p + r, [0] * len(p) + [1] * len(r)


@functools.lru_cache(maxsize=16)
def turn_end(enc) -> int:
    """The token that ends an assistant's answer: the first special token the template writes after the answer's
    text (ChatML's <|im_end|>), or the end of text."""
    template = chat_template(enc)
    if not template:
        return enc.eot_token
    ids, mask = encode_example(enc, "q", "a")
    specials = set(enc._special_tokens.values())
    return next((t for t, m in zip(ids, mask) if m and t in specials), enc.eot_token)


def read_pairs(path: str | Path, split: str | None = None) -> list[dict]:
    return [row for _, row in jsonl_objects(path) if split is None or row.get("split") == split]


def pack(examples: Iterable[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedily pack examples into rows of seq_len+1 tokens.

    Returns (tokens (N, seq_len+1) int64, mask (N, seq_len+1) uint8). An example longer than a row is
    truncated; a row is never split across examples' boundaries beyond what fits, and padding is masked.
    """
    width = seq_len + 1
    rows_t: list[list[int]] = []
    rows_m: list[list[int]] = []
    cur_t: list[int] = []
    cur_m: list[int] = []
    for ids, mask in examples:
        ids, mask = ids[:width], mask[:width]
        if len(cur_t) + len(ids) > width:
            rows_t.append(cur_t + [pad_id] * (width - len(cur_t)))
            rows_m.append(cur_m + [0] * (width - len(cur_m)))
            cur_t, cur_m = [], []
        cur_t += ids
        cur_m += mask
    if cur_t:
        rows_t.append(cur_t + [pad_id] * (width - len(cur_t)))
        rows_m.append(cur_m + [0] * (width - len(cur_m)))
    if not rows_t:
        raise ValueError("no instruction examples to pack")
    return np.asarray(rows_t, dtype=np.int64), np.asarray(rows_m, dtype=np.uint8)


def pad_rows(examples: Iterable[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """One example per row (no packing), cut to seq_len+1 tokens and padded to the longest.

    Returns (tokens (N, W) int64, mask (N, W) uint8) with W = min(longest example, seq_len+1); padding is masked.
    Used where each sequence must be scored on its own (preference pairs, RL samples).
    """
    width = seq_len + 1
    rows = [(ids[:width], mask[:width]) for ids, mask in examples]
    if not rows:
        raise ValueError("no examples to pad")
    w = max(len(ids) for ids, _ in rows)
    tokens = np.full((len(rows), w), pad_id, dtype=np.int64)
    masks = np.zeros((len(rows), w), dtype=np.uint8)
    for i, (ids, mask) in enumerate(rows):
        tokens[i, : len(ids)] = ids
        masks[i, : len(mask)] = mask
    return tokens, masks


def trim_padding(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop trailing columns whose targets are all ignored: a causal model scores the rest identically."""
    used = (y != IGNORE).any(dim=0).nonzero()  # (k, 1) columns holding a target
    end = int(used.max()) + 1 if used.numel() else 1
    return x[:, :end], y[:, :end]


def to_xy(tokens: np.ndarray, mask: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T+1) tokens and mask -> x (B, T), y (B, T) with IGNORE where the target is not a response token."""
    t = torch.from_numpy(tokens)
    m = torch.from_numpy(mask).bool()
    x, y = t[:, :-1], t[:, 1:].clone()  # (B, T), (B, T)
    y[~m[:, 1:]] = IGNORE
    return x.contiguous(), y


class PackedLoader:
    """Shuffled batches of packed rows; each rank takes a disjoint slice; state is (epoch, batch)."""

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0):
        self.tokens, self.mask = tokens, mask
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.global_batch = batch_size * world_size
        if len(tokens) < self.global_batch:
            raise ValueError(
                f"{len(tokens)} packed rows cannot fill one global batch of {self.global_batch} rows; "
                "add instruction data or lower the batch size"
            )
        self.epoch = 0
        self.batch = 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.tokens))

    @property
    def batches_per_epoch(self) -> int:
        return len(self.tokens) // self.global_batch

    def next_indices(self) -> np.ndarray:
        """Row indices of this rank's next batch (sorted), advancing the (epoch, batch) position."""
        if self.batch >= self.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
            self._perm = self._permutation(self.epoch)
        start = self.batch * self.global_batch + self.rank * self.batch_size
        idx = np.sort(self._perm[start : start + self.batch_size])
        self.batch += 1
        return idx

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.next_indices()
        return to_xy(self.tokens[idx], self.mask[idx])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        if state["global_batch"] != self.global_batch:
            raise ValueError(f"loader state was saved with global batch {state['global_batch']}, now {self.global_batch}")
        self.seed, self.epoch, self.batch = state["seed"], state["epoch"], state["batch"]
        self._perm = self._permutation(self.epoch)


def iter_packed_eval(tokens: np.ndarray, mask: np.ndarray, batch_size: int, max_batches: int) -> Iterator:
    for i in range(0, min(len(tokens), batch_size * max_batches), batch_size):
        yield to_xy(tokens[i : i + batch_size], mask[i : i + batch_size])


class SftStage(NextTokenStage):
    """Next-token training on packed instruction pairs (the ``train`` split of train_files[0]), loss on responses
    only; validated on the pairs of its ``val`` split."""

    def __init__(self, job: JobConfig, info: DistInfo):
        from kiln.tokens.tokenizer import load_encoding

        enc = load_encoding(job.tokenizer)

        def packed(split: str) -> tuple[np.ndarray, np.ndarray]:
            rows = read_pairs(job.train_files[0], split)
            if not rows:
                raise ValueError(f"{job.train_files[0]}: no '{split}' instruction pairs")
            return pack((encode_example(enc, r["prompt"], r["response"]) for r in rows), job.seq_len, enc.eot_token)

        self.lora = job.lora  # enabled: adapters on the frozen init_from weights
        tt, tm = packed("train")
        vt, vm = packed("val")
        super().__init__(job, info, PackedLoader(tt, tm, job.micro_batch, info.data_rank, info.data_world, job.seed),
                         lambda: iter_packed_eval(vt, vm, job.micro_batch, job.eval_batches))
