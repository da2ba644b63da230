"""Tests of kiln/evaluation/adapter.py (KilnLM, lm-eval's model ``kiln``): its scores against hand computation,
greedy and rolling requests, generation to the model's own end token, batching, and its request progress lines.

KilnLM.loglikelihood with a shared context (``share_context``): the endings of one
multiple-choice item (lm-eval sends each as its own request, with the same context) are scored with the context run
once into a KV cache. Its numbers are those of one row per request (the path with sharing off) to float rounding,
whatever the batch size or request order; contexts that do not fit, one-token endings and lone requests keep the
one-row path.

Run: python -m pytest -n 0 -q tests/kiln/evaluation/test_adapter.py   (tiny models, CPU, seconds)
"""

from __future__ import annotations

import random
import re

import pytest
import tiktoken
import torch
import torch.nn as nn
import torch.nn.functional as F
from lm_eval.api.instance import Instance

from kiln.evaluation import sample_generations
from kiln.evaluation.adapter import KilnLM, RequestProgress
from kiln.model.config import ModelConfig
from kiln.model.families import build_model
from kiln.model.gpt2.model import GPT
from tests.kiln.evaluation.evaluation_kit import PAT, TableLM, cycle_lm, direct_logprob, ll_req, tiny_gpt
from tests.kiln.evaluation.evaluation_kit import enc  # noqa: F401  (enc is a fixture)

BLOCK = 48


def tiny(family: str, seed: int = 0):
    torch.manual_seed(seed)
    extra = dict(n_kv_head=2, tie_embeddings=False) if family == "llama" else {}
    return build_model(ModelConfig(family=family, vocab_size=320, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32,
                                   **extra)).eval()


def req(ctx: str, cont: str) -> Instance:
    return Instance(request_type="loglikelihood", doc={}, arguments=(ctx, cont), idx=0)


def items(seed: int = 0) -> list[Instance]:
    """Multiple-choice items of contexts and endings of many lengths, and the cases that keep the one-row path."""
    rng = random.Random(seed)
    word = lambda: "".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 6)))  # noqa: E731
    out = []
    for _ in range(12):  # contexts of 2..~30 tokens, 2-5 endings of 1..~14 tokens (some equal, some repeated)
        ctx = " ".join(word() for _ in range(rng.randint(1, 5)))
        ends = [" " + " ".join(word() for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(2, 5))]
        out += [req(ctx, e) for e in ends + [ends[0]]]
    out += [req("Question: a b c?\nAnswer:", e) for e in (" A", " B", " C", " D")]  # one-token endings: one row
    out += [req("x" * 40, " yz"), req("x" * 40, " yzyzyzyz")]  # the second does not fit: left-truncated, one row
    out += [req("x" * 46, " y"), req("x" * 46, " yyyyy")]  # neither fits with its context
    out += [req("q", " one"), req("q", " two words")]  # a one-token context: nothing to cache
    out += [req("", "Start"), req("", "Stop")]  # no context: the end-of-text token
    out += [req("Trailing space ", "goes with the ending"), req("Trailing space ", "too")]
    out += [req("lone context", " only one request")]
    out += [req("long", " " + "z" * 60), req("long", " " + "w" * 3)]  # a continuation longer than the window
    return out


def direct(model, enc, ctx: list[int], cont: list[int]) -> float:
    x = torch.tensor([(ctx + cont)[:-1]])
    with torch.no_grad():
        logp = F.log_softmax(model(x)[0, :, : enc.n_vocab], dim=-1)
    return float(sum(logp[len(ctx) - 1 + j, t] for j, t in enumerate(cont)))


