"""The job file of a training run: the fields every stage shares (TrainJob) and the pretraining/SFT job (JobConfig).

A job is a JSON file of these fields (unknown keys are errors); its nested blocks are typed (``job.model`` is a
ModelConfig, ``job.optim`` an OptimConfig, ``job.spikes`` a SpikeConfig, ``job.lora`` a LoRAConfig).
``load_job(cls, data, where)`` is the one validation: the torchrun resource calls it before launching and writes the
job it built as the job file (``job_file``: every field, with a ``checked`` digest of them); rank 0 rebuilds that job
from the file without checking it again (the digest says nothing changed since the check) and broadcasts it. A job
file written by hand, or edited after it was written, has no matching digest and is validated in full.
kiln.posttrain.common.PosttrainJob adds the DPO and RL fields. Run one with ``python -m kiln.train --config job.json``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, TypeVar

from kiln.common.config import ConfigError, Domain, check_domains, from_dict
from kiln.model.config import ModelConfig, model_dict
from kiln.model.lora import LoRAConfig
from kiln.model.parallel import MeshLayout
from kiln.model.pipeline_parallel import PipelineConfig
from kiln.train.optim import OptimConfig
from kiln.train.spikes import SpikeConfig

J = TypeVar("J", bound="TrainJob")

# job task -> the job class that reads its file ("module:Class"; kiln.train.entry.TASKS names the module that runs it)
JOB_CLASSES = {"pretrain": "kiln.train.job:JobConfig", "sft": "kiln.train.job:SftJob",
               "dpo": "kiln.posttrain.dpo:DpoJob", "rl": "kiln.posttrain.rl:RlJob",
               "reward": "kiln.posttrain.reward:RewardJob", "ppo": "kiln.posttrain.ppo:PpoJob"}


def job_class(task: str, where: str = "job") -> type[TrainJob]:
    """The job class of ``task``; an unknown task is a ConfigError that lists the known ones."""
    if task not in JOB_CLASSES:
        raise ConfigError(f"{where}.task: {task!r} is not a training task; choose one of {', '.join(JOB_CLASSES)}")
    module, name = JOB_CLASSES[task].split(":")
    return getattr(importlib.import_module(module), name)


CHECKED = "checked"  # the job file's key holding the digest of the fields load_job validated


def fields_digest(fields: dict[str, Any]) -> str:
    """sha256 of a job's fields as JSON with sorted keys."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def job_file(job: TrainJob) -> dict[str, Any]:
    """The job file of a validated job: every field (``asdict``) and their digest under ``checked``."""
    fields = json.loads(json.dumps(asdict(job), default=str))
    return {**fields, CHECKED: fields_digest(fields)}


def load_job(cls: type[J], data: dict[str, Any], where: str = "job") -> J:
    """``cls`` built from a job file's fields and checked as a whole: an unknown key, a bad value or two fields that
    do not go together is a ConfigError naming ``where.<key>``. The one place a job's config is validated: fields
    that carry the digest ``job_file`` gave them after this check (and still match it) are rebuilt, not checked
    again; a ``checked`` key that does not match is dropped and the fields are validated in full."""
    data = dict(data)
    digest = data.pop(CHECKED, None)
    if digest is not None and digest == fields_digest(data) and set(data) == {f.name for f in dataclasses.fields(cls)}:
        return from_dict(cls, data, where, check=False)
    try:
        job = from_dict(cls, data, where)
        job.check(where)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # a block's own __post_init__ check (ModelConfig, LoRAConfig, ...)
        raise ConfigError(f"{where}: {e}") from e
    return job


