"""Tests for kiln.posttrain.reward: the Bradley-Terry loss, last-token pooling, learning a separable preference, the
job, and loading the saved model back in Kiln and in transformers with equal scores.

Run: python -m pytest tests/kiln/posttrain/test_reward.py -q
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from kiln.model.config import ModelConfig
from kiln.model.families import build_model
from kiln.posttrain.instructions import write_jsonl
from kiln.posttrain.reward import (RewardModel, bradley_terry_loss, encode_pairs, load_reward_model, pad_ids,
                                   pair_rows, reward_ids, score_texts, write_hf_reward)
from kiln.posttrain.sft import chat_prompt_ids
from kiln.train.checkpoint import save_checkpoint

TINY = {"vocab_size": 320, "block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32, "dropout": 0.0}
LLAMA = {**TINY, "family": "llama", "n_kv_head": 1, "intermediate_size": 64}
MOE = {**TINY, "family": "moe", "n_kv_head": 1, "n_experts": 4, "n_experts_per_token": 2, "moe_intermediate_size": 16}


def test_bradley_terry_loss_matches_a_hand_computation() -> None:
    chosen, rejected = torch.tensor([1.0, 0.0, -0.5]), torch.tensor([0.0, 2.0, -0.5])
    loss, stats = bradley_terry_loss(chosen, rejected)
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    hand = -(math.log(sig(1.0)) + math.log(sig(-2.0)) + math.log(sig(0.0))) / 3
    assert loss.item() == pytest.approx(hand, rel=1e-6)
    assert stats["accuracy"] == pytest.approx(1 / 3)  # a tie is not a win
    assert stats["margin"] == pytest.approx((1.0 - 2.0 + 0.0) / 3)
    assert stats["chosen_reward"] == pytest.approx(0.5 / 3)


@pytest.mark.parametrize("model", [TINY, LLAMA, MOE], ids=["gpt2", "llama", "moe"])
def test_reward_is_read_at_the_last_real_token_whatever_the_padding(model) -> None:
    torch.manual_seed(0)
    rm = RewardModel(build_model(ModelConfig(**model))).eval()
    rows = [[5, 6, 7, 8, 9], [5, 6, 7]]
    x, n = pad_ids(rows, pad_id=0)
    assert x.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]] and n.tolist() == [5, 3]
    with torch.no_grad():
        batched = rm(x, n)
        alone = rm(torch.tensor([rows[1]]), torch.tensor([3]))
        repadded = rm(torch.cat([x[1:], torch.full((1, 4), 11)], 1), torch.tensor([3]))  # other pad values, longer
        hidden = rm.hidden(torch.tensor([rows[1]]))[0, -1]  # (C,) the last real token's final hidden state
    assert batched[1].item() == pytest.approx(alone.item(), abs=1e-5)
    assert repadded.item() == pytest.approx(alone.item(), abs=1e-5)
    assert alone.item() == pytest.approx(float(hidden @ rm.score.weight[0].detach()), abs=1e-5)
    assert rm.num_params() == rm.backbone.num_params() + model["n_embd"]


def separable_pairs(n: int, seed: int) -> list[dict]:
    """Prompts 'What is A + B?'; chosen answers end with 'yes', rejected ones with 'no' (a synthetic preference)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        a, b = torch.randint(0, 20, (2,), generator=g).tolist()
        rows.append({"id": f"p{seed}-{i}", "prompt": f"What is {a} + {b}?", "chosen": f"{a + b} yes",
                     "rejected": f"{a + b} no", "kind": "arithmetic", "split": "train"})
    return rows


