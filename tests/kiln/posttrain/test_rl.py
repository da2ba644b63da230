"""Tests for kiln.posttrain.rl: group-relative advantages, the GRPO loss and KL penalty, a task a tiny model learns, the
job; DAPO's options (clipped surrogate, token-level loss, dynamic sampling, overlong penalty), the default left as it was.

Run: python -m pytest tests/kiln/posttrain/test_rl.py -q
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import subprocess
import sys
from dataclasses import asdict
from fractions import Fraction
from pathlib import Path
from unittest import mock

import pytest
import torch

from kiln.train.checkpoint import load_for_inference, save_checkpoint
from kiln.posttrain.instructions import arithmetic, build_pairs, final_number, write_jsonl
from kiln.model.config import ModelConfig
from kiln.model.gpt2.model import GPT
from kiln.posttrain.logprobs import model_token_logps
from kiln.posttrain.sampling import complete
from kiln.common.config import ConfigError
from kiln.posttrain.rl import (ALGORITHMS, RL_SETTINGS, RlJob, RlSettings, RlStage, answer_rows, group_advantages, grpo_loss, make_reward,
                               overlong_penalty, rollout_policy_loss, sample_groups, sample_rollout)
from kiln.posttrain.sampling import decode_completion
from kiln.posttrain.sft import IGNORE, chat_prompt_ids
from kiln.train.dist import DistInfo
from kiln.train.job import load_job
from tests.rollouts import rollout_loss

ROOT = Path(__file__).resolve().parents[3]


def test_group_advantages_are_relative_within_each_group() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 3.0]])
    adv = group_advantages(rewards, eps=0.0 + 1e-8)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert adv[0].tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5)
    assert adv[1].tolist() == [0.0] * 4  # every answer scored the same: no signal
    assert adv[2].tolist() == pytest.approx([-0.5, -0.5, -0.5, 1.5], rel=1e-5)  # std of [0,0,0,3] is 1.5
    assert adv.sum(dim=1).abs().max() < 1e-5


def test_grpo_loss_is_the_policy_gradient_plus_a_nonnegative_kl() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -2.5, -0.5], [-0.3, -0.2, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the last token of row 2 is padding
    adv = torch.tensor([2.0, -1.0])
    loss, stats = grpo_loss(logp, ref, adv, mask, kl_coef=0.1)
    d = ref - logp.detach()
    kl = torch.exp(d) - d - 1
    assert bool((kl >= 0).all()) and kl[0, 0] == 0
    hand = ((-2.0 * 3 + 0.1 * kl[0].sum()) / 3 + (1.0 * 2 + 0.1 * kl[1, :2].sum()) / 2) / 2
    assert loss.item() == pytest.approx(hand.item(), rel=1e-6)
    assert stats["kl"] == pytest.approx(((kl[0].sum() / 3 + kl[1, :2].sum() / 2) / 2).item(), rel=1e-6)
    loss.backward()
    # d/dlogp: (-A + c * (1 - exp(d))) / len / N, zero on padding
    expected = torch.stack([(-2.0 + 0.1 * (1 - torch.exp(d[0]))) / 3 / 2,
                            (1.0 + 0.1 * (1 - torch.exp(d[1]))) / 2 / 2 * mask[1]])
    torch.testing.assert_close(logp.grad, expected)
    # no KL penalty when the policy is the reference
    same, s = grpo_loss(ref.clone().requires_grad_(), ref, adv, mask, kl_coef=1.0)
    assert s["kl"] == 0.0


def test_training_reward_is_exact_with_optional_partial_credit_for_a_near_miss() -> None:
    item = {"prompt": "What is 12 - 19?", "answer": "-7"}
    exact = make_reward("arithmetic", 0.0)
    partial = make_reward("arithmetic", 0.5)
    assert exact("12 - 19 = -7.", item) == 1.0 and exact("-7", item) == 1.0 and exact("12 - 19 = -8.", item) == 0.0
    assert partial("12 - 19 = -7.", item) == 1.0  # the exact answer earns the full reward, never more
    assert partial("12 - 19 = -8.", item) == pytest.approx(0.5 * 0.9)  # off by one
    assert partial("12 - 19 = 3.", item) == 0.0  # off by ten or more: nothing
    assert partial("seven", item) == 0.0


def test_answer_rows_target_only_the_sampled_answer(tiny_tokenizer) -> None:
    enc, _ = tiny_tokenizer
    comps = [[[5, 6, enc.eot_token], [7]]]
    x, y = answer_rows(enc, ["What is 1 + 1?"], comps, seq_len=31)
    p = chat_prompt_ids(enc, "What is 1 + 1?")
    assert x.shape[0] == 2
    assert y[0][y[0] != IGNORE].tolist() == [5, 6, enc.eot_token]
    assert y[1][y[1] != IGNORE].tolist() == [7]
    assert x[0, : len(p)].tolist() == p


def test_sampling_stops_each_row_at_its_end_of_text(tiny_tokenizer, one_thread) -> None:
    enc, _ = tiny_tokenizer
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=320, block_size=32, n_layer=1, n_head=2, n_embd=32)).eval()
    prompts = ["What is 1 + 2?", "Explain the river.", "What is 10 + 20?"]
    out = complete(model, enc, prompts, max_new_tokens=6, temperature=1.0, samples=5,
                   generator=torch.Generator().manual_seed(0))
    assert [len(g) for g in out] == [5, 5, 5]
    for group in out:
        for c in group:
            assert 1 <= len(c) <= 6 and all(t < enc.n_vocab for t in c)  # never an id past the tokenizer
            assert enc.eot_token not in c[:-1]  # cut at the first end-of-text
    greedy = complete(model, enc, prompts, max_new_tokens=6)
    assert greedy == complete(model, enc, prompts, max_new_tokens=6)


def tiny_policy():
    """(policy, its frozen copy as the reference, AdamW, 64 arithmetic items): the learnable-task tests' start."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=320, block_size=32, n_layer=2, n_head=2, n_embd=48))
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    items = list(arithmetic(64, seed=0))
    return model, ref, opt, items