@dataclass
class TrainJob:
    """Fields every training job has; kiln.train.trainer.Trainer reads these and nothing else."""

    task: str = "pretrain"  # "pretrain", "sft", "dpo" or "rl": picks the stage (kiln.train.entry.TASKS)
    out_dir: str = ""  # run folder: checkpoints/, result.json, logbook.jsonl
    tokenizer: str = ""  # tokenizer.json copied into every checkpoint
    model: ModelConfig = field(default_factory=ModelConfig)  # the architecture and its size
    optim: OptimConfig = field(default_factory=OptimConfig)  # optimizer, learning rates and schedule
    train_files: list = field(default_factory=list)  # the stage's training data
    init_from: str = ""  # checkpoint whose weights start this run (fine-tuning)
    seq_len: Annotated[int, Domain(1)] = 256  # tokens per sequence
    micro_batch: Annotated[int, Domain(1)] = 8  # sequences per rank per forward
    grad_accum: Annotated[int, Domain(1)] = 1  # micro-batches per optimizer step
    max_steps: Annotated[int, Domain(1)] = 100  # optimizer steps
    parallelism: str = "auto"  # "auto" (ddp on several ranks), "none", "ddp" or "fsdp"; one rank always runs "none"
    # how the ranks split the model (kiln.model.parallel.MeshLayout): tp > 1 splits each layer over that many
    # neighbouring ranks (tensor + sequence parallelism), the data-parallel ranks left shard it with FSDP2
    layout: MeshLayout = field(default_factory=MeshLayout)
    # how the pipeline stages run when layout.pp > 1: the schedule, stages per rank, and the micro-batches a step's
    # micro_batch x grad_accum sequences are cut into (0: grad_accum of micro_batch sequences each)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    activation_checkpointing: bool = False  # recompute block activations in backward to save memory
    compile: bool = False  # torch.compile each block
    # on CPU, the forward and backward under bf16 autocast (matmuls in bf16; weights, gradients and optimizer state
    # stay fp32): fast where the CPU multiplies bf16 natively (AVX-512 BF16, AMX), slow where it emulates it (AVX2);
    # a Dagster launch sets it from the plan (kiln.plan.memory.cpu_bf16_choice)
    cpu_bf16: bool = False
    eval_interval: Annotated[int, Domain(1)] = 100  # steps between validation passes
    ckpt_interval: Annotated[int, Domain(1)] = 200  # steps between checkpoints (the last step is always saved)
    keep_last: Annotated[int, Domain(0)] = 2  # newest checkpoints kept on disk (0 keeps all)
    keep_every: Annotated[int, Domain(0)] = 0  # also keep every checkpoint whose step is a multiple of this (0: none)
    async_save: bool = True  # write checkpoints in the background while training continues
    spikes: SpikeConfig = field(default_factory=SpikeConfig)  # loss/gradient spike thresholds, rollback, skip
    log_interval: Annotated[int, Domain(1)] = 25  # steps between progress lines
    seed: Annotated[int, Domain(0)] = 1337  # seeds init, data order and dropout
    mlflow_tracking_uri: str = ""  # where rank 0 streams metrics
    mlflow_run_id: str = ""  # the MLflow run that receives them
    preempt_grace_s: Annotated[float, Domain(0)] = 30.0  # seconds a stop signal leaves to save (Slurm's KillWait, Kubernetes' grace period)
    system_metrics_s: Annotated[float, Domain(0)] = 10.0  # seconds between MLflow system-metric samples on rank 0 (CPU, memory, GPU; 0: off)
    peak_flops: Annotated[float, Domain()] = 0.0  # per-device peak FLOP/s for MFU; 0: GPU table, or a matmul measured on CPU; <0: no MFU

    def check(self, where: str = "job") -> None:
        """Every number inside its declared Domain (for a job made in code; from_dict checked them already), then
        fields that do not go together: ConfigError naming the key."""
        check_domains(self, where)
        lora = getattr(self, "lora", None)
        if lora is not None and lora.enabled and self.parallelism == "fsdp":
            raise ConfigError(f"{where}.parallelism is 'fsdp' but lora.enabled: a LoRA run replicates its model; "
                              "use 'ddp'")
        self.check_layout(where)

    def check_layout(self, where: str = "job", world_size: int | None = None) -> None:
        """A layout this job cannot train is a ConfigError naming ``where.layout.<field>``; with ``world_size``
        (the launcher knows it) the sizes must also multiply to it and suit the model (MeshLayout.resolve)."""
        lay = self.layout
        if lay == MeshLayout():
            return
        if lay.pp != 1:
            self.check_pipeline(where)
        if lay.dp_replicate != 1:
            raise ConfigError(f"{where}.layout.dp_replicate: {lay.dp_replicate}; the training job replicates "
                              "through parallelism: ddp (dp_replicate is 1: every data-parallel rank is in dp_shard)")
        if lay.tp > 1 and self.task not in ("pretrain", "sft"):
            raise ConfigError(f"{where}.layout.tp: {lay.tp}; tensor parallelism trains tasks pretrain and sft, "
                              f"not {self.task!r} (its reference and sampling models run whole): set layout.tp to 1")
        lora = getattr(self, "lora", None)
        if lay.tp > 1 and lora is not None and lora.enabled:
            raise ConfigError(f"{where}.layout.tp: {lay.tp} with lora.enabled: LoRA's adapters wrap whole layers; "
                              "set layout.tp to 1")
        if lay.tp > 1 and self.parallelism == "ddp":
            raise ConfigError(f"{where}.parallelism: 'ddp' with layout.tp {lay.tp}: the data-parallel ranks of a "
                              "tensor-parallel job shard its layers with FSDP2; set parallelism to 'fsdp' (or 'auto')")
        if world_size is not None:
            sizes = lay.resolve(world_size, self.model, f"{where}.layout")
            if sizes.pp > 1 and sizes.tp > 1 and sizes.dp_shard > 1:
                raise ConfigError(f"{where}.layout: pp {sizes.pp} x dp_shard {sizes.dp_shard} x tp {sizes.tp} on "
                                  f"{world_size} ranks; pipeline stages are split by tensor parallelism or sharded by "
                                  "FSDP2, not both at once: make pp x tp the world size, or set tp to 1")

    def check_pipeline(self, where: str) -> None:
        """Pipeline stages (layout.pp > 1) that cannot run this job: a ConfigError naming the field."""
        lay, lora = self.layout, getattr(self, "lora", None)
        if self.task not in ("pretrain", "sft"):
            raise ConfigError(f"{where}.layout.pp: {lay.pp}; pipeline stages train tasks pretrain and sft, not "
                              f"{self.task!r} (its reference and sampling models run whole): set layout.pp to 1")
        if lora is not None and lora.enabled:
            raise ConfigError(f"{where}.layout.pp: {lay.pp} with lora.enabled: a LoRA run replicates its model; set "
                              "layout.pp to 1")
        if lay.tp > 1 and lay.dp_shard not in (1, -1):
            raise ConfigError(f"{where}.layout: pp {lay.pp} x dp_shard {lay.dp_shard} x tp {lay.tp}; pipeline stages "
                              "are split by tensor parallelism or sharded by FSDP2, not both at once: set dp_shard "
                              "or tp to 1")
        from kiln.model.families import of

        if lay.tp > 1 and of(self.model).parallelize.tp_interleaved:
            raise ConfigError(f"{where}.layout: pp {lay.pp} with tp {lay.tp} for the {self.model.family} family: its "
                              "tensor-parallel q|k|v rows are held rank-interleaved and saved in the model's order "
                              "by gathering one full state, and with pipeline stages no rank holds the whole model "
                              "to gather it; set tp or pp to 1")
        if self.parallelism == "ddp":
            raise ConfigError(f"{where}.parallelism: 'ddp' with layout.pp {lay.pp}: the data-parallel ranks of a "
                              "pipeline shard its stages with FSDP2; set parallelism to 'fsdp' (or 'auto')")
        try:
            self.pipeline_config().check(self.model, lay.pp, self.micro_batch * self.grad_accum, f"{where}.pipeline",
                                         f"{where}.layout.pp")
        except ConfigError as e:
            if self.pipeline.microbatches or "microbatches" not in str(e):
                raise
            raise ConfigError(f"{e} (pipeline.microbatches 0 takes grad_accum, {self.grad_accum}: raise "
                              f"{where}.grad_accum to a multiple of layout.pp, or set {where}.pipeline.microbatches)"
                              ) from None

    def pipeline_config(self) -> PipelineConfig:
        """The pipeline as it runs: microbatches 0 resolved to grad_accum."""
        return PipelineConfig(self.pipeline.schedule, self.pipeline.virtual_stages,
                              self.pipeline.microbatches or self.grad_accum)

    def params(self) -> dict[str, Any]:
        """The job as its run records it (MLflow params, checkpoints' meta.json, result.json, the logbook): every
        field, the model in its serialised form (kiln.model.config.model_dict), the data files left out."""
        out = {k: v for k, v in asdict(self).items() if k not in ("train_files", "val_files")}
        if self.layout.pp == 1:  # recorded when there are pipeline stages: other runs keep the record they had
            del out["pipeline"]
        if self.layout == MeshLayout():  # recorded when it splits the model: other runs keep the record they had
            del out["layout"]
        else:  # as MeshLayout records it (pp only when there are pipeline stages)
            out["layout"] = self.layout.record()
        return {**out, "model": model_dict(self.model)}


