"""Step 4's evidence as assets: hyper-parameter sweeps (one Dagster partition per point) and a scaling ladder whose
fitted law predicts, and can size, the run training_plan plans.

A sweep: materialize ``sweep_grid`` (its points become partitions of ``sweep``), then every partition of ``sweep``
(a backfill in the UI), then ``sweep_results``; ``kiln sweep --preset P`` does all three. training_plan takes the
best point with ``from_sweep: true``. The ladder: ``scaling_ladder`` (opt-in, ``kiln run --select scaling_ladder``).
"""


import time
from pathlib import Path
from typing import Annotated, Any, Optional

from dagster import (AssetExecutionContext, DynamicPartitionsDefinition, Failure, MetadataValue, Output,
                     asset)
from pydantic import Field

from assets._common import (add_new_partitions, asset_output, failing_on_config_errors, line_plot, log_child_run,
                            md_table, point_records, report_metadata)
from assets._config import KilnConfig
from assets.training import Batch, ModelOverrides, Optim, TrainingPlanConfig
from kiln.common.config import ConfigError, Domain
from kiln.common.files import atomic_write_json, stable_hash
from kiln.scaling import ladder as kladder
from kiln.scaling.sweep import Point, Swept, expand, marginals, overrides, ranked
from kiln.train.launch import RunSpec, finished, pretrain_report
from resources.storage import KilnStorageResource
from resources.torchrun import TorchrunResource
from resources.tracking import MlflowResource

SWEEP_POINTS = "sweep_points"  # the dynamic partitions set: one key per point of the grid sweep_grid last expanded
sweep_partitions = DynamicPartitionsDefinition(name=SWEEP_POINTS)


class SweptField(KilnConfig):
    field: str = Field(description="<block>.<field> of the training run: optim.* (kiln.train.optim.OptimConfig: lr, muon_lr, warmup_steps, name, schedule, ...), batch.* (global_batch, seq_len, ...) or model.* (n_embd, n_layer, ...).")
    values: Annotated[list[float], Domain()] = Field(default=[], description="Numbers to try (a grid axis; in random mode one is drawn per sample).")
    choices: list[str] = Field(default=[], description="Strings to try (optim.name: [adamw, muon]; flags as true/false).")
    low: Annotated[Optional[float], Domain(none=True)] = Field(default=None, description="Random mode: the lower end of the range drawn from.")
    high: Annotated[Optional[float], Domain(none=True)] = Field(default=None, description="Random mode: the upper end of the range drawn from.")
    log: bool = Field(default=True, description="Random mode: draw uniformly in log space (learning rates), else linearly.")


class SweepGridConfig(KilnConfig):
    fields: list[SweptField] = Field(default=[], description="The fields swept and their values or ranges.")
    mode: str = Field(default="grid", description="grid: every combination of the values; random: `samples` seeded draws.")
    samples: Annotated[int, Domain(1)] = Field(default=8, description="Random mode: how many points to draw.")
    seed: Annotated[int, Domain(0)] = Field(default=0, description="Random mode: the draw's seed (the points are the same for the same seed).")
    plan: TrainingPlanConfig = Field(default_factory=TrainingPlanConfig, description="The run every point varies: training_plan's fields (model preset and overrides, batch, hardware, parallel).")
    optim: Optim = Field(default_factory=Optim, description="The optimizer every point starts from (the pretraining recipe's by default); optim.* fields of a point override it.")
    max_steps: Annotated[int, Domain(0)] = Field(default=0, description="Steps of each point's run; 0 keeps the plan's batch.max_steps. Short runs rank settings cheaply.")
    eval_batches: Annotated[int, Domain(1)] = Field(default=16, description="Validation batches behind each point's final loss.")
    train_seed: Annotated[int, Domain(0)] = Field(default=1337, description="The training seed every point shares (data order and init).")