def test_rl_raises_mean_reward_on_a_task_a_tiny_model_can_learn(tiny_tokenizer, one_thread) -> None:
    """Answer with a number: a random tiny model does so ~20% of the time; GRPO makes it nearly always."""
    enc, _ = tiny_tokenizer
    model, ref, opt, items = tiny_policy()
    job = RlJob(group_size=8, max_new_tokens=4, temperature=1.0, kl_coef=0.01, seq_len=31)
    reward = lambda text, item: float(final_number(text) is not None)  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    rewards, kls = [], []
    for step in range(30):
        batch = items[(step * 8) % 64 : (step * 8) % 64 + 8]
        loss, stats = rollout_loss(model, model, lambda x, y: model_token_logps(ref, x, y), enc, batch, reward, job, gen)
        loss.backward()
        opt.step()
        opt.zero_grad()
        rewards.append(stats["reward_mean"])
        kls.append(stats["kl"])
    assert sum(rewards[:3]) / 3 < 0.4
    assert sum(rewards[-3:]) / 3 > 0.85, rewards
    assert kls[0] == pytest.approx(0.0, abs=1e-6) and kls[-1] > 0  # the policy moved away from its reference


def tiny_checkpoint(root: Path, tok_path: Path, model: dict, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    cfg = ModelConfig(**model)
    return save_checkpoint(root, 0, {"model": GPT(cfg).state_dict()}, {"model": asdict(cfg)}, {"tokenizer.json": tok_path})


@pytest.mark.slow
def test_rl_job_with_lora_reports_rewards_resumes_and_saves_plain_weights(tmp_path, tiny_tokenizer, model_dict) -> None:
    from tests.conftest import subprocess_env

    enc, tok_path = tiny_tokenizer
    model = {**model_dict, "dropout": 0.0}
    init = tiny_checkpoint(tmp_path / "init", tok_path, model)
    data = tmp_path / "pairs.jsonl"
    write_jsonl(build_pairs([], n_arithmetic=60, seed=2, val_permille=200, max_doc_pairs=0), data)
    job = {"task": "rl", "out_dir": str(tmp_path / "run"), "tokenizer": str(tok_path), "model": model,
           "optim": {"lr": 1e-3, "warmup_steps": 1}, "lora": {"enabled": True, "rank": 4},
           "train_files": [str(data)], "init_from": str(init), "seq_len": 31, "micro_batch": 4, "group_size": 4,
           "max_new_tokens": 6, "max_steps": 6, "eval_interval": 2, "eval_items": 8, "log_interval": 2,
           "ckpt_interval": 2, "keep_last": 2, "temperature": 1.0, "partial_credit": 0.0, "kl_coef": 0.05,
           "preference_coef": 0.0}
    config = tmp_path / "job.json"
    config.write_text(json.dumps(job))
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"fail_at_step": 5}))
    cmd = [sys.executable, "tests/faults.py", "--faults", str(faults), "--config", str(config), "--device", "cpu"]
    # the first launch crashes at step 5, after the step-4 checkpoint; the second resumes with its adapters
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and "injected failure at step 5" in proc.stderr
    assert "LoRA rank 4" in proc.stdout and "GRPO on" in proc.stdout and "held-out reward" in proc.stdout
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step_0000004" in proc.stdout
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["steps"] == 6 and result["lora"]["enabled"] and result["reward"] == "arithmetic"
    hist = result["history"]
    assert [h["step"] for h in hist] == [0, 1, 2, 3, 4, 5, 6]
    assert [h["step"] for h in hist if "val_reward" in h] == [0, 2, 4, 6]
    assert all(0.0 <= h.get("reward", 0.0) <= 1.0 and h.get("kl", 0.0) >= 0.0 for h in hist)
    w = model["n_embd"]
    assert result["trainable_params"] == model["n_layer"] * 4 * ((w + 3 * w) + (w + w) + (w + 4 * w) + (4 * w + w))
    # the checkpoint holds plain (merged) GPT weights, loadable for inference and release
    m, e, meta = load_for_inference(result["checkpoint"])
    assert meta["task"] == "rl" and meta["lora"]["rank"] == 4
    base, _, _ = load_for_inference(init)
    ids = torch.tensor([chat_prompt_ids(e, "What is 3 + 4?")])
    # a random model never answers exactly: every group scores 0, so no advantage and no KL gradient moves it
    assert all(h["reward"] == 0.0 for h in hist[1:])
    with torch.no_grad():
        assert torch.equal(m(ids), base(ids))


@pytest.mark.slow
def test_an_update_with_replayed_pairs_and_reference_answers_trains_on_two_gloo_processes(tmp_path, tiny_tokenizer,
                                                                                        model_dict) -> None:
    """The rollout, the reference answers and the replayed pairs each take a forward of their own, one backward takes
    their sum: under DDP the ranks (each sampling its own prompts) end with the same weights. FSDP2 is refused: with
    it, the same job hung (each rank decodes for as long as its own answers need, and every forward gathers)."""
    from kiln.posttrain.preferences import build_preferences
    from tests.conftest import subprocess_env

    _, tok_path = tiny_tokenizer
    model = {**model_dict, "dropout": 0.0}
    init = tiny_checkpoint(tmp_path / "init", tok_path, model)
    pairs, prefs = tmp_path / "pairs.jsonl", tmp_path / "prefs.jsonl"
    write_jsonl(build_pairs([], n_arithmetic=60, seed=2, val_permille=200, max_doc_pairs=0), pairs)
    write_jsonl(build_preferences(build_pairs([], n_arithmetic=60, seed=5, val_permille=250, max_doc_pairs=0), seed=0),
                prefs)
    job = {"task": "rl", "out_dir": str(tmp_path / "run"), "tokenizer": str(tok_path), "model": model,
           "optim": {"lr": 1e-3, "warmup_steps": 1}, "train_files": [str(pairs)], "init_from": str(init),
           "seq_len": 31, "micro_batch": 2, "group_size": 4, "max_new_tokens": 6, "max_steps": 3, "eval_interval": 3,
           "eval_items": 4, "log_interval": 1, "ckpt_interval": 3, "temperature": 1.0, "partial_credit": 1.0,
           "ptx_coef": 0.5, "preference_coef": 0.5, "preference_file": str(prefs), "parallelism": "ddp"}
    config = tmp_path / "job.json"
    config.write_text(json.dumps(job))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                           "kiln.posttrain", "--config", str(config), "--device", "cpu"], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    assert res["world_size"] == 2 and res["parallelism"] == "ddp" and res["steps"] == 3
    assert len(set(res["rank_param_digests"])) == 1
    steps = [h for h in res["history"] if h["step"] > 0]
    assert len(steps) == 3 and all(h["ptx_loss"] > 0 and h["preference_loss"] > 0 for h in steps)
    assert all(h["rollout_tokens_per_s"] > 0 for h in steps)
    trained, _, _ = load_for_inference(res["checkpoint"])
    start, _, _ = load_for_inference(init)
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), start.parameters()))  # the updates moved it