@dataclass
class JobConfig(TrainJob):
    """A pretraining job on token shards, or supervised fine-tuning on instruction pairs (task "sft")."""

    val_files: list = field(default_factory=list)  # validation shards; for sft the same JSONL (split=val)
    eval_batches: Annotated[int, Domain(1)] = 16  # micro-batches per validation pass
    # attend within documents only (pretraining; kiln.model.masks): an EOT opens the document after it; training and
    # validation both masked; the EOT id is read from the shards' manifest.json (eot_token) or the tokenizer
    document_mask: bool = False
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # enabled=true trains adapters on frozen weights (sft; and
    # continued pretraining of init_from's weights)

    def check(self, where: str = "job") -> None:
        super().check(where)
        if self.task not in ("pretrain", "sft"):
            raise ConfigError(f"{where}.task must be 'pretrain' or 'sft', not {self.task!r}")
        if self.document_mask and self.task != "pretrain":
            raise ConfigError(f"{where}.document_mask is a pretraining option (packed token shards); task "
                              f"{self.task!r} batches are not packed documents: set document_mask to false")
        if self.task == "pretrain" and self.lora.enabled and not self.init_from:
            raise ConfigError(f"{where}.lora: LoRA adapts weights that exist; pretraining from random weights trains "
                              "every weight. Continued pretraining of imported weights (pretrained_model) takes it")


@dataclass
class SftJob(JobConfig):
    """Supervised fine-tuning on instruction pairs: a JobConfig with fine-tuning's defaults."""

    task: str = "sft"
    max_steps: Annotated[int, Domain(1)] = 80  # optimizer steps
    micro_batch: Annotated[int, Domain(1)] = 16  # pairs per rank per forward
    eval_interval: Annotated[int, Domain(1)] = 40  # steps between validation passes
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(warmup_steps=20))  # AdamW for fine-tuning