def close(a: list, b: list) -> None:
    assert [g for _, g in a] == [g for _, g in b]
    torch.testing.assert_close(torch.tensor([v for v, _ in a]), torch.tensor([v for v, _ in b]), rtol=1e-6, atol=2e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_shared_scores_equal_one_row_per_request_at_any_batch_size_and_order(enc, family):
    model = tiny(family)
    reqs = items()
    base = KilnLM(model, enc, batch_size=4, share_context=False).loglikelihood(reqs)
    shared = KilnLM(model, enc, batch_size=4).loglikelihood(reqs)
    close(shared, base)
    for bs in (1, 2, 64):
        close(KilnLM(model, enc, batch_size=bs).loglikelihood(reqs), shared)
    close(KilnLM(model, enc, batch_size=3).loglikelihood(reqs[::-1])[::-1], shared)
    for i, r in enumerate(reqs[:3] + reqs[-12:]):  # shared ones, and ones on the one-row path, against a full pass
        ctx, cont = r.args
        n_sp = len(ctx) - len(ctx.rstrip())
        ctx, cont = (ctx[:-n_sp], ctx[-n_sp:] + cont) if n_sp else (ctx, cont)
        if len(ctx) + len(cont) <= BLOCK + 1:
            got = shared[i if i < 3 else len(reqs) - 15 + i][0]
            assert got == pytest.approx(direct(model, enc, enc.encode(ctx) or [enc.eot_token], enc.encode(cont)),
                                        abs=1e-4)
    assert all(v < 0 for v, _ in shared)


def test_a_shared_context_runs_once_and_the_prefill_makes_no_logits(enc):
    model = tiny("llama")
    ctx = "one two three four five six"  # 27 byte tokens
    ends = [" reds", " blue", " pink", " gold"]  # 5 tokens each: one pass
    reqs = [req(ctx, e) for e in ends]
    fed, head = [], []
    model.register_forward_pre_hook(lambda m, args: fed.append(tuple(args[0].shape)))
    model.lm_head.register_forward_hook(lambda m, args, out: head.append(tuple(args[0].shape[:2])))
    lm = KilnLM(model, enc, batch_size=8)
    shared = lm.loglikelihood(reqs)
    n_ctx, n_end = len(enc.encode(ctx)), [len(enc.encode(e)) for e in ends]
    # the context less its last token once (no logits), then each ending's row: the last context token and the ending
    assert fed == [(1, n_ctx - 1), (4, max(n_end))] and head == [(1, 0), (4, max(n_end))]
    fed.clear()
    lm.share_context = False
    close(shared, lm.loglikelihood(reqs))
    assert fed == [(4, n_ctx + max(n_end) - 1)]  # one whole row per request
    for (v, _), e in zip(shared, ends):
        assert v == pytest.approx(direct(model, enc, enc.encode(ctx), enc.encode(e)), abs=1e-4)


def test_which_requests_go_to_the_shared_path(enc):
    lm = KilnLM(tiny("gpt2"), enc)
    pairs = [([1, 2, 3], [4, 5]), ([1, 2, 3], [6]), ([1, 2, 3], [4, 5]),  # a repeated ending is answered twice
             ([7, 8], [9]), ([7, 8], [10]),  # one-token endings: one row either way
             ([11], [12, 13]), ([11], [14, 15]),  # a one-token context: nothing to cache
             ([20, 21], [22, 23]),  # alone: one row either way
             ([1] * 41, [2] * 8), ([1] * 41, [3] * 9)]  # 41 + 9 > BLOCK + 1: the second is left-truncated, one row
    assert lm._shareable(pairs) == {(1, 2, 3): [0, 1, 2]}
    lm._head = lambda: None  # a model whose head cannot be left out: the same choice
    assert lm._shareable(pairs) == {(1, 2, 3): [0, 1, 2]}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_head_runs_only_where_a_target_is_predicted(enc, family):
    model = tiny(family)
    reqs = [req("a context of a few words", " x"), req("a context of a few more", " yz"), req("a context of a few birds", " w")]
    head = []
    model.lm_head.register_forward_hook(lambda m, args, out: head.append((tuple(args[0].shape), tuple(out.shape))))
    lm = KilnLM(model, enc, batch_size=8, share_context=False)
    got = lm.loglikelihood(reqs)
    n_cont = [len(enc.encode(r.args[1])) for r in reqs]
    # one pass of three rows of equal length; the head sees (rows, longest continuation) positions, not
    # (rows, longest row)
    assert [h[0][:2] for h in head] == [(3, max(n_cont))] and head[0][1][-1] == model.config.vocab_size
    for (v, _), r in zip(got, reqs):
        assert v == pytest.approx(direct(model, enc, enc.encode(r.args[0]), enc.encode(r.args[1])), abs=1e-4)


def test_one_token_answers_read_one_row(enc):
    model = tiny("llama")
    ctx = "Question: which letter?\nAnswer:"
    reqs = [req(ctx, f" {c}") for c in "ABCD"]  # " A" is two byte tokens: all four read the one row ctx + " "
    fed, head = [], []
    model.register_forward_pre_hook(lambda m, args: fed.append(tuple(args[0].shape)))
    model.lm_head.register_forward_hook(lambda m, args, out: head.append(tuple(args[0].shape[:2])))
    lm = KilnLM(model, enc, batch_size=4)
    shared = lm.loglikelihood(reqs)
    n_ctx = len(enc.encode(ctx))
    assert fed == [(1, n_ctx + 1)] and head == [(4, 2)]  # one row; the head at each answer's two positions
    lm.share_context = False
    close(shared, lm.loglikelihood(reqs))
    assert len({v for v, _ in shared}) == 4


def test_switched_off_the_shared_path_never_runs(enc):
    lm = KilnLM(tiny("gpt2"), enc)

    def no(*a, **k):
        raise AssertionError("share_context is off")

    lm.share_context = False
    lm._score_shared = no
    lm.loglikelihood([req("one two", " three four"), req("one two", " five six")])


def test_sharing_can_be_switched_off(enc, monkeypatch):
    model = tiny("gpt2")
    assert KilnLM(model, enc).share_context
    assert not KilnLM(model, enc, share_context="false").share_context
    monkeypatch.setenv("KILN_EVAL_SHARE_CONTEXT", "0")
    assert not KilnLM(model, enc).share_context
    assert KilnLM(model, enc, share_context=True).share_context  # an explicit argument beats the environment
    captured = {}
    monkeypatch.setattr(KilnLM, "from_checkpoint", classmethod(lambda cls, ckpt, **kw: captured.update(kw)))
    KilnLM.create_from_arg_string("checkpoint=/x,share_context=False")
    assert captured["share_context"] is False


def test_progress_counts_shared_and_single_requests_to_the_last(enc):
    lines: list[str] = []
    lm = KilnLM(tiny("llama"), enc, batch_size=1, progress=lines.append)
    reqs = items()
    lm.loglikelihood(reqs)
    done = [int(ln.split()[1].split("/")[0]) for ln in lines]
    assert done == sorted(done) and lines[-1].startswith(f"eval {len(reqs)}/{len(reqs)}: loglikelihood |")


def test_a_pass_holds_no_more_logits_than_logits_gib_and_scores_do_not_change(enc, monkeypatch):
    model = tiny("llama")
    reqs = items()
    wide = KilnLM(model, enc, batch_size=64)
    assert wide.pass_tokens == 64 * BLOCK  # 320-token vocabulary: the default 2 GiB never binds here
    # a cap of one full-length row's logits: every pass holds at most BLOCK tokens
    narrow = KilnLM(model, enc, batch_size=64, logits_gib=BLOCK * 320 * 4 / 2**30)
    assert narrow.pass_tokens == BLOCK
    seen = []
    real = model.forward
    monkeypatch.setattr(model, "forward", lambda x, *a, **k: seen.append(x.numel()) or real(x, *a, **k))
    got = narrow.loglikelihood(reqs)
    assert seen and max(seen) <= BLOCK
    close(got, KilnLM(model, enc, batch_size=64, share_context=False).loglikelihood(reqs))
    monkeypatch.setenv("KILN_EVAL_LOGITS_GIB", "0")
    with pytest.raises(ValueError, match="KILN_EVAL_LOGITS_GIB"):
        KilnLM(model, enc)


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


def byte_encoding() -> tiktoken.Encoding:
    ranks = {bytes([i]): i for i in range(256)}
    return tiktoken.Encoding(name="t", pat_str=PAT, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 256})


