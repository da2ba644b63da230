"""What a plan costs: device-hours, energy and money from conf/cost.yaml, and its distance from Chinchilla's
compute-optimal size."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated

from kiln.common.config import Domain, from_dict
from kiln.plan.memory import PlanError, TrainingPlan

CHINCHILLA_TOKENS_PER_PARAM = 20.0  # Hoffmann et al. 2022: compute-optimal training uses about 20 tokens per parameter
COST_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf",
                         "cost.yaml")


@dataclass
class CostConfig:
    price_per_device_hour: Annotated[float, Domain(0)] = 0.0  # money per device-hour (one GPU, or one CPU rank)
    currency: str = "USD"
    watts_per_device: Annotated[float, Domain(0)] = 0.0  # power per device for energy estimates where no counter is read


def load_cost(device: str, path: str | None = None) -> CostConfig:
    """The cost settings for ``device`` ("cpu" or "cuda") from conf/cost.yaml (``currency`` at the top, one block
    per device; unknown keys are errors)."""
    import yaml

    path = path or COST_FILE
    if not os.path.exists(path):
        return CostConfig()
    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f) or {}
    blocks = {k: v for k, v in raw.items() if k != "currency"}
    if device not in blocks:
        raise PlanError(f"{path}: no block for device {device!r}; add {device}: {{price_per_device_hour: ..., "
                        "watts_per_device: ...}")
    return from_dict(CostConfig, {"currency": raw.get("currency", "USD"), **blocks[device]}, f"{path}:{device}")


def planned_costs(plan, cost: CostConfig) -> dict:
    """Device-hours, energy (an estimate at ``watts_per_device``) and money the plan's time estimate implies."""
    p = plan if isinstance(plan, dict) else plan.to_dict()
    device_hours = (p.get("est_hours") or 0.0) * p["world_size"]
    return {"device_hours": round(device_hours, 6), "energy_kwh": round(device_hours * cost.watts_per_device / 1000, 6),
            "cost": round(device_hours * cost.price_per_device_hour, 4), "currency": cost.currency}


def compute_optimal(params: int, tokens: int) -> dict:
    """Chinchilla's compute-optimal size for the plan's budget C = 6 N D: N_opt = sqrt(C / (6 x 20)), D_opt = 20 N_opt;
    and how far the chosen size and token count are from them (ratios above 1: larger, more)."""
    budget = 6.0 * params * tokens
    n_opt = (budget / (6.0 * CHINCHILLA_TOKENS_PER_PARAM)) ** 0.5
    d_opt = CHINCHILLA_TOKENS_PER_PARAM * n_opt
    return {"budget_flops": budget, "optimal_params": int(n_opt), "optimal_tokens": int(d_opt),
            "params_ratio": params / n_opt if n_opt else 0.0, "tokens_ratio": tokens / d_opt if d_opt else 0.0,
            "tokens_per_param": tokens / params if params else 0.0}


def describe_costs(plan: TrainingPlan, cost: CostConfig) -> str:
    """The plan's device-hours, energy and money, and its distance from the compute-optimal size, as terminal lines."""
    c, opt = planned_costs(plan, cost), compute_optimal(plan.params, plan.total_tokens)
    lines = []
    if plan.est_hours:
        lines.append(f"cost         {c['device_hours']:.3g} device-hours ({plan.est_hours:.3g} h x {plan.world_size}) at "
                     f"{cost.price_per_device_hour:g} {cost.currency}/device-hour: {c['cost']:,.2f} {cost.currency}; "
                     f"energy about {c['energy_kwh']:.3g} kWh (estimate: {cost.watts_per_device:g} W per device)")
    far = "at" if 0.8 <= opt["params_ratio"] <= 1.25 else ("below" if opt["params_ratio"] < 1 else "above")
    lines.append(f"optimal      for {opt['budget_flops']:.3g} FLOPs (6ND), ~{CHINCHILLA_TOKENS_PER_PARAM:g} tokens/parameter "
                 f"(Chinchilla) means {opt['optimal_params'] / 1e6:,.1f}M parameters on {opt['optimal_tokens']:,} tokens; "
                 f"this plan is {far} it: {opt['params_ratio']:.2f}x the size on {opt['tokens_ratio']:.2f}x the tokens "
                 f"({opt['tokens_per_param']:.1f} tokens/parameter)")
    return "\n".join(lines) + "\n"