# -- DAPO's options (Yu et al., 2025, arXiv 2503.14476)


def test_the_clipped_surrogate_with_a_decoupled_range_matches_a_hand_computed_value() -> None:
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]])
    ratio = torch.tensor([[1.5, 1.1, 0.5], [0.6, 1.5, 1.0]])  # pi / pi_old of each token
    logp = (old + ratio.log()).requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the last token of row 2 is padding
    adv = torch.tensor([2.0, -1.0])
    loss, stats = grpo_loss(logp, logp.detach(), adv, mask, kl_coef=0.0, old_logp=old, eps_low=0.2, eps_high=0.28)
    # A = 2: 1.5 is above 1 + eps_high, so 1.28 counts (and passes no gradient); 1.1 is inside; 0.5 is below
    # 1 - eps_low, but with A > 0 the unclipped 0.5 * A is the smaller term. A = -1: 0.6 is below 0.8, so 0.8 counts
    # (no gradient); 1.5 is above 1.28, but with A < 0 the unclipped term is the smaller
    row1, row2 = -(1.28 * 2 + 1.1 * 2 + 0.5 * 2) / 3, -(0.8 * -1 + 1.5 * -1) / 2
    assert loss.item() == pytest.approx((row1 + row2) / 2, rel=1e-6) and loss.item() == pytest.approx(-0.385, rel=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 5)  # two of the five answer tokens had their gradient cut
    assert stats["kl"] == 0.0
    loss.backward()
    # d/dlogp of -r A is -r A, over the answer's length and the number of answers; nothing where the clip counts
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.1 * 2 / 3 / 2, -0.5 * 2 / 3 / 2],
                                                        [0.0, 1.5 / 2 / 2, 0.0]]))
    # GRPO's symmetric range holds the first token at 1.2 instead: clip-higher lets a rising probability climb further
    sym, s = grpo_loss(logp.detach(), logp.detach(), adv, mask, 0.0, old_logp=old, eps_low=0.2, eps_high=0.2)
    assert sym.item() == pytest.approx(loss.item() + (1.28 - 1.2) * 2 / 3 / 2, rel=1e-6)
    assert s["clip_frac"] == pytest.approx(0.4)


def test_token_level_aggregation_weighs_every_token_of_a_group_alike() -> None:
    # two groups of two answers: 3 and 1 tokens, then 2 and 4; on-policy without KL each token's term is -A
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([2.0, -1.0, 0.5, 1.5])
    logp = torch.full((4, 4), -1.0, requires_grad=True)
    seq, _ = grpo_loss(logp, logp.detach(), adv, mask, kl_coef=0.0)
    assert seq.item() == pytest.approx(-(2.0 - 1.0 + 0.5 + 1.5) / 4)  # each answer's mean, then the answers' mean
    tok, _ = grpo_loss(logp, logp.detach(), adv, mask, kl_coef=0.0, aggregation="token", group_size=2)
    group1, group2 = -(2.0 * 3 - 1.0 * 1) / 4, -(0.5 * 2 + 1.5 * 4) / 6  # each group's sum over its 4 and 6 tokens
    assert tok.item() == pytest.approx((group1 + group2) / 2) and tok.item() == pytest.approx(-29 / 24)
    one, _ = grpo_loss(logp, logp.detach(), adv, mask, kl_coef=0.0, aggregation="token")  # all rows one group
    assert one.item() == pytest.approx(-(5 + 7) / 10)
    each, _ = grpo_loss(logp, logp.detach(), adv, mask, kl_coef=0.0, aggregation="token", group_size=1)
    assert each.item() == pytest.approx(seq.item())  # a group of one answer is that answer's mean
    # gradients: sequence divides each token by its answer's length, token by its group's token count
    seq.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-2 / 3, 1 / 1, -0.5 / 2, -1.5 / 4])[:, None] / 4 * mask)
    logp.grad = None
    tok.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-2 / 4, 1 / 4, -0.5 / 6, -1.5 / 6])[:, None] / 2 * mask)
    with pytest.raises(ValueError, match="not whole groups of 3"):
        grpo_loss(logp, logp.detach(), adv, mask, kl_coef=0.0, aggregation="token", group_size=3)


def test_the_overlong_penalty_is_zero_then_falls_linearly_to_minus_one_at_the_limit() -> None:
    lengths = torch.tensor([[5, 12, 13], [14, 15, 16]])
    assert overlong_penalty(lengths, 16, 4).tolist() == [[0.0, 0.0, -0.25], [-0.5, -0.75, -1.0]]
    assert overlong_penalty(lengths, 16, 0).tolist() == [[0.0] * 3] * 2


def resolved(**fields) -> dict:
    """The RL settings RlJob(**fields) resolves to, beside the default job's: only what differs."""
    base = asdict(RlJob().settings())
    return {k: v for k, v in asdict(RlJob(**fields).settings()).items() if base[k] != v}


