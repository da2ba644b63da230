"""Tests for kiln.evaluation: the lm-eval adapter's scores against hand computation, local tasks, the suite.

Run: python -m pytest tests/kiln/evaluation/test_evaluation.py -q   (tiny random models; a few seconds on CPU)
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest
import tiktoken
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from lm_eval.api.instance import Instance

from kiln.evaluation import (
    CHANCE,
    TASK_NAMES,
    KilnLM,
    NotEnoughDocumentsError,
    build_tasks,
    run_suite,
    sample_generations,
)
from kiln.model.cache import KVCache
from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT

PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
FILL = "the a of and to in on with near under over slowly quietly every old new small bright".split()


@pytest.fixture(scope="module")
def enc() -> tiktoken.Encoding:
    ranks = {bytes([i]): i for i in range(256)}
    return tiktoken.Encoding(name="t", pat_str=PAT, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 256})


def tiny_gpt(block_size: int = 32, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig(vocab_size=320, block_size=block_size, n_layer=2, n_head=2, n_embd=32)).eval()


class TableLM(nn.Module):
    """A fake GPT whose next-token logits depend only on the current token: logits = table[idx]."""

    def __init__(self, table: torch.Tensor, block_size: int = 64):
        super().__init__()
        self.config = ModelConfig(vocab_size=table.shape[1], block_size=block_size, n_layer=1, n_head=1, n_embd=8)
        self.table = nn.Parameter(table.clone(), requires_grad=False)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        if cache is not None:  # nothing to remember: only the position moves on
            cache.advance(idx.size(1))
        return self.table[idx]  # (B, T) -> (B, T, V)


def cycle_lm(text: str = "abcdefg") -> TableLM:
    """Greedy decoding from any letter of ``text`` walks the cycle: after 'a' comes 'b', ... after 'g' 'a'."""
    table = torch.zeros(320, 320)
    for a, b in zip(text, text[1:] + text[0]):
        table[ord(a), ord(b)] = 5.0
    return TableLM(table)


def direct_logprob(model: nn.Module, enc: tiktoken.Encoding, ctx: list[int], cont: list[int]) -> float:
    """Sum of log p(cont | ctx) from one full forward pass (log_softmax over the tokenizer's real ids)."""
    x = torch.tensor([(ctx + cont)[:-1]])  # (1, T)
    with torch.no_grad():
        logp = F.log_softmax(model(x)[0, :, : enc.n_vocab], dim=-1)  # (T, Vr)
    n = len(ctx)
    return float(sum(logp[n - 1 + j, t] for j, t in enumerate(cont)))


def ll_req(ctx: str, cont: str) -> Instance:
    return Instance(request_type="loglikelihood", doc={}, arguments=(ctx, cont), idx=0)


def test_loglikelihood_matches_direct_and_ignores_batching(enc):
    model = tiny_gpt(block_size=32)
    lm = KilnLM(model, enc, batch_size=4)
    (lp, _), = lm.loglikelihood([ll_req("Hello world", " and more")])
    assert lp == pytest.approx(direct_logprob(model, enc, enc.encode("Hello world"), enc.encode(" and more")), abs=1e-4)

    long_ctx, long_cont = "x" * 50, "y" * 45  # left truncation; a continuation longer than block_size
    reqs = [ll_req(c, t) for c, t in [("", "Start"), ("ab", "c"), ("Hello ", "there"), (long_ctx, " tail"),
                                      ("q", long_cont), ("Some words", " more words here")]]
    base = lm.loglikelihood(reqs)
    assert base[0][0] == pytest.approx(direct_logprob(model, enc, [enc.eot_token], enc.encode("Start")), abs=1e-4)
    ids = enc.encode(long_ctx + " tail")[-33:]  # the last block_size + 1 tokens
    assert base[3][0] == pytest.approx(direct_logprob(model, enc, ids[:-5], ids[-5:]), abs=1e-4)
    for other in (KilnLM(model, enc, batch_size=1).loglikelihood(reqs), lm.loglikelihood(reqs[::-1])[::-1]):
        assert [g for _, g in other] == [g for _, g in base]
        torch.testing.assert_close(torch.tensor([v for v, _ in other]), torch.tensor([v for v, _ in base]))
    assert all(v < 0 for v, _ in base)


def test_is_greedy(enc):
    lm = KilnLM(cycle_lm(), enc)
    (lp, greedy), (_, wrong) = lm.loglikelihood([ll_req("abc", "defg"), ll_req("abc", "dxfg")])
    assert greedy and not wrong
    assert lp == pytest.approx(4 * (5.0 - torch.logsumexp(torch.tensor([5.0] + [0.0] * 256), 0).item()), abs=1e-4)


def test_loglikelihood_rolling_matches_hand_windows(enc):
    L = 16
    model = tiny_gpt(block_size=L, seed=1)
    lm = KilnLM(model, enc, batch_size=3)
    text = "The quick brown fox jumps over the lazy dog, again and again."  # 62 byte tokens > block_size
    tok = enc.encode(text)
    seq = [enc.eot_token] + tok  # seq[i + 1] is token i; every token is predicted once
    with torch.no_grad():
        total, s = 0.0, 0
        while s < len(tok):
            r = min(L, len(tok) - s)
            start = s if r == L else len(tok) - L  # a full chunk, or the last L inputs for a final short one
            logp = F.log_softmax(model(torch.tensor([seq[start : start + L]]))[0, :, : enc.n_vocab], -1)  # (L, Vr)
            total += sum(float(logp[L - r + j, seq[s + 1 + j]]) for j in range(r))
            s += r
    (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert got == pytest.approx(total, abs=1e-3)
    (short,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("Hi there",), 0)])
    assert short == pytest.approx(direct_logprob(model, enc, [enc.eot_token], enc.encode("Hi there")), abs=1e-4)


