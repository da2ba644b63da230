"""Tests for kiln.posttrain.dpo: the loss against a hand computation, pair batches, and a tiny DPO job that learns its pairs.

Run: python -m pytest tests/kiln/posttrain/test_dpo.py -q
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.train.checkpoint import load_for_inference, save_checkpoint
from kiln.posttrain.dpo import DpoJob, PairLoader, dpo_loss, encode_preferences, pair_batch
from kiln.posttrain.instructions import build_pairs, write_jsonl
from kiln.model.config import ModelConfig
from kiln.model.gpt2.model import GPT
from kiln.posttrain.logprobs import score_responses, sequence_logps, token_logps
from kiln.posttrain.preferences import build_preferences
from kiln.posttrain.sft import IGNORE, encode_example

ROOT = Path(__file__).resolve().parents[3]


def log_sigmoid(z: float) -> float:
    return -math.log(1 + math.exp(-z))


def test_dpo_loss_matches_a_hand_computation() -> None:
    pc, pr = torch.tensor([-3.0, -10.0]), torch.tensor([-5.0, -9.0])  # policy log p(chosen), log p(rejected)
    rc, rr = torch.tensor([-4.0, -10.5]), torch.tensor([-4.5, -8.0])  # reference
    beta = 0.5
    loss, cr, rj = dpo_loss(pc, pr, rc, rr, beta)
    # reward = beta * (policy - reference); loss = mean of -log sigmoid(chosen reward - rejected reward)
    hand_cr = [beta * (-3 + 4), beta * (-10 + 10.5)]
    hand_rr = [beta * (-5 + 4.5), beta * (-9 + 8)]
    hand = -(log_sigmoid(hand_cr[0] - hand_rr[0]) + log_sigmoid(hand_cr[1] - hand_rr[1])) / 2
    assert cr.tolist() == pytest.approx(hand_cr) and rj.tolist() == pytest.approx(hand_rr)
    assert loss.item() == pytest.approx(hand, rel=1e-6)
    # policy == reference: every reward is 0 and the loss is log 2
    same, _, _ = dpo_loss(rc, rr, rc, rr, beta)
    assert same.item() == pytest.approx(math.log(2))
    # label smoothing eps mixes in the flipped pair's loss
    eps = 0.2
    smooth, _, _ = dpo_loss(pc, pr, rc, rr, beta, eps)
    m = [a - b for a, b in zip(hand_cr, hand_rr)]
    hand_s = sum(-(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z) for z in m) / 2
    assert smooth.item() == pytest.approx(hand_s, rel=1e-6)


def test_dpo_gradient_pushes_chosen_up_and_rejected_down() -> None:
    pc, pr = torch.tensor([-3.0], requires_grad=True), torch.tensor([-5.0], requires_grad=True)
    loss, _, _ = dpo_loss(pc, pr, torch.tensor([-4.0]), torch.tensor([-4.5]), beta=0.5)
    loss.backward()
    s = 1 / (1 + math.exp(0.75))  # sigmoid(-margin)
    assert pc.grad.item() == pytest.approx(-0.5 * s) and pr.grad.item() == pytest.approx(0.5 * s)


def test_sequence_logps_sum_response_tokens_only(tiny_tokenizer) -> None:
    enc, _ = tiny_tokenizer
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=320, block_size=64, n_layer=1, n_head=2, n_embd=32)).eval()
    ids, mask = encode_example(enc, "Who sees the river?", "The cat sees the river.")
    x, y = torch.tensor([ids[:-1]]), torch.tensor([[t if m else IGNORE for t, m in zip(ids[1:], mask[1:])]])
    with torch.no_grad():
        logits = model(x)
        logp = torch.log_softmax(logits, -1)[0]
        hand = sum(logp[i, ids[i + 1]].item() for i in range(len(ids) - 1) if mask[i + 1])
        assert sequence_logps(logits, y).item() == pytest.approx(hand, rel=1e-5)
        assert torch.count_nonzero(token_logps(logits, y)[y == IGNORE]) == 0
        scored, n = score_responses(model, enc, ["Who sees the river?"], ["The cat sees the river."], 63)
    assert scored[0] == pytest.approx(hand, rel=1e-5) and n[0] == sum(mask)


def test_pair_batches_put_chosen_rows_first_and_trim_padding(tiny_tokenizer) -> None:
    enc, _ = tiny_tokenizer
    rows = [{"prompt": "What is 1 + 2?", "chosen": "1 + 2 = 3.", "rejected": "1 + 2 = 4."},
            {"prompt": "Explain the road.", "chosen": "The long road runs to the market.", "rejected": "A dog."}]
    tokens, mask = encode_preferences(enc, rows, seq_len=63)
    assert tokens.shape[:2] == (2, 2) and tokens.shape == mask.shape
    x, y = pair_batch(tokens, mask)
    assert x.shape[0] == 4 and x.shape == y.shape
    longest = max(len(encode_example(enc, r["prompt"], r[k])[0]) for r in rows for k in ("chosen", "rejected"))
    assert x.shape[1] == longest - 1  # trailing padding columns dropped
    for i, (r, key) in enumerate([(rows[0], "chosen"), (rows[1], "chosen"), (rows[0], "rejected"), (rows[1], "rejected")]):
        ids, m = encode_example(enc, r["prompt"], r[key])
        targets = [t for t, keep in zip(ids[1:], m[1:]) if keep]
        assert y[i][y[i] != IGNORE].tolist() == targets
    loader = PairLoader(tokens, mask, batch_size=1, seed=0)
    xb, yb = loader.next_batch()
    assert xb.shape[0] == 2  # one pair: its chosen and its rejected row


def tiny_checkpoint(root: Path, tok_path: Path, model: dict, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    cfg = ModelConfig(**model)
    return save_checkpoint(root, 0, {"model": GPT(cfg).state_dict()}, {"model": asdict(cfg)}, {"tokenizer.json": tok_path})


def run_module(module: str, config: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    from tests.conftest import subprocess_env

    return subprocess.run([sys.executable, "-m", module, "--config", str(config), "--device", "cpu"], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def arithmetic_preferences(tmp_path: Path, tok_path: Path, model_dict: dict) -> tuple[dict, Path, list[dict], Path]:
    """(model fields without dropout, a tiny starting checkpoint, 24 arithmetic preference pairs, their JSONL)."""
    model = {**model_dict, "dropout": 0.0}
    init = tiny_checkpoint(tmp_path / "init", tok_path, model)
    prefs = build_preferences(build_pairs([], n_arithmetic=24, seed=5, val_permille=250, max_doc_pairs=0), seed=0)
    data = tmp_path / "prefs.jsonl"
    write_jsonl(prefs, data)
    return model, init, prefs, data


def test_dpo_job_raises_preference_accuracy_on_its_training_pairs(tmp_path, tiny_tokenizer, model_dict) -> None:
    enc, tok_path = tiny_tokenizer
    model, init, prefs, data = arithmetic_preferences(tmp_path, tok_path, model_dict)
    job = {"task": "dpo", "out_dir": str(tmp_path / "run"), "tokenizer": str(tok_path), "model": model,
           "optim": {"lr": 3e-3, "warmup_steps": 2, "weight_decay": 0.0}, "train_files": [str(data)],
           "init_from": str(init), "seq_len": 31, "micro_batch": 8, "max_steps": 40, "eval_interval": 20,
           "log_interval": 10, "beta": 0.5, "ckpt_interval": 20}
    config = tmp_path / "job.json"
    config.write_text(json.dumps(job))
    proc = run_module("kiln.posttrain", config)  # dispatches on task "dpo"
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["task"] == "dpo" and result["steps"] == 40
    assert "DPO on" in proc.stdout and "reward acc" in proc.stdout

    train = [p for p in prefs if p["split"] == "train"]

    def accuracy(ckpt) -> float:
        m, e, _ = load_for_inference(ckpt)
        prompts = [p["prompt"] for p in train]
        c, _ = score_responses(m, e, prompts, [p["chosen"] for p in train], 31)
        r, _ = score_responses(m, e, prompts, [p["rejected"] for p in train], 31)
        return float(np.mean(np.array(c) > np.array(r)))

    before, after = accuracy(init), accuracy(result["checkpoint"])
    assert after >= 0.9 and after > before + 0.2, (before, after)
    first, last = result["initial_val"], result["final_val"]
    assert first["reward_margin"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert set(last) >= {"reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward", "chosen_logp"}
    trained = result["final_train"]  # the last step's batch of training pairs
    assert trained["reward_margin"] > 1.0 and trained["chosen_reward"] > trained["rejected_reward"]
    assert trained["loss"] < 0.3
    assert {"train_loss", "train_reward_accuracy", "val_chosen_logp", "val_rejected_logp"} <= set(result["history"][-1])
    # rerunning the finished job resumes at its last step and trains no further
    proc = run_module("kiln.posttrain.dpo", config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and json.loads((tmp_path / "run" / "result.json").read_text())["steps"] == 40


def dpo_job(tmp_path: Path, tok_path: Path, model: dict, init: Path, data: Path, **overrides) -> Path:
    job = {"task": "dpo", "out_dir": str(tmp_path / "run"), "tokenizer": str(tok_path), "model": model,
           "optim": {"lr": 3e-3, "warmup_steps": 2, "weight_decay": 0.0}, "train_files": [str(data)],
           "init_from": str(init), "seq_len": 31, "micro_batch": 8, "max_steps": 6, "eval_interval": 3,
           "eval_pairs": 12, "log_interval": 3, "beta": 0.5, "ckpt_interval": 3, **overrides}
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "job.json").write_text(json.dumps(job))
    return tmp_path / "job.json"


@pytest.fixture
def preference_file(tmp_path) -> Path:
    data = tmp_path / "prefs.jsonl"
    write_jsonl(build_preferences(build_pairs([], n_arithmetic=60, seed=5, val_permille=250, max_doc_pairs=0), seed=0), data)
    return data


@pytest.mark.slow
def test_dpo_on_two_gloo_processes_follows_one_process(tmp_path, tiny_tokenizer, model_dict, preference_file) -> None:
    """DDP through the shared harness: 2 ranks x 4 pairs give the 1 x 8 curve, identical replicas, a checkpoint
    whose data version follows its weights."""
    from kiln.train.checkpoint import checkpoint_identity, load_state, verify_checkpoint, weights_digest
    from tests.conftest import subprocess_env

    _, tok_path = tiny_tokenizer
    model = {**model_dict, "dropout": 0.0}
    init = tiny_checkpoint(tmp_path / "init", tok_path, model)
    one = dpo_job(tmp_path / "one", tok_path, model, init, preference_file)
    two = dpo_job(tmp_path / "two", tok_path, model, init, preference_file, micro_batch=4)
    assert run_module("kiln.posttrain", one).returncode == 0
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "kiln.posttrain", "--config", str(two), "--device", "cpu"], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ref, res = (json.loads((p.parent / "run" / "result.json").read_text()) for p in (one, two))
    assert res["world_size"] == 2 and res["parallelism"] == "ddp" and len(set(res["rank_param_digests"])) == 1
    assert [h["step"] for h in res["history"]] == [0, 3, 6]
    for key in ("val_loss", "val_reward_margin", "train_loss"):
        assert [h.get(key) for h in res["history"]] == pytest.approx([h.get(key) for h in ref["history"]], abs=1e-4), key
    meta = verify_checkpoint(Path(res["checkpoint"]))
    assert meta["task"] == "dpo" and meta["format"] == "full" and meta["world_size"] == 2
    state, _ = load_state(Path(res["checkpoint"]))
    assert meta["weights_digest"] == weights_digest(state["model"])
    assert checkpoint_identity(Path(res["checkpoint"])) == meta["weights_digest"][:16]
    assert res["goodput"]["sessions"] == 1 and 0 < res["goodput"]["goodput"] < 1


def test_an_older_dpo_checkpoint_is_named_rather_than_resumed(tmp_path, tiny_tokenizer, model_dict,
                                                              preference_file) -> None:
    from kiln.posttrain.dpo import main
    from kiln.train.checkpoint import CheckpointError

    _, tok_path = tiny_tokenizer
    model = {**model_dict, "dropout": 0.0}
    init = tiny_checkpoint(tmp_path / "init", tok_path, model)
    job = dpo_job(tmp_path / "job", tok_path, model, init, preference_file)
    old = tiny_checkpoint(tmp_path / "job" / "run" / "checkpoints", tok_path, model)  # meta as DPO wrote it: no "job"
    with pytest.raises(CheckpointError, match=rf"{old}: an older DPO/RL checkpoint, which a run cannot resume from"):
        main(["--config", str(job), "--device", "cpu"])


class _Quiet:
    def log(self, message: str) -> None:
        pass


def test_a_lora_dpo_run_resumes_after_a_crash_bit_identically(tmp_path, tiny_tokenizer, model_dict,
                                                              preference_file) -> None:
    """Adapters, optimizer, data order and dropout's RNG come back from the step-3 checkpoint exactly."""
    from kiln.posttrain.dpo import main
    from kiln.train.checkpoint import load_state
    from tests.faults import injector

    _, tok_path = tiny_tokenizer
    init = tiny_checkpoint(tmp_path / "init", tok_path, model_dict)  # dropout 0.1: the RNG state matters
    kw = dict(lora={"enabled": True, "rank": 4, "dropout": 0.1}, micro_batch=4, grad_accum=2, max_steps=8,
              eval_interval=4, eval_pairs=8, keep_last=3)
    args = lambda name: ["--config", str(dpo_job(tmp_path / name, tok_path, model_dict, init, preference_file, **kw)),  # noqa: E731
                         "--device", "cpu"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = main(args("ref"), _Quiet())
        with pytest.raises(RuntimeError, match="injected failure at step 5"):
            main(args("crash"), _Quiet(), [injector(fail_at_step=5)])
        res = main(args("crash"), _Quiet(), [injector(fail_at_step=5)])
    finally:
        torch.set_num_threads(threads)
    assert Path(res["resumed_from"]).name == "step_0000003" and res["steps"] == 8
    assert res["history"] == ref["history"] and res["final_train"] == ref["final_train"]
    a, _ = load_state(Path(ref["checkpoint"]))
    b, _ = load_state(Path(res["checkpoint"]))
    for part in ("model", "lora"):  # merged weights for readers, adapters for resuming
        assert a[part].keys() == b[part].keys() and all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    assert all(k.endswith(("lora_A", "lora_B")) for k in a["lora"]) and "lora" not in "".join(a["model"])
    assert a["loader"] == b["loader"] and a["run"]["data_batches"] == b["run"]["data_batches"] == 8


def test_a_loss_name_and_settings_that_cannot_run_are_config_errors() -> None:
    from kiln.common.config import ConfigError
    from kiln.train.job import load_job

    base = {"init_from": "c", "train_files": ["p.jsonl"]}
    with pytest.raises(ConfigError, match=r"dpo_model.loss: 'orpo' is not a preference loss; choose one of dpo, ipo, "
                                          r"simpo, kto"):
        load_job(DpoJob, {**base, "loss": "orpo"}, "dpo_model")
    with pytest.raises(ConfigError, match=r"dpo_model.label_smoothing applies to loss dpo, not 'simpo'"):
        load_job(DpoJob, {**base, "loss": "simpo", "label_smoothing": 0.1}, "dpo_model")
    assert load_job(DpoJob, {**base, "loss": "simpo"}, "dpo_model").settings().beta == 2.0
    assert load_job(DpoJob, {**base, "loss": "ipo", "beta": 0.5}, "dpo_model").settings().beta == 0.5


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["ipo", "simpo", "kto"])
def test_every_registered_loss_trains_the_stage_toward_the_chosen_responses(tmp_path, tiny_tokenizer, model_dict,
                                                                           loss, one_thread) -> None:
    """Each loss through the stage at its paper's beta: held-out and training preference accuracy rise; SimPO loads
    no reference model."""
    from kiln.posttrain.dpo import main

    enc, tok_path = tiny_tokenizer
    model, init, _, data = arithmetic_preferences(tmp_path, tok_path, model_dict)
    config = dpo_job(tmp_path / "job", tok_path, model, init, data, loss=loss, beta=0.0, max_steps=30,
                     eval_interval=30, ckpt_interval=30, eval_pairs=64)
    result = main(["--config", str(config), "--device", "cpu"])
    assert result["loss"] == loss and result["beta"] == {"ipo": 0.1, "simpo": 2.0, "kto": 0.1}[loss]
    assert (result["reference"] is None) == (loss == "simpo")
    first, trained = result["initial_val"], result["final_train"]
    # the objective falls and the last batch of training pairs prefers its chosen responses (the held-out pairs
    # are sums never seen, which the tiny model cannot learn: kiln.posttrain.measures)
    assert trained["loss"] < first["loss"] and trained["reward_accuracy"] >= 0.75, (first, trained)