def test_the_algorithm_presets_fill_only_the_fields_left_unset() -> None:
    assert RlJob().settings() == RlSettings(group_size=8, kl_coef=0.1, algorithm="grpo", ppo_epochs=1, eps_low=0.2,
                                            eps_high=0.2, loss_aggregation="sequence", dynamic_sampling=False,
                                            max_sampling_rounds=3, overlong_buffer=0, ptx_coef=0.0,
                                            preference_coef=0.1, preference_beta=0.1)
    assert RlJob().settings().describe() == ""  # plain on-policy GRPO: nothing to add to the start line
    assert resolved(algorithm="dapo") == {"algorithm": "dapo", "eps_high": 0.28, "loss_aggregation": "token",
                                          "dynamic_sampling": True, "overlong_buffer": 3}  # 16 // 5
    assert resolved(algorithm="dapo", eps_high=0.3, dynamic_sampling=False, overlong_buffer=0, ppo_epochs=2) == {
        "algorithm": "dapo", "ppo_epochs": 2, "eps_high": 0.3, "loss_aggregation": "token"}
    assert resolved(loss_aggregation="token", ppo_epochs=4) == {"ppo_epochs": 4, "loss_aggregation": "token"}
    assert resolved(group_size=4, kl_coef=0.0, ptx_coef=0.5, algorithm="dapo", max_new_tokens=9) == {
        "group_size": 4, "kl_coef": 0.0, "ptx_coef": 0.5, "algorithm": "dapo", "eps_high": 0.28,
        "loss_aggregation": "token", "dynamic_sampling": True, "overlong_buffer": 1}  # the preset leaves kl_coef as set
    assert RlJob(algorithm="dapo", ppo_epochs=2, max_new_tokens=20).settings().describe() == (
        "2 updates per sampled batch, ratio clipped to [0.8, 1.28], token-level loss, dynamic sampling (at most 3 "
        "rounds), overlong penalty over the last 4 tokens")


def test_the_presets_are_rl_settings_and_every_setting_is_an_rl_job_field_with_its_default() -> None:
    assert all(isinstance(p, RlSettings) for p in ALGORITHMS.values())
    dapo = ALGORITHMS["dapo"]
    assert (dapo.algorithm, dapo.eps_low, dapo.eps_high, dapo.loss_aggregation, dapo.dynamic_sampling) == (
        "dapo", 0.2, 0.28, "token", True)
    assert dapo.overlong_buffer == Fraction(1, 5)  # of max_new_tokens, rounded down
    assert [RlJob(algorithm="dapo", max_new_tokens=n).settings().overlong_buffer for n in (4, 5, 16, 20, 20480)] == [
        0, 1, 3, 4, 4096]
    job = {f.name: f for f in dataclasses.fields(RlJob)}
    assert RL_SETTINGS == tuple(f.name for f in dataclasses.fields(RlSettings))
    assert all(job[name].default == getattr(RlSettings(), name) for name in RL_SETTINGS)
    every = RlJob(group_size=3, kl_coef=0.2, algorithm="dapo", ppo_epochs=2, eps_low=0.1, eps_high=0.5,
                  loss_aggregation="sequence", dynamic_sampling=False, max_sampling_rounds=5, overlong_buffer=2,
                  ptx_coef=0.3, preference_coef=0.4, preference_beta=0.2)
    assert asdict(every.settings()) == {name: getattr(every, name) for name in RL_SETTINGS}  # set: kept as set


