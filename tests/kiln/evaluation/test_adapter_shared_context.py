"""KilnLM.loglikelihood with a shared context (kiln.evaluation.adapter ``share_context``): the endings of one
multiple-choice item (lm-eval sends each as its own request, with the same context) are scored with the context run
once into a KV cache. Its numbers are those of one row per request (the path with sharing off) to float rounding,
whatever the batch size or request order; contexts that do not fit, one-token endings and lone requests keep the
one-row path.

Run: python -m pytest -n 0 -q tests/kiln/evaluation/test_adapter_shared_context.py   (tiny models, CPU, seconds)
"""

from __future__ import annotations

import random

import pytest
import tiktoken
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance

from kiln.evaluation.adapter import KilnLM
from kiln.model.config import ModelConfig
from kiln.model.families import build_model

PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
BLOCK = 48


@pytest.fixture(scope="module")
def enc() -> tiktoken.Encoding:
    ranks = {bytes([i]): i for i in range(256)}
    return tiktoken.Encoding(name="t", pat_str=PAT, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 256})


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
    ends = [" red", " blue", " pink", " gold"]  # 4, 5, 5 and 5 tokens: one pass
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
    reqs = [req("a long enough context here", " x"), req("another context", " yz"), req("third", " w")]
    head = []
    model.lm_head.register_forward_hook(lambda m, args, out: head.append((tuple(args[0].shape), tuple(out.shape))))
    lm = KilnLM(model, enc, batch_size=8, share_context=False)
    got = lm.loglikelihood(reqs)
    n_cont = [len(enc.encode(r.args[1])) for r in reqs]
    # one pass of three rows; the head sees (rows, longest continuation) positions, not (rows, longest row)
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
