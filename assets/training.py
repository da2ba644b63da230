"""Steps 4-7 as assets: the training plan and the base model (pretraining, or continued pretraining of an imported
model: a torchrun job through Pipes).

Materialize with the pipeline (``kiln run --preset smoke``); ``kiln plan --preset NAME`` shows the plan alone.
"""


from typing import Annotated, Optional

from dagster import AssetExecutionContext, Backoff, MetadataValue, Output, RetryPolicy, asset
from pydantic import Field

from assets._common import asset_output, failing_on_config_errors, md_table, report_metadata
from assets._config import KilnConfig, schema_of
from assets.pretrained import recorded_start, start_of
from kiln.common.config import ConfigError, Domain
from kiln.model.config import ModelConfig, preset_fields
from kiln.plan.layout import LayoutRequest
from kiln.plan.memory import PREDICTIONS, BatchConfig, HardwareConfig, ParallelConfig, plan_version
from kiln.plan.planner import Planned, plan_training
from kiln.train.job import JobConfig
from kiln.train.launch import RunSpec, describe_sizes, pretrain_report
from kiln.model.lora import LoRAConfig
from kiln.train.optim import PRETRAIN_OPTIM, OptimConfig
from kiln.train.spikes import SpikeConfig
from resources.storage import KilnStorageResource
from resources.torchrun import TorchrunResource
from resources.tracking import MlflowResource

# A failed launch is retried: the run folder is keyed by the inputs, so the retry resumes from the newest good
# checkpoint (torchrun's own restarts cover a worker that dies; this covers the launch itself failing). A config
# error is not retried (failing_on_config_errors), nor a full disk (resources.torchrun.full_disk_failure: the job
# stops without a torchrun restart either).
TRAINING_RETRY = RetryPolicy(max_retries=2, delay=5, backoff=Backoff.EXPONENTIAL)


ModelOverrides = schema_of(ModelConfig, optional=True, name="ModelOverrides")
Batch = schema_of(BatchConfig, name="Batch")
Hardware = schema_of(HardwareConfig, name="Hardware")
Parallel = schema_of(ParallelConfig, name="Parallel")
LayoutBlock = schema_of(LayoutRequest, name="LayoutRequest")
Optim = schema_of(OptimConfig, defaults=PRETRAIN_OPTIM, name="Optim")
Spikes = schema_of(SpikeConfig, name="Spikes")
Lora = schema_of(LoRAConfig, name="Lora")  # the adapters of any training stage (alignment's and RLHF's too)


class TrainingPlanConfig(KilnConfig):
    model_preset: str = Field(default="", description="Named size of the model's family from kiln.model.config.MODEL_PRESETS (gpt2: tiny, demo, gpt2, gpt2-medium, gpt2-large, gpt2-xl; llama: tiny, demo, 125m, smollm-135m, llama3.2-1b); `model` overrides its fields.")
    model: ModelOverrides = Field(default_factory=ModelOverrides, description="The family (`family: llama`; gpt2 when unset) and fields overriding its named size (or the ModelConfig defaults); vocab_size comes from the tokenizer. A field another family uses is an error.")
    batch: Batch = Field(default_factory=Batch, description="The token budget: sequence length, global batch, steps.")
    hardware: Hardware = Field(default_factory=Hardware, description="Where it trains: device, processes, nodes, memory.")
    parallel: Parallel = Field(default_factory=Parallel, description="How it is spread over the ranks: DDP or FSDP2, activation checkpointing, compile, and bf16 autocast on CPU.")
    layout: Optional[LayoutBlock] = Field(default=None, description="Plan tensor, pipeline and data parallelism for the hardware block's GPUs over these links (kiln.plan.layout): base_model trains the fastest layout that fits, `kiln plan` explains the choice. Unset: data parallelism alone.")
    from_sweep: bool = Field(default=False, description="Train the best point of sweep_results: its model, batch and optim fields replace these (and base_model's optim).")
    sizing: str = Field(default="preset", description="preset: the configured model and steps; law: the width and steps the scaling_ladder's fitted law finds compute-optimal for compute_budget (the model keeps the configured shape: family, depth, heads).")
    compute_budget: Annotated[float, Domain(0)] = Field(default=0.0, description="sizing: law: the training FLOPs to spend; 0 is what the configured model and steps would spend.")

    def planned(self, n_vocab: int, pretrained: dict | None = None) -> Planned:
        """kiln.plan.planner.plan_training of these fields (the asset, ``kiln plan``, the sweep's points and the
        preflight all call it); with an imported ``pretrained`` model its architecture replaces model_preset and
        model (only dropout may be set)."""
        preset, model = self.model_preset, self.model.to_dict()
        if pretrained and pretrained.get("path"):
            if preset or set(model) - {"dropout"}:
                raise ConfigError(f"training_plan.model_preset / training_plan.model: the architecture comes from "
                                  f"pretrained_model.path ({pretrained['path']}); remove them (model.dropout may stay)")
            preset, model = "", {**pretrained["model"], **model}
        return plan_training(n_vocab, preset, model, self.batch.to_dict(), self.hardware.to_dict(),
                             self.parallel.to_dict(), self.layout.to_dict() if self.layout is not None else None)