@pytest.mark.parametrize("fields, message", [
    ({"algorithm": "ppo"}, "job.algorithm 'ppo' is not known; choose from grpo, dapo"),
    ({"ppo_epochs": 0}, "job.ppo_epochs is 0: give >= 1"),
    ({"eps_low": 1.0}, "job.eps_low is 1.0: give 0 < x < 1 or None"),
    ({"eps_high": 0.0}, "job.eps_high is 0.0: give > 0 or None"),
    ({"loss_aggregation": "tokens"}, "job.loss_aggregation 'tokens' is not known; choose from sequence, token"),
    ({"max_sampling_rounds": 0}, "job.max_sampling_rounds is 0: give >= 1"),
    ({"overlong_buffer": 17}, "job.overlong_buffer must be between 0 (off) and max_new_tokens (16), got 17"),
    ({"overlong_buffer": -1}, "job.overlong_buffer is -1: give >= 0 or None"),
    ({"group_size": 0}, "job.group_size is 0: give >= 2"),
    ({"kl_coef": -0.1}, "job.kl_coef is -0.1: give >= 0"),
    ({"preference_beta": 0.0}, "job.preference_beta is 0.0: give > 0"),
    ({"parallelism": "fsdp"}, "job.parallelism 'fsdp': each rank samples"),
    ({"ptx_coef": -1.0}, "job.ptx_coef is -1.0: give >= 0"),
    ({"eps_hi": 0.3}, "job: unknown key 'eps_hi'. Did you mean 'eps_high'?"),
])
def test_bad_dapo_fields_are_config_errors_naming_the_key(fields, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_job(RlJob, {"init_from": "c", "train_files": ["p.jsonl"], "preference_file": "p.jsonl", **fields})


class Scripted:
    """Stands in for kiln.posttrain.sampling.complete: each prompt's group is the answers its name scripts, token 1 a
    right answer and 2 a wrong one; the prompts of each call are recorded."""

    ANSWERS = {"A": [1, 1, 1, 1], "B": [1, 2, 2, 2], "C": [2, 2, 2, 2], "D": [2, 1, 1, 2], "E": [1, 1, 1, 1],
               "F": [1, 2, 1, 2], "G": [2, 2, 1, 2]}

    def __init__(self):
        self.calls: list[list[str]] = []

    def __call__(self, model, enc, prompts, max_new_tokens, temperature, samples, generator, device):
        self.calls.append(list(prompts))
        return [[[t] for t in self.ANSWERS[p]] for p in prompts]


class DigitEnc:
    eot_token = 0

    def decode(self, ids: list[int]) -> str:
        return "".join(map(str, ids))


def scripted_groups(rounds: list[str], **job) -> tuple:
    """sample_groups over rounds of scripted prompts ("ABC": one round of three) -> (the result, the prompts sampled)."""
    stub = Scripted()
    with mock.patch("kiln.posttrain.rl.complete", stub):
        got = sample_groups(torch.nn.Linear(1, 1), DigitEnc(), [[{"prompt": p} for p in r] for r in rounds],
                            lambda text, item: float(text == "1"), RlJob(group_size=4, **job), None, "cpu")
    return got, ["".join(c) for c in stub.calls]


def test_dynamic_sampling_filters_groups_that_all_score_alike_and_refills_from_the_next_rounds() -> None:
    # A and E are all right, C all wrong: no advantage. B, D, F and G carry signal; the batch wants three
    got, calls = scripted_groups(["ABC", "DE", "FG"], algorithm="dapo")
    assert calls == ["ABC", "DE", "FG"] and [it["prompt"] for it in got.items] == ["B", "D", "F"] and got.signal
    assert got.rewards.tolist() == [[1, 0, 0, 0], [0, 1, 1, 0], [1, 0, 1, 0]]
    assert got.completions[0] == [[1], [2], [2], [2]]
    # statistics of every sampled answer: 14 of 28 right, 4 of 7 groups with signal, 3 filtered, in 3 rounds
    assert got.stats == pytest.approx({"reward_mean": 0.5, "groups_with_signal": 4 / 7, "sampling_rounds": 3.0,
                                       "groups_filtered": 3.0, "groups_trained": 3.0,
                                       "reward_group_std": (0.5 + 2 / math.sqrt(3) + 0.5) / 7})  # B, D, F, G
    assert got.tokens == 28  # every sampled answer's one token, the filtered groups' too
    # the cap: two rounds find two informative groups, and the batch trains on those two
    got, calls = scripted_groups(["ABC", "DE", "FG"], algorithm="dapo", max_sampling_rounds=2)
    assert calls == ["ABC", "DE"] and [it["prompt"] for it in got.items] == ["B", "D"]
    assert (got.stats["sampling_rounds"], got.stats["groups_filtered"], got.stats["groups_trained"]) == (2.0, 3.0, 2.0)
    # enough signal in the first round: no refill is sampled
    got, calls = scripted_groups(["BDF", "G"], dynamic_sampling=True)
    assert calls == ["BDF"] and got.stats["sampling_rounds"] == 1.0 and got.stats["groups_filtered"] == 0.0
    # nothing informative at all: the last round stands in, flagged to carry no advantage
    got, calls = scripted_groups(["AC", "E"], algorithm="dapo")
    assert calls == ["AC", "E"] and [it["prompt"] for it in got.items] == ["E"] and not got.signal
    assert (got.stats["groups_filtered"], got.stats["groups_trained"]) == (3.0, 1.0)
    # GRPO keeps the first round whole, refills or not, and reports what it always did
    got, calls = scripted_groups(["ABC", "DE"])
    assert calls == ["ABC"] and [it["prompt"] for it in got.items] == ["A", "B", "C"] and got.signal
    assert set(got.stats) == {"reward_mean", "reward_group_std", "groups_with_signal"}
    assert got.tokens == 12  # the first round's 3 groups of 4 one-token answers


def test_advantages_come_from_the_reward_plus_the_length_penalty_but_not_for_a_stand_in(tiny_tokenizer) -> None:
    enc, _ = tiny_tokenizer
    (right,), (wrong,) = enc.encode("7"), enc.encode("x")
    # answers of 1 to 4 tokens with max_new_tokens 4 and a buffer of 3: penalties 0, -1/3, -2/3, -1
    answers = {"mixed": [[right], [wrong] * 2, [wrong] * 3, [wrong] * 4], "wrong": [[wrong] * k for k in (1, 2, 3, 4)]}
    sampled = lambda model, enc, prompts, *args: [answers[p] for p in prompts]  # noqa: E731
    reward = lambda text, item: float(text == "7")  # noqa: E731
    zero_ref = lambda x, y: torch.zeros(y.shape)  # noqa: E731

    def rollout(prompts: str, **fields):
        job = RlJob(group_size=4, max_new_tokens=4, seq_len=31, overlong_buffer=3, **fields)
        with mock.patch("kiln.posttrain.rl.complete", sampled):
            return sample_rollout(torch.nn.Linear(1, 1), zero_ref, enc, [{"prompt": p} for p in prompts.split()],
                                  reward, job)

    penalty = torch.tensor([0.0, -1 / 3, -2 / 3, -1.0])
    shaped = torch.stack([torch.tensor([1.0, 0, 0, 0]) + penalty, penalty])  # (2, 4)
    got = rollout("mixed wrong")  # GRPO with the penalty: the length alone separates the wrong group's answers
    torch.testing.assert_close(got.advantages, group_advantages(shaped).flatten())
    assert got.stats["overlong_penalty"] == pytest.approx(-0.5)
    got = rollout("mixed wrong", dynamic_sampling=True)  # the all-wrong group is filtered out
    torch.testing.assert_close(got.advantages, group_advantages(shaped[:1]).flatten())
    got = rollout("wrong", dynamic_sampling=True)  # it stands in when nothing else is left: no advantage at all
    assert got.advantages.tolist() == [0.0] * 4 and got.x.shape[0] == 4


def pairs_file(tmp_path: Path) -> Path:
    data = tmp_path / "pairs.jsonl"
    write_jsonl(build_pairs([], n_arithmetic=60, seed=2, val_permille=200, max_doc_pairs=0), data)
    return data


def test_the_stage_draws_refills_apart_and_shares_a_sampled_batch_across_its_updates(tmp_path, tiny_tokenizer) -> None:
    _, tok_path = tiny_tokenizer
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    base = {"init_from": "c", "train_files": [str(pairs_file(tmp_path))], "tokenizer": str(tok_path), "preference_coef": 0.0, "micro_batch": 4,
            "grad_accum": 2}
    grpo = RlStage(RlJob(**base), info)
    dapo = RlStage(RlJob(**base, algorithm="dapo", ppo_epochs=2), info)
    plain = list(grpo.batches(1))
    assert [b.key for b in plain] == [(1, 0), (1, 1)] and all(b.refills == [] for b in plain)
    for index in (2, 3):  # both updates of sampled batch 1
        drawn = list(dapo.batches(index))
        assert [b.key for b in drawn] == [(1, 0), (1, 1)]
        assert [b.items for b in drawn] == [b.items for b in plain]  # the first round is what GRPO draws
        for b in drawn:  # two more rounds of four prompts, none drawn twice in the micro-batch
            assert [len(r) for r in b.refills] == [4, 4]
            prompts = [it["prompt"] for r in [b.items, *b.refills] for it in r]
            assert len(set(prompts)) == 12
    assert [b.items for b in dapo.batches(4)] != [b.items for b in plain]  # the next sampled batch draws anew


def test_later_updates_reuse_the_samples_against_the_first_updates_log_probs(tiny_tokenizer, one_thread) -> None:
    enc, _ = tiny_tokenizer
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=320, block_size=32, n_layer=2, n_head=2, n_embd=48))
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    reward = lambda text, item: float(len(text) % 2 == 0)  # noqa: E731  (signal in most groups)
    job = RlJob(group_size=4, max_new_tokens=5, seq_len=31, ppo_epochs=2, eps_high=0.28, kl_coef=0.05)
    rollout = sample_rollout(model, lambda x, y: model_token_logps(ref, x, y), enc, list(arithmetic(4, seed=0)),
                             reward, job, torch.Generator().manual_seed(0))
    first, s1 = rollout_policy_loss(model, rollout, job)
    # the first update is GRPO's on-policy one: ratio 1, nothing clipped, the same loss and gradient
    assert s1["clip_frac"] == 0.0 and torch.equal(rollout.old_logp, model_token_logps(model, rollout.x, rollout.y))
    first.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    on, s0 = rollout_policy_loss(model, dataclasses.replace(rollout, old_logp=None), RlJob(**{
        **asdict(job), "ppo_epochs": 1}))
    on.backward()
    assert on.item() == first.item() and "clip_frac" not in s0
    assert all(torch.allclose(p.grad, g, rtol=1e-6, atol=1e-9) for p, g in zip(model.parameters(), grads))
    torch.optim.SGD(model.parameters(), lr=1.0).step()  # a large step: some ratios leave [0.8, 1.28]
    model.zero_grad(set_to_none=True)
    second, s2 = rollout_policy_loss(model, rollout, job)
    # by hand, against the log-probs kept from the first update
    logp = model_token_logps(model, rollout.x, rollout.y).detach()
    m, a = (rollout.y != IGNORE).float(), rollout.advantages[:, None]
    r = torch.exp(logp - rollout.old_logp)
    d = rollout.ref_logp - logp
    per_token = -torch.min(r * a, r.clamp(0.8, 1.28) * a) + 0.05 * (torch.exp(d) - d - 1)
    assert second.item() == pytest.approx(((per_token * m).sum(1) / m.sum(1)).mean().item(), rel=1e-5)
    cut = ((r > 1.28) & (a > 0)) | ((r < 0.8) & (a < 0))
    assert s2["clip_frac"] == pytest.approx((cut * m).sum().item() / m.sum().item()) and s2["clip_frac"] > 0
    assert s2["reward_mean"] == s1["reward_mean"]  # the same samples, not new ones


