"""What a training asset needs around the job itself: the job file made from the plan, the run folder's key, and
the result shown as plain values, tables and plots (assets/_common.report_metadata turns those into metadata).

``spec = RunSpec("pretrain", fields, plan, {"token_shards": v1, "tokenizer": v2}, tokenizer_path)``; the run
folder is ``storage/<asset>/<spec.key>``, so the same inputs resume the same run. Nothing here imports Dagster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.common.files import stable_hash
from kiln.train.job import TrainJob, job_class, load_job

POSTTRAIN_TASKS = ("dpo", "rl", "reward", "ppo")  # kiln.posttrain.common.PosttrainJob jobs: own batch fields, a start checkpoint


@dataclass
class Table:
    rows: list[dict[str, Any]]
    columns: list[str] | None = None  # default: the first row's keys


@dataclass
class Plot:
    series: dict[str, list[tuple[float, float]]]  # legend -> (x, y) points
    title: str
    xlabel: str
    ylabel: str
    file: Path  # the PNG, saved beside the run and logged to its MLflow run


@dataclass
class FilePath:
    path: str


@dataclass
class RunSpec:
    """A training job as an asset launches it; its run folder is keyed by everything that decides its result."""

    task: str  # "pretrain", "sft", "dpo" or "rl"
    fields: dict[str, Any]  # job fields the asset sets: optim, data files, steps, intervals, seed ...
    plan: dict[str, Any]  # the training plan: model, seq_len, micro_batch, grad_accum, parallelism, hardware
    inputs: dict[str, Any]  # input name -> data version (in the key; MLflow tags input.<name>)
    tokenizer: str  # tokenizer.json copied into every checkpoint
    init: str = ""  # the checkpoint a DPO or RL job starts from
    reuse: dict[str, Any] = field(default_factory=dict)  # what an identical earlier run must also share
    root: str = ""  # the storage root its files are under (set by the launcher; only its place, not part of the key)

    @property
    def posttrain(self) -> bool:
        return self.task in POSTTRAIN_TASKS

    @property
    def key(self) -> str:
        """The run folder's name: a hash of everything that decides the result, the paths under ``root`` (the
        home's storage) taken relative to it, so a copied or moved home finds its run folders."""
        return stable_hash(under_root({"task": self.task, **self.inputs, **self.fields, "plan": self.plan},
                                      self.root))[:16]

    def validate(self, where: str) -> TrainJob:
        """The job this spec launches, built and checked as the workers will read it (kiln.train.job.load_job):
        a wrong key or value is a ConfigError naming ``where.<key>`` before anything is launched."""
        job = load_job(job_class(self.task, where), self.job(Path("<run folder>"), "", ""), where)
        if "world_size" in self.plan:  # the layout must multiply to the ranks the plan launches
            job.check_layout(where, self.plan["world_size"])
        return job

    def params(self) -> dict[str, Any]:
        shown = ("micro_batch", "world_size") if self.posttrain else ("micro_batch", "grad_accum", "world_size")
        return {**self.fields, "plan": {k: self.plan[k] for k in shown}}

    def tags(self) -> dict[str, str]:
        return {f"input.{k}": v for k, v in self.inputs.items() if isinstance(v, str)}

    def job(self, out_dir: Path, tracking_uri: str, run_id: str) -> dict[str, Any]:
        """The job file's fields (kiln.train.job.JobConfig, or kiln.posttrain.common.PosttrainJob's subclasses)."""
        plan = self.plan
        base = {"task": self.task, "out_dir": str(out_dir), "tokenizer": self.tokenizer, "model": plan["model"],
                "seq_len": plan["seq_len"]}
        tracking = {"mlflow_tracking_uri": tracking_uri, "mlflow_run_id": run_id}
        if self.posttrain:
            return {**base, "init_from": self.init, **tracking, **self.fields}
        job = {**base, "micro_batch": plan["micro_batch"], "grad_accum": plan["grad_accum"],
               "parallelism": plan.get("parallelism", "auto"),
               "activation_checkpointing": plan.get("activation_checkpointing", False),
               "compile": plan.get("compile", False), **({"cpu_bf16": True} if plan.get("cpu_bf16") else {}),
               **tracking, **self.fields}
        peak = plan["hardware"].get("peak_tflops")
        if peak:
            job["peak_flops"] = peak * 1e12
        if plan.get("layout"):  # a plan that splits the model: its mesh, and how its pipeline stages run
            job["layout"] = {k: int(v) for k, v in plan["layout"].items()
                             if k in ("dp_replicate", "dp_shard", "tp") or k in ("pp", "ep") and v > 1}
            if plan.get("pipeline"):
                job["pipeline"] = dict(plan["pipeline"])
        return job