def point_plan(config: SweepGridConfig, point: Point | dict, n_vocab: int) -> dict[str, Any]:
    """The training plan of one point (the base plan with the point's model and batch fields), as training_plan
    makes it; a point the planner refuses is a ConfigError naming it."""
    ov = overrides(point)
    key = point.key if isinstance(point, Point) else point["key"]
    base = config.plan
    if base.layout is not None:
        raise ConfigError(f"sweep_grid point {key}: sweep_grid.plan.layout is set; a sweep's points train on the "
                          "data-parallel planner: remove the layout block")
    try:
        plan = (base if not (ov["model"] or ov["batch"]) else TrainingPlanConfig(
            model_preset=base.model_preset, model={**base.model.to_dict(), **ov["model"]},
            batch={**base.batch.to_dict(), **ov["batch"]}, hardware=base.hardware.to_dict(),
            parallel=base.parallel.to_dict())).planned(n_vocab).launch()
    except ConfigError as e:
        raise ConfigError(f"sweep_grid point {key}: {e}") from e
    return {**plan, "max_steps": config.max_steps or plan["max_steps"]}


def point_optim(config: SweepGridConfig, point: Point | dict) -> dict[str, Any]:
    from kiln.common.config import from_dict
    from kiln.train.optim import OptimConfig

    optim = {**config.optim.to_dict(), **overrides(point)["optim"]}
    key = point.key if isinstance(point, Point) else point["key"]
    from_dict(OptimConfig, optim, f"sweep_grid point {key}: optim")  # a bad combination fails here, not in a worker
    return optim


@asset(code_version="1", group_name="decisions")
def sweep_grid(context: AssetExecutionContext, config: SweepGridConfig, tokenizer: dict, token_shards: dict,
               mlflow: MlflowResource) -> Output[dict]:
    """The points of a hyper-parameter sweep (a grid, or a seeded random search, over typed training fields), each checked by the planner, and each registered as a partition of `sweep`; then materialize every partition of `sweep` and `sweep_results`."""
    with failing_on_config_errors():
        swept = [Swept(f.field, list(f.values), list(f.choices), f.low, f.high, f.log) for f in config.fields]
        points = expand(swept, config.mode, config.samples, config.seed, "sweep_grid")
        plans = {p.key: point_plan(config, p, tokenizer["n_vocab"]) for p in points}
        optims = {p.key: point_optim(config, p) for p in points}
    value = {"points": [p.to_dict() for p in points], "plans": plans, "optims": optims,
             "fields": [f.field for f in config.fields], "eval_batches": config.eval_batches, "seed": config.train_seed,
             "train_files": token_shards["train"], "val_files": token_shards["val"], "tokenizer": tokenizer["path"],
             "inputs": {"token_shards": token_shards["version"], "tokenizer": tokenizer["version"]}}
    value["version"] = stable_hash(value)[:16]
    new = add_new_partitions(context.instance, SWEEP_POINTS, [p.key for p in points])
    context.log.info(f"sweep_grid: {len(points)} points ({len(new)} new partitions of sweep)")
    with asset_output(context, mlflow, params={"points": len(points), "mode": config.mode}) as out:
        rows = [{"point": p.key, **p.values, "params": plans[p.key]["params"], "steps": plans[p.key]["max_steps"],
                 "tokens": plans[p.key]["tokens_per_step"] * plans[p.key]["max_steps"]} for p in points]
        return out.result(value, {"points": len(points), "new_partitions": len(new), "grid": md_table(rows),
                                  "next": "materialize every partition of sweep (kiln sweep --preset P runs them), then sweep_results"},
                          version=value["version"])


def point_file(storage: KilnStorageResource, grid_version: str, key: str) -> Path:
    """Where a point's result is kept for sweep_results: under the grid's version (a changed base run is another grid)."""
    return storage.path("sweep", "points", grid_version) / (stable_hash(key)[:16] + ".json")