def legacy_rollout_loss(policy, reference_logps, enc, items, reward_fn, job, generator):
    """rollout_loss and grpo_loss as they were before DAPO's options, the path the frozen smoke record was made on."""
    policy.eval()
    comps = complete(policy, enc, [it["prompt"] for it in items], job.max_new_tokens, job.temperature, job.group_size,
                     generator, "cpu")
    policy.train()
    texts = [[decode_completion(enc, c) for c in group] for group in comps]
    rewards = torch.tensor([[reward_fn(t, it) for t in group] for group, it in zip(texts, items)], dtype=torch.float32)
    adv = group_advantages(rewards).flatten()
    x, y = answer_rows(enc, [it["prompt"] for it in items], comps, job.seq_len)
    ref = reference_logps(x, y)
    logp = model_token_logps(policy, x, y)
    mask = (y != IGNORE).float()
    ratio = torch.exp(logp - logp.detach())
    delta = ref - logp
    kl = torch.exp(delta) - delta - 1
    per_token = -ratio * adv[:, None] + job.kl_coef * kl
    lengths = mask.sum(1).clamp(min=1)
    return ((per_token * mask).sum(1) / lengths).mean(), float(rewards.mean())


def test_the_default_job_computes_exactly_the_loss_it_did_before_dapos_options(tiny_tokenizer, one_thread) -> None:
    enc, _ = tiny_tokenizer
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=320, block_size=32, n_layer=2, n_head=2, n_embd=48, dropout=0.1)).train()
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    items = list(arithmetic(16, seed=0))[:6]
    reward = lambda text, item: float(len(text) % 2 == 0)  # noqa: E731
    job = RlJob(group_size=4, max_new_tokens=5, seq_len=31)
    ref_logps = lambda x, y: model_token_logps(ref, x, y)  # noqa: E731

    def grads() -> list[torch.Tensor]:
        out = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return out

    torch.manual_seed(1)  # the same dropout masks for both
    old, old_mean = legacy_rollout_loss(model, ref_logps, enc, items, reward, job, torch.Generator().manual_seed(3))
    old.backward()
    old_grads = grads()
    torch.manual_seed(1)
    new, stats = rollout_loss(model, model, ref_logps, enc, items, reward, job, torch.Generator().manual_seed(3))
    new.backward()
    assert torch.equal(old.detach(), new.detach()) and old.item() != 0.0  # bit for bit
    assert all(torch.equal(a, b) for a, b in zip(old_grads, grads()))
    assert stats["reward_mean"] == old_mean
    assert set(stats) == {"kl", "reward_mean", "reward_group_std", "groups_with_signal", "answer_tokens", "loss",
                          "rollout_s", "rollout_tokens_per_s"}
    # every token sampled, the answers' tokens: 6 prompts x 4 answers
    assert stats["rollout_tokens_per_s"] * stats["rollout_s"] == pytest.approx(24 * stats["answer_tokens"])


