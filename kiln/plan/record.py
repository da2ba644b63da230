"""The training plan as a typed record: every key of the plan base_model launches and the training_plan asset
records (``PlanRecord``), and its plain-dict form, which run keys and the plan's data version hash.

``PlanRecord.from_dict(kiln.plan.planner.plan_training(...).launch())`` reads a launch plan; the training_plan asset
adds where its sizes came from (``notes``), its prediction, the imported start and the epochs, then records
``to_dict()``. An optional key is absent from the dict while its field is None, as a plan without it always was.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from kiln.common.config import RecordError, record_from
from kiln.plan.memory import TrainingPlan

# The keys a plan holds only when it has them (to_dict leaves a None one out: a plan without them hashes as before).
OPTIONAL = ("layout", "pipeline", "sweep", "optim_overrides", "sized_by_law", "sizing", "scaling", "pretrained", "epochs",
            "cpu_bf16")


@dataclass(kw_only=True)
class PlanRecord(TrainingPlan):
    """The training plan: kiln.plan.memory.TrainingPlan's fields (the single-node plan, or the same fields from a
    cluster layout: kiln.plan.layout.training_plan_of), the hardware block and steps; then the optional keys."""

    hardware: dict[str, Any]  # the hardware block as planned
    max_steps: int
    layout: dict[str, int] | None = None  # a split model's mesh: dp_replicate, dp_shard, tp, pp (and ep)
    pipeline: dict[str, Any] | None = None  # pipeline stages: schedule, virtual_stages, microbatches
    sweep: dict[str, Any] | None = None  # from_sweep: the best point, its final_val_loss, the sweep_results version
    optim_overrides: dict[str, Any] | None = None  # from_sweep: the point's optimizer fields base_model sets
    sized_by_law: dict[str, Any] | None = None  # sizing: law: the width and steps the law chose, and why
    sizing: str | None = None  # sizing: law: that choice in words
    scaling: dict[str, Any] | None = None  # the scaling ladder's prediction of this run's loss
    pretrained: dict[str, Any] | None = None  # the imported weights base_model continues from
    epochs: float | None = None  # passes over the train split

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "training_plan") -> "PlanRecord":
        """The plan recorded as ``data``; a missing required key or an undeclared one is a RecordError naming it."""
        return record_from(cls, data, where, strict=True)

    def to_dict(self) -> dict[str, Any]:
        """The plan as the plain dict base_model launches and run keys hash: every field, an optional one only when
        it is set."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in OPTIONAL and value is None:
                continue
            out[f.name] = value
        return out

    def with_(self, **changes: Any) -> "PlanRecord":
        """A copy with ``changes`` (field: value); a name the plan does not declare is a RecordError."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise RecordError(f"training_plan: unknown key {', '.join(map(repr, unknown))}")
        return dataclasses.replace(self, **changes)