def point_spec(grid: dict, key: str) -> RunSpec:
    plan = grid["plans"][key]
    steps = plan["max_steps"]
    fields = {"optim": grid["optims"][key], "train_files": grid["train_files"], "val_files": grid["val_files"],
              "max_steps": steps, "eval_interval": max(1, steps // 4), "eval_batches": grid["eval_batches"],
              "ckpt_interval": steps, "keep_last": 1, "seed": grid["seed"]}
    return RunSpec("pretrain", fields, plan, dict(grid["inputs"]), grid["tokenizer"])


@asset(partitions_def=sweep_partitions, code_version="1", group_name="decisions")
def sweep(context: AssetExecutionContext, sweep_grid: dict, storage: KilnStorageResource, torchrun: TorchrunResource,
          mlflow: MlflowResource) -> Output[dict]:
    """One point of the sweep (this partition's key names its field values): a short pretraining run through the normal trainer and torchrun, its final validation loss and loss curve; a rerun with the same grid and inputs reuses the finished run."""
    key = context.partition_key
    points = {p["key"]: p for p in sweep_grid["points"]}
    if key not in points:
        raise Failure(f"sweep: partition {key!r} is not a point of the current grid ({len(points)} points, version "
                      f"{sweep_grid['version']}); rematerialize sweep_grid with the sweep that has it, or pick one of "
                      f"{', '.join(sorted(points)[:8])}")
    spec = point_spec(sweep_grid, key)
    with torchrun.training_run(context, spec, storage, mlflow) as job:
        if job.reused is not None:
            output = job.reused
            result = output.value
        else:
            result = job.launch()
            output = job.output(report_metadata(pretrain_report(result, job.out_dir), job.run),
                                point=points[key]["values"], grid=sweep_grid["version"])
            result = output.value
    record = {"key": key, "values": points[key]["values"], "final_val_loss": result["final_val_loss"],
              "initial_val_loss": result["initial_val_loss"], "steps": result["steps"], "tokens": result["tokens"],
              "wall_s": result["wall_s"], "params": result.get("params"), "out_dir": result["out_dir"],
              "mlflow_run_id": result.get("mlflow_run_id"), "curve": [(h["step"], h["val_loss"]) for h in
                                                                         result.get("history", []) if h.get("val_loss") is not None],
              "reused": job.reused is not None}
    atomic_write_json(point_file(storage, sweep_grid["version"], key), record)
    return output


@asset(code_version="1", group_name="decisions", deps=[sweep])
def sweep_results(context: AssetExecutionContext, sweep_grid: dict, storage: KilnStorageResource,
                  mlflow: MlflowResource) -> Output[dict]:
    """Every point of the sweep ranked by final validation loss: the table, the loss against each swept field, the best point (training_plan takes it with from_sweep: true), and an MLflow parent run with a child run per point."""
    rows = point_records({p["key"]: point_file(storage, sweep_grid["version"], p["key"]) for p in sweep_grid["points"]},
                         "sweep_results", "sweep", "kiln sweep --preset P")
    order = ranked([dict(r) for r in rows])
    best = order[0]
    if best["rank"] is None:
        raise Failure(f"sweep_results: every point diverged ({', '.join(r['key'] for r in rows)}); lower the "
                      "learning rates swept")
    value = {"best": {"key": best["key"], "values": best["values"], "final_val_loss": best["final_val_loss"]},
             "rows": [{k: r[k] for k in ("key", "values", "final_val_loss", "rank")} for r in order],
             "grid": sweep_grid["version"]}
    value["version"] = stable_hash(value)[:16]
    with asset_output(context, mlflow, inputs={"sweep_grid": sweep_grid}, reuse={"rows": value["rows"]},
                      parent=storage.path("sweep_results")) as out:
        if out.reused:
            return out.reused
        for r in order:  # one child run per point under this asset's run: the MLflow UI's sweep view
            log_child_run(out, r["key"], "sweep_point", r["values"], {"final_val_loss": r["final_val_loss"]},
                          r.get("curve", []), {"kiln.trial_run_id": str(r.get("mlflow_run_id"))})
        out.log_metrics({"best_final_val_loss": best["final_val_loss"]})
        table = [{"rank": r["rank"] or "-", "point": r["key"], "final_val_loss": r["final_val_loss"],
                  "steps": r["steps"], "wall_s": round(r["wall_s"], 1), "reused": r["reused"],
                  **({"note": r["note"]} if r.get("note") else {})} for r in order]
        plots = {}
        for path, xy in marginals([{"values": r["values"]} for r in rows], [r["final_val_loss"] for r in rows]).items():
            plots[f"loss_vs_{path.replace('.', '_')}"] = line_plot({"best loss at this value": xy}, f"final val loss vs {path}",
                                                                   path, "final val loss", save_to=out.stage / f"{path}.png")
            out.log_artifact(out.stage / f"{path}.png")
        curves = line_plot({r["key"]: r["curve"] for r in order[:8] if r.get("curve")}, "validation loss of the best points",
                           "step", "val loss", save_to=out.stage / "curves.png")
        value["plots"] = str(out.commit())  # the PNGs' folder (content-addressed: not in the version)
        return out.result(value, {"points": len(rows), "best_point": best["key"], "best_final_val_loss": best["final_val_loss"],
                                  "results": md_table(table), **plots, "val_curves": curves,
                                  "total_wall_s": round(sum(r["wall_s"] for r in rows), 1),
                                  "reused_points": sum(bool(r["reused"]) for r in rows)}, version=value["version"])


# -- the scaling ladder

class ScalingLadderConfig(KilnConfig):
    model_preset: str = Field(default="demo", description="The named size whose shape (family, depth, heads) the ladder's models share, at smaller widths.")
    model: ModelOverrides = Field(default=ModelOverrides(family="llama"), description="Family and fields overriding the named size (the width is the ladder's).")
    widths: Annotated[list[int], Domain(1)] = Field(default=[16, 24, 32, 48, 64, 80, 96], description="n_embd of the ladder's models (at least three; the demo's vocabulary makes these 0.08M to 0.80M parameters). A width a budget gives too few or too many steps is left out of that budget.")
    budgets: Annotated[list[float], Domain(0, low_open=True)] = Field(default=[1e12, 2.5e12, 6e12], description="Compute budgets in training FLOPs (the planner's count): one IsoFLOP profile each; every width trains the steps its budget buys.")
    batch: Batch = Field(default_factory=Batch, description="Sequence length and global batch of every rung (the demo's by default); max_steps is the budget's.")
    optim: Optim = Field(default_factory=Optim, description="The recipe every rung trains with (the pretraining recipe by default).")
    min_steps: Annotated[int, Domain(1)] = Field(default=100, description="A rung its budget gives fewer steps is left out (too short for the schedule).")
    max_epochs: Annotated[float, Domain(0, low_open=True)] = Field(default=4.0, description="A rung that would read the training split more often than this is left out (repeated tokens do not follow the law).")
    eval_batches: Annotated[int, Domain(1)] = Field(default=16, description="Validation batches behind each rung's final loss.")
    bootstrap: Annotated[int, Domain(1)] = Field(default=200, description="Bootstrap resamples behind the law's intervals.")
    seed: Annotated[int, Domain(0)] = Field(default=1337, description="Training seed of every rung.")


def ladder_plan(config: ScalingLadderConfig, rung: kladder.Rung, n_vocab: int) -> dict[str, Any]:
    from kiln.plan.memory import plan_from_config

    batch = {**config.batch.to_dict(), "max_steps": rung.steps}
    made, _, bc, hw = plan_from_config(n_vocab, "", rung.model, batch, {}, {}, "scaling_ladder")
    return {**made.to_dict(), "hardware": hw.__dict__, "max_steps": bc.max_steps}


def ladder_design(config: ScalingLadderConfig, n_vocab: int, train_tokens: int) -> tuple[dict, list, list]:
    """The ladder's shape (the preset's fields under the configured model's), its rungs (kiln.scaling.ladder.design:
    each budget at each width that fits ``max_epochs`` over the ``train_tokens``) and the rungs skipped, with why."""
    from kiln.model.config import preset_fields

    family = config.model.to_dict().get("family", "gpt2")
    try:
        base = {**(preset_fields(config.model_preset, family) if config.model_preset else {}), **config.model.to_dict()}
    except ValueError as e:
        raise ConfigError(f"scaling_ladder: {e}") from e
    bc = config.batch
    rungs, skipped = kladder.design(base, config.widths, config.budgets, n_vocab, bc.seq_len,
                                    bc.global_batch * bc.seq_len, config.min_steps, config.max_epochs * train_tokens)
    return base, rungs, skipped


def isoflop_plot(rows: list[dict], path: Path):
    """The IsoFLOP profiles (final validation loss against parameters, one line per budget), saved to ``path``."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        series.setdefault(f"{r['budget']:.2g} FLOPs", []).append((r["params"], r["loss"]))
    return line_plot({k: sorted(v) for k, v in series.items()}, "IsoFLOP profiles: final val loss vs parameters",
                     "parameters", "final val loss", save_to=path)


@asset(code_version="1", group_name="decisions")
def scaling_ladder(context: AssetExecutionContext, config: ScalingLadderConfig, tokenizer: dict, token_shards: dict,
                   storage: KilnStorageResource, torchrun: TorchrunResource, mlflow: MlflowResource) -> Output[dict]:
    """Small models of the planned shape trained at a few compute budgets with the pretraining recipe (IsoFLOP profiles), and Chinchilla's fits to their losses: approach 2 (each budget's best size, and how it grows with compute) and approach 3 (L(N, D) = E + A/N^alpha + B/D^beta by Huber loss, with bootstrap intervals); training_plan predicts its run's loss with the law, and can take its size from it (sizing: law)."""
    n_vocab = tokenizer["n_vocab"]
    bc = config.batch
    tokens_per_step = bc.global_batch * bc.seq_len
    with failing_on_config_errors():
        base, rungs, skipped = ladder_design(config, n_vocab, token_shards["totals"]["train"]["tokens"])
        plans = [ladder_plan(config, r, n_vocab) for r in rungs]
    inputs = {"token_shards": token_shards["version"], "tokenizer": tokenizer["version"]}
    with asset_output(context, mlflow, config=config, inputs={"token_shards": token_shards, "tokenizer": tokenizer},
                      parent=storage.path("scaling_ladder", "report")) as out:
        if out.reused:
            return out.reused
        start = time.time()
        rows = [train_rung(context, out, i, len(rungs), rung, plan, config, inputs, token_shards, tokenizer, storage,
                           torchrun) for i, (rung, plan) in enumerate(zip(rungs, plans))]
        fits = kladder.summarize(rows, config.bootstrap, seed=0)
        law, iso = fits["law"], fits["isoflop"]
        value = {"rows": rows, "law": law, "isoflop": iso, "skipped": skipped, "shape": base,
                 "seq_len": bc.seq_len, "tokens_per_step": tokens_per_step, "n_vocab": n_vocab}
        value["version"] = stable_hash({k: v for k, v in value.items() if k != "rows"} | {
            "losses": [(r["rung"], r["loss"]) for r in rows]})[:16]
        plot = isoflop_plot(rows, out.stage / "isoflop.png")
        out.log_artifact(out.stage / "isoflop.png")
        if "error" not in law:
            out.log_metrics({f"law_{k}": law[k] for k in ("E", "A", "B", "alpha", "beta") if isinstance(law.get(k), (int, float))})
        out.commit()
        meta = {**ladder_metadata(rows, skipped, law, iso), "isoflop_profiles": plot, "wall_s": round(time.time() - start, 1)}
        return out.result(value, meta, version=value["version"])


