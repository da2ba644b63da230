"""The pieces of the asset outputs the model card reads, as typed records (kiln.release.card builds them once from
release_bundle's upstream outputs, and its sections read their attributes).

Each record's ``from_dict`` reads one recorded output; a key the card needs and the output lacks is a RecordError
naming the key and the output. Keys the card does not read are left unread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from kiln.common.config import RecordError, record_from


def _at(data: Mapping[str, Any], path: str, where: str) -> Any:
    """``data``'s value at the dotted ``path`` ("summary.agreement"); a missing step is a RecordError naming it."""
    value: Any = data
    for i, key in enumerate(path.split(".")):
        if not isinstance(value, Mapping) or key not in value:
            raise RecordError(f"{where}: no {'.'.join(path.split('.')[:i + 1])!r}")
        value = value[key]
    return value


@dataclass(frozen=True)
class LadderPrediction:
    """The scaling ladder's prediction of the run's final validation loss (the plan's ``scaling``)."""

    ladder: str  # the scaling_ladder version
    params: int
    tokens: int
    predicted_val_loss: float
    interval: list[float]  # [low, high]
    law: dict[str, float]  # the fitted E, A, B, alpha, beta
    rungs: list[dict[str, Any]]  # {rung, budget, params, tokens, loss}
    intervals: dict[str, list[float]] | None = None  # bootstrap interval of each coefficient
    optimal: dict[str, Any] | None = None  # the law's {params, tokens} for this budget, or {error}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "training_plan.scaling") -> "LadderPrediction":
        return record_from(cls, data, where)


@dataclass(frozen=True)
class CardPlan:
    """What the card says of the training plan (kiln.plan.record.PlanRecord's keys, those the card reads)."""

    model: dict[str, Any]  # ModelConfig's fields (GPT-2 plans omit the family)
    params: int
    world_size: int
    parallelism: str
    hardware: dict[str, Any]
    tokens_per_step: int
    tokens_per_param: float
    micro_batch: int
    grad_accum: int
    scaling: LadderPrediction | None = None
    sizing: str | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "training_plan") -> "CardPlan":
        return record_from(cls, data, where, scaling=prediction_of(data, where))


def prediction_of(plan: Mapping[str, Any], where: str = "training_plan") -> LadderPrediction | None:
    """The plan's ladder prediction, or None when no ladder was fitted."""
    sc = plan.get("scaling")
    return LadderPrediction.from_dict(sc, f"{where}.scaling") if sc else None


@dataclass(frozen=True)
class BaseRun:
    """The base model's training run (base_model's output)."""

    version: str
    steps: int
    tokens: int
    initial_val_loss: float
    final_val_loss: float
    checkpoint: str
    mlflow_run_id: str

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "base_model") -> "BaseRun":
        return record_from(cls, data, where)


@dataclass(frozen=True)
class LossHistory:
    """What the card's figures plot of the base model's run: its train-loss curve, validation history, final loss."""

    final_val_loss: float
    curve: list[Any] = field(default_factory=list)  # [step, train loss] pairs
    history: list[dict[str, Any]] = field(default_factory=list)  # {step, val_loss, ...} per evaluation
    out_dir: str | None = None  # the run folder (its checkpoint_evals sit beside base_model's runs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "base_model") -> "LossHistory":
        return record_from(cls, data, where)


@dataclass(frozen=True)
class EvalScores:
    """The base model's scores (eval_scores): bits per byte, and one lm-eval row per task on all and clean items."""

    val_bits_per_byte: float
    tasks: dict[str, dict[str, Any]]
    tasks_clean: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "eval_scores") -> "EvalScores":
        return record_from(cls, data, where)


@dataclass(frozen=True)
class RedTeamKind:
    """One kind of red-team probe: the released stage's gated rate against its limit, the judge's figures, and
    every stage's failure rate by rules."""

    kind: str
    n: int
    gated_rate: float
    gated_stderr: float
    limit: float | None
    rules_rate: dict[str, float]  # {stage: failure rate by rules}
    judge_rate: float | None  # the released stage's, by the judge
    judge_agrees_with_rules: Any
    judge_orders_references: Any


@dataclass(frozen=True)
class RedTeam:
    """The red-team report and release_bundle's gate on it: the probes, the judge, each kind's rates, the verdict."""

    version: str
    intended_use: str
    excluded_uses: list[str]
    probes: int
    probes_sha256: str
    probes_source: str
    judge: dict[str, Any]  # {family, kind, path, params}
    stage: str  # the released stage the gate counts
    kinds: list[RedTeamKind]
    judge_skipped: str | None
    gate_on: str  # "rules" or "judge"
    reasons: list[str]  # the limits exceeded, in words
    override: str  # why it was released anyway ("" for none)

    @classmethod
    def from_dict(cls, report: Mapping[str, Any], gate: Mapping[str, Any], where: str = "red_team_report",
                  gate_where: str = "release_bundle's red-team gate") -> "RedTeam":
        """From the red-team report and the gate release_bundle made of it."""
        p, stages = _at(report, "probes", where), _at(report, "stages", where)
        stage = _at(gate, "stage", gate_where)
        released = _at(stages, f"{stage}.summary", f"{where}.stages")
        limits = gate.get("limits") or {}
        kinds = []
        for kind, k in _at(gate, "summary.kinds", gate_where).items():
            mine = _at(released, f"kinds.{kind}", f"{where}.stages.{stage}.summary")
            kinds.append(RedTeamKind(
                kind=kind, n=k["n"], gated_rate=k["gated"]["rate"], gated_stderr=k["gated"]["stderr"],
                limit=limits.get(kind),
                rules_rate={s: _at(v, f"summary.kinds.{kind}.rules.rate", f"{where}.stages.{s}") for s, v in stages.items()},
                judge_rate=(mine.get("judge") or {}).get("rate"),
                judge_agrees_with_rules=_at(mine, "judge_agrees_with_rules", f"{where}.stages.{stage}.summary.kinds.{kind}"),
                judge_orders_references=mine.get("judge_orders_references")))
        return cls(version=_at(report, "version", where), intended_use=_at(p, "intended_use", f"{where}.probes"),
                   excluded_uses=_at(p, "excluded_uses", f"{where}.probes"), probes=_at(p, "n", f"{where}.probes"),
                   probes_sha256=_at(p, "sha256", f"{where}.probes"), probes_source=_at(p, "source", f"{where}.probes"),
                   judge=_at(report, "judge", where), stage=stage, kinds=kinds,
                   judge_skipped=released.get("judge_skipped"), gate_on=_at(gate, "gate_on", gate_where),
                   reasons=list(_at(gate, "reasons", gate_where)), override=gate.get("override") or "")
