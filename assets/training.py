"""Steps 4-7 as assets: the training plan and the pretrained base model (a torchrun job through Pipes)."""


from typing import Any

from dagster import AssetExecutionContext, Backoff, Config, MetadataValue, Output, RetryPolicy, asset
from pydantic import Field

from assets._common import md_table, mlflow_meta, report_metadata
from kiln.common.files import stable_hash
from kiln.plan import plan_from_config
from kiln.train.launch import RunSpec, pretrain_report
from resources.storage import KilnStorageResource
from resources.torchrun import TorchrunResource
from resources.tracking import MlflowResource

# A failed launch is retried: the run folder is keyed by the inputs, so the retry resumes from the newest good
# checkpoint (torchrun's own restarts cover a worker that dies; this covers the launch itself failing).
TRAINING_RETRY = RetryPolicy(max_retries=2, delay=5, backoff=Backoff.EXPONENTIAL)


class TrainingPlanConfig(Config):
    model_preset: str = Field(default="", description="Named size from kiln.model.gpt.MODEL_PRESETS (tiny, demo, gpt2, gpt2-medium, gpt2-large, gpt2-xl); `model` overrides its fields.")
    model: dict[str, Any] = Field(default_factory=dict, description="kiln.model.gpt.GPTConfig fields (vocab_size comes from the tokenizer).")
    batch: dict[str, Any] = Field(default_factory=dict, description="kiln.plan.BatchConfig fields: seq_len, global_batch, micro_batch, max_steps.")
    hardware: dict[str, Any] = Field(default_factory=dict, description="kiln.plan.HardwareConfig fields: device, nproc_per_node, nnodes, memory_gb, peak_tflops.")
    parallel: dict[str, Any] = Field(default_factory=dict, description="kiln.plan.ParallelConfig fields: strategy (auto|ddp|fsdp), activation_checkpointing, compile.")


@asset(code_version="3", group_name="training")
def training_plan(context: AssetExecutionContext, config: TrainingPlanConfig, tokenizer: dict, token_shards: dict,
                  mlflow: MlflowResource) -> Output[dict]:
    """Model size, memory per rank, parallelism (DDP or FSDP2), activation checkpointing, micro-batch and gradient accumulation for the configured hardware and token budget."""
    made, _, batch, hw = plan_from_config(tokenizer["n_vocab"], config.model_preset, config.model, config.batch,
                                          config.hardware, config.parallel)
    plan = made.to_dict()
    plan["hardware"] = hw.__dict__
    plan["max_steps"] = batch.max_steps
    train_tokens = token_shards["totals"]["train"]["tokens"]
    plan["epochs"] = plan["total_tokens"] / max(train_tokens, 1)
    context.log.info(f"plan: {plan['reason']}")
    with mlflow.asset_run(context, params=plan, reuse={"plan": plan}) as run:
        if run.reused is not None:
            return run.reused
        run.log_metrics({"params": plan["params"], "memory_gb": plan["memory_gb"]["total"]})
        version = stable_hash(plan)[:16]
        return run.output(plan, version, {
            "parameters": plan["params"], "parameters_non_embedding": plan["params_non_embedding"],
            "parallelism": plan["parallelism"], "activation_checkpointing": plan["activation_checkpointing"],
            "compile": plan["compile"], "why": plan["reason"], "world_size": plan["world_size"],
            "micro_batch": plan["micro_batch"], "grad_accum": plan["grad_accum"], "global_batch": plan["global_batch"],
            "tokens_per_step": plan["tokens_per_step"], "total_tokens": plan["total_tokens"],
            "tokens_per_parameter": round(plan["tokens_per_param"], 3), "epochs_over_train_split": round(plan["epochs"], 3),
            "memory_gb_per_rank": md_table([{"part": k, "GiB": v} for k, v in plan["memory_gb"].items()]),
            "options_considered": md_table(plan["alternatives"]),
            "device_memory_gb": plan["device_memory_gb"], "estimated_flops": plan["total_flops"],
            "peak_tflops_per_device": plan["peak_tflops"],
            "estimated_hours": float(f"{plan['est_hours']:.4g}"), "model": MetadataValue.json(plan["model"]), **mlflow_meta(run),
        })


class BaseModelConfig(Config):
    optim: dict[str, Any] = Field(default_factory=dict, description="kiln.train.optim.OptimConfig fields: lr, warmup_steps, weight_decay, grad_clip ...")
    eval_interval: int = Field(default=100, description="Steps between validation-loss passes.")
    eval_batches: int = Field(default=16, description="Micro-batches per validation pass.")
    ckpt_interval: int = Field(default=200, description="Steps between checkpoints (the last step is always saved).")
    keep_last: int = Field(default=2, description="Newest checkpoints kept on disk.")
    keep_every: int = Field(default=0, description="Also keep every checkpoint whose step is a multiple of this (0: none).")
    async_save: bool = Field(default=True, description="Write checkpoints in the background while training continues.")
    spikes: dict[str, Any] = Field(default_factory=dict, description="kiln.train.spikes.SpikeConfig fields: thresholds, rollback_steps, skip_batches, max_rollbacks.")
    log_interval: int = Field(default=25, description="Steps between progress lines in the Dagster log.")
    seed: int = Field(default=1337, description="Seed for initial weights and data order.")


@asset(code_version="2", group_name="training", retry_policy=TRAINING_RETRY)
def base_model(context: AssetExecutionContext, config: BaseModelConfig, training_plan: dict, token_shards: dict,
               tokenizer: dict, storage: KilnStorageResource, torchrun: TorchrunResource, mlflow: MlflowResource) -> Output[dict]:
    """The pretrained GPT: a torchrun job (AdamW, warmup + cosine, clipping, validation, background checkpoints, loss-spike rollback) that resumes from its newest good checkpoint after a crash, a retry or a rematerialization; every kept checkpoint is listed for evaluation."""
    fields = {"optim": config.optim, "train_files": token_shards["train"], "val_files": token_shards["val"],
              "max_steps": training_plan["max_steps"], "eval_interval": config.eval_interval,
              "eval_batches": config.eval_batches, "ckpt_interval": config.ckpt_interval, "keep_last": config.keep_last,
              "keep_every": config.keep_every, "async_save": config.async_save, "spikes": config.spikes,
              "log_interval": config.log_interval, "seed": config.seed}
    spec = RunSpec("pretrain", fields, training_plan,
                   {"token_shards": token_shards["version"], "tokenizer": tokenizer["version"]}, tokenizer["path"])
    with torchrun.training_run(context, spec, storage, mlflow) as job:
        if job.reused is not None:
            return job.reused
        result = job.launch()
        return job.output(report_metadata(pretrain_report(result, job.out_dir), job.run))