def law_table(law: dict[str, Any], chinchilla: dict[str, float]) -> list[dict[str, Any]]:
    """The fitted coefficients beside their bootstrap intervals and Chinchilla's; [] when the fit failed."""
    if "error" in law:
        return []
    iv = law.get("intervals") or {}
    return [{"coefficient": k, "fitted": law[k], "low": (iv.get(k) or [None, None])[0],
             "high": (iv.get(k) or [None, None])[1], "chinchilla": chinchilla[k]} for k in ("E", "A", "B", "alpha", "beta")]


def train_rung(context, out, i: int, n: int, rung: kladder.Rung, plan: dict, config: ScalingLadderConfig, inputs: dict,
               token_shards: dict, tokenizer: dict, storage: KilnStorageResource, torchrun: TorchrunResource) -> dict:
    """One rung trained through torchrun (a child MLflow run of the ladder's ``out`` run), or its finished run folder
    reused after checking it (``finished``); its row of the ladder."""
    fields = {"optim": config.optim.to_dict(), "train_files": token_shards["train"], "val_files": token_shards["val"],
              "max_steps": rung.steps, "eval_interval": rung.steps, "eval_batches": config.eval_batches,
              "ckpt_interval": rung.steps, "keep_last": 1, "seed": config.seed}
    spec = RunSpec("pretrain", fields, plan, inputs, tokenizer["path"], root=str(storage.local_base()))
    run_dir = storage.path("scaling_ladder", spec.key)
    result = finished(run_dir, rung.steps)
    reused = result is not None
    if result is None:
        context.log.info(f"scaling_ladder: rung {i + 1}/{n} {rung.name}: {rung.params:,} parameters, "
                         f"{rung.steps} steps ({rung.tokens:,} tokens) at {rung.budget:.3g} FLOPs")
        client = out.run.client
        child = client.create_run(out.run.experiment_id, tags={"mlflow.parentRunId": out.run_id,
                                                               "mlflow.runName": rung.name, "kiln.kind": "ladder_rung"})
        job = spec.job(run_dir, out.tracking_uri, child.info.run_id)
        try:
            result = torchrun.launch(context, job, plan["hardware"]["nproc_per_node"], plan["hardware"]["device"])
            client.set_terminated(child.info.run_id, "FINISHED")
        except BaseException:
            client.set_terminated(child.info.run_id, "FAILED")
            raise
    return {"rung": rung.name, "budget": rung.budget, "width": rung.width, "params": rung.params, "tokens": rung.tokens,
            "steps": rung.steps, "flops": rung.flops, "loss": result["final_val_loss"],
            "wall_s": round(result["wall_s"], 1), "reused": reused, "run_dir": str(run_dir)}


