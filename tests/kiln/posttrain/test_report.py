"""Tests for kiln.posttrain.report: what every post-training stage shows (the before/after table with each measure's
meaning, the checkpoint, steps, rounded wall time and scale), and the DPO, RL, reward model and PPO reports' curves
(the history points that carry each quantity, the PNG each is saved to), tables and rounded figures.
"""

from __future__ import annotations

from pathlib import Path

from kiln.posttrain.measures import MEASURES
from kiln.posttrain.report import dpo_report, ppo_report, reward_report, rl_report, stage_report
from kiln.train.launch import FilePath, Plot, Table

ROWS = [{"measure": "preference_accuracy", "before": 0.5, "after": 0.75, "change": 0.25, "stderr": 0.05,
         "beyond_noise": True},
        {"measure": "response_loss", "before": 2.5, "after": 2.4, "change": -0.1, "stderr": 0.02, "beyond_noise": True}]


def run_result(history: list[dict], **more) -> dict:
    return {"checkpoint": Path("/runs/stage/checkpoints/step_0000020"), "steps": 20, "wall_s": 12.3456,
            "resumed_from": None, "world_size": 2, "device": "cpu", "trainable_params": 1536,
            "lora": {"enabled": True, "rank": 4}, "history": history, **more}


def test_every_stage_shows_its_comparison_checkpoint_and_scale():
    got = stage_report(run_result([]), ROWS)
    assert got == {
        "before_after": Table([{**ROWS[0], "what": MEASURES["preference_accuracy"]},
                               {**ROWS[1], "what": MEASURES["response_loss"]}]),
        "checkpoint": FilePath("/runs/stage/checkpoints/step_0000020"), "steps": 20, "wall_s": 12.3,
        "resumed_from": "None", "world_size": 2, "device": "cpu", "trainable_parameters": 1536, "lora": True}
    assert "what" not in ROWS[0]  # the rows given are not changed


DPO_HISTORY = [
    {"step": 0, "val_loss": 0.693, "val_reward_accuracy": 0.5, "val_reward_margin": 0.0, "val_chosen_logp": -40.0,
     "val_rejected_logp": -41.0},
    {"step": 5, "train_loss": 0.6, "train_reward_accuracy": 0.6, "train_reward_margin": 0.2},
    {"step": 10, "train_loss": 0.5, "train_reward_accuracy": 0.7, "train_reward_margin": 0.4, "val_loss": 0.55,
     "val_reward_accuracy": 0.75, "val_reward_margin": 0.5, "val_chosen_logp": -39.0, "val_rejected_logp": -43.0},
    {"step": 12, "train_reward_margin": None},
]


def test_a_dpo_report_plots_margins_and_log_probabilities_and_rounds_the_final_figures(tmp_path):
    result = run_result(DPO_HISTORY, initial_val={"reward_accuracy": 0.5, "loss": 0.693},
                        final_val={"reward_accuracy": 0.7500049, "reward_margin": 0.512345678, "loss": 0.55})
    got = dpo_report(result, ROWS, tmp_path)
    assert got["reward_margin_curve"] == Plot(
        {"train margin": [(5, 0.2), (10, 0.4)], "held-out margin": [(0, 0.0), (10, 0.5)]},
        "DPO reward margin", "step", "beta * log-ratio difference", tmp_path / "margins.png")
    assert got["logps_curve"] == Plot({"chosen": [(0, -40.0), (10, -39.0)], "rejected": [(0, -41.0), (10, -43.0)]},
                                      "held-out log-probabilities", "step", "summed log p(response)",
                                      tmp_path / "logps.png")
    assert got["held_out_pairs"] == Table(DPO_HISTORY, ["step", "train_loss", "train_reward_accuracy", "val_loss",
                                                        "val_reward_accuracy", "val_reward_margin", "val_chosen_logp",
                                                        "val_rejected_logp"])
    assert got["final_held_out"] == Table([{"quantity": "reward_accuracy", "start": 0.5, "end": 0.7500049},
                                           {"quantity": "reward_margin", "start": None, "end": 0.512345678},
                                           {"quantity": "loss", "start": 0.693, "end": 0.55}])
    assert (got["held_out_reward_accuracy"], got["held_out_reward_margin"]) == (0.75, 0.5123)
    assert got["steps"] == 20 and got["before_after"] == stage_report(result, ROWS)["before_after"]


def test_a_dpo_run_without_held_out_pairs_has_empty_figures(tmp_path):
    got = dpo_report(run_result([{"step": 1, "train_reward_margin": 0.1}], initial_val=None, final_val=None), ROWS,
                     tmp_path)
    assert got["final_held_out"] == Table([]) and got["held_out_reward_accuracy"] is None
    assert got["reward_margin_curve"].series == {"train margin": [(1, 0.1)], "held-out margin": []}