def finished(out_dir: Path, steps: int) -> dict | None:
    """result.json of a completed run of ``steps`` steps in ``out_dir`` whose final checkpoint is there, else None:
    what a ladder rung or an ablation proxy reuses instead of training again."""
    import json

    try:
        result = json.loads((out_dir / "result.json").read_text())
    except (OSError, ValueError):
        return None
    ok = result.get("outcome") == "completed" and result.get("steps") == steps and Path(result.get("checkpoint", "")).is_dir()
    return result if ok else None


def under_root(value: Any, root: str) -> Any:
    """``value`` with every path under ``root`` written relative to it ("<storage>/..."): what is the same in a
    copied or moved home."""
    if not root:
        return value
    prefix = root.rstrip("/") + "/"
    if isinstance(value, str):
        return "<storage>/" + value[len(prefix):] if value.startswith(prefix) else value
    if isinstance(value, dict):
        return {k: under_root(v, root) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [under_root(v, root) for v in value]
    return value


def describe_sizes(layout: dict[str, int]) -> str:
    """A recorded layout as "pp 2 x dp_replicate 1 x dp_shard 1 x tp 1", outermost mesh dim first."""
    from kiln.model.parallel import MESH_DIMS

    return " x ".join(f"{k} {layout[k]}" for k in (*MESH_DIMS, "ep") if k in layout)


def pretrain_report(result: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """A pretraining or SFT run as metadata: losses, throughput, the loss curve, checkpoints, goodput, spikes."""
    hist = result["history"]
    curve = result.get("curve") or [(h["step"], h["train_loss"]) for h in hist if h.get("train_loss") is not None]
    goodput = result.get("goodput") or {}
    return {
        "checkpoint": FilePath(str(result["checkpoint"])), "steps": result["steps"], "tokens": result["tokens"],
        "initial_val_loss": result["initial_val_loss"], "final_val_loss": result["final_val_loss"],
        "final_train_loss": result["final_train_loss"], "wall_s": round(result["wall_s"], 1),
        "resumed_from": str(result["resumed_from"]), "world_size": result["world_size"], "device": result["device"],
        "parallelism": result.get("parallelism", "none"), "tokens_per_s": result.get("tokens_per_s"),
        "mfu": result.get("mfu"), "peak_memory_gb": round(result.get("peak_memory_gb") or 0.0, 3),
        "loss_curve": Plot({"train loss": [tuple(p) for p in curve],
                            "val loss": [(h["step"], h["val_loss"]) for h in hist if h.get("val_loss") is not None]},
                           f"{result['task']} loss", "step", "cross-entropy (nats/token)", Path(out_dir) / "loss.png"),
        "validation": Table(hist),
        "checkpoints": Table([{k: c[k] for k in ("step", "val_loss", "format", "bytes", "path")}
                              for c in result.get("checkpoints", [])]),
        "goodput": goodput.get("goodput"),
        "goodput_breakdown": Table([{"where": k.removesuffix("_s"), "seconds": v} for k, v in goodput.items()
                                    if k.endswith("_s")]),
        "spike_events": Table(result.get("events", [])),
        **({"layout": describe_sizes(result["layout"])} if result.get("layout") else {}),
        **(expert_report(result["expert_load"], out_dir) if result.get("expert_load") else {}),
    }


def expert_report(load: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """A mixture of experts' routing over the run as metadata: each layer's share of token slots per expert (a plot;
    flat at 1 / E is perfect balance), the balance per layer, and the total and active parameter counts."""
    import math

    rows, series = [], {}
    for i, counts in enumerate(load["by_layer"]):
        total = max(sum(counts), 1)
        share = [c / total for c in counts]
        series[f"layer {i}"] = [(e, s) for e, s in enumerate(share)]
        mean = total / len(counts)
        entropy = -sum(s * math.log(s) for s in share if s > 0) / math.log(len(counts))
        rows.append({"layer": i, "token_slots": total, "max_over_mean": round(max(counts) / mean, 4),
                     "entropy": round(entropy, 4), "busiest": f"expert {counts.index(max(counts))}",
                     "idlest": f"expert {counts.index(min(counts))}"})
    params = load.get("params", {})
    return {"expert_load": Plot(series, f"expert load ({load.get('router_balance', '')} balancing)", "expert",
                                "share of token slots", Path(out_dir) / "expert_load.png"),
            "expert_balance": Table(rows), "load_max_over_mean": load["balance"]["moe/load_max_over_mean"],
            **({"params_total": params["total"], "params_active": params["active"]} if params else {})}