def decided(config: TrainingPlanConfig, n_vocab: int, pretrained: dict | None, sweep_results: dict | None,
            scaling_ladder: dict | None) -> tuple[TrainingPlanConfig, dict]:
    """The config training_plan plans (the best sweep point's fields with from_sweep, the law's width and steps
    with sizing: law) and what the plan records about where they came from."""
    from kiln.scaling.ladder import law_of, size_for
    from kiln.scaling.sweep import overrides

    notes: dict = {}
    if config.sizing not in ("preset", "law"):
        raise ConfigError(f"training_plan.sizing: {config.sizing!r}; choose preset or law")
    if (config.from_sweep or config.sizing == "law") and (config.layout is not None or (pretrained or {}).get("path")):
        raise ConfigError("training_plan.from_sweep / training_plan.sizing: law size a model trained from scratch on "
                          "the data-parallel planner; unset them with a layout block or an imported pretrained model")
    model, batch = config.model.to_dict(), config.batch.to_dict()
    if config.from_sweep:
        if not sweep_results:
            raise ConfigError("training_plan.from_sweep: no sweep_results in this home; run the sweep first "
                              "(kiln sweep --preset P) or set from_sweep: false")
        ov = overrides(sweep_results["best"])
        model, batch = {**model, **ov["model"]}, {**batch, **ov["batch"]}
        notes["sweep"] = {"point": sweep_results["best"]["key"], "final_val_loss": sweep_results["best"]["final_val_loss"],
                          "sweep_results": sweep_results["version"]}
        notes["optim_overrides"] = ov["optim"]
    config = config.model_copy(update={"model": ModelOverrides(**model), "batch": Batch(**batch)})
    if config.sizing == "law":
        law = law_of(scaling_ladder)  # a ConfigError when there is no ladder or its law did not fit
        planned = config.planned(n_vocab)
        made, bc = planned.single, planned.batch
        budget = config.compute_budget or made.total_flops
        shape = {**({} if not config.model_preset else preset_fields(config.model_preset, model.get("family", "gpt2"))),
                 **model}
        sized = size_for(law.optimal, budget, shape, n_vocab, bc.seq_len, made.tokens_per_step)
        model = {**model, "n_embd": sized["width"]}
        model.pop("intermediate_size", None)  # follows the width
        config = config.model_copy(update={"model": ModelOverrides(**model),
                                           "batch": Batch(**{**batch, "max_steps": sized["steps"]})})
        notes["sized_by_law"] = sized
    return config, notes


def prediction(plan: dict, scaling_ladder: dict | None, sizing: str) -> dict | None:
    """What the ladder's law says this plan's run will reach (final validation loss, with its bootstrap interval),
    and the ladder it came from; None without a fitted ladder."""
    from kiln.scaling.ladder import law_of
    from kiln.scaling.law import FitError

    if not scaling_ladder or "error" in scaling_ladder.get("law", {"error": ""}):
        return None
    law = law_of(scaling_ladder)
    n, d = plan["params"], plan["total_tokens"]
    low, high = law.interval(n, d)
    try:  # the law's compute-optimal split of this run's budget (C = 6ND, as compute_optimal's fixed ratio counts)
        opt_n, opt_d = law.optimal(6.0 * n * d)
        optimal = {"params": opt_n, "tokens": opt_d}
    except FitError as e:
        optimal = {"error": str(e)}
    return {"ladder": scaling_ladder["version"], "sizing": sizing, "params": n, "tokens": d, "optimal": optimal,
            "predicted_val_loss": law.predict(n, d), "interval": [low, high],
            "law": {k: scaling_ladder["law"][k] for k in ("E", "A", "B", "alpha", "beta")},
            "intervals": scaling_ladder["law"].get("intervals"),
            "rungs": [{k: r[k] for k in ("rung", "budget", "params", "tokens", "loss")} for r in scaling_ladder["rows"]]}


