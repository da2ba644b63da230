"""An AI judge: any model Kiln loads labels preference pairs against written principles (RLAIF, Constitutional AI).

``judge = load_judge(path)`` (a Hugging Face folder, a release bundle or a Kiln checkpoint), then
``judge_pairs(judge, read_principles("conf/judge/principles.yaml"), pairs, rule="yes_no")`` scores every pair in both
orders from the judge's next-token probabilities; ``agreement(verdicts, truth)`` measures it where the label is known.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import random
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn as nn

from kiln.common.config import ConfigError, check_types, from_dict, read_yaml


# ---- principles ---------------------------------------------------------------------------------------------------

@dataclass
class Principle:
    name: str = ""  # a short identifier, e.g. correct_arithmetic
    text: str = ""  # the principle as the judge reads it
    weight: float = 1.0  # its weight in an answer's score (> 0)


@dataclass
class Principles:
    principles: list = field(default_factory=list)  # the numbered principles, each {name, text, weight}
    yes_word: str = "Yes"  # the judge's word for "follows the principle"; its first token is scored
    no_word: str = "No"  # its word for "does not"


def read_principles(path: str | Path) -> Principles:
    """The principles file (YAML) as Principles; an unknown key, a missing text or a bad weight is a ConfigError
    naming the file and the key."""
    path = Path(path)
    doc = read_yaml(path, "the principles file", "give judged_preferences.principles a YAML file like "
                    "conf/judge/principles.yaml")
    if not isinstance(doc, dict) or not all(isinstance(k, str) for k in doc):
        raise ConfigError(f"{path}: a principles file is a mapping with a 'principles' list and string keys "
                          f"(got keys {list(doc) if isinstance(doc, dict) else doc!r}; YAML reads bare yes/no as booleans)")
    out = from_dict(Principles, doc, str(path))
    check_types(out, str(path))
    if not isinstance(out.principles, list) or not out.principles:
        raise ConfigError(f"{path}: 'principles' must be a non-empty list of {{name, text, weight}}")
    items = []
    for i, item in enumerate(out.principles):
        where = f"{path}: principles[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"{where}: must be a mapping {{name, text, weight}}, got {item!r}")
        p = from_dict(Principle, item, where)
        check_types(p, where)
        if not p.name or not p.text.strip():
            raise ConfigError(f"{where}: 'name' and 'text' must be set")
        if not p.weight > 0:
            raise ConfigError(f"{where}.weight must be > 0, got {p.weight}")
        items.append(p)
    names = [p.name for p in items]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: principle names must be unique, got {names}")
    if not out.yes_word.strip() or out.yes_word.strip() == out.no_word.strip():
        raise ConfigError(f"{path}: 'yes_word' and 'no_word' must be two different words, got {out.yes_word!r} "
                          f"and {out.no_word!r}")
    out.principles = items
    return out


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ---- the judge model ----------------------------------------------------------------------------------------------

@dataclass
class Judge:
    """A loaded judge: the model (eval mode, on ``device``), its own tokenizer, and what identifies it in lineage."""

    model: nn.Module
    enc: Any
    identity: dict[str, Any]  # {path, kind, sha256, family, params}
    device: str = "cpu"


def judge_fingerprint(path: str | Path, where: str = "judge") -> dict[str, str]:
    """{path, kind, sha256} of a judge without loading its weights: a Hugging Face folder's content hash, a
    release's SHA256SUMS hash, or a checkpoint's weights digest (kiln.train.checkpoint.checkpoint_identity)."""
    from kiln.pretrained.source import folder_hash, is_importable
    from kiln.train.checkpoint import CheckpointError, checkpoint_identity, resolve_checkpoint

    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{where}: {p} does not exist; give a Hugging Face folder, a release bundle or a Kiln checkpoint")
    if (p / "SHA256SUMS").is_file():  # a release bundle is a Hugging Face folder too: its checksums come first
        return {"path": str(p.resolve()), "kind": "release", "sha256": file_sha256(p / "SHA256SUMS")}
    if is_importable(p):
        return {"path": str(p.resolve()), "kind": "hf_folder" if p.is_dir() else "gguf", "sha256": folder_hash(p)}
    try:
        ckpt = resolve_checkpoint(p)
    except CheckpointError as e:
        raise ConfigError(f"{where}: {p} is not a Hugging Face folder, a release bundle or a Kiln checkpoint ({e})") from e
    return {"path": str(ckpt.resolve()), "kind": "checkpoint", "sha256": checkpoint_identity(ckpt)}


def load_judge(path: str | Path, device: str = "cpu", where: str = "judge") -> Judge:
    """A judge from a Hugging Face folder or GGUF file (imported as kiln.pretrained imports it), a release bundle (SHA256SUMS) or
    a Kiln checkpoint (a checkpoint folder, checkpoints root or run folder); ``where`` names the config key in errors."""
    ident = judge_fingerprint(path, where)
    p = Path(ident["path"])
    if ident["kind"] in ("hf_folder", "gguf"):
        model, enc = _load_hf(p)
    elif ident["kind"] == "release":
        from kiln.release.bundle import load_release

        model, enc = load_release(p)
    else:
        from kiln.train.checkpoint import load_for_inference

        model, enc, _ = load_for_inference(p)
    model.to(device).eval().requires_grad_(False)
    identity = {**ident, "family": model.config.family, "params": sum(t.numel() for t in model.parameters())}
    return Judge(model, enc, identity, device)


def _load_hf(folder: Path) -> tuple[nn.Module, Any]:
    from kiln.model.families import build_model
    from kiln.pretrained.source import load_pretrained

    state, cfg, tok, _ = load_pretrained(folder)
    model = build_model(cfg)
    model.load_state_dict(state)
    return model, tok.encoding


# ---- scoring rules ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    """How the judge is asked: ``pairwise`` templates show both answers (judged in both orders); pointwise ones
    score each answer alone, so the order of a pair cannot matter."""

    template: str  # with {principle}, {question} and {answer} (pointwise) or {first} and {second} (pairwise)
    pairwise: bool
    about: str


RULES: dict[str, Rule] = {
    "yes_no": Rule("Principle: {principle}\nQuestion: {question}\nAnswer: {answer}\n"
                   "Does the answer follow the principle?", False,
                   "each answer alone: log p(yes) - log p(no), weighted over principles; A is preferred when it scores higher"),
    "compare": Rule("Principle: {principle}\nQuestion: {question}\nAnswer 1: {first}\nAnswer 2: {second}\n"
                    "Does Answer 1 follow the principle better than Answer 2?", True,
                    "both answers shown: log p(yes) - log p(no) that the first is better, in both orders, averaged"),
}


def rule_of(name: str, where: str = "rule") -> Rule:
    if name not in RULES:
        raise ConfigError(f"{where}: unknown scoring rule {name!r}; choose one of {sorted(RULES)}")
    return RULES[name]


def _fit(lengths: dict[str, int], budget: int) -> int:
    """The largest cap L such that the slots, each cut to its first L tokens, fit in ``budget`` tokens."""
    cap = max(lengths.values(), default=0)
    while cap > 0 and sum(min(n, cap) for n in lengths.values()) > budget:
        cap -= 1
    return cap


ANSWER_TOKENS = 96  # the judge reads at most this many tokens of a question or answer (the first ones)


def render_ids(enc, template: str, principle: str, slots: dict[str, str], max_len: int) -> list[int]:
    """Token ids of ``template`` filled in, in the chat template when the judge has its tokens. Each question and
    answer slot keeps its first ANSWER_TOKENS tokens; when the whole is still longer than ``max_len``, the question
    is cut first (to a quarter of the room, or what the answers leave), then the answers evenly; the principle never is."""
    sp = getattr(enc, "_special_tokens", {})
    chat = "<|user|>" in sp and "<|assistant|>" in sp
    pieces = [(lit, name) for lit, name, _, _ in string.Formatter().parse(template)]
    fixed = sum(len(enc.encode_ordinary(lit)) for lit, _ in pieces) + len(enc.encode_ordinary(principle)) + 2 * chat
    slot_ids = {k: enc.encode_ordinary(v)[:ANSWER_TOKENS] for k, v in slots.items()}
    room = max_len - fixed
    if "question" in slot_ids:  # the answers come first: the question keeps at most a quarter of a tight room
        q = slot_ids["question"] = slot_ids["question"][: max(room - sum(len(v) for k, v in slot_ids.items()
                                                                          if k != "question"), room // 4, 0)]
        room -= len(q)
    cap = _fit({k: len(v) for k, v in slot_ids.items() if k != "question"}, room)
    if room < 0 or cap == 0 and any(v for k, v in slot_ids.items() if k != "question"):
        raise ConfigError(f"principle {principle[:40]!r}: the template leaves no room for the answer in the judge's "
                          f"{max_len}-token context; shorten the principle or use a judge with a longer context")
    ids: list[int] = [sp["<|user|>"]] if chat else []
    for lit, name in pieces:
        ids += enc.encode_ordinary(lit)
        if name == "principle":
            ids += enc.encode_ordinary(principle)
        elif name == "question":
            ids += slot_ids[name]
        elif name is not None:
            ids += slot_ids[name][:cap]
    return ids + ([sp["<|assistant|>"]] if chat else [])


def answer_tokens(enc, principles: Principles) -> tuple[int, int]:
    """The first token of the yes and of the no word (after a space outside the chat template); they must differ."""
    sp = getattr(enc, "_special_tokens", {})
    lead = "" if "<|assistant|>" in sp else " "
    yes = enc.encode_ordinary(lead + principles.yes_word.strip())[0]
    no = enc.encode_ordinary(lead + principles.no_word.strip())[0]
    if yes == no:
        raise ConfigError(f"principles yes_word={principles.yes_word!r} and no_word={principles.no_word!r} start "
                          f"with the same token "
                          f"({yes}) in the judge's tokenizer; choose words that begin differently")
    return yes, no


class _TwoLogits(nn.Module):
    """Stands in for a model's ``lm_head`` while judging: the logits of two tokens at each row's last real position
    only, (B, T, C) -> (B, 1, 2), instead of the whole vocabulary at every position."""

    def __init__(self, head: nn.Module, tokens: tuple[int, int], last: torch.Tensor):
        super().__init__()
        self.head, self.tokens, self.last = head, list(tokens), last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x[torch.arange(x.size(0), device=x.device), self.last]  # (B, C)
        return (h @ self.head.weight[self.tokens].T).unsqueeze(1)  # (B, 1, 2)


@contextlib.contextmanager
def _one_thread_on(device: str) -> Iterator[None]:
    """One CPU thread inside (small latency-bound batches, as kiln.posttrain.measures runs them); else unchanged."""
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def verdict_logits(judge: Judge, rows: list[list[int]], yes: int, no: int, batch_size: int = 16) -> np.ndarray:
    """log p(yes) - log p(no) of the next token after each row (the logit difference; softmax cancels), batched:
    rows of similar length share a right-padded batch, and only the two logits at each row's last real position
    are computed (the model's head is swapped for _TwoLogits meanwhile)."""
    out = np.zeros(len(rows), dtype=np.float64)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    model, pad, dev = judge.model, judge.enc.eot_token, judge.device
    head = model.lm_head
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            width = max(len(rows[i]) for i in idx)
            x = torch.tensor([rows[i] + [pad] * (width - len(rows[i])) for i in idx], device=dev)  # (B, T)
            model.lm_head = _TwoLogits(head, (yes, no), torch.tensor([len(rows[i]) - 1 for i in idx], device=dev))
            with _one_thread_on(dev):
                two = model(x)[:, 0].double()  # (B, 2)
            out[idx] = (two[:, 0] - two[:, 1]).cpu().numpy()
    finally:
        model.lm_head = head
    return out


# ---- judging pairs ------------------------------------------------------------------------------------------------

def _scores(judge: Judge, principles: Principles, rule: Rule, items: list[tuple[str, dict[str, str]]],
            batch_size: int) -> np.ndarray:
    """(len(items),) weighted sums over principles of the verdict logit; items are (question, slots)."""
    yes, no = answer_tokens(judge.enc, principles)
    max_len = judge.model.config.block_size
    rows = [render_ids(judge.enc, rule.template, p.text, {"question": q, **slots}, max_len)
            for q, slots in items for p in principles.principles]
    logits = verdict_logits(judge, rows, yes, no, batch_size).reshape(len(items), len(principles.principles))
    weights = np.array([p.weight for p in principles.principles], dtype=np.float64)  # (P,)
    return logits @ weights  # (N,)


def answer_scores(judge: Judge, principles: Principles, items: list[tuple[str, str]], batch_size: int = 16) -> np.ndarray:
    """(len(items),) pointwise scores of (question, answer) items by the yes_no rule: the weighted sum over
    principles of log p(yes) - log p(no) that the answer follows each."""
    return _scores(judge, principles, RULES["yes_no"], [(q, {"answer": a}) for q, a in items], batch_size)


def _side(margin: float, tie: float) -> str:
    return "a" if margin > tie else "b" if margin < -tie else "tie"


def judge_pairs(judge: Judge, principles: Principles, pairs: list[dict], rule: str = "yes_no",
                tie_margin: float = 1e-3, batch_size: int = 16) -> list[dict[str, Any]]:
    """One verdict per pair {prompt, a, b}: ``ab`` is the preference for a with a shown first, ``ba`` the preference
    for b with b shown first, ``margin`` = (ab - ba) / 2 (position bias cancels); ``verdict`` "a", "b" or "tie"
    (|margin| <= tie_margin); ``flipped`` when the two orders alone would have given different verdicts."""
    r = rule_of(rule)
    if r.pairwise:
        items = [(p["prompt"], {"first": x, "second": y}) for p in pairs for x, y in ((p["a"], p["b"]), (p["b"], p["a"]))]
        s = _scores(judge, principles, r, items, batch_size).reshape(len(pairs), 2)
        ab, ba = s[:, 0], s[:, 1]
    else:
        answers = sorted({(p["prompt"], x) for p in pairs for x in (p["a"], p["b"])})
        s = dict(zip(answers, _scores(judge, principles, r, [(q, {"answer": a}) for q, a in answers], batch_size)))
        ab = np.array([s[(p["prompt"], p["a"])] - s[(p["prompt"], p["b"])] for p in pairs])
        ba = -ab
    out = []
    for a_first, b_first in zip(ab.tolist(), ba.tolist()):
        margin = (a_first - b_first) / 2
        first_only, second_only = _side(a_first, tie_margin), _side(-b_first, tie_margin)
        out.append({"ab": a_first, "ba": b_first, "margin": margin, "verdict": _side(margin, tie_margin),
                    "flipped": first_only != second_only})
    return out


def agreement(verdicts: list[dict], truth: list[str]) -> dict[str, float]:
    """{agreement, stderr, n, ties}: the share of pairs whose verdict is the known label ("a" or "b"), a tie counting
    one half; stderr is the standard error of that mean (sqrt(p(1-p)/n) without ties)."""
    if len(verdicts) != len(truth):
        raise ValueError(f"agreement: {len(verdicts)} verdicts but {len(truth)} labels")
    hits = np.array([1.0 if v["verdict"] == t else 0.5 if v["verdict"] == "tie" else 0.0 for v, t in zip(verdicts, truth)])
    n = len(hits)
    return {"agreement": float(hits.mean()) if n else math.nan, "stderr": float(hits.std() / math.sqrt(n)) if n else math.nan,
            "n": n, "ties": sum(v["verdict"] == "tie" for v in verdicts)}


def position_bias(verdicts: list[dict]) -> float:
    """The share of pairs whose verdict flipped with the order the answers were shown in."""
    return float(np.mean([v["flipped"] for v in verdicts])) if verdicts else math.nan


# ---- candidates and the labelled file -----------------------------------------------------------------------------

def sample_candidates(model: nn.Module, enc, prompts: list[str], k: int, max_new_tokens: int, temperature: float,
                      seed: int, device: str = "cpu") -> list[list[str]]:
    """``k`` answers per prompt drawn from ``model`` with the KV-cache sampler (kiln.posttrain.sampling), seeded."""
    from kiln.posttrain.sampling import complete, decode_completion

    g = torch.Generator(device=device).manual_seed(seed)
    with _one_thread_on(device):
        outs = complete(model, enc, prompts, max_new_tokens, temperature=temperature, samples=k, generator=g,
                        device=device)
    return [[decode_completion(enc, o).strip() for o in group] for group in outs]


def candidate_pairs(rows: list[dict], candidates: list[list[str]]) -> tuple[list[dict], int]:
    """(every pair of distinct candidates of each row, as {prompt, a, b, row}; pairs skipped as identical)."""
    pairs, same = [], 0
    for row, cands in zip(rows, candidates):
        for x, y in itertools.combinations(cands, 2):
            if x == y or not x or not y:
                same += 1
                continue
            pairs.append({"prompt": row["prompt"], "a": x, "b": y, "row": row})
    return pairs, same


def checkable_pairs(prefs: list[dict], n: int, seed: int) -> list[dict]:
    """Up to ``n`` preference rows (known labels) as pairs; a seeded coin puts the correct answer first or second,
    so a judge that always prefers one position scores one half."""
    rng = random.Random(seed)
    out = []
    for p in prefs[:n]:
        swap = rng.random() < 0.5
        a, b = (p["rejected"], p["chosen"]) if swap else (p["chosen"], p["rejected"])
        out.append({"prompt": p["prompt"], "a": a, "b": b, "truth": "b" if swap else "a", "row": p})
    return out


def labelled_rows(pairs: list[dict], verdicts: list[dict]) -> list[dict]:
    """Preference rows (preference_data's format: id, prompt, kind, split, source_id, chosen, rejected, error) from
    judged pairs; ties are left out (nothing to learn), the judge's margin kept as ``judge_margin``."""
    out = []
    for i, (p, v) in enumerate(zip(pairs, verdicts)):
        if v["verdict"] == "tie":
            continue
        chosen, rejected = (p["a"], p["b"]) if v["verdict"] == "a" else (p["b"], p["a"])
        row = p["row"]
        pid = hashlib.sha256(f"{row['id']}|{chosen}|{rejected}".encode()).hexdigest()[:16]
        out.append({"id": pid, "prompt": row["prompt"], "kind": row["kind"], "split": row["split"],
                    "source_id": row["source_id"], "chosen": chosen, "rejected": rejected, "error": "judge",
                    "judge_margin": round(abs(v["margin"]), 6)})
    return out


def judgement_record(p: dict, v: dict) -> dict[str, Any]:
    """One line of judgements.jsonl: the pair, both orders' preferences, the verdict and (checkable) the truth."""
    return {"prompt": p["prompt"], "a": p["a"], "b": p["b"], "ab": round(v["ab"], 6), "ba": round(v["ba"], 6),
            "margin": round(v["margin"], 6), "verdict": v["verdict"], "flipped": v["flipped"],
            **({"truth": p["truth"]} if "truth" in p else {})}



@dataclass
class JudgingRun:
    """What one judging pass made: the checkable pairs (known labels) and the sampled ones, each with verdicts."""

    checkable: list[dict]
    checkable_verdicts: list[dict]
    sampled: list[dict]
    sampled_verdicts: list[dict]
    identical: int  # sampled pairs left out because both answers were the same text


def run_judging(judge: Judge, principles: Principles, checkable: list[dict], prompts: list[dict], policy: nn.Module,
                policy_enc, *, rule: str = "yes_no", candidates: int = 2, max_new_tokens: int = 48,
                temperature: float = 1.0, tie_margin: float = 1e-3, seed: int = 0, batch_size: int = 16,
                device: str = "cpu") -> JudgingRun:
    """Judge ``checkable`` (preference rows whose right label is known) and pairs of ``candidates`` answers that
    ``policy`` samples for each of ``prompts`` (preference rows whose prompt is used)."""
    if candidates < 2:
        raise ConfigError(f"judged_preferences.candidates must be at least 2 (a pair), got {candidates}")
    checks = checkable_pairs(checkable, len(checkable), seed)
    check_v = judge_pairs(judge, principles, checks, rule, tie_margin, batch_size)
    drawn = sample_candidates(policy, policy_enc, [r["prompt"] for r in prompts], candidates, max_new_tokens,
                              temperature, seed, device) if prompts else []
    pairs, same = candidate_pairs(prompts, drawn)
    return JudgingRun(checks, check_v, pairs, judge_pairs(judge, principles, pairs, rule, tie_margin, batch_size), same)
