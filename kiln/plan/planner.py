"""Step 4's one entry point: a ``training_plan`` block's fields -> the plan base_model launches.

Without a ``layout`` block the single-node planner (kiln.plan.memory) decides DDP or FSDP2, checkpointing, micro-batch
and accumulation; with one, the cluster planner (kiln.plan.layout) chooses data, tensor, pipeline and expert
parallelism by estimated step time and turns its choice into the same launch fields. The training_plan asset,
``kiln plan``, the sweep's points and the run's preflight all call ``plan_training``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.common.config import ConfigError
from kiln.model.config import ModelConfig
from kiln.plan.cost import describe_costs, load_cost
from kiln.plan.layout import LayoutPlan, describe_layout_plan, layout_from_config, training_plan_of
from kiln.plan.memory import BatchConfig, TrainingPlan, describe_plan, model_from_config, plan_from_config
from kiln.plan.record import PlanRecord


@dataclass
class Planned:
    """What the planner decided for a ``training_plan`` block: ``single``, the single-node plan, or ``layout``, the
    cluster's layout plan (the other None), for ``model``; ``launch()`` turns it into what base_model launches."""

    model: ModelConfig
    hardware: dict[str, Any]  # the hardware block as planned (a single-node plan's device resolved from "auto")
    single: TrainingPlan | None = None
    batch: BatchConfig | None = None  # the single-node plan's batch
    layout: LayoutPlan | None = None
    compile: bool = False
    where: str = "training_plan"

    def record(self) -> PlanRecord:
        """What base_model launches: TrainingPlan's fields, the hardware block and max_steps; for a layout, the job's
        layout and pipeline blocks too, and a layout the training job cannot run (HSDP) is a ConfigError saying what
        to pin."""
        if self.layout is None:
            assert self.single is not None and self.batch is not None
            return PlanRecord.from_dict({**self.single.to_dict(), "hardware": dict(self.hardware),
                                         "max_steps": self.batch.max_steps}, self.where)
        return PlanRecord.from_dict(training_plan_of(self.layout, self.model, self.hardware, self.compile, self.where),
                                    self.where)

    def launch(self) -> dict[str, Any]:
        """``record()`` as the plain dict base_model launches and run keys hash."""
        return self.record().to_dict()

    def describe(self) -> str:
        """What ``kiln plan`` prints: the layout's choice size by size, or the single-node plan and its costs."""
        if self.layout is not None:
            return describe_layout_plan(self.layout)
        assert self.single is not None
        return describe_plan(self.single) + describe_costs(self.single, load_cost(self.hardware["device"]))


def plan_training(n_vocab: int, model_preset: str = "", model: dict | None = None, batch: dict | None = None,
                  hardware: dict | None = None, parallel: dict | None = None, layout: dict | None = None,
                  where: str = "training_plan") -> Planned:
    """The plan of a ``training_plan`` block for a tokenizer of ``n_vocab`` tokens; ``layout`` None plans one node's
    data parallelism, a dict (even empty) a cluster's layout. Unknown keys and impossible values are ConfigErrors
    (PlanError where nothing fits) naming ``where.<section>.<key>``."""
    if layout is None:
        made, cfg, bc, hw = plan_from_config(n_vocab, model_preset, model, batch, hardware, parallel, where)
        return Planned(cfg, hw.__dict__, single=made, batch=bc, where=where)
    if (parallel or {}).get("cpu_bf16"):
        raise ConfigError(f"{where}.parallel.cpu_bf16: bf16 autocast on CPU is planned for one node's data parallelism; "
                          f"a layout plan trains in fp32 on CPU (remove cpu_bf16 or the layout block)")
    chosen = layout_from_config(n_vocab, model_preset, model, batch, hardware, parallel, layout, where)
    return Planned(model_from_config(n_vocab, model_preset, model, where), dict(hardware or {}), layout=chosen,
                   compile=bool((parallel or {}).get("compile")), where=where)
