"""A scaling ladder: small models trained at a few compute budgets (IsoFLOP profiles), the laws fitted to their
losses, and what those laws say about a larger run.

``rungs, skipped = design(base, widths=[32, 64, 96], budgets=[1e12, 3e12], n_vocab=4096, seq_len=256,
tokens_per_step=2048, min_steps=100, max_tokens=3.2e6)`` gives each (budget, width) run: the base shape at that
width (``base`` is ModelConfig fields: the family, depth and heads), its parameters, its training FLOPs per token
(the planner's count, kiln.model.families.flops_per_token: 6N plus attention, so a tiny model's head and attention
are not left out), and the steps that spend the budget. ``summarize(rows, bootstrap)`` fits Chinchilla's approach 2
and approach 3 (kiln.scaling.law) to the finished rungs' losses. ``size_for(law, budget, base, ...)`` picks the
width and steps a budget should buy according to the fitted law.

N is the total parameter count (embedding included), as the Chinchilla paper counts it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

from kiln.common.config import ConfigError


@dataclass
class Rung:
    name: str  # "w64@3e+12"
    budget: float  # the IsoFLOP group: its nominal compute in FLOPs
    width: int  # n_embd
    model: dict  # the ModelConfig fields this rung trains
    params: int  # total parameters (N)
    flops_per_token: float
    steps: int
    tokens: int  # steps x tokens per step (D)

    @property
    def flops(self) -> float:
        """The compute the rung actually spends (its steps are whole: within a step of the budget)."""
        return self.tokens * self.flops_per_token

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "flops": self.flops}


def model_at(base: dict[str, Any], width: int, n_vocab: int, where: str = "scaling_ladder") -> Any:
    """The ModelConfig of ``base`` (fields of the ladder's shape) at ``width``; a width the heads do not divide,
    or any other bad field, is a ConfigError naming the width."""
    from kiln.model.config import ModelConfig, padded_vocab

    fields = {k: v for k, v in base.items() if k not in ("intermediate_size", "moe_intermediate_size")}
    try:  # the MLP follows the width (8/3 of it for llama) unless the base fixes a ratio-free value
        return ModelConfig(**{**fields, "vocab_size": padded_vocab(n_vocab), "n_embd": int(width)})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}.widths: width {width}: {e}") from e


def design(base: dict[str, Any], widths: list[int], budgets: list[float], n_vocab: int, seq_len: int,
           tokens_per_step: int, min_steps: int, max_tokens: float,
           where: str = "scaling_ladder") -> tuple[list[Rung], list[dict[str, Any]]]:
    """(the rungs to train, the (budget, width) pairs left out and why). A pair is left out when the budget buys
    fewer than ``min_steps`` steps (too short for the schedule to mean anything) or more than ``max_tokens`` tokens
    (too many passes over the data: repeated tokens do not follow the law). Each budget must keep at least three
    widths (a parabola needs three points), else the ladder does not fit its budgets: a ConfigError listing
    what each width would need."""
    from kiln.model.families import flops_per_token
    from kiln.plan.memory import count_params

    if len(widths) < 3 or len(set(widths)) != len(widths):
        raise ConfigError(f"{where}.widths: {widths}: give at least three different widths")
    bad = [w for w in widths if isinstance(w, bool) or not isinstance(w, int) or w < 1]
    if bad:
        raise ConfigError(f"{where}.widths: {bad[0]!r} is not a width: give whole numbers >= 1 (the model's n_embd)")
    if not isinstance(min_steps, int) or min_steps < 1:
        raise ConfigError(f"{where}.min_steps is {min_steps!r}: give a whole number >= 1")
    if len(budgets) < 2 or len(set(budgets)) != len(budgets) or any(b <= 0 for b in budgets):
        raise ConfigError(f"{where}.budgets: {budgets}: give at least two different positive budgets (FLOPs)")
    rungs, skipped, problems = [], [], []
    for budget in sorted(budgets):
        kept = []
        for width in sorted(widths):
            cfg = model_at(base, width, n_vocab, where)
            params = count_params(cfg)[0]
            f = flops_per_token(cfg, seq_len)
            steps = int(round(budget / f / tokens_per_step))
            name = f"w{width}@{budget:.2g}"
            why = None
            if steps < min_steps:
                why = f"{steps} steps < min_steps {min_steps}"
            elif steps * tokens_per_step > max_tokens:
                why = f"{steps * tokens_per_step:,} tokens > the {max_tokens:,.0f} allowed (max_epochs)"
            if why:
                skipped.append({"rung": name, "params": params, "steps": steps, "why": why})
                continue
            kept.append(Rung(name, float(budget), int(width), _fields(cfg), params, f, steps, steps * tokens_per_step))
        if len(kept) < 3:
            problems.append(f"budget {budget:.3g} keeps {len(kept)} width(s): "
                            + "; ".join(f"{s['rung']} {s['why']}" for s in skipped if s["rung"].endswith(f"@{budget:.2g}")))
        rungs += kept
    if problems:
        raise ConfigError(f"{where}: the ladder does not fit its budgets (each needs three widths that train "
                          f"between min_steps and max_epochs): {' | '.join(problems)}. Change budgets or widths")
    return rungs, skipped


def _fields(cfg) -> dict[str, Any]:
    from kiln.model.config import model_dict

    return model_dict(cfg)


def summarize(rows: list[dict[str, Any]], bootstrap: int = 200, seed: int = 0) -> dict[str, Any]:
    """Both fits of the finished rungs (rows with params, tokens, budget, loss): approach 2's per-budget minima and
    exponents, approach 3's law with bootstrap intervals. A fit that cannot be made is reported with its reason
    ({"error": ...}) rather than a number; the other fit is still made."""
    from kiln.scaling.law import FitError, fit_isoflop, fit_parametric

    points = [{"params": r["params"], "tokens": r["tokens"], "flops": r["budget"], "loss": r["loss"],
               "name": r["rung"]} for r in rows if r.get("loss") is not None and math.isfinite(r["loss"])]
    out: dict[str, Any] = {"points": len(points)}
    try:
        out["isoflop"] = fit_isoflop(points).to_dict()
    except FitError as e:
        out["isoflop"] = {"error": str(e)}
    try:
        fit = fit_parametric(points, bootstrap=bootstrap, seed=seed)
        out["law"] = {**fit.to_dict(), "draws": fit.draws.tolist()}  # the bootstrap fits: a later interval needs them
        if not fit.converged:  # kept for reading, marked so that nothing predicts or sizes with it
            try:
                fit.check()
            except FitError as e:  # the reason with the points listed
                out["law"]["error"] = str(e)
    except FitError as e:
        out["law"] = {"error": str(e)}
    return out


def law_of(ladder: dict[str, Any] | None, where: str = "training_plan"):
    """The fitted kiln.scaling.law.LawFit of a scaling_ladder output (its coefficients and bootstrap draws); a
    ConfigError when there is no ladder or its law was not fitted (the reason and what to do)."""
    import numpy as np

    from kiln.scaling.law import LawFit

    if not ladder:
        raise ConfigError(f"{where}.sizing: law needs the scaling_ladder asset: materialize it first "
                          "(kiln run --preset P --select scaling_ladder, or opt_in: [scaling_ladder]) or set sizing: preset")
    law = ladder.get("law") or {}
    if "error" in law:
        raise ConfigError(f"{where}: scaling_ladder {ladder.get('version')} has no usable law ({law['error']}); widen "
                          "the ladder (more widths or budgets) and rematerialize it, or set sizing: preset")
    return LawFit(E=law["E"], A=law["A"], B=law["B"], alpha=law["alpha"], beta=law["beta"], points=(),
                  delta=law["delta"], objective=law["objective"], converged=law["converged"],
                  intervals={k: tuple(v) for k, v in law.get("intervals", {}).items()},
                  draws=np.array(law.get("draws") or np.empty((0, 5)), dtype=float).reshape(-1, 5))


def size_for(optimal: Callable[..., tuple[float, float]], budget: float, base: dict[str, Any], n_vocab: int,
             seq_len: int, tokens_per_step: int, width_step: int = 32,
             where: str = "training_plan") -> dict[str, Any]:
    """The model and steps a budget buys by a fitted law: ``optimal(budget, flops_per_token=f)`` gives the
    law's (N_opt, D_opt) for FLOPs per token ``f(N)`` of the base shape; the width (a multiple of ``width_step``
    the heads divide) whose parameter count is nearest N_opt in log, and the steps nearest D_opt / tokens per step."""
    from kiln.model.families import flops_per_token
    from kiln.plan.memory import count_params

    heads = int(base.get("n_head", 4))
    step = width_step * heads // math.gcd(width_step, heads)
    widths = [w for w in range(step, 16384 + 1, step)]
    table = [(count_params(c := model_at(base, w, n_vocab, where))[0], flops_per_token(c, seq_len), w)
             for w in widths]

    def f(n: float) -> float:  # FLOPs per token of a model of n parameters, interpolated on the shape's widths
        import numpy as np

        xs = [math.log(p) for p, _, _ in table]
        return float(np.exp(np.interp(math.log(n), xs, [math.log(x) for _, x, _ in table])))

    n_opt, d_opt = optimal(budget, flops_per_token=f)
    params, fpt, width = min(table, key=lambda t: abs(math.log(t[0] / n_opt)))
    steps = max(1, int(round(budget / fpt / tokens_per_step)))
    return {"budget_flops": budget, "optimal_params": float(n_opt), "optimal_tokens": float(d_opt),
            "width": width, "params": params, "flops_per_token": fpt, "steps": steps, "tokens": steps * tokens_per_step}
