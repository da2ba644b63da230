"""Tests for the post-training log-probabilities through the chunked head and the sampler's forked prefill: they
give what the full log-softmax of the logits and the repeated prompt rows gave (DPO, RL, PPO, the measures, the
reward model's hidden states).

Run: python -m pytest tests/kiln/posttrain/test_logprobs.py -q
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import kiln.model.loss as km
from kiln.model.config import ModelConfig
from kiln.model.families import build_model
import kiln.posttrain.logprobs as lp
from kiln.posttrain.logprobs import (encode_rows, grouped_sequence_logps, length_groups, model_sequence_logps,
                                     model_token_logps, score_responses, sequence_logps, target_lengths, token_logps)
from kiln.posttrain.measures import measure_items
from kiln.posttrain.reward import RewardModel
from kiln.posttrain.rl import RlJob
from tests.rollouts import rollout_loss

TINY = {"vocab_size": 320, "block_size": 48, "n_layer": 2, "n_head": 2, "n_embd": 32}
MODELS = {"gpt2": TINY, "llama": {**TINY, "family": "llama", "n_kv_head": 1}}


def make(family: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(**{**MODELS[family], **kw}))


PAIRS = [("What is 1 + 2?", "1 + 2 = 3."), ("Explain the river.", "The river runs to the sea."),
         ("What is 10 + 20?", "10 + 20 = 30.")]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_model_logps_equal_the_logits_log_softmax_with_gradients(tiny_tokenizer, monkeypatch, family) -> None:
    enc, _ = tiny_tokenizer
    monkeypatch.setitem(km.CE_CHUNK_BYTES, "cpu", 1 << 13)  # several chunks per batch
    x, y = encode_rows(enc, [p for p, _ in PAIRS], [r for _, r in PAIRS], 47)
    a, b = make(family), make(family)
    old = token_logps(a(x), y)
    (old.sum(-1) * torch.tensor([1.0, -2.0, 0.5])).sum().backward()  # a DPO-like weighting of the rows
    new = model_token_logps(b, x, y)
    (new.sum(-1) * torch.tensor([1.0, -2.0, 0.5])).sum().backward()
    assert torch.equal(new, old)
    assert torch.equal(model_sequence_logps(b, x, y), sequence_logps(a(x), y))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa.grad, pb.grad, rtol=1e-5, atol=1e-6), name
    with torch.no_grad():
        scored, n = score_responses(b.eval(), enc, [p for p, _ in PAIRS], [r for _, r in PAIRS], 47)
    assert scored == pytest.approx(sequence_logps(a.eval()(x), y).tolist(), abs=1e-5)
    assert n == (y != -100).sum(-1).tolist()


def test_rows_group_by_length_where_the_padding_saved_beats_a_pass() -> None:
    lengths = [22, 200, 19, 25, 21, 188, 23, 20] * 2  # a demo batch of pairs: short rows and a few long ones
    groups = length_groups(lengths, pass_tokens=1024)
    assert [sorted(lengths[i] for i in g) for g in groups] == [sorted([22, 19, 25, 21, 23, 20] * 2),
                                                               [188, 188, 200, 200]]
    assert sorted(i for g in groups for i in g) == list(range(16))  # every row once
    assert len(length_groups(lengths, pass_tokens=10_000)) == 1  # a pass dearer than the padding: one batch
    assert length_groups([30, 31, 29], pass_tokens=1024) == [[2, 0, 1]]  # similar rows: one batch, sorted
    assert [len(g) for g in length_groups([5, 9, 5, 9], pass_tokens=0)] == [2, 2]  # free passes: one per length
    assert length_groups([]) == []
    y = torch.tensor([[-100, 5, 6, -100, -100], [-100, -100, -100, -100, 7], [-100] * 5])
    assert target_lengths(y) == [3, 5, 1]  # up to the last target; a row without one counts 1


def test_grouped_sums_equal_one_batchs_with_gradients(tiny_tokenizer, monkeypatch) -> None:
    enc, _ = tiny_tokenizer
    long = "The river runs past the mill and the old stone bridge down to the sea, " * 2
    prompts, responses = ["Hi?", "What is 2 + 2?", "Tell me.", "Go on."], ["Yes.", "4.", long, "No."]
    x, y = encode_rows(enc, prompts, responses, 47)
    monkeypatch.setattr(lp, "PASS_TOKENS", 8)  # small rows: a split pays at this size
    widths = []
    model = make("llama")

    def logps(a, b):
        widths.append((a.size(0), a.size(1)))
        return model_token_logps(model, a, b)

    weights = torch.tensor([1.0, -2.0, 0.5, 3.0])
    one = model_token_logps(model, x, y).sum(-1)
    (one * weights).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    grouped = grouped_sequence_logps(logps, x, y)
    (grouped * weights).sum().backward()
    # the long row alone at the batch's width, the short ones in narrower passes
    assert widths[-1] == (1, x.size(1)) and sum(n for n, _ in widths) == 4 and max(t for _, t in widths[:-1]) < 20
    assert torch.allclose(grouped, one, atol=1e-5)  # the same rows, in their order
    for g, p in zip(grads, model.parameters()):
        assert torch.allclose(p.grad, g, rtol=1e-4, atol=1e-6)


def test_the_reward_models_hidden_states_are_the_backbones_final_norm_output() -> None:
    rm = RewardModel(make("llama"))
    x = torch.randint(0, 320, (2, 9))
    head = rm.backbone.lm_head
    rm.backbone.lm_head = torch.nn.Identity()  # what RewardModel.hidden did before: the head swapped out
    old = rm.backbone(x)
    rm.backbone.lm_head = head
    assert torch.equal(rm.hidden(x), old) and rm.hidden(x).dtype == torch.float32


def test_the_rl_loss_is_the_one_of_the_full_log_softmax(tiny_tokenizer, one_thread) -> None:
    enc, _ = tiny_tokenizer
    policy, ref = make("gpt2"), make("gpt2").eval().requires_grad_(False)
    items = [{"prompt": p, "answer": "3"} for p, _ in PAIRS]
    job = RlJob(group_size=4, max_new_tokens=6, temperature=1.0, seq_len=47)
    reward = lambda text, it: float(len(text) % 3 == 0)  # noqa: E731  (some signal in every group)

    def run(reference_logps, logps):
        with mock.patch("kiln.posttrain.rl.model_token_logps", logps):
            loss, stats = rollout_loss(policy, policy, reference_logps, enc, items, reward, job,
                                       torch.Generator().manual_seed(2))
        loss.backward()
        grads = [p.grad.clone() for p in policy.parameters()]
        policy.zero_grad(set_to_none=True)
        return loss, stats, grads

    new = run(lambda x, y: model_token_logps(ref, x, y), model_token_logps)
    old = run(lambda x, y: token_logps(ref(x), y), lambda m, x, y: token_logps(m(x), y))
    untimed = lambda stats: {k: v for k, v in stats.items() if k not in ("rollout_s", "rollout_tokens_per_s")}  # noqa: E731
    assert new[0].item() == old[0].item() and untimed(new[1]) == untimed(old[1])
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(new[2], old[2]))


def test_the_response_measures_are_those_of_the_logits(tiny_tokenizer, one_thread) -> None:
    enc, _ = tiny_tokenizer
    model = make("llama").eval()
    rows = [{"prompt": p, "response": r} for p, r in PAIRS]
    got = measure_items(model, enc, [], [], rows)
    x, y = encode_rows(enc, [p for p, _ in PAIRS], [r for _, r in PAIRS], model.config.block_size - 1)
    with torch.no_grad():
        logits = model(x)
    keep = y != -100
    assert got["response_loss"]["items"] == (-token_logps(logits, y) * keep).sum(1).tolist()
    assert got["response_token_accuracy"]["items"] == ((logits.argmax(-1) == y) & keep).sum(1).float().tolist()