def test_generate_until_stops_and_is_deterministic(enc):
    lm = KilnLM(cycle_lm(), enc)
    gen = lambda kw: lm.generate_until([Instance("generate_until", {}, ("a", kw), 0)])[0]  # noqa: E731
    assert gen({"until": ["e"], "max_gen_toks": 20}) == "bcd"
    assert gen({"until": "cd"}) == "b"
    assert gen({"until": [], "max_gen_toks": 9}) == "bcdefgabc"
    model = tiny_gpt()
    greedy = sample_generations(model, enc, ["Hello", "The river"], max_new_tokens=8, seed=0)
    assert greedy == sample_generations(model, enc, ["Hello", "The river"], max_new_tokens=8, seed=5)
    hot = [sample_generations(model, enc, ["Hello"], 8, seed=3, temperature=1.0) for _ in range(2)]
    assert hot[0] == hot[1] and hot[0][0]["prompt"] == "Hello"


def test_generation_ends_at_the_models_own_end_token_as_hflm_ends_at_its_eos(tmp_path):
    """An imported model ends its text with its own end of sequence (SmolLM2-Instruct's <|im_end|>, not
    <|endoftext|>): HFLM stops there (its tokenizer's eos), so Kiln does too; the end token is saved with the
    encoding and is part of its fingerprint."""
    from kiln.tokens.tokenizer import encoding_fingerprint, end_token, load_encoding, save_encoding, with_end_token

    ranks = {bytes([i]): i for i in range(256)}
    enc = tiktoken.Encoding(name="t2", pat_str=PAT, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": 256, "<|im_end|>": 257})
    table = torch.zeros(320, 320)
    for a, b in (("a", "b"), ("b", "c")):
        table[ord(a), ord(b)] = 5.0
    table[ord("c"), 257] = 5.0  # after c the model ends its turn, then would go on with d
    table[257, ord("d")] = 5.0
    table[ord("d"), ord("a")] = 5.0
    gen = lambda: KilnLM(TableLM(table), enc).generate_until(  # noqa: E731
        [Instance("generate_until", {}, ("a", {"until": ["zz"], "max_gen_toks": 6}), 0)])[0]
    assert end_token(enc) == 256 and gen() == "bcdab"  # Kiln's own end token only; specials left out, as HFLM does
    before = encoding_fingerprint(enc)
    with_end_token(enc, 257)
    assert gen() == "bc" and encoding_fingerprint(enc) != before
    save_encoding(enc, tmp_path / "enc.json")
    back = load_encoding(tmp_path / "enc.json")
    assert end_token(back) == 257 and encoding_fingerprint(back) == encoding_fingerprint(enc)
    with pytest.raises(Exception, match="end token id 999 is not an id of encoding t2"):
        with_end_token(enc, 999)


def make_docs(n: int, seed: int = 0) -> list[str]:
    """Documents of 10 sentences mixing filler words with 4 made-up topic words of their own."""
    r = random.Random(seed)
    docs = []
    for _ in range(n):
        topic = ["".join(r.choice("bcdfghklmnprstvz") + r.choice("aeiou") for _ in range(3)) for _ in range(4)]
        words = [[r.choice(topic + FILL) for _ in range(r.randint(6, 14))] for _ in range(10)]
        sents = [" ".join(w).capitalize() + "." for w in words]
        docs.append(" ".join(sents))
    return docs


class NGramLM(nn.Module):
    """A fake GPT that memorised some texts: logit 5 for each token that followed the last n-1 tokens there."""

    def __init__(self, texts: list[list[int]], n: int = 10, block_size: int = 64):
        super().__init__()
        self.config = ModelConfig(vocab_size=320, block_size=block_size, n_layer=1, n_head=1, n_embd=8)
        self.n, self.next = n, {}
        for ids in texts:
            for t in range(len(ids) - 1):
                self.next.setdefault(tuple(ids[max(0, t - n + 2) : t + 1]), set()).add(ids[t + 1])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(*idx.shape, self.config.vocab_size)  # (B, T, V)
        for b, row in enumerate(idx.tolist()):
            for t in range(len(row)):
                for nxt in self.next.get(tuple(row[max(0, t - self.n + 2) : t + 1]), ()):
                    out[b, t, nxt] = 5.0
        return out


def test_build_tasks_files_and_determinism(tmp_path, enc):
    docs = make_docs(50)
    info = build_tasks(docs, tmp_path / "a", n_items=20, seed=7)
    assert set(info) == set(TASK_NAMES)
    again = build_tasks(docs, tmp_path / "b", n_items=20, seed=7)
    other = build_tasks(docs, tmp_path / "c", n_items=20, seed=8)
    for task, meta in info.items():
        spec = yaml.safe_load(Path(meta["path"]).read_text())
        assert spec["task"] == task and spec["dataset_path"] == "json"
        data = Path(spec["dataset_kwargs"]["data_files"]["test"])
        assert data.is_absolute() and data == Path(meta["data"]).resolve()
        assert meta["items"] == 20 and meta["chance"] == CHANCE[task]
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        assert len(rows) == 20
        assert data.read_text() == Path(again[task]["data"]).read_text()
        assert data.read_text() != Path(other[task]["data"]).read_text()
    for row in map(json.loads, Path(info["kiln_continuation"]["data"]).read_text().splitlines()):
        assert len(set(row["choices"])) == 4 and 0 <= row["label"] < 4
        assert row["context"] + " " + row["choices"][row["label"]] in " ".join(docs[row["doc_index"]].split())
    for row in map(json.loads, Path(info["kiln_lastword"]["data"]).read_text().splitlines()):
        assert row["target"].startswith(" ") and row["context"] + row["target"] in docs[row["doc_index"]]
    with pytest.raises(NotEnoughDocumentsError, match=r"kiln_heldout_ppl: needs n_items=30 .* only 10 come from the 10"):
        build_tasks(docs[:10], tmp_path / "d", n_items=30, seed=0)

    # n_items as a cap with a floor, and several disjoint passages per document
    few = build_tasks(docs[:10], tmp_path / "e", n_items=30, seed=0, min_items=5, per_doc=3)
    assert few["kiln_heldout_ppl"]["items"] == 10  # one per document
    assert 10 < few["kiln_continuation"]["items"] <= 30 and 10 < few["kiln_lastword"]["items"] <= 30
    for task in ("kiln_continuation", "kiln_lastword"):
        rows = [json.loads(line) for line in Path(few[task]["data"]).read_text().splitlines()]
        per_doc = {}
        for r in rows:
            per_doc.setdefault(r["doc_index"], []).append(r["context"])
        assert max(map(len, per_doc.values())) <= 3
        assert all(len(set(c)) == len(c) for c in per_doc.values())  # disjoint passages, no repeats
        assert [r["id"] for r in rows] == list(range(len(rows)))
    with pytest.raises(NotEnoughDocumentsError, match="at most 1 per document"):
        build_tasks(docs[:10], tmp_path / "f", n_items=30, seed=0, min_items=11)


def test_run_suite_random_and_cheating_models(tmp_path, enc):
    docs = make_docs(60, seed=1)
    info = build_tasks(docs, tmp_path, n_items=40, seed=0)
    model = tiny_gpt(block_size=64, seed=1).train()
    res = run_suite(model, enc, tmp_path, list(TASK_NAMES), batch_size=8)
    assert model.training  # mode restored
    assert set(res["kiln_heldout_ppl"]) == {"word_perplexity", "byte_perplexity", "bits_per_byte", "chance", "items"}
    assert set(res["kiln_continuation"]) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "chance", "items"}
    assert set(res["kiln_lastword"]) == {"acc", "acc_stderr", "perplexity", "perplexity_stderr", "chance", "items"}
    assert all(res[t]["items"] == 40 and res[t]["chance"] == info[t]["chance"] for t in TASK_NAMES)
    accs = [res["kiln_continuation"]["acc"]]
    for s in (2, 3):
        accs.append(run_suite(tiny_gpt(64, seed=s), enc, tmp_path, ["kiln_continuation"])["kiln_continuation"]["acc"])
    assert 0.1 <= sum(accs) / 3 <= 0.4  # random models: near chance 0.25 (sd ~0.04 over 3 x 40 items)
    assert 0 <= res["kiln_lastword"]["acc"] <= 1 and res["kiln_heldout_ppl"]["bits_per_byte"] > 6  # ~log2(257)
    json.dumps(res)

    # A model that memorised each passage with its true ending must mostly pick it: checks labels end to end.
    # (Not 1.0: a distractor may be another item's memorised ending.)
    rows = [json.loads(line) for line in Path(info["kiln_continuation"]["data"]).read_text().splitlines()]
    cheat_lm = NGramLM([enc.encode(r["context"] + " " + r["choices"][r["label"]]) for r in rows])
    cheat = run_suite(cheat_lm, enc, tmp_path, ["kiln_continuation"], limit=25)
    assert cheat["kiln_continuation"]["items"] == 25 and cheat["kiln_continuation"]["acc"] >= 0.8


