"""Tests for kiln.posttrain.ppo: GAE, the clipped policy and value losses, the per-token KL reward, a tiny run that
raises a hand-made reward on held-out prompts, and the job (resume included).

Run: python -m pytest tests/kiln/posttrain/test_ppo.py -q
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from kiln.model.config import ModelConfig
from kiln.model.families import build_model
from kiln.posttrain.instructions import arithmetic, build_pairs, write_jsonl
from kiln.posttrain.ppo import (PpoJob, gae, masked_mean, policy_loss, ppo_losses, rollout, step_value, token_rewards,
                                value_loss, whiten)
from kiln.posttrain.logprobs import model_token_logps
from kiln.posttrain.reward import RewardModel
from kiln.train.checkpoint import load_for_inference, save_checkpoint
from kiln.train.dist import DistInfo

ROOT = Path(__file__).resolve().parents[3]
TINY = {"vocab_size": 320, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 48, "dropout": 0.0}


def test_gae_matches_a_hand_computed_example() -> None:
    # one row: a prompt position (masked), then three answer tokens, then padding
    rewards = torch.tensor([[0.0, 0.1, -0.2, 1.0, 0.0]])
    values = torch.tensor([[9.0, 0.5, 0.4, 0.3, 7.0]])
    mask = torch.tensor([[0, 1, 1, 1, 0]])
    g, lam = 0.9, 0.8
    d3 = 1.0 - 0.3  # the last answer token: no value after it
    d2 = -0.2 + g * 0.3 - 0.4
    d1 = 0.1 + g * 0.4 - 0.5
    a3, a2 = d3, d2 + g * lam * d3
    a1 = d1 + g * lam * a2
    adv, ret = gae(rewards, values, mask, g, lam)
    assert adv[0].tolist() == pytest.approx([0.0, a1, a2, a3, 0.0], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([0.0, a1 + 0.5, a2 + 0.4, a3 + 0.3, 0.0], abs=1e-6)
    # gamma = lam = 1: the advantage is the reward still to come minus the value
    adv1, _ = gae(rewards, values, mask, 1.0, 1.0)
    assert adv1[0, 1].item() == pytest.approx(0.1 - 0.2 + 1.0 - 0.5, abs=1e-6)


def test_token_rewards_put_the_score_on_the_last_answer_token_and_the_kl_on_every_one() -> None:
    logp = torch.tensor([[-1.0, -1.0, -2.0, 0.0], [-1.0, -0.5, 0.0, 0.0]])
    ref = torch.tensor([[-1.0, -1.5, -1.0, -3.0], [-1.0, -1.0, -9.0, -9.0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]])
    rewards, kl = token_rewards(torch.tensor([2.0, -1.0]), logp, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(kl, torch.tensor([[0.0, 0.5, -1.0, 0.0], [0.0, 0.5, 0.0, 0.0]]))
    torch.testing.assert_close(rewards, torch.tensor([[0.0, -0.05, 0.1 + 2.0, 0.0], [0.0, -0.05 - 1.0, 0.0, 0.0]]))


def test_clipped_policy_and_value_losses_match_hand_values() -> None:
    old = torch.tensor([[0.0, 0.0, 0.0]])
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5, 0.5, 1.1
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    mask = torch.tensor([[1, 1, 1]])
    loss, frac = policy_loss(logp, old, adv, mask, clip=0.2)
    # per token max(-A r, -A clip(r)): max(-1.5, -1.2) = -1.2; max(-0.5, -0.8) = -0.5; max(2.2, 2.2) = 2.2
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 2.2) / 3, rel=1e-6)
    assert frac == pytest.approx(2 / 3)
    v, old_v, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 2.0]])
    vl = value_loss(v, old_v, ret, torch.tensor([[1, 1]]), clip=0.2)
    # token 1: max((1-0)^2, (0.2-0)^2) = 1; token 2: max((0-2)^2, (0-2)^2) = 4
    assert vl.item() == pytest.approx(0.5 * (1.0 + 4.0) / 2)
    w = whiten(torch.tensor([[1.0, 2.0, 3.0, 99.0]]), torch.tensor([[1, 1, 1, 0]]))
    assert w[0, :3].tolist() == pytest.approx([-math.sqrt(1.5), 0.0, math.sqrt(1.5)], rel=1e-4) and w[0, 3] == 0
    assert masked_mean(torch.tensor([[1.0, 5.0]]), torch.tensor([[1, 0]])).item() == 1.0


class TokenReward(nn.Module):
    """A hand-made reward model: 1 when a row's last token is one of the preferred ids (the even ones), else 0."""

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        last = x[torch.arange(x.size(0)), lengths - 1]  # (B,)
        return (last % 2 == 0).float()  # (B,)


