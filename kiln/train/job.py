"""The job file of a training run: the fields every stage shares (TrainJob) and the pretraining/SFT job (JobConfig).

A job is a JSON file of these fields (unknown keys are errors), read by rank 0 and broadcast to every rank;
kiln.posttrain.common.PosttrainJob adds the DPO and RL fields. Run one with ``python -m kiln.train --config job.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainJob:
    """Fields every training job has; kiln.train.trainer.Trainer reads these and nothing else."""

    task: str = "pretrain"  # "pretrain", "sft", "dpo" or "rl": picks the stage (kiln.train.entry.TASKS)
    out_dir: str = ""  # run folder: checkpoints/, result.json, goodput.jsonl
    tokenizer: str = ""  # tokenizer.json copied into every checkpoint
    model: dict = field(default_factory=dict)  # ModelConfig fields
    optim: dict = field(default_factory=dict)  # kiln.train.optim.OptimConfig fields
    train_files: list = field(default_factory=list)  # the stage's training data
    init_from: str = ""  # checkpoint whose weights start this run (fine-tuning)
    seq_len: int = 256  # tokens per sequence
    micro_batch: int = 8  # sequences per rank per forward
    grad_accum: int = 1  # micro-batches per optimizer step
    max_steps: int = 100  # optimizer steps
    parallelism: str = "auto"  # "auto" (ddp on several ranks), "none", "ddp" or "fsdp"; one rank always runs "none"
    activation_checkpointing: bool = False  # recompute block activations in backward to save memory
    compile: bool = False  # torch.compile each block
    eval_interval: int = 100  # steps between validation passes
    ckpt_interval: int = 200  # steps between checkpoints (the last step is always saved)
    keep_last: int = 2  # newest checkpoints kept on disk (0 keeps all)
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this (0: none)
    async_save: bool = True  # write checkpoints in the background while training continues
    spikes: dict = field(default_factory=dict)  # kiln.train.spikes.SpikeConfig fields: thresholds, rollback, skip
    log_interval: int = 25  # steps between progress lines
    seed: int = 1337  # seeds init, data order and dropout
    mlflow_tracking_uri: str = ""  # where rank 0 streams metrics
    mlflow_run_id: str = ""  # the MLflow run that receives them
    preempt_grace_s: float = 30.0  # seconds a stop signal leaves to save (Slurm's KillWait, Kubernetes' grace period)
    system_metrics_s: float = 10.0  # seconds between MLflow system-metric samples on rank 0 (CPU, memory, GPU; 0: off)
    peak_flops: float = 0.0  # per-device peak FLOP/s for MFU; 0: GPU table, or a matmul measured on CPU; <0: no MFU


@dataclass
class JobConfig(TrainJob):
    """A pretraining job on token shards, or supervised fine-tuning on instruction pairs (task "sft")."""

    val_files: list = field(default_factory=list)  # validation shards; for sft the same JSONL (split=val)
    eval_batches: int = 16  # micro-batches per validation pass
    # attend within documents only (pretraining; kiln.model.masks): an EOT opens the document after it; training and
    # validation both masked; the EOT id is read from the shards' manifest.json (eot_token) or the tokenizer
    document_mask: bool = False
    lora: dict = field(default_factory=dict)  # task sft: kiln.model.lora.LoRAConfig fields; enabled=true trains adapters only
