"""One training harness for every stage: pretraining, SFT, DPO and RL run this loop, its checkpoints and its reports.

A stage (kiln.train.pretrain.PretrainStage, kiln.posttrain.sft.SftStage, kiln.posttrain.dpo.DpoStage,
kiln.posttrain.rl.RlStage) supplies its batches, its loss and its held-out measures; ``Trainer(job, stage, info,
reporter).fit()`` does the rest. Run a job with ``python -m kiln.train --config job.json`` (kiln.train.entry).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from kiln.common.files import atomic_write_json
from kiln.common.metrics import operations_metrics
from kiln.model.config import model_dict
from kiln.model.families import build_model, flops_per_token, of
from kiln.model.moe.balance import begin_step, end_step, load_measures
from kiln.model.moe.model import sparse_layers
from kiln.model.moe.parallelize import apply_ep, apply_moe
from kiln.model.lora import LoRAConfig, apply_lora, lora_state_dict, merged_state_dict, trainable_parameters
from kiln.model.parallel import (MeshLayout, align_grads, build_mesh, clip_grad_norm, describe, gradient_sync,
                                 parallelize)
from kiln.model.pipeline_parallel import Pipeline
from kiln.model.tensor_parallel import apply_tp
from kiln.train.checkpoint import CheckpointError, list_checkpoints, load_state, resolve_checkpoint, step_of
from kiln.train.checkpointer import Checkpointer, rng_state, set_rng_state
from kiln.train.diskfull import naming
from kiln.train.dist import DistInfo, all_gather, all_mean, rank_digests
from kiln.train.energy import EnergyMeter
from kiln.train.goodput import GoodputClock, summarize
from kiln.train.job import TrainJob
from kiln.train.journal import Journal
from kiln.train.logbook import Logbook
from kiln.train.optim import make_optimizer, make_scheduler
from kiln.train.preempt import PreemptionWatch
from kiln.train.spikes import SpikeDetector, SpikeError
from kiln.train.telemetry import (Reporter, SystemMetrics, checkpoint_table, make_logger, peak_memory_gb, resident_gb,
                                  resolve_peak_flops)

MAX_SKIPPED_IN_A_ROW = 10  # spiking updates dropped back to back (no checkpoint yet) before the run gives up


@dataclass
class RunState:
    """Training-loop bookkeeping saved in every checkpoint beside model, optimizer, scheduler and loader."""

    step: int = 0  # optimizer steps whose updates are in the weights
    data_batches: int = 0  # global batches drawn from the data (steps plus batches skipped after spikes)
    lineage_s: float = 0.0  # seconds of the steps that made these weights (goodput's productive time)
    train_loss: float = float("nan")
    val_loss: float | None = None
    history: list = field(default_factory=list)  # the stage's rows: one per validation (RL: one per step)
    curve: list = field(default_factory=list)  # [step, train_loss] at every progress line (the loss plot)


@dataclass
class StepReport:
    """What a progress line can show about one finished step."""

    step: int
    max_steps: int
    train: dict[str, float]  # train_loss and the stage's statistics, averaged over ranks
    val: dict[str, float] | None  # the held-out measures, when this step validated
    metrics: dict[str, float]  # what was logged for the step: lr, grad_norm, tokens_per_s, mfu, memory_gb ...
    val_loss: float | None  # the newest validation loss
    left_s: float  # estimated seconds to max_steps


class Stage:
    """What one training stage supplies to the Trainer; subclasses override what differs from these defaults."""

    tokens_per_step: int | None = None  # tokens one optimizer step trains on (tokens/s and MFU); None: it varies
    lora = LoRAConfig()  # enabled: the policy trains LoRA adapters on its frozen weights
    init_note = ""  # added to the "initialised weights from ..." line

    def setup(self, trainer: Trainer) -> None:
        """Called once the model is built, before each rank is seeded (a frozen reference model is built here)."""

    def describe(self, trainer: Trainer) -> str | None:
        """The stage's own opening line, or None."""
        return None

    def batches(self, index: int) -> Iterator[Any]:
        """The ``grad_accum`` micro-batches of global batch ``index`` (batches skipped after a spike count too)."""
        raise NotImplementedError

    def loss(self, trainer: Trainer, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch's loss to backpropagate, and statistics to report (averaged over micro-batches, ranks)."""
        raise NotImplementedError

    def validate(self, trainer: Trainer) -> dict[str, float]:
        """Held-out measures, named as logged (every rank calls this and gets the same numbers)."""
        raise NotImplementedError

    def pipeline_batch(self, trainer: Trainer, index: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Global batch ``index`` whole for pipeline stages: inputs, targets and extra forward arguments, each cut
        along dim 0 into the schedule's micro-batches. Stages whose batches are not (x, y) pairs do not pipeline."""
        raise NotImplementedError(f"{type(self).__name__} does not run on pipeline stages")

    def history_row(self, step: int, train: dict[str, float], val: dict[str, float] | None) -> dict | None:
        """The history row of ``step`` (by default one per validation), or None."""
        return None if val is None else {"step": step, "train_loss": train["train_loss"], **val}

    def start_line(self, val: dict[str, float]) -> str | None:
        """The line reporting the held-out measures before training, or None."""
        return None

    def progress(self, r: StepReport) -> str:
        raise NotImplementedError

    def meta(self) -> dict[str, Any]:
        """Extra fields for each checkpoint's meta.json."""
        return {}

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        """Extra fields for result.json."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The data position to save in checkpoints (a resumed run draws what the original would have)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Callback:
    """Hooks into a run. Production runs have none; tests/faults.py injects crashes, kills and spikes through them."""

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        """Step ``step``'s update is in the weights; nothing of it is logged, validated or saved yet."""

    def before_optimizer_step(self, trainer: Trainer, batch: int) -> None:
        """The gradients of data batch ``batch`` are clipped and about to be applied."""

    def after_optimizer_step(self, trainer: Trainer, batch: int) -> None:
        """The update of data batch ``batch`` is applied; the schedule has not stepped yet."""

    def on_checkpoint_write(self, path: Path) -> None:
        """A checkpoint's state file is on disk, not yet committed (called on the thread that saves)."""


def accumulate_gradients(model: torch.nn.Module, batches: Iterable[Any],
                         loss_fn: Callable[[Any], tuple[torch.Tensor, dict[str, float]]], grad_accum: int,
                         device: torch.device) -> tuple[float, dict[str, float]]:
    """Forward and backward ``grad_accum`` micro-batches (gradients synchronised across ranks on the last only);
    return this rank's mean loss and mean statistics. One sync with the device per step, for the loss."""
    loss_sum = torch.zeros((), device=device)
    stats: dict[str, float] = {}
    for micro, batch in enumerate(itertools.islice(batches, grad_accum)):
        with gradient_sync(model, micro == grad_accum - 1):
            loss, s = loss_fn(batch)
            (loss / grad_accum).backward()
        loss_sum += loss.detach()
        for k, v in s.items():
            stats[k] = stats.get(k, 0.0) + v / grad_accum
    return loss_sum.item() / grad_accum, stats


class Trainer:
    """A run of one stage on this rank: model, optimizer, checkpoints, spike rollback, metrics and goodput.

    ``fit`` reads top to bottom: start (resume or seed), validate, then per step ``train_step`` -> spike check
    (``rollback``) -> ``optimizer_step`` -> ``end_step`` (log, validate, report, ``save``), and ``finish``.
    """

    def __init__(self, job: TrainJob, stage: Stage, info: DistInfo, reporter: Reporter, callbacks: Iterable[Callback] = ()):
        self.job, self.stage, self.info, self.reporter = job, stage, info, reporter
        self.callbacks = list(callbacks)
        self.cfg, self.opt_cfg, self.spike_cfg = job.model, job.optim, job.spikes  # built and checked by load_job
        self.layout = self.split_layout()  # None unless the model is split over the ranks (layout.tp, pp or ep > 1)
        self.pipe: Pipeline | None = None  # this rank's pipeline stages (layout.pp > 1)
        self.moe: dict[str, Any] | None = None  # a mixture of experts' last step: load, dropped slots, aux losses
        self.expert_load: torch.Tensor | None = None  # (layers, experts) token slots routed this session
        if self.layout is not None:  # the data-parallel ranks left over shard the split model with FSDP2
            self.strategy = "fsdp" if self.layout.dp_shard > 1 else "none"
        else:
            self.strategy = "none" if info.world_size == 1 else ("ddp" if job.parallelism == "auto" else job.parallelism)
        self.out = Path(job.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)  # the journal's first line is written before any checkpoint
        self.journal = Journal(self.out, info.is_main)  # the run's one record (kiln.train.journal), rank 0's
        self.clock = GoodputClock(self.journal)  # where this process's time goes
        self.base_gb = resident_gb()
        self.logger = make_logger(job, info)  # rank 0 alone tracks
        self.ckpt = Checkpointer(self.out / "checkpoints", info.rank, info.world_size, sharded=self.sharded_checkpoints(),
                                 async_save=job.async_save, keep_last=job.keep_last, keep_every=job.keep_every,
                                 extra_files={"tokenizer.json": Path(job.tokenizer)} if job.tokenizer else {}, log=self.say,
                                 on_write=self._on_checkpoint_write)
        self.bf16 = info.device.type == "cuda" and torch.cuda.is_bf16_supported()
        self.cpu_bf16 = info.device.type == "cpu" and bool(job.cpu_bf16)  # autocast on CPU; MFU against bf16's peak
        # with FSDP2's mixed precision the sharded parameters are cast to bf16 already; otherwise autocast on CUDA
        # and on CPU with cpu_bf16 (autocast alone there: FSDP2 keeps fp32 shards on CPU)
        self.autocast = contextlib.nullcontext
        if self.bf16 and self.strategy != "fsdp":
            self.autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
        elif self.cpu_bf16:
            self.autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
        self.detector = SpikeDetector(self.spike_cfg)
        self.run, self.events, self.resumed_from = RunState(), [], None  # events: rollbacks, kept across restarts
        self.session_steps, self.tokens_s, self.mfus, self.grad_spikes, self.skipped_in_a_row = 0, [], [], 0, 0
        self.last_stats: dict[str, float] = {}
        self.preempt, self.stop_agreed, self.saved_step = PreemptionWatch(), False, -1
        self.logbook = Logbook(self.journal)  # one record per attempt: how it started, how it ended
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.energy = EnergyMeter(info.device.type, local) if info.is_main else EnergyMeter("none")
        self.nodes, self.energy_mark = max(1, info.world_size // local), 0.0
        self.latest = self.ckpt.latest()
        self.build()

    # -- reporting (rank 0 alone)

    def say(self, message: str) -> None:
        if self.info.is_main:
            self.reporter.log(message)

    def warn(self, message: str) -> None:
        if self.info.is_main:
            getattr(self.reporter, "warning", self.reporter.log)(message)

    def _on_checkpoint_write(self, path: Path) -> None:
        for cb in self.callbacks:
            cb.on_checkpoint_write(path)

    # -- the model

    def split_layout(self) -> MeshLayout | None:
        """The job's layout resolved for this world (a ConfigError when it cannot run here), or None when the
        model is not split (tp, pp and ep 1: the data-parallel strategies alone)."""
        if self.job.layout.tp == 1 and self.job.layout.pp == 1 and self.job.layout.ep == 1:
            return None
        self.job.check_layout("job", self.info.world_size)
        return self.job.layout.resolve(self.info.world_size, self.cfg, "job.layout")

    def sharded_checkpoints(self) -> bool:
        """FSDP2 and tensor-parallel runs save each rank's shards (DCP), except a family whose tensor-parallel rows
        are held rank-interleaved (GPT-2's fused q|k|v): those gather one full state on rank 0, in the model's order."""
        if self.layout is not None:  # pipeline stages: each rank holds other parameters
            return self.layout.pp > 1 or not of(self.cfg).parallelize.tp_interleaved
        return self.strategy == "fsdp"

    def build(self) -> None:
        """Seeded init, starting weights, LoRA, device, the stage's own models, parallelism, optimizer, in that order
        (the order random numbers are drawn in: a rerun builds bit-identical models)."""
        job, lora = self.job, self.stage.lora
        self.init_ckpt = self.ckpt.agree(lambda: str(resolve_checkpoint(job.init_from))) if job.init_from else None
        self._full_base: dict[str, torch.Tensor] | None = None  # a QLoRA run's starting weights (full_base())
        torch.manual_seed(job.seed)  # identical initial weights on every rank
        raw = build_model(self.cfg)
        if self.init_ckpt and (self.latest is None or lora.enabled):  # a LoRA run resumes adapters on this base
            start = load_state(Path(self.init_ckpt), "cpu")[0]["model"]  # memory-mapped
            raw.load_state_dict(start)
            if lora.enabled and lora.quantize == "nf4":  # kept for the saves: the weights the adapters fold into
                self._full_base = start
        if lora.enabled:  # before .to(): the adapters' initial values come from the CPU generator
            wrapped = apply_lora(raw, lora)
            nf4 = " (frozen weights in NF4)" if lora.quantize == "nf4" else ""
            self.say(f"LoRA rank {lora.rank} on {len(wrapped)} layers{nf4}: {trainable_parameters(raw):,} trainable "
                     "parameters")
        self.raw = raw.to(self.info.device)  # the model to save and load, however it is wrapped
        self.stage.setup(self)
        self.counts = (self.raw.num_params(), trainable_parameters(self.raw))  # the whole model's
        fsdp_mesh = None
        if self.layout is not None and self.layout.pp > 1:
            return self.build_pipeline(build_mesh(self.layout, self.info.device.type))
        ignored, dp_group = None, (dist.group.WORLD if self.info.world_size > 1 else None)
        if self.layout is not None:  # split each layer over the tensor-parallel ranks before anything wraps it
            mesh = build_mesh(self.layout, self.info.device.type)
            if self.layout.tp > 1:
                apply_tp(self.raw, mesh["tp"])
            fsdp_mesh = mesh["dp_shard"]
            if self.layout.ep > 1:  # the experts split over the data-shard ranks; FSDP2 shards the rest
                ep_mesh = mesh["dp_shard", "tp"] if self.layout.tp > 1 else fsdp_mesh
                ignored = apply_ep(self.raw, ep_mesh, self.layout.dp_shard)
        # a mixture of experts counts its balance over every rank's tokens (each rank holds others: its data-parallel
        # batch, under sequence parallelism its shard of it)
        apply_moe(self.raw, dp_group, job.grad_accum, tp=self.layout.tp if self.layout is not None else 1)
        self.model = parallelize(self.raw, self.strategy, job.activation_checkpointing, job.compile, self.info.device,
                                 self.bf16, fsdp_mesh=fsdp_mesh, ignored=ignored)  # the model to call
        self.optimizer = make_optimizer(self.raw, self.opt_cfg, self.info.device)
        self.scheduler = make_scheduler(self.optimizer, self.opt_cfg, job.max_steps)
        self.sparse = sparse_layers(self.raw)  # a mixture of experts' blocks (none for a dense model)

    def build_pipeline(self, mesh) -> None:
        """This rank's pipeline stages of the model (split over tp or sharded by FSDP2 over dp_shard), their
        schedule, and the optimizer over them; ``raw`` and ``model`` become this rank's part of the model (its
        stages' blocks and tables under the whole model's names), which the checkpoints save and load."""
        job = self.job
        dp_mesh = mesh["dp_shard"] if self.layout.dp_shard > 1 else None
        tp_mesh = mesh["tp"] if self.layout.tp > 1 else None
        self.pipe = Pipeline(self.raw, job.pipeline_config(), mesh["pp"].get_group(), self.info.device,
                             batch=job.micro_batch * job.grad_accum, dp_mesh=dp_mesh, bf16=self.bf16,
                             activation_checkpointing=job.activation_checkpointing, compile=job.compile,
                             tp_mesh=tp_mesh, ep=self.layout.ep)
        self.raw = self.model = self.pipe.local  # trained through self.pipe: its forward runs one stage only
        # a mixture of experts counts its balance over the stage's data-parallel ranks; the schedule scales the
        # micro-batches' summed gradients (so the auxiliary losses' too); the stages' loads are gathered
        tokens = tp_mesh if tp_mesh is not None else dp_mesh  # a stage's ranks holding other tokens
        apply_moe(self.raw, tokens.get_group() if tokens is not None else None, 1, mesh["pp"].get_group(),
                  tp=self.layout.tp)
        self.optimizer = make_optimizer(self.raw, self.opt_cfg, self.info.device)
        self.scheduler = make_scheduler(self.optimizer, self.opt_cfg, job.max_steps)
        self.sparse = sparse_layers(self.raw)  # this rank's stages' mixture-of-experts blocks

    def job_params(self) -> dict[str, Any]:
        return self.job.params()

    # -- the run

    def fit(self) -> dict[str, Any]:
        """Train to max_steps from wherever the run folder says the run is; return the summary (also result.json).
        A stop signal (kiln.train.preempt) ends it early, after a step, with a checkpoint of that step saved."""
        self.preempt.install()
        system = SystemMetrics(self.job, self.info)
        try:
            return self._fit()
        except Exception as e:
            if getattr(self, "ckpt", None) is not None:
                self.ckpt.finish_after_crash()
            self.end_attempt("crashed", self.run.step, error=f"{type(e).__name__}: {e}")
            raise
        except BaseException as e:  # KeyboardInterrupt, SystemExit: stopped from outside without a save
            self.end_attempt("killed", self.run.step, error=type(e).__name__)
            raise
        finally:
            system.stop()
            self.preempt.restore()

    def _fit(self) -> dict[str, Any]:
        self.start()
        t_start = time.time()
        self.clock.ready(self.run.step, self.run.lineage_s)
        if self.run.step == 0 and not self.run.history:
            val = self.validate(0)
            self.run.history.append({"step": 0, **val})
            line = self.stage.start_line(val)
            if line:
                self.say(line)
        self.t_ready = time.perf_counter()
        self.model.train()
        while self.run.step < self.job.max_steps:
            t0 = time.perf_counter()
            batch = self.run.data_batches
            train, norm = self.train_step(batch)
            verdict = self.detector.check(train["train_loss"], norm)
            if self.detector.rolls_back(verdict):
                self.optimizer.zero_grad(set_to_none=True)
                self.clock.add("step_s", time.perf_counter() - t0)
                self.rollback(verdict[1], train["train_loss"])
                continue
            self.skipped_in_a_row = 0
            if verdict is not None:
                self.grad_spike(norm, verdict[1])
            self.optimizer_step(batch)
            self.end_step(train, norm, time.perf_counter() - t0)
            if self.stop_agreed if self.info.world_size > 1 else self.preempt.requested:
                return self.preempted(t_start)
        return self.finish(t_start)

    def start(self) -> None:
        """Resume from the newest good checkpoint, or seed each rank for a fresh run; say what will run."""
        if self.latest is not None:
            self.restore(self.latest)
            self.resumed_from = str(self.latest)
            self.say(f"resumed from {self.latest} at step {self.run.step}")
        else:
            if self.init_ckpt:
                self.say(f"initialised weights from {self.init_ckpt}{self.stage.init_note}")
            # weights are identical on every rank; dropout differs between data-parallel ranks (the ranks of a
            # tensor-parallel group draw the same masks, as their replicated activations need)
            torch.manual_seed(self.job.seed + self.info.data_rank)
        tokens = self.stage.tokens_per_step
        self.peak_flops = resolve_peak_flops(self.job.peak_flops, self.info.device, self.cpu_bf16) if tokens else 0.0
        if self.info.is_main:
            self.logger.log_params({"job": self.job_params(), "peak_flops_per_device": self.peak_flops})
        self.say(f"training {self.counts[0] / 1e6:.2f}M parameters on {self.info.world_size} x "
                 f"{self.info.device.type} ({self.describe_parallel()}), "
                 + (f"{tokens} tokens/step, " if tokens else "") + f"steps {self.run.step}->{self.job.max_steps}"
                 + (f", MFU against {self.peak_flops / 1e12:.3g} TFLOP/s per device" if self.peak_flops else ""))
        line = self.stage.describe(self)
        if line:
            self.say(line)
        from kiln.common.files import process_start_time

        self.begin_attempt("resume" if self.latest is not None else "fresh", process_start_time())

    def describe_parallel(self) -> str:
        """How the ranks share the work, for the start line: "fsdp, tensor parallel 2 (dp_shard 2 x tp 2)"."""
        how = describe(self.strategy, self.job.activation_checkpointing, self.job.compile)
        if self.layout is None:
            return how
        if self.pipe is not None:
            pc = self.pipe.config
            per = f", {pc.virtual_stages} stages per rank" if pc.virtual_stages > 1 else ""
            return (f"{how}, pipeline parallel {self.layout.pp} ({pc.schedule}{per}, {self.pipe.microbatches} "
                    f"micro-batches; {self.layout.describe()})")
        return f"{how}, tensor parallel {self.layout.tp} ({self.layout.describe()})"

    def layout_record(self) -> dict[str, Any]:
        """The mesh sizes for result.json and the logbook, when the model is split (else nothing is added)."""
        if self.layout is None:
            return {}
        return {"layout": self.layout.record(), **({"pipeline": asdict(self.pipe.config)} if self.pipe else {})}

    def env_config(self) -> dict[str, Any]:
        """What the logbook compares between attempts beside the job: where and on what this attempt runs."""
        return {"world_size": self.info.world_size, "device": self.info.device.type, "parallelism": self.strategy,
                "torch": torch.__version__, "host": socket.gethostname(), **self.layout_record()}

    def begin_attempt(self, how: str, t: float | None = None) -> None:
        self.energy_mark = self.energy.joules() or 0.0
        resumed_from = str(self.latest) if how == "resume" else None
        self.logbook.begin(self.run.step, how, self.job_params(), self.env_config(), resumed_from, t)

    def end_attempt(self, outcome: str, step: int, **fields: Any) -> None:
        """Close this attempt in the logbook, with the energy its devices used where NVML counts it."""
        if self.logbook.attempt is None:  # failed before the attempt began (a bad config, no data)
            return
        joules = self.energy.joules()
        if joules is not None:
            fields["energy_j"] = (joules - self.energy_mark) * self.nodes  # rank 0's node, scaled to every node
        self.logbook.end(outcome, step, **fields)
        self.logbook.attempt = None

    def train_step(self, index: int) -> tuple[dict[str, float], float]:
        """Forward and backward every micro-batch of data batch ``index``; return the step's training measures
        (averaged over ranks) and the gradient norm before clipping."""
        begin_step(self.sparse)  # a mixture of experts counts this step's routing only
        if self.pipe is not None:  # the schedule runs the micro-batches; the last stage's loss reaches every rank
            x, y, kwargs = self.stage.pipeline_batch(self, index)
            with self.autocast():
                loss, stats = float(self.pipe.step(x, y, **kwargs)), {}
            norm = self.pipe.clip_grad_norm(self.opt_cfg.grad_clip)
        else:
            loss, stats = accumulate_gradients(self.model, self.stage.batches(index),
                                               lambda b: self.stage.loss(self, b), self.job.grad_accum, self.info.device)
            if self.layout is not None:  # tensor-parallel ranks' partial sums (a replicated weight applied to a
                align_grads(self.raw.parameters())  # shard of the tokens) summed, as FSDP2 does for what it shards
            norm = clip_grad_norm(self.model, self.opt_cfg.grad_clip)
        self.run.data_batches += 1
        values = {"train_loss": loss}
        if self.info.world_size > 1:  # a stop signal on any rank rides on the loss all-reduce: all stop together
            values["stop_signal"] = float(self.preempt.requested)
        train = all_mean(values, self.info)
        self.stop_agreed = train.pop("stop_signal", 0.0) > 0
        return {**train, **(all_mean(stats, self.info) if stats else {})}, norm

    def optimizer_step(self, batch: int) -> None:
        for cb in self.callbacks:
            cb.before_optimizer_step(self, batch)
        self.optimizer.step()
        self.moe = end_step(self.sparse)  # a mixture of experts: the step's expert load, aux_free's bias moved
        for cb in self.callbacks:
            cb.after_optimizer_step(self, batch)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def end_step(self, train: dict[str, float], norm: float, seconds: float) -> None:
        """Account for the finished step, then log it, validate, report and save when their intervals come round."""
        job, run = self.job, self.run
        run.step += 1
        run.train_loss = train["train_loss"]
        step = run.step
        self.clock.add("step_s", seconds)
        run.lineage_s = self.clock.lineage_s
        self.clock.beat(step)  # the step's time is on record before a kill can come
        for cb in self.callbacks:
            cb.on_step_end(self, step)
        self.session_steps += 1
        self.last_stats = {k: v for k, v in train.items() if k != "train_loss"}
        metrics = self.step_metrics(train, norm, seconds)
        self.logger.log(metrics, step)
        val = self.validate(step) if step % job.eval_interval == 0 or step == job.max_steps else None
        row = self.stage.history_row(step, train, val)
        if row is not None:
            run.history.append(row)
        if step % job.log_interval == 0 or step == job.max_steps:
            self.progress(step, train, val, metrics)
        if step % job.ckpt_interval == 0 or step == job.max_steps:
            self.save(step)
        if val is not None or step % job.ckpt_interval == 0 or step == job.max_steps:
            self.clock.beat(step)  # validation and saving time of this step

    def step_metrics(self, train: dict[str, float], norm: float, seconds: float) -> dict[str, float]:
        metrics = {"train_loss": train["train_loss"], "lr": self.scheduler.get_last_lr()[0], "grad_norm": norm}
        tokens = self.stage.tokens_per_step
        if tokens:
            metrics["tokens_per_s"] = tokens / seconds
            self.tokens_s.append(metrics["tokens_per_s"])
        metrics.update(step_time_s=seconds, memory_gb=peak_memory_gb(self.info.device, self.base_gb))
        if tokens and self.peak_flops > 0:
            metrics["mfu"] = flops_per_token(self.cfg, self.job.seq_len) * metrics["tokens_per_s"] / (
                self.peak_flops * self.info.world_size)
            self.mfus.append(metrics["mfu"])
        if self.moe is not None:  # expert load of the step, every rank's tokens
            load = self.moe["load"]
            self.expert_load = load if self.expert_load is None else self.expert_load + load
            metrics.update(load_measures(load), **self.moe["losses"])
            metrics["moe/dropped_fraction"] = self.moe["dropped"] / max(float(load.sum()), 1.0)
        return {**metrics, **{k: v for k, v in train.items() if k != "train_loss"}}

    def validate(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        val = self.stage.validate(self)
        self.clock.add("eval_s", time.perf_counter() - t0)
        self.run.val_loss = val.get("val_loss", self.run.val_loss)
        self.logger.log(val, step)
        return val

    def progress(self, step: int, train: dict[str, float], val: dict[str, float] | None, metrics: dict[str, float]) -> None:
        self.run.curve.append([step, train["train_loss"]])
        if self.info.is_main:
            left = (time.perf_counter() - self.t_ready) / self.session_steps * (self.job.max_steps - step)
            self.reporter.log(self.stage.progress(StepReport(step, self.job.max_steps, train, val, metrics,
                                                             self.run.val_loss, left)))

    def grad_spike(self, norm: float, why: str) -> None:
        """A gradient-norm spike: clipped, reported, trained on."""
        self.grad_spikes += 1
        self.logger.log({"grad_norm_spike": norm}, self.run.step + 1)
        self.logbook.event("grad_norm", self.run.step + 1, reason=why)
        self.warn(f"step {self.run.step + 1}: {why} (clipped to {self.opt_cfg.grad_clip}; a rollback follows only "
                  "if the loss spikes)")

    # -- checkpoints

    def save(self, step: int) -> None:
        """Checkpoint everything a resumed run needs to continue bit for bit (in the background when async_save)."""
        extras = {"scheduler": self.scheduler.state_dict(), "loader": self.stage.state_dict(),
                  "rng": all_gather(rng_state(), self.info), "step": step, "spikes": self.detector.state_dict(),
                  "run": asdict(self.run), "events": self.events}
        lora = self.stage.lora.enabled
        if lora:
            extras["lora"] = lora_state_dict(self.raw)
        meta = {"model": model_dict(self.cfg), "task": self.job.task, "val_loss": self.run.val_loss,
                "train_loss": self.run.train_loss, "seed": self.job.seed, "world_size": self.info.world_size,
                "parallelism": self.strategy, "history": self.run.history, "job": self.job_params(), **self.stage.meta()}
        # readers get plain weights; a QLoRA run's adapters fold into the full-precision weights it started from
        weights = (lambda: merged_state_dict(self.raw, self.full_base())) if lora else None
        self.clock.add("save_s", self.ckpt.save(step, self.raw, self.optimizer, extras, meta, weights))
        self.saved_step = step

    def full_base(self) -> dict[str, torch.Tensor] | None:
        """The starting weights a QLoRA run quantised (init_from's, as build() read them, memory-mapped), which its
        saved weights fold the adapters into; None for other runs."""
        return self._full_base

    def restore(self, path: Path, rolling_back: bool = False) -> None:
        if "job" not in json.loads((Path(path) / "meta.json").read_text()):  # DPO and RL saved less before the Trainer
            raise CheckpointError(f"{path}: an older DPO/RL checkpoint, which a run cannot resume from; move "
                                  f"{Path(path).parent} aside to train this stage again")
        extras, _ = self.ckpt.load(path, self.raw, self.optimizer, part="lora" if self.stage.lora.enabled else "model")
        self.scheduler.load_state_dict(extras["scheduler"])
        self.stage.load_state_dict(extras["loader"])
        rngs = extras["rng"]
        if self.info.rank < len(rngs):
            set_rng_state(rngs[self.info.rank])
        else:  # resumed on more ranks than saved: new ranks get their own stream
            torch.manual_seed(self.job.seed + self.info.rank + 1_000_003 * extras["step"])
        self.detector.load_state_dict(extras["spikes"])
        self.run = RunState(**extras["run"])
        if not rolling_back:  # a rollback keeps the events that led to it
            self.events = list(extras.get("events", []))

    def rollback(self, reason: str, loss: float) -> None:
        """PaLM's recipe: back to a checkpoint about rollback_steps earlier, then skip the batches around the spike."""
        cfg, run = self.spike_cfg, self.run
        n_rollbacks = sum(1 for e in self.events if e["event"] == "rollback")
        if n_rollbacks >= cfg.max_rollbacks or self.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
            why = (f"after {n_rollbacks} rollbacks (spikes.max_rollbacks={cfg.max_rollbacks})"
                   if n_rollbacks >= cfg.max_rollbacks else
                   f"after {self.skipped_in_a_row} updates in a row were dropped, with no checkpoint yet to roll back to")
            raise SpikeError(f"loss spike at step {run.step + 1} ({reason}) {why}: lower optim.lr, raise "
                             f"optim.warmup_steps or check the data near batch {run.data_batches}")
        t0 = time.perf_counter()
        self.clock.add("save_s", self.ckpt.wait())
        spike_step, spike_batches = run.step + 1, run.data_batches
        target = self.ckpt.latest(before_step=spike_step - cfg.rollback_steps) or self.ckpt.latest(before_step=run.step)
        if target is None:  # too early for any checkpoint: drop this batch's update (a run of them means trouble)
            self.warn(f"loss spike at step {spike_step}: {reason}; no checkpoint to roll back to, so this update is skipped")
            self.events.append({"event": "skipped_update", "step": spike_step, "reason": reason, "loss": loss})
            self.logbook.event("skipped_update", spike_step, reason=reason, loss=loss)
            self.logger.log({"spike": 1.0}, spike_step)
            self.skipped_in_a_row += 1
            return
        skip = self.rewind(target, spike_batches)
        self.end_attempt("rolled_back", spike_step - 1, to_step=self.run.step, skipped_batches=skip, reason=reason,
                         loss=loss)
        self.begin_attempt("rollback")
        self.events.append({"event": "rollback", "step": spike_step, "to_step": self.run.step, "skipped_batches": skip,
                            "reason": reason, "loss": loss})
        self.clock.add("restore_s", time.perf_counter() - t0)
        self.clock.restored(self.run.step, self.run.lineage_s)
        self.logger.log({"spike": 1.0, "spike_loss": loss, "rollback_to_step": float(self.run.step),
                         "skipped_batches": float(skip)}, spike_step)
        self.warn(f"loss spike at step {spike_step}: {reason}. Rolled back to step {self.run.step} ({target.name}) and "
                  f"skipped {skip} batches ({n_rollbacks + 1}/{cfg.max_rollbacks} rollbacks)")

    def rewind(self, target: Path, spike_batches: int) -> int:
        """Restore ``target``, delete the checkpoints after it, skip the data up to and past the spike; return
        the batches skipped."""
        self.restore(target, rolling_back=True)
        if self.info.is_main:  # checkpoints after the target belong to the abandoned trajectory
            for p in list_checkpoints(self.ckpt.root):
                if step_of(p) > self.run.step:
                    shutil.rmtree(p, ignore_errors=True)
        skip = max(self.spike_cfg.skip_batches, spike_batches - self.run.data_batches)
        for i in range(skip):
            for _ in self.stage.batches(self.run.data_batches + i):
                pass
        self.run.data_batches += skip
        return skip

    # -- the end

    def preempted(self, t_start: float) -> dict[str, Any]:
        """A stop signal came: save this step's checkpoint now unless it is being saved already, wait for it, say how
        long it took against the grace period, and finish as "preempted"."""
        step, t0 = self.run.step, time.perf_counter()
        if self.saved_step != step:
            self.save(step)
        self.clock.add("save_s", self.ckpt.wait())
        save_s, since = time.perf_counter() - t0, self.preempt.seconds_since()
        within = since <= self.job.preempt_grace_s
        self.logger.log({"preempted": 1.0, "preempt_save_s": save_s}, step)
        self.warn(f"preempted ({self.preempt.signal_name or 'a stop signal on another rank'}): stopped after step {step} "
                  f"and saved its checkpoint in {save_s:.1f}s, {since:.1f}s after the signal "
                  f"({'within' if within else 'OVER'} the {self.job.preempt_grace_s:g}s grace period); launch again to resume")
        return self.finish(t_start, "preempted", {"signal": self.preempt.signal_name, "saved_step": step,
                                                  "save_s": round(save_s, 3), "within_grace": within})

    def finish(self, t_start: float, outcome: str = "completed", end: dict[str, Any] | None = None) -> dict[str, Any]:
        """Wait for the last save, check the ranks agree, account for goodput; close the attempt in the logbook;
        write and return result.json (``outcome``: completed or preempted)."""
        self.clock.add("save_s", self.ckpt.wait())
        self.logger.flush()
        digests = rank_digests(self.model, self.info)
        copies = self.info.world_size // (self.layout.pp if self.pipe else 1)  # ranks holding one stage's weights
        if self.info.is_main and any(len(set(digests[i:i + copies])) > 1 for i in range(0, len(digests), copies)):
            self.warn(f"ranks disagree on the final parameters: {digests}")
        self.clock.beat(self.run.step)
        goodput = summarize(self.out) if self.info.is_main else {}
        if self.info.is_main:
            # at step 0, as every operations figure: MLflow's system-metrics monitor resumes its sample count after
            # the highest step of the run's system/* metrics
            self.logger.log(operations_metrics({f"goodput_{k}" if k != "goodput" else k: v for k, v in goodput.items()}), 0)
            self.logger.flush()
        self.end_attempt(outcome, self.run.step, **(end or {}))
        summary = {**self.summary(t_start, digests, goodput), "outcome": outcome, "preemption": end or None}
        if self.info.is_main:
            with naming(self.out / "result.json"):
                atomic_write_json(self.out / "result.json", summary)
        return summary

    def summary(self, t_start: float, digests: list[str], goodput: dict[str, Any]) -> dict[str, Any]:
        run, tokens = self.run, self.stage.tokens_per_step
        checkpoints = checkpoint_table(self.ckpt.root) if self.info.is_main else []
        median = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
        return {
            "task": self.job.task, "steps": run.step, "tokens": run.step * tokens if tokens else None,
            "final_train_loss": run.train_loss, "final_val_loss": run.val_loss,
            "initial_val_loss": run.history[0].get("val_loss") if run.history else None,
            "history": run.history, "curve": run.curve,
            "checkpoint": checkpoints[-1]["path"] if checkpoints else None, "checkpoints": checkpoints,
            "resumed_from": self.resumed_from, "world_size": self.info.world_size, "device": self.info.device.type,
            "parallelism": self.strategy, "activation_checkpointing": self.job.activation_checkpointing,
            "compile": self.job.compile, "cpu_bf16": self.job.cpu_bf16, "params": self.counts[0],
            "trainable_params": self.counts[1],
            "wall_s": time.time() - t_start,
            "tokens_per_s": median(self.tokens_s), "mfu": median(self.mfus), "peak_flops_per_device": self.peak_flops,
            "peak_memory_gb": peak_memory_gb(self.info.device, self.base_gb), "data_batches": run.data_batches,
            "events": self.events, "grad_norm_spikes": self.grad_spikes, "goodput": goodput,
            "rank_param_digests": digests, **self.layout_record(), **self.stage.summary(self),
            **({"expert_load": self.expert_summary()} if self.expert_load is not None else {}),
        }

    def expert_summary(self) -> dict[str, Any]:
        """This session's token slots per expert per layer (every rank's), its balance measures, and the routed
        and active parameter counts."""
        from kiln.model.moe.counts import tensor_count

        load = self.expert_load
        return {"by_layer": load.round().long().tolist(), "balance": load_measures(load),
                "params": tensor_count(self.cfg), "router_balance": self.cfg.router_balance}