class CountingLM(nn.Module):
    """Wraps a model and records the batch shape of every forward pass."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.config, self.calls = inner, inner.config, []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.calls.append(tuple(idx.shape))
        return self.inner(idx)


def test_one_token_choices_share_one_forward_pass(enc):
    model = CountingLM(tiny_gpt(block_size=64, seed=4))
    lm = KilnLM(model, enc, batch_size=8)
    question = "Which is it?\nA. one\nB. two\nC. three\nD. four\nAnswer:"
    got = lm.loglikelihood([ll_req(question, f" {c}") for c in "ABCD"])
    assert len(model.calls) == 1 and model.calls[0][0] == 1  # four requests, one distinct input row
    for (lp, _), c in zip(got, "ABCD"):  # " A" is two byte tokens: the input (question + " ") is the same
        assert lp == pytest.approx(direct_logprob(model.inner, enc, enc.encode(question), enc.encode(f" {c}")), abs=1e-4)


def test_generate_until_batched_equals_one_at_a_time(enc):
    model = tiny_gpt(block_size=16, seed=2)
    contexts = ["Hello", "The river runs far away from here", "", "x" * 30, "ab"]  # one longer than block_size
    reqs = [Instance("generate_until", {}, (c, {"until": ["zz"], "max_gen_toks": 12}), i) for i, c in enumerate(contexts)]
    batched = KilnLM(model, enc, batch_size=4).generate_until(reqs)
    single = KilnLM(model, enc, batch_size=1).generate_until(reqs)
    assert batched == single and len(batched) == len(contexts)
    assert all(len(t) <= 12 for t in batched) and any(batched)  # <= 1 character per byte token


def test_lm_eval_command_line_loads_a_checkpoint_as_model_kiln(tmp_path, enc, capsys):
    """``kiln-lm-eval --model kiln --model_args checkpoint=...`` (lm-eval's own CLI with the model registered)."""
    from dataclasses import asdict

    from kiln.train.checkpoint import save_checkpoint
    from kiln.evaluation import lm_eval_cli
    from kiln.tokens.tokenizer import save_encoding

    model = tiny_gpt(block_size=64, seed=6)
    save_encoding(enc, tmp_path / "tokenizer.json")
    ckpt = save_checkpoint(tmp_path / "run" / "checkpoints", 5, {"model": model.state_dict()},
                           {"model": asdict(model.config)}, {"tokenizer.json": tmp_path / "tokenizer.json"})
    build_tasks(make_docs(30, seed=2), tmp_path / "tasks", n_items=6, seed=0)
    out = tmp_path / "out"
    lm_eval_cli(["--model", "kiln", "--model_args", f"checkpoint={tmp_path / 'run'},batch_size=4",
                 "--tasks", "kiln_continuation", "--include_path", str(tmp_path / "tasks"), "--output_path", str(out)])
    (result,) = out.rglob("results_*.json")
    got = json.loads(result.read_text())["results"]["kiln_continuation"]
    lm = KilnLM(model, enc, batch_size=4)  # the same checkpoint in code gives the same accuracy
    ref = run_suite(lm.model, enc, tmp_path / "tasks", ["kiln_continuation"], batch_size=4)
    assert got["acc,none"] == ref["kiln_continuation"]["acc"] and str(ckpt).endswith("step_0000005")