def ladder_metadata(rows: list[dict], skipped: list[dict], law: dict, iso: dict) -> dict[str, Any]:
    """The ladder's metadata: its runs, those left out, both fits (or why not), the law's residuals."""
    from kiln.scaling.law import CHINCHILLA

    law_rows = law_table(law, CHINCHILLA)
    meta = {"rungs": len(rows), "reused_rungs": sum(r["reused"] for r in rows),
            "train_wall_s": round(sum(r["wall_s"] for r in rows if not r["reused"]), 1),
            "ladder": md_table([{k: r[k] for k in ("rung", "budget", "params", "tokens", "steps", "loss", "reused")}
                                for r in rows]),
            "left_out": md_table(skipped) if skipped else "none",
            "law": md_table(law_rows) if law_rows else MetadataValue.md(f"**no fit**: {law.get('error')}"),
            "isoflop_fit": md_table([{k: b[k] for k in ("flops", "usable", "why", "params_opt", "tokens_opt", "loss_opt")}
                                     for b in iso["budgets"]]) if "error" not in iso else MetadataValue.md(f"**no fit**: {iso['error']}"),
            "law_residuals": md_table([{k: r[k] for k in ("name", "params", "tokens", "loss", "predicted", "relative_error")}
                                       for r in law.get("residuals", [])]) if law.get("residuals") else "none"}
    if "error" not in iso:  # Chinchilla's approach 2 found 0.49 and 0.51
        meta["params_exponent_a"] = iso.get("a")
        meta["tokens_exponent_b"] = iso.get("b")
    if "error" not in law:
        meta["law_bootstrap_used"] = law.get("bootstrap_used")
    return meta
