"""How a DPO or RL run is shown on its asset: before/after measures, the run itself, and the stage's own curves.

``dpo_report(result, rows, out_dir)`` / ``rl_report(...)`` give plain values, tables and plots (kiln.train.launch
types) that assets/_common.report_metadata turns into Dagster metadata; nothing here imports Dagster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.posttrain.measures import comparison_table
from kiln.train.launch import FilePath, Plot, Table


def stage_report(result: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What every post-training stage shows: the before/after table and the run's checkpoint, steps and scale."""
    return {"before_after": Table(comparison_table(rows)), "checkpoint": FilePath(str(result["checkpoint"])),
            "steps": result["steps"], "wall_s": round(result["wall_s"], 1), "resumed_from": str(result["resumed_from"]),
            "world_size": result["world_size"], "device": result["device"],
            "trainable_parameters": result["trainable_params"], "lora": result["lora"]["enabled"]}


def _rounded(v: Any, digits: int = 4) -> Any:
    """A figure for a page: 4 decimals (None stays None)."""
    return round(v, digits) if isinstance(v, float) else v


def _series(hist: list[dict], key: str) -> list[tuple[float, float]]:
    return [(h["step"], h[key]) for h in hist if h.get(key) is not None]


def dpo_report(result: dict[str, Any], rows: list[dict[str, Any]], out_dir: Path) -> dict[str, Any]:
    """Reward margins and chosen/rejected log-probabilities over steps, and the held-out pair statistics."""
    hist, out_dir = result["history"], Path(out_dir)
    return {
        **stage_report(result, rows),
        "reward_margin_curve": Plot({"train margin": _series(hist, "train_reward_margin"),
                                     "held-out margin": _series(hist, "val_reward_margin")},
                                    "DPO reward margin", "step", "beta * log-ratio difference", out_dir / "margins.png"),
        "logps_curve": Plot({"chosen": _series(hist, "val_chosen_logp"), "rejected": _series(hist, "val_rejected_logp")},
                            "held-out log-probabilities", "step", "summed log p(response)", out_dir / "logps.png"),
        "held_out_pairs": Table(hist, ["step", "train_loss", "train_reward_accuracy", "val_loss", "val_reward_accuracy",
                                       "val_reward_margin", "val_chosen_logp", "val_rejected_logp"]),
        "final_held_out": Table([{"quantity": k, "start": (result["initial_val"] or {}).get(k), "end": v}
                                 for k, v in (result["final_val"] or {}).items()]),
        "held_out_reward_accuracy": _rounded((result["final_val"] or {}).get("reward_accuracy")),
        "held_out_reward_margin": _rounded((result["final_val"] or {}).get("reward_margin")),
    }


def rl_report(result: dict[str, Any], rows: list[dict[str, Any]], out_dir: Path) -> dict[str, Any]:
    """Sampled and held-out rewards over steps, the KL to the reference, and the held-out reward table."""
    hist, out_dir = result["history"], Path(out_dir)
    return {
        **stage_report(result, rows),
        "reward_curve": Plot({"sampled reward (train)": [(h["step"], h["reward"]) for h in hist if "reward" in h],
                              "sampled exact answers (train)": [(h["step"], h["exact_answer"]) for h in hist
                                                                if "exact_answer" in h],
                              "greedy held-out reward": [(h["step"], h["val_reward"]) for h in hist if "val_reward" in h]},
                             "RL reward over steps", "step", "mean reward", out_dir / "reward.png"),
        "kl_curve": Plot({"KL to reference": [(h["step"], h["kl"]) for h in hist if "kl" in h]},
                         "KL to the reference", "step", "nats/token", out_dir / "kl.png"),
        "held_out_reward": Table([{"step": h["step"], "reward": h["val_reward"]} for h in hist if "val_reward" in h]),
        "initial_held_out_reward": _rounded(result.get("initial_val_reward")),
        "final_held_out_reward": _rounded(result.get("final_val_reward")),
    }


def reward_report(result: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """A reward model run: held-out pair accuracy, margin and loss over steps, the pairs it saw, the released folder."""
    hist, out_dir = result["history"], Path(out_dir)
    final, first = result.get("final_val") or {}, result.get("initial_val") or {}
    return {
        "checkpoint": FilePath(str(result["checkpoint"])), "steps": result["steps"], "wall_s": round(result["wall_s"], 1),
        "resumed_from": str(result["resumed_from"]), "world_size": result["world_size"], "device": result["device"],
        "pairs_train": result["pairs"]["train"], "pairs_held_out": result["pairs"]["val"],
        "held_out_accuracy": final.get("accuracy"), "held_out_margin": final.get("margin"),
        "held_out_loss": final.get("loss"), "initial_held_out_accuracy": first.get("accuracy"),
        "accuracy_curve": Plot({"train accuracy": _series(hist, "train_accuracy"),
                                "held-out accuracy": _series(hist, "val_accuracy")},
                               "reward model pair accuracy", "step", "share of pairs ranked right", out_dir / "accuracy.png"),
        "margin_curve": Plot({"train margin": _series(hist, "train_margin"), "held-out margin": _series(hist, "val_margin")},
                             "reward margin r(chosen) - r(rejected)", "step", "reward", out_dir / "margin.png"),
        "held_out_pairs": Table(hist, ["step", "train_loss", "train_accuracy", "val_loss", "val_accuracy", "val_margin",
                                       "val_chosen_reward", "val_rejected_reward"]),
    }


def ppo_report(result: dict[str, Any], rows: list[dict[str, Any]], out_dir: Path) -> dict[str, Any]:
    """A PPO run: reward-model score, KL, value and policy losses, clip fraction and answer length over steps."""
    hist, out_dir = result["history"], Path(out_dir)
    train = [h for h in hist if "reward" in h]
    return {
        **stage_report(result, rows),
        "initial_held_out_reward": result["initial_val_reward"], "final_held_out_reward": result["final_val_reward"],
        "initial_held_out_kl": result["initial_val_kl"], "final_held_out_kl": result["final_val_kl"],
        "reward_curve": Plot({"rollout reward (reward model)": _series(train, "reward"),
                              "greedy held-out reward": _series(hist, "val_reward")},
                             "PPO reward over steps", "step", "reward-model score", out_dir / "reward.png"),
        "kl_curve": Plot({"rollout KL": _series(train, "kl"), "held-out KL": _series(hist, "val_kl")},
                         "KL to the reference", "step", "nats/token", out_dir / "kl.png"),
        "loss_curves": Plot({"value loss": _series(train, "value_loss"), "policy loss": _series(train, "policy_loss"),
                             "clip fraction": _series(train, "clip_frac")},
                            "PPO losses", "step", "loss / share", out_dir / "losses.png"),
        "steps_table": Table(hist, ["step", "reward", "kl", "value_loss", "policy_loss", "clip_frac", "response_length",
                                    "val_reward", "val_kl"]),
    }