@asset(code_version="3", group_name="training")
def training_plan(context: AssetExecutionContext, config: TrainingPlanConfig, tokenizer: dict, token_shards: dict,
                  mlflow: MlflowResource, pretrained_model: Optional[dict] = None, sweep_results: Optional[dict] = None,
                  scaling_ladder: Optional[dict] = None) -> Output[dict]:
    """Model size, memory per rank, parallelism (DDP or FSDP2; with a layout block, tensor and pipeline parallelism too), activation checkpointing, micro-batch and gradient accumulation for the configured hardware and token budget; with an imported pretrained model, its architecture and the checkpoint base_model starts from; the best sweep point (from_sweep) or the scaling ladder's compute-optimal size (sizing: law) when asked, and the ladder's prediction of the run's loss when a ladder was fitted."""
    with failing_on_config_errors():
        config, notes = decided(config, tokenizer["n_vocab"], pretrained_model, sweep_results, scaling_ladder)
        record = config.planned(tokenizer["n_vocab"], pretrained_model).record().with_(**notes)
        if config.sizing == "law":  # (a preset-sized plan keeps the keys it always had: its version is unchanged)
            sized = notes["sized_by_law"]
            record = record.with_(sizing=(
                f"law: the scaling ladder's compute-optimal size for {sized['budget_flops']:.3g} FLOPs "
                f"(N_opt {sized['optimal_params']:,.0f}, D_opt {sized['optimal_tokens']:,.0f}): width "
                f"{sized['width']}, {sized['params']:,} parameters, {sized['steps']} steps"))
        record = record.with_(scaling=prediction(record.to_dict(), scaling_ladder, config.sizing))
    if pretrained_model and pretrained_model["path"]:  # base_model continues from these weights
        record = record.with_(pretrained=start_of(pretrained_model))
    record = record.with_(epochs=record.total_tokens / max(token_shards["totals"]["train"]["tokens"], 1))
    plan = record.to_dict()
    context.log.info(f"plan: {plan['reason']}")
    with asset_output(context, mlflow, params=plan, reuse={"plan": plan}) as out:
        if out.reused:
            return out.reused
        out.log_metrics({"params": plan["params"], "memory_gb": plan["memory_gb"]["total"]})
        return out.result(plan, plan_metadata(plan), version=plan_version(plan))


def plan_metadata(plan: dict) -> dict:
    """What the training_plan asset shows: sizes, parallelism, batch, memory, the options considered, cost, and the
    sweep point or the ladder's prediction the plan came with."""
    scaling = plan.get("scaling")
    return {
        "parameters": plan["params"], "parameters_non_embedding": plan["params_non_embedding"],
        "parallelism": plan["parallelism"], "activation_checkpointing": plan["activation_checkpointing"],
        **({"layout": describe_sizes(plan["layout"])} if plan.get("layout") else {}),
        **({"pipeline": f"{plan['pipeline']['schedule']}, {plan['pipeline']['virtual_stages']} stage(s) per rank, "
                        f"{plan['grad_accum']} micro-batches"} if plan.get("pipeline") else {}),
        "compile": plan["compile"], "cpu_bf16_autocast": bool(plan.get("cpu_bf16")), "why": plan["reason"],
        "world_size": plan["world_size"],
        "micro_batch": plan["micro_batch"], "grad_accum": plan["grad_accum"], "global_batch": plan["global_batch"],
        "tokens_per_step": plan["tokens_per_step"], "total_tokens": plan["total_tokens"],
        "tokens_per_parameter": round(plan["tokens_per_param"], 3), "epochs_over_train_split": round(plan["epochs"], 3),
        "memory_gb_per_rank": md_table([{"part": k, "GiB": v} for k, v in plan["memory_gb"].items()]),
        "options_considered": md_table(plan["alternatives"]),
        "device_memory_gb": plan["device_memory_gb"], "estimated_flops": plan["total_flops"],
        "peak_tflops_per_device": plan["peak_tflops"],
        "estimated_hours": float(f"{plan['est_hours']:.4g}"), "model": MetadataValue.json(plan["model"]),
        **plan_cost_metadata(plan),
        "sizing": plan.get("sizing", "preset: the configured model and steps (compute_optimal_* beside it use "
                                     "Chinchilla's ~20 tokens per parameter)"),
        **({"sweep_point": plan["sweep"]["point"], "sweep_point_val_loss": plan["sweep"]["final_val_loss"]}
           if plan.get("sweep") else {}),
        **(prediction_metadata(scaling) if scaling else {}),
    }


def prediction_metadata(scaling: dict) -> dict:
    """The scaling ladder's prediction of the run's loss (``prediction``), as the training_plan asset shows it."""
    low, high = scaling["interval"]
    return {"predicted_val_loss": round(scaling["predicted_val_loss"], 4),
            "predicted_val_loss_interval": f"{low:.4f} .. {high:.4f}",
            "predicted_by": f"scaling_ladder {scaling['ladder']}",
            **({"law_optimal_params": int(scaling["optimal"]["params"]),
                "law_optimal_tokens": int(scaling["optimal"]["tokens"])} if "params" in scaling["optimal"] else {})}


