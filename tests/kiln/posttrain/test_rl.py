"""Tests for kiln.posttrain.rl: group-relative advantages, the GRPO loss and KL penalty, a task a tiny model learns, the job.

Run: python -m pytest tests/kiln/posttrain/test_rl.py -q
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from kiln.train.checkpoint import load_for_inference, save_checkpoint
from kiln.posttrain.instructions import arithmetic, build_pairs, final_number, write_jsonl
from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.posttrain.logprobs import model_token_logps
from kiln.posttrain.sampling import complete
from kiln.posttrain.rl import RlJob, answer_rows, group_advantages, grpo_loss, make_reward, rollout_loss
from kiln.posttrain.sft import IGNORE, chat_prompt_ids

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


def test_rl_raises_mean_reward_on_a_task_a_tiny_model_can_learn(tiny_tokenizer, one_thread) -> None:
    """Answer with a number: a random tiny model does so ~20% of the time; GRPO makes it nearly always."""
    enc, _ = tiny_tokenizer
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=320, block_size=32, n_layer=2, n_head=2, n_embd=48))
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    items = list(arithmetic(64, seed=0))
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
           "ckpt_interval": 2, "keep_last": 2}
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