def test_dapo_raises_mean_reward_on_the_task_a_tiny_model_can_learn(tiny_tokenizer, one_thread) -> None:
    """The GRPO test's task with algorithm dapo: two updates per sampled batch, refills from the next prompts."""
    enc, _ = tiny_tokenizer
    model, ref, opt, items = tiny_policy()
    job = RlJob(group_size=8, max_new_tokens=4, temperature=1.0, kl_coef=0.01, seq_len=31, algorithm="dapo",
                ppo_epochs=2)
    reward = lambda text, item: float(final_number(text) is not None)  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    rewards, filtered, clipped = [], [], []
    for batch in range(20):
        at = (batch * 8) % 64
        rollout = sample_rollout(model, lambda x, y: model_token_logps(ref, x, y), enc, items[at : at + 8], reward, job,
                                 gen, refills=[items[(at + 8) % 64 : (at + 8) % 64 + 8]])
        for _ in range(job.ppo_epochs):
            loss, stats = rollout_policy_loss(model, rollout, job)
            loss.backward()
            opt.step()
            opt.zero_grad()
            clipped.append(stats["clip_frac"])
        rewards.append(stats["reward_mean"])
        filtered.append(stats["groups_filtered"])
    assert sum(rewards[:2]) / 2 < 0.4
    assert sum(rewards[-3:]) / 3 > 0.85, rewards
    assert clipped[0::2] == [0.0] * 20 and max(clipped[1::2]) > 0  # first updates are on-policy; later ones clip
    assert filtered[0] > 0, filtered  # groups where no answer gave a number were dropped


@pytest.mark.slow
def test_a_dapo_job_runs_through_the_trainer_and_reports_its_options(tmp_path, tiny_tokenizer, model_dict) -> None:
    from tests.conftest import subprocess_env

    _, tok_path = tiny_tokenizer
    model = {**model_dict, "dropout": 0.0}
    init = tiny_checkpoint(tmp_path / "init", tok_path, model)
    job = {"task": "rl", "out_dir": str(tmp_path / "run"), "tokenizer": str(tok_path), "model": model,
           "optim": {"lr": 1e-3, "warmup_steps": 1, "weight_decay": 0.0}, "train_files": [str(pairs_file(tmp_path))],
           "init_from": str(init), "seq_len": 31, "micro_batch": 4, "group_size": 4, "max_new_tokens": 6,
           "algorithm": "dapo", "ppo_epochs": 2, "max_sampling_rounds": 2, "overlong_buffer": 4, "max_steps": 4,
           "eval_interval": 4, "eval_items": 4, "log_interval": 1, "ckpt_interval": 4, "temperature": 1.0,
           "partial_credit": 0.0, "kl_coef": 0.05, "preference_coef": 0.0}
    config = tmp_path / "job.json"
    config.write_text(json.dumps(job))
    proc = subprocess.run([sys.executable, "-m", "kiln.posttrain", "--config", str(config), "--device", "cpu"],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert ("DAPO on 47 arithmetic prompts, 4 answers each, kl_coef 0.05; 2 updates per sampled batch, ratio "
            "clipped to [0.8, 1.28], token-level loss, dynamic sampling (at most 2 rounds), overlong penalty over the last 4 "
            "tokens") in proc.stdout
    assert "groups filtered in 2.0 rounds" in proc.stdout and "clipped 0.000" in proc.stdout
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["steps"] == 4 and result["algorithm"] == "dapo"
    assert result["algorithm_settings"] == {"group_size": 4, "kl_coef": 0.05, "algorithm": "dapo", "ppo_epochs": 2,
                                            "eps_low": 0.2, "eps_high": 0.28, "loss_aggregation": "token",
                                            "dynamic_sampling": True, "max_sampling_rounds": 2, "overlong_buffer": 4,
                                            "ptx_coef": 0.0, "preference_coef": 0.0, "preference_beta": 0.1}
    hist = result["history"][1:]
    assert [h["step"] for h in hist] == [1, 2, 3, 4]
    # a random model never answers exactly: both rounds' four groups are filtered every time, and the last round stands
    # in with no advantage, so nothing is clipped
    assert all(h["groups_filtered"] == 8.0 and h["sampling_rounds"] == 2.0 and h["clip_frac"] == 0.0 for h in hist)
    assert all(h["overlong_penalty"] == -1.0 for h in hist)  # every answer ran to max_new_tokens
    # no advantage and no KL gradient at the reference: with no weight decay the weights have not moved
    trained, _, _ = load_for_inference(result["checkpoint"])
    base, _, _ = load_for_inference(init)
    assert all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(), base.state_dict().values()))


def test_the_supervised_term_adds_ptx_coef_times_the_reference_answers_mean_nll(tiny_tokenizer, one_thread) -> None:
    """rollout_policy_loss with ptx: the policy loss alone plus ptx_coef x the reference answers' mean token NLL, from
    one forward over both batches (padded rows change neither), with the gradient of that sum."""
    from kiln.posttrain.logprobs import encode_rows

    enc, _ = tiny_tokenizer
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=320, block_size=48, n_layer=2, n_head=2, n_embd=48))
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    items = list(arithmetic(8, seed=0))
    reward = lambda text, item: float(len(text) % 2 == 0)  # noqa: E731
    job = RlJob(group_size=4, max_new_tokens=5, seq_len=47, kl_coef=0.05, ptx_coef=0.5)
    rollout = sample_rollout(model, lambda x, y: model_token_logps(ref, x, y), enc, items[:3], reward, job,
                             torch.Generator().manual_seed(0))
    x, y = encode_rows(enc, [p["prompt"] for p in items[3:]], [p["response"] for p in items[3:]], job.seq_len)
    assert x.size(1) != rollout.x.size(1)  # the two batches differ in width: padding is exercised
    with_ptx, stats = rollout_policy_loss(model, rollout, job, ptx=(x, y))
    with_ptx.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    alone, plain = rollout_policy_loss(model, rollout, job)
    nll = -model_token_logps(model, x, y).sum() / (y != IGNORE).sum()
    (alone + 0.5 * nll).backward()
    assert stats["ptx_loss"] == pytest.approx(nll.item(), rel=1e-5) and 0.5 < stats["ptx_loss"] < 20
    assert with_ptx.item() == pytest.approx(alone.item() + 0.5 * nll.item(), rel=1e-5)
    assert "ptx_loss" not in plain
    assert all(torch.allclose(p.grad, g, rtol=1e-4, atol=1e-7) for p, g in zip(model.parameters(), grads))