def plan_cost_metadata(plan: dict) -> dict:
    """Planned device-hours, energy and money (conf/cost.yaml) and the distance from Chinchilla's compute-optimal size."""
    from kiln.plan.cost import compute_optimal, load_cost, planned_costs

    cost = planned_costs(plan, load_cost(plan["hardware"]["device"]))
    opt = compute_optimal(plan["params"], plan["total_tokens"])
    return {"planned_device_hours": cost["device_hours"], "planned_energy_kwh_estimate": cost["energy_kwh"],
            f"planned_cost_{cost['currency'].lower()}": cost["cost"], "compute_optimal_params": opt["optimal_params"],
            "compute_optimal_tokens": opt["optimal_tokens"], "params_vs_compute_optimal": round(opt["params_ratio"], 3),
            "tokens_vs_compute_optimal": round(opt["tokens_ratio"], 3)}


PRETRAIN_FIELDS = ("eval_interval", "eval_batches", "ckpt_interval", "keep_last", "keep_every", "async_save",
                   "log_interval", "seed", "document_mask")  # kiln.train.job.JobConfig fields base_model sets: their defaults live there


class BaseModelConfig(schema_of(JobConfig, include=PRETRAIN_FIELDS, name="PretrainJobFields")):
    optim: Optim = Field(default_factory=Optim, description="Optimizer (Muon on the blocks' matrices with AdamW on the rest, or AdamW alone) and its schedule: peak lrs, warmup, warmup-stable-decay or cosine, floor, decay, clipping.")
    spikes: Spikes = Field(default_factory=Spikes, description="Loss-spike detection and rollback to an earlier checkpoint.")
    lora: Lora = Field(default_factory=Lora, description="Continued pretraining of imported weights only: {enabled: true} trains adapters (merged into the saved weights), {enabled: true, quantize: nf4} on a 4-bit frozen base (QLoRA); off: every weight trains.")


@asset(code_version="2", group_name="training", retry_policy=TRAINING_RETRY)
def base_model(context: AssetExecutionContext, config: BaseModelConfig, training_plan: dict, token_shards: dict,
               tokenizer: dict, storage: KilnStorageResource, torchrun: TorchrunResource, mlflow: MlflowResource) -> Output[dict]:
    """The pretrained model (GPT-2 or llama family, as the plan says): a torchrun job (Muon and AdamW, warmup-stable-decay, clipping, validation, background checkpoints, loss-spike rollback) from random weights, or continued pretraining of the imported pretrained model; it resumes from its newest good checkpoint after a crash, a retry or a rematerialization; every kept checkpoint is listed for evaluation."""
    with failing_on_config_errors():
        fields = {**config.job_fields(), "train_files": token_shards["train"], "val_files": token_shards["val"],
                  "max_steps": training_plan["max_steps"]}
        if not fields.get("lora"):  # adapters off: the job every run without them had (its run key unchanged)
            fields.pop("lora", None)
        if training_plan.get("optim_overrides"):  # the best sweep point's optimizer fields (from_sweep)
            fields["optim"] = {**fields.get("optim", {}), **training_plan["optim_overrides"]}
        predicted = training_plan.get("scaling")
        training_plan = {k: v for k, v in training_plan.items() if k not in PREDICTIONS}
        inputs = {"token_shards": token_shards["version"], "tokenizer": tokenizer["version"]}
        start = training_plan.get("pretrained")  # continued pretraining: the imported weights (in the plan's key)
        extra = {"pretrained": recorded_start(start)} if start else {}
        if start:
            fields["init_from"] = start["checkpoint"]
        spec = RunSpec("pretrain", fields, training_plan, inputs, tokenizer["path"])
        with torchrun.training_run(context, spec, storage, mlflow) as job:
            if job.reused is not None:
                return job.reused
            result = job.launch()
            meta = report_metadata(pretrain_report(result, job.out_dir), job.run)
            if predicted:  # the scaling ladder's prediction beside what the run reached
                err = result["final_val_loss"] / predicted["predicted_val_loss"] - 1
                meta.update({"predicted_val_loss": round(predicted["predicted_val_loss"], 4),
                             "prediction_error": f"{err:+.2%} (measured {result['final_val_loss']:.4f}; interval "
                                                 f"{predicted['interval'][0]:.4f} .. {predicted['interval'][1]:.4f})"})
            return job.output(meta, **extra)