def test_progress_lines_give_done_of_total_rate_and_time_left():
    now = [100.0]
    lines: list[str] = []
    tell = RequestProgress(lines.append, "loglikelihood", 400, every_s=5.0, clock=lambda: now[0])
    for done, t in ((40, 102.0), (80, 104.0), (120, 107.0), (400, 108.0)):
        now[0] = t
        tell.reached(done)
    # the first update, then 120 (5 s after the last line; 80 came 2 s after 40), then the last
    assert lines == ["eval 40/400: loglikelihood | 20.0 requests/s | 18s left",
                     "eval 120/400: loglikelihood | 17.1 requests/s | 16s left",
                     "eval 400/400: loglikelihood | 50.0 requests/s | 0s left"]
    RequestProgress(None, "loglikelihood", 10).reached(5)  # no sink: nothing to do


def test_the_adapter_reports_each_request_type_to_the_last_request():
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=320, block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()
    lines: list[str] = []
    lm = KilnLM(model, byte_encoding(), batch_size=2, progress=lines.append)
    reqs = [Instance("loglikelihood", {}, (f"question {i}", f" answer {i % 3}"), 0) for i in range(7)]
    lm.loglikelihood(reqs)
    lm.generate_until([Instance("generate_until", {}, (f"q{i}", {"max_gen_toks": 2}), 0) for i in range(5)])
    lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("some text to score",), 0)])
    assert lines[0].startswith("eval ") and lines[0].split(":")[1].startswith(" loglikelihood |")
    ends = [ln.split(" |")[0] for ln in lines if re.match(r"eval (\d+)/\1:", ln)]  # each call's last line
    assert ends == ["eval 7/7: loglikelihood", "eval 5/5: generate_until", "eval 1/1: loglikelihood_rolling"]
    assert all(ln.endswith(" left") and " requests/s | " in ln for ln in lines)


def test_a_long_row_does_not_pad_much_shorter_ones_to_its_length(enc):
    model = tiny("llama")
    fed = []
    model.register_forward_pre_hook(lambda m, args: fed.append(tuple(args[0].shape)))
    lm = KilnLM(model, enc, batch_size=8, share_context=False)
    reqs = [req("x" * 40, " y"), req("ab", " c"), req("de", " f"), req("gh", " i")]
    got = lm.loglikelihood(reqs)
    assert fed == [(1, 41), (3, 3)]  # the 41-token row alone, the three 3-token rows together
    for (v, _), r in zip(got, reqs):
        assert v == pytest.approx(direct(model, enc, enc.encode(r.args[0]), enc.encode(r.args[1])), abs=1e-4)