def test_a_tiny_reward_model_learns_a_separable_preference(tiny_tokenizer, one_thread) -> None:
    enc, _ = tiny_tokenizer
    torch.manual_seed(0)
    rm = RewardModel(build_model(ModelConfig(**TINY)))
    train, val = separable_pairs(64, 0), separable_pairs(32, 1)
    tt, tl = encode_pairs(enc, train, 31)
    vx, vn = pair_rows(*encode_pairs(enc, val, 31))
    assert tt.shape[:2] == (64, 2) and tl.shape == (64, 2)

    def held_out() -> dict:
        with torch.no_grad():
            r = rm.eval()(vx, vn)
        rm.train()
        return bradley_terry_loss(r[:32], r[32:])[1]

    before = held_out()
    opt = torch.optim.AdamW(rm.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(40):
        idx = [(step * 16 + k) % 64 for k in range(16)]
        x, n = pair_rows(tt[idx], tl[idx])
        r = rm(x, n)
        loss, _ = bradley_terry_loss(r[:16], r[16:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    after = held_out()
    # an untrained head orders every pair alike (all 'yes' vs all 'no'): its loss is near log 2
    assert before["loss"] == pytest.approx(math.log(2), abs=0.1) and before["accuracy"] in (0.0, 1.0)
    assert after["accuracy"] == 1.0 and after["margin"] > 1.0, (before, after)
    assert after["loss"] < 0.3


def reward_checkpoint(root: Path, tok_path: Path, model: dict, eot: int, seed: int = 0) -> tuple[Path, RewardModel]:
    torch.manual_seed(seed)
    rm = RewardModel(build_model(ModelConfig(**model))).eval()
    torch.nn.init.normal_(rm.score.weight, std=0.5)  # scores far from 0
    ckpt = save_checkpoint(root, 0, {"model": rm.state_dict()},
                           {"model": asdict(ModelConfig(**model)), "head": "reward", "pad_token_id": eot},
                           {"tokenizer.json": tok_path})
    return ckpt, rm


@pytest.mark.parametrize("model", [{**TINY, "bias": True}, {**LLAMA, "tie_embeddings": False},
                                   {**MOE, "tie_embeddings": False}], ids=["gpt2", "llama", "moe"])
def test_a_saved_reward_model_loads_back_in_kiln_and_transformers_with_equal_scores(tmp_path, tiny_tokenizer, model) -> None:
    import transformers

    enc, tok_path = tiny_tokenizer
    ckpt, rm = reward_checkpoint(tmp_path / "run", tok_path, model, enc.eot_token)
    prompts, responses = ["What is 1 + 2?", "Explain the river.", "What is 10 + 20?"], ["3", "It flows downhill.", ""]
    want = score_texts(rm, enc, prompts, responses, 31)
    back, _, meta = load_reward_model(tmp_path / "run")
    assert meta["head"] == "reward"
    assert score_texts(back, enc, prompts, responses, 31) == pytest.approx(want, abs=1e-6)
    assert len(set(round(w, 3) for w in want)) == 3  # distinct scores: the test can tell rows apart

    hf_dir = write_hf_reward(ckpt, tmp_path / "hf")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir).eval()
    cls = {None: "GPT2ForSequenceClassification", "llama": "LlamaForSequenceClassification",
           "moe": "Qwen3MoeForSequenceClassification"}[model.get("family")]
    assert type(hf).__name__ == cls and json.loads((hf_dir / "config.json").read_text())["pad_token_id"] == enc.eot_token
    x, n = pad_ids([reward_ids(enc, p, r, 31) for p, r in zip(prompts, responses)], enc.eot_token)  # right-padded
    with torch.no_grad():
        got = hf(input_ids=x).logits[:, 0]  # (B,) HF pools at the last token that is not padding
    assert got.tolist() == pytest.approx(want, abs=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert tok("What is 1 + 2?")["input_ids"] == enc.encode_ordinary("What is 1 + 2?")
    assert x[0, : len(chat_prompt_ids(enc, prompts[0]))].tolist() == chat_prompt_ids(enc, prompts[0])


def test_load_reward_model_refuses_a_plain_checkpoint(tmp_path, tiny_tokenizer) -> None:
    enc, tok_path = tiny_tokenizer
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "lm", 0, {"model": build_model(ModelConfig(**TINY)).state_dict()},
                    {"model": asdict(ModelConfig(**TINY))}, {"tokenizer.json": tok_path})
    with pytest.raises(ValueError, match="not a reward model checkpoint"):
        load_reward_model(tmp_path / "lm")


def reward_job(tmp_path: Path, tok_path: Path, model: dict, init: Path, data: Path, **overrides) -> Path:
    job = {"task": "reward", "out_dir": str(tmp_path / "run"), "tokenizer": str(tok_path), "model": model,
           "optim": {"lr": 3e-3, "warmup_steps": 2, "weight_decay": 0.0}, "train_files": [str(data)],
           "init_from": str(init), "seq_len": 31, "micro_batch": 8, "max_steps": 12, "eval_interval": 6,
           "eval_pairs": 16, "log_interval": 6, "ckpt_interval": 6, **overrides}
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "job.json").write_text(json.dumps(job))
    return tmp_path / "job.json"


@pytest.mark.slow
def test_reward_job_on_two_gloo_processes_follows_one_process_and_learns(tmp_path, tiny_tokenizer, model_dict) -> None:
    """The job through the shared harness: 2 ranks x 4 pairs give the 1 x 8
    curve with identical replicas; the checkpoint loads back as a reward model."""
    import subprocess
    import sys

    from kiln.posttrain.preferences import build_preferences
    from kiln.posttrain.instructions import build_pairs
    from tests.conftest import subprocess_env

    root = Path(__file__).resolve().parents[3]
    enc, tok_path = tiny_tokenizer
    model = {**model_dict, "dropout": 0.0}
    torch.manual_seed(0)
    init = save_checkpoint(tmp_path / "init", 0, {"model": build_model(ModelConfig(**model)).state_dict()},
                           {"model": model}, {"tokenizer.json": tok_path})
    data = tmp_path / "prefs.jsonl"
    write_jsonl(build_preferences(build_pairs([], n_arithmetic=120, seed=5, val_permille=250, max_doc_pairs=0)), data)
    one = reward_job(tmp_path / "one", tok_path, model, init, data)
    two = reward_job(tmp_path / "two", tok_path, model, init, data, micro_batch=4)
    for cmd in ([sys.executable, "-m", "kiln.posttrain", "--config", str(one), "--device", "cpu"],
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                 "kiln.posttrain", "--config", str(two), "--device", "cpu"]):
        proc = subprocess.run(cmd, cwd=root, env=subprocess_env(), capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ref, res = (json.loads((p.parent / "run" / "result.json").read_text()) for p in (one, two))
    assert "reward model on" in proc.stdout and "held-out acc" in proc.stdout
    assert res["world_size"] == 2 and res["parallelism"] == "ddp" and len(set(res["rank_param_digests"])) == 1
    assert [h["step"] for h in res["history"]] == [0, 6, 12]
    for key in ("val_loss", "val_accuracy", "val_margin"):
        assert [h.get(key) for h in res["history"]] == pytest.approx([h.get(key) for h in ref["history"]], abs=1e-4), key
    assert ref["initial_val"]["loss"] == pytest.approx(math.log(2), abs=0.05)  # a fresh head scores pairs alike
    assert ref["final_val"]["margin"] != ref["initial_val"]["margin"] and 0 <= ref["final_val"]["accuracy"] <= 1
    assert ref["pairs"]["val"] == 16
    rm, _, meta = load_reward_model(ref["checkpoint"])
    assert meta["task"] == "reward" and meta["head"] == "reward" and meta["pad_token_id"] == enc.eot_token