def test_an_rl_report_plots_sampled_and_held_out_rewards_and_the_kl(tmp_path):
    history = [{"step": 0, "val_reward": 0.1}, {"step": 1, "reward": 0.2, "exact_answer": 0.0, "kl": 0.01},
               {"step": 2, "reward": 0.4, "exact_answer": 0.5, "kl": 0.03, "val_reward": 0.35}]
    got = rl_report(run_result(history, initial_val_reward=0.1, final_val_reward=0.3512345), ROWS, tmp_path)
    assert got["reward_curve"] == Plot(
        {"sampled reward (train)": [(1, 0.2), (2, 0.4)], "sampled exact answers (train)": [(1, 0.0), (2, 0.5)],
         "greedy held-out reward": [(0, 0.1), (2, 0.35)]}, "RL reward over steps", "step", "mean reward",
        tmp_path / "reward.png")
    assert got["kl_curve"] == Plot({"KL to reference": [(1, 0.01), (2, 0.03)]}, "KL to the reference", "step",
                                   "nats/token", tmp_path / "kl.png")
    assert got["held_out_reward"] == Table([{"step": 0, "reward": 0.1}, {"step": 2, "reward": 0.35}])
    assert (got["initial_held_out_reward"], got["final_held_out_reward"]) == (0.1, 0.3512)
    assert rl_report(run_result([]), ROWS, tmp_path)["final_held_out_reward"] is None


def test_a_reward_model_report_shows_pair_accuracy_and_margins(tmp_path):
    history = [{"step": 0, "val_accuracy": 0.5, "val_margin": 0.0, "val_loss": 0.69},
               {"step": 4, "train_accuracy": 0.6, "train_margin": 0.3, "train_loss": 0.6},
               {"step": 8, "train_accuracy": 0.8, "train_margin": 0.9, "val_accuracy": 0.7, "val_margin": 0.6}]
    result = {**run_result(history), "pairs": {"train": 120, "val": 30},
              "initial_val": {"accuracy": 0.5}, "final_val": {"accuracy": 0.7, "margin": 0.6, "loss": 0.58}}
    got = reward_report(result, tmp_path)
    assert {k: v for k, v in got.items() if not isinstance(v, (Plot, Table))} == {
        "checkpoint": FilePath("/runs/stage/checkpoints/step_0000020"), "steps": 20, "wall_s": 12.3,
        "resumed_from": "None", "world_size": 2, "device": "cpu", "pairs_train": 120, "pairs_held_out": 30,
        "held_out_accuracy": 0.7, "held_out_margin": 0.6, "held_out_loss": 0.58, "initial_held_out_accuracy": 0.5}
    assert got["accuracy_curve"] == Plot(
        {"train accuracy": [(4, 0.6), (8, 0.8)], "held-out accuracy": [(0, 0.5), (8, 0.7)]},
        "reward model pair accuracy", "step", "share of pairs ranked right", tmp_path / "accuracy.png")
    assert got["margin_curve"].series == {"train margin": [(4, 0.3), (8, 0.9)], "held-out margin": [(0, 0.0), (8, 0.6)]}
    assert got["margin_curve"].file == tmp_path / "margin.png"
    assert got["held_out_pairs"].columns[:3] == ["step", "train_loss", "train_accuracy"]
    assert "before_after" not in got  # a reward model has no policy to compare before and after
    empty = reward_report({**result, "initial_val": None, "final_val": None}, tmp_path)
    assert (empty["held_out_accuracy"], empty["initial_held_out_accuracy"]) == (None, None)


def test_a_ppo_report_plots_its_losses_from_the_rollout_steps_only(tmp_path):
    history = [{"step": 0, "val_reward": -0.5, "val_kl": 0.0},
               {"step": 1, "reward": -0.2, "kl": 0.02, "value_loss": 1.5, "policy_loss": 0.1, "clip_frac": 0.05,
                "response_length": 12},
               {"step": 2, "reward": 0.1, "kl": 0.04, "value_loss": 1.1, "policy_loss": -0.05, "clip_frac": 0.1,
                "response_length": 15, "val_reward": 0.2, "val_kl": 0.03}]
    result = run_result(history, initial_val_reward=-0.5, final_val_reward=0.2, initial_val_kl=0.0, final_val_kl=0.03)
    got = ppo_report(result, ROWS, str(tmp_path))
    assert (got["initial_held_out_reward"], got["final_held_out_reward"]) == (-0.5, 0.2)
    assert (got["initial_held_out_kl"], got["final_held_out_kl"]) == (0.0, 0.03)
    assert got["reward_curve"].series == {"rollout reward (reward model)": [(1, -0.2), (2, 0.1)],
                                          "greedy held-out reward": [(0, -0.5), (2, 0.2)]}
    assert got["kl_curve"].series == {"rollout KL": [(1, 0.02), (2, 0.04)], "held-out KL": [(0, 0.0), (2, 0.03)]}
    assert got["loss_curves"] == Plot({"value loss": [(1, 1.5), (2, 1.1)], "policy loss": [(1, 0.1), (2, -0.05)],
                                       "clip fraction": [(1, 0.05), (2, 0.1)]}, "PPO losses", "step", "loss / share",
                                      tmp_path / "losses.png")
    assert [p.file.name for p in (got["reward_curve"], got["kl_curve"])] == ["reward.png", "kl.png"]
    assert got["steps_table"] == Table(history, ["step", "reward", "kl", "value_loss", "policy_loss", "clip_frac",
                                                 "response_length", "val_reward", "val_kl"])
    assert got["lora"] is True and got["before_after"].rows[0]["what"] == MEASURES["preference_accuracy"]