def test_the_stage_draws_ptx_pairs_only_when_asked_and_leaves_the_prompts_as_they_were(tmp_path, tiny_tokenizer) -> None:
    _, tok_path = tiny_tokenizer
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    base = {"init_from": "c", "train_files": [str(pairs_file(tmp_path))], "tokenizer": str(tok_path), "micro_batch": 4,
            "preference_coef": 0.0}
    plain, mixed = RlStage(RlJob(**base), info), RlStage(RlJob(**base, ptx_coef=0.2), info)
    for index in (0, 1):
        (p,), (m,) = list(plain.batches(index)), list(mixed.batches(index))
        assert p.ptx == [] and p.items == m.items  # the prompts do not depend on the supervised term
        assert len(m.ptx) == 4 and all(r["response"] and r["kind"] == "arithmetic" for r in m.ptx)
    assert list(mixed.batches(0))[0].ptx != list(mixed.batches(1))[0].ptx  # drawn anew each step
    with pytest.raises(ConfigError, match=r"job\.ptx_coef is -0\.1: give >= 0"):
        RlJob(**base, ptx_coef=-0.1).check()


def test_replayed_preference_pairs_add_preference_coef_times_dpos_loss_against_the_reference(tiny_tokenizer,
                                                                                            one_thread) -> None:
    """rollout_policy_loss with preferences: the policy loss plus preference_coef x DPO's loss on the pairs, by hand:
    -log sigmoid(beta ((c - c_ref) - (r - r_ref))) averaged over pairs; the rollout, ptx and preferences in one update."""
    import torch.nn.functional as F

    from kiln.posttrain.dpo import encode_preferences, pair_batch
    from kiln.posttrain.logprobs import encode_rows
    from kiln.posttrain.rl import Preferences

    enc, _ = tiny_tokenizer
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=320, block_size=48, n_layer=2, n_head=2, n_embd=48))
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    items = list(arithmetic(8, seed=0))
    pairs = [{"prompt": it["prompt"], "chosen": it["response"], "rejected": f"{it['answer']}0."} for it in items[3:]]
    job = RlJob(group_size=4, max_new_tokens=5, seq_len=47, kl_coef=0.05, ptx_coef=0.25, preference_coef=2.0,
                preference_beta=0.5, preference_file="pairs.jsonl")
    rollout = sample_rollout(model, lambda x, y: model_token_logps(ref, x, y), enc, items[:3],
                             lambda text, item: float(len(text) % 2 == 0), job, torch.Generator().manual_seed(0))
    with torch.no_grad():  # move the policy off its reference, so DPO's loss is not log 2
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    px, py = pair_batch(*encode_preferences(enc, pairs, job.seq_len))
    prefs = Preferences(px, py, model_token_logps(ref, px, py).sum(-1))
    sx, sy = encode_rows(enc, [p["prompt"] for p in items[:2]], [p["response"] for p in items[:2]], job.seq_len)
    loss, stats = rollout_policy_loss(model, rollout, job, ptx=(sx, sy), preferences=prefs)
    alone, _ = rollout_policy_loss(model, rollout, job)
    nll = -model_token_logps(model, sx, sy).sum() / (sy != IGNORE).sum()
    pol, m = model_token_logps(model, px, py).sum(-1), len(pairs)
    d = 0.5 * ((pol[:m] - prefs.ref_logp[:m]) - (pol[m:] - prefs.ref_logp[m:]))
    dpo = -F.logsigmoid(d).mean()
    assert abs(dpo.item() - math.log(2)) > 1e-3
    assert stats["preference_loss"] == pytest.approx(dpo.item(), rel=1e-5)
    assert stats["preference_reward_accuracy"] == pytest.approx((d > 0).float().mean().item())
    assert loss.item() == pytest.approx(alone.item() + 0.25 * nll.item() + 2.0 * dpo.item(), rel=1e-5)


def test_the_stage_replays_preference_pairs_from_the_training_split_only_when_asked(tmp_path, tiny_tokenizer) -> None:
    _, tok_path = tiny_tokenizer
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    prefs = tmp_path / "prefs.jsonl"
    write_jsonl([{"id": str(i), "prompt": f"q{i}", "chosen": "a", "rejected": "b", "kind": "arithmetic",
                  "split": "val" if i < 3 else "train"} for i in range(10)], prefs)
    base = {"init_from": "c", "train_files": [str(pairs_file(tmp_path))], "tokenizer": str(tok_path), "micro_batch": 4,
            "preference_coef": 0.0}
    plain, replay = RlStage(RlJob(**base), info), RlStage(RlJob(**{**base, "preference_coef": 0.5},
                                                                preference_file=str(prefs)), info)
    (p,), (r,) = list(plain.batches(0)), list(replay.batches(0))
    assert p.preferences == [] and p.items == r.items
    assert len(r.preferences) == 4 and {x["split"] for x in r.preferences} == {"train"}
    assert list(replay.batches(1))[0].preferences != r.preferences
    with pytest.raises(ConfigError, match="needs preference_file"):
        RlJob(**{**base, "preference_coef": 0.5}).check()