def test_ppo_raises_a_hand_made_reward_on_held_out_prompts(tiny_tokenizer, one_thread) -> None:
    enc, _ = tiny_tokenizer
    torch.manual_seed(0)
    policy = build_model(ModelConfig(**TINY))
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    value = RewardModel(build_model(ModelConfig(**TINY)))
    rm = TokenReward()
    job = PpoJob(max_new_tokens=6, temperature=1.0, kl_coef=0.01, seq_len=31, ppo_epochs=2)
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3, weight_decay=0.0)
    vopt = torch.optim.AdamW(value.parameters(), lr=1e-3, weight_decay=0.0)
    items = [it["prompt"] for it in arithmetic(96, seed=0)]
    train, held = items[:64], items[64:]
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    ref_logps = lambda x, y: model_token_logps(ref, x, y)  # noqa: E731  (the stage's reference_logps)

    def held_out_reward() -> float:
        buf = rollout(policy, ref_logps, value, rm, enc, held, job, torch.Generator().manual_seed(123), "cpu")
        return float(buf["score"].mean())

    before, stats = held_out_reward(), []
    gen = torch.Generator().manual_seed(0)
    for r in range(16):
        buf = rollout(policy, ref_logps, value, rm, enc, train[(r * 16) % 64 : (r * 16) % 64 + 16], job, gen, "cpu")
        for _ in range(job.ppo_epochs):
            pl, vl, s = ppo_losses(policy, value, buf, job, contextlib.nullcontext)
            step_value(value, vopt, vl, info)
            pl.backward()
            opt.step()
            opt.zero_grad()
            stats.append(s)
    after = held_out_reward()
    assert before < 0.7 and after > before + 0.2, (before, after)
    assert stats[0]["kl"] == pytest.approx(0.0, abs=1e-5) and stats[-1]["kl"] > 0  # moved away from the reference
    assert stats[0]["clip_frac"] == 0.0  # the first epoch of a rollout is on-policy: ratio 1
    assert all(s["value_loss"] >= 0 and 1 <= s["response_length"] <= 6 for s in stats)


def checkpoints(root: Path, tok_path: Path, model: dict, eot: int) -> tuple[Path, Path]:
    """An SFT-like policy checkpoint and a reward checkpoint on the same (random) backbone."""
    torch.manual_seed(0)
    cfg = ModelConfig(**model)
    backbone = build_model(cfg)
    policy = save_checkpoint(root / "sft", 0, {"model": backbone.state_dict()}, {"model": asdict(cfg)},
                             {"tokenizer.json": tok_path})
    rm = RewardModel(copy.deepcopy(backbone))
    reward = save_checkpoint(root / "reward", 0, {"model": rm.state_dict()},
                             {"model": asdict(cfg), "head": "reward", "pad_token_id": eot}, {"tokenizer.json": tok_path})
    return policy, reward


@pytest.mark.slow
def test_ppo_job_reports_its_curves_resumes_and_saves_a_plain_policy(tmp_path, tiny_tokenizer, model_dict) -> None:
    from tests.conftest import subprocess_env

    enc, tok_path = tiny_tokenizer
    model = {**model_dict, "dropout": 0.0}
    init, reward = checkpoints(tmp_path, tok_path, model, enc.eot_token)
    data = tmp_path / "pairs.jsonl"
    write_jsonl(build_pairs([], n_arithmetic=60, seed=2, val_permille=200, max_doc_pairs=0), data)
    job = {"task": "ppo", "out_dir": str(tmp_path / "run"), "tokenizer": str(tok_path), "model": model,
           "optim": {"lr": 1e-3, "warmup_steps": 1}, "train_files": [str(data)], "init_from": str(init),
           "reward_model": str(reward), "seq_len": 31, "micro_batch": 4, "max_new_tokens": 6, "max_steps": 6,
           "ppo_epochs": 2, "eval_interval": 2, "eval_items": 8, "log_interval": 2, "ckpt_interval": 2, "keep_last": 2}
    config = tmp_path / "job.json"
    config.write_text(json.dumps(job))
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"fail_at_step": 5}))
    cmd = [sys.executable, "tests/faults.py", "--faults", str(faults), "--config", str(config), "--device", "cpu"]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and "injected failure at step 5" in proc.stderr, proc.stderr[-2000:]
    assert "PPO on" in proc.stdout and "held-out reward" in proc.stdout
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step_0000004" in proc.stdout
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["task"] == "ppo" and result["steps"] == 6 and result["ppo_epochs"] == 2
    hist = result["history"]
    assert [h["step"] for h in hist] == [0, 1, 2, 3, 4, 5, 6]
    assert [h["step"] for h in hist if "val_reward" in h] == [0, 2, 4, 6]
    assert all(h["value_loss"] >= 0 and 0 <= h["clip_frac"] <= 1 and h["response_length"] >= 1 for h in hist[1:])
    assert hist[0]["val_kl"] == pytest.approx(0.0, abs=1e-6)
    m, _, meta = load_for_inference(result["checkpoint"])  # plain policy weights, loadable for release
    assert meta["task"] == "ppo" and meta["reward_model"] == str(reward)
    base, _, _ = load_for_inference(init)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert not torch.equal(m(ids), base(ids))  # the policy trained
