"""Pipeline parallelism: a model's blocks cut into consecutive stages over the ranks of a pipeline group, run by a
torch.distributed.pipelining schedule (GPipe, 1F1B, interleaved 1F1B or interleaved zero bubble).

``pipe = Pipeline(model, PipelineConfig(schedule="1f1b", microbatches=4), group, device)`` on every rank of the
group, then per step ``loss = pipe.step(x, y)`` (forward and backward of the whole batch; every rank gets the loss),
``pipe.clip_grad_norm(1.0)`` and the optimizer over ``pipe.parameters()``. Each stage is a copy of the whole model
with the blocks and tables it does not run taken out, so its parameter names are the whole model's and a checkpoint
is read by name under any layout. The last stage computes the loss as the whole model does (the fused chunked
cross-entropy of kiln.model.loss), so no stage holds a tokens x vocabulary tensor.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Annotated, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from kiln.common.config import ConfigError, Domain
from kiln.model.families import of
from kiln.model.parallel import align_grads, apply_fsdp, full_value, is_dtensor

# schedule name -> torch.distributed.pipelining class; the looped ones run several stages per rank (rank r holds
# stages r, r + pp, r + 2 pp, ...), which shrinks the bubble from (pp - 1) / m to (pp - 1) / (v m)
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble"}
LOOPED = ("interleaved_1f1b", "interleaved_zero_bubble")


@dataclass
class PipelineConfig:
    """How pipeline stages run (when layout.pp > 1): the schedule, the stages each rank holds, the micro-batches."""

    schedule: str = "1f1b"  # gpipe, 1f1b, interleaved_1f1b or interleaved_zero_bubble
    virtual_stages: Annotated[int, Domain(1)] = 1  # stages per rank: 1 for gpipe and 1f1b, 2 or more for the looped schedules
    # micro-batches a step's batch is cut into: a multiple of pp (0: in a training job, grad_accum, so that each is
    # one micro_batch; elsewhere pp)
    microbatches: Annotated[int, Domain(0)] = 0

    def check(self, cfg, pp: int, batch: int | None = None, where: str = "pipeline", pp_field: str = "layout.pp"
              ) -> None:
        """A pipeline ``cfg`` (a ModelConfig) cannot run on ``pp`` ranks is a ConfigError naming the field (under
        ``where``; the rank count as ``pp_field``) and the legal values."""
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"{where}.schedule: {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        looped = self.schedule in LOOPED
        if looped and self.virtual_stages < 2 or not looped and self.virtual_stages != 1:
            raise ConfigError(f"{where}.virtual_stages: {self.virtual_stages} with schedule {self.schedule}; "
                              + ("the looped schedules run 2 or more stages per rank" if looped
                                 else f"{self.schedule} runs one stage per rank: set it to 1, or pick "
                                      f"{' or '.join(LOOPED)}"))
        stages = pp * self.virtual_stages
        if cfg.n_layer % stages:
            legal = [d for d in range(1, cfg.n_layer + 1) if cfg.n_layer % (d * self.virtual_stages) == 0]
            raise ConfigError(f"{pp_field}: {pp} ranks x {self.virtual_stages} stages each must divide the "
                              f"{cfg.n_layer} layers (model.n_layer); {pp_field.rsplit('.', 1)[-1]} may be "
                              f"{', '.join(map(str, legal))}")
        m = self.microbatches or pp
        if m < pp or m % pp:
            raise ConfigError(f"{where}.microbatches: {m}; a multiple of pp ({pp}), so that every stage works "
                              "in the steady state")
        if batch is not None and batch % m:
            raise ConfigError(f"{where}.microbatches: {m} must divide the batch of {batch} sequences per step")


class Skip(nn.Module):
    """A block another stage runs: passes the hidden states through, holds nothing."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return x


def stage_layers(n_layer: int, n_stages: int) -> list[range]:
    """The blocks of each stage: equal consecutive runs (n_layer divisible by n_stages, PipelineConfig.check)."""
    per = n_layer // n_stages
    return [range(s * per, (s + 1) * per) for s in range(n_stages)]


def _drop(model: nn.Module, path: str) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    if isinstance(parent, nn.ModuleDict):
        del parent[leaf]
    else:
        setattr(parent, leaf, None)


def _keep_stages(part: nn.Module, stages: list[int], n_stages: int) -> nn.Module:
    """``part`` (a copy of the whole model) cut in place to the blocks of ``stages``, holding the tables before
    the blocks only with stage 0 and the final norm and head only with the last stage."""
    fam = of(part.config)
    ranges = stage_layers(len(part.blocks), n_stages)
    keep = {i for s in stages for i in ranges[s]}
    for i in range(len(part.blocks)):
        if i not in keep:
            part.blocks[i] = Skip()
    for path in (fam.parallelize.first_stage if 0 not in stages else ()) + (fam.parallelize.last_stage if n_stages - 1 not in stages else ()):
        _drop(part, path)
    return part


def cut_stage(model: nn.Module, stage: int, n_stages: int) -> nn.Module:
    """A copy of ``model`` that runs only stage ``stage`` of ``n_stages``: the other stages' blocks are Skip, the
    tables before the blocks stay on the first stage, the final norm and head on the last. A stage before the last
    returns its hidden states; the last, given the targets, the loss."""
    return _keep_stages(copy.deepcopy(model), [stage], n_stages)


def _shallow(m: nn.Module) -> nn.Module:
    """A new module object over the same submodules, parameters and buffers, with registries of its own."""
    c = copy.copy(m)
    for k, v in vars(m).items():
        if isinstance(v, (dict, set)):  # _modules, _parameters, _buffers, the hook dicts
            c.__dict__[k] = copy.copy(v)
    return c


def stage_view(part: nn.Module, stage: int, n_stages: int) -> nn.Module:
    """Stage ``stage`` of ``part`` (cut by _keep_stages to several stages) as a module of its own that shares every
    submodule it runs with ``part``: the modules on the way to what it leaves out are new objects, the rest are
    ``part``'s, so the parameters both see are the same tensors (one optimizer, one state dict over ``part``)."""
    fam = of(part.config)
    root = _shallow(part)
    copies: dict[str, nn.Module] = {"": root}

    def parent_of(path: str) -> tuple[nn.Module, str]:
        node, key = root, ""
        *through, leaf = path.split(".")
        for name in through:
            key = f"{key}.{name}" if key else name
            if key not in copies:
                copies[key] = _shallow(node._modules[name])
                node._modules[name] = copies[key]
            node = copies[key]
        return node, leaf

    blocks = next(name for name, m in part.named_modules() if m is part.blocks)
    mine = stage_layers(len(part.blocks), n_stages)[stage]
    for i, block in enumerate(part.blocks):
        if i not in mine and not isinstance(block, Skip):
            parent, leaf = parent_of(f"{blocks}.{i}")
            parent._modules[leaf] = Skip()
    for path in (fam.parallelize.first_stage if stage > 0 else ()) + (fam.parallelize.last_stage if stage < n_stages - 1 else ()):
        parent, leaf = parent_of(path)
        if leaf in parent._modules:
            if isinstance(parent, nn.ModuleDict):
                del parent._modules[leaf]
            else:
                parent._modules[leaf] = None
    return root


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def _stage_class():
    """torch's PipelineStage whose shape inference (a forward on stand-in tensors before the first step of a
    schedule) leaves a mixture of experts' load counts alone: they feed its aux_free balancing and its reports, and
    must count real tokens only."""
    from torch.distributed import pipelining

    from kiln.model.moe.model import sparse_layers

    class Stage(pipelining.PipelineStage):
        def _forward_metadata_inference(self, *args, **kwargs):
            layers = sparse_layers(self.submod)
            for m in layers:
                m.counting = False
            try:
                return super()._forward_metadata_inference(*args, **kwargs)
            finally:
                for m in layers:
                    m.counting = True

    return Stage


class Pipeline:
    """This rank's stages of ``model`` and the schedule that runs them with the other ranks of ``group``; with
    ``dp_mesh`` each stage is also sharded by FSDP2 over the data-parallel ranks (which each bring their own rows of
    the batch); with ``ep`` > 1 (a mixture of experts, ep = the dp_mesh size) the experts are split over them
    instead (kiln.model.moe.parallelize.apply_ep)."""

    def __init__(self, model: nn.Module, config: PipelineConfig, group: dist.ProcessGroup, device: torch.device,
                 batch: int | None = None, dp_mesh=None, bf16: bool = False, activation_checkpointing: bool = False,
                 compile: bool = False, tp_mesh=None, ep: int = 1):
        from torch.distributed import pipelining

        self.config, self.group, self.cfg, self.dp_mesh, self.tp_mesh = config, group, model.config, dp_mesh, tp_mesh
        pp, rank = dist.get_world_size(group), dist.get_rank(group)
        config.check(self.cfg, pp, batch)
        n_stages = pp * config.virtual_stages
        self.stage_ids = list(range(rank, n_stages, pp))  # looped placement: rank r runs r, r + pp, ...
        # ``local``: this rank's part of the model (all its stages' blocks and tables, under the whole model's
        # names), the module to optimize, save and load; ``modules``: one per stage, sharing its submodules
        self.local = _keep_stages(copy.deepcopy(model), self.stage_ids, n_stages).to(device)
        if tp_mesh is not None:  # each held layer split over the tensor-parallel ranks, before the stages share it
            from kiln.model.tensor_parallel import apply_tp

            apply_tp(self.local, tp_mesh)
        if compile:
            for block in self.local.blocks:
                if not isinstance(block, Skip):
                    block.compile()
        self.local.checkpoint_blocks = activation_checkpointing
        self.modules = ([self.local] if len(self.stage_ids) == 1
                        else [stage_view(self.local, s, n_stages) for s in self.stage_ids])
        ignored = None
        if ep > 1:
            from kiln.model.moe.parallelize import apply_ep

            ignored = apply_ep(self.local, dp_mesh, dp_mesh.size())
        if dp_mesh is not None:
            for m in self.modules:
                apply_fsdp(m, device, bf16, dp_mesh, ignored)
        self.stages = [_stage_class()(m, s, n_stages, device, group=group) for m, s in zip(self.modules, self.stage_ids)]
        self.first, self.last = 0 in self.stage_ids, n_stages - 1 in self.stage_ids
        self.last_rank = (n_stages - 1) % pp  # the group rank that computes the loss
        fam = of(self.cfg)
        self.tied = fam.parts.tied(self.cfg) and n_stages > 1  # the head shares the token table across two stages
        self.head = self.modules[-1].get_parameter(fam.parts.head) if self.last else None
        self.table = self.modules[0].get_parameter(fam.parts.embedding) if self.first else None
        self.microbatches = config.microbatches or pp
        schedule = getattr(pipelining, SCHEDULES[config.schedule])
        # the last stage's forward computes the loss (the fused head and cross-entropy, inside the module, where
        # FSDP2 has its weights gathered): the schedule's loss function passes it on
        self.schedule = schedule(self.stages if config.schedule in LOOPED else self.stages[0],
                                 n_microbatches=self.microbatches, loss_fn=lambda loss, _: loss,
                                 scale_grads=True)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.local.parameters()

    def train(self, mode: bool = True) -> None:
        """Training or evaluation mode (dropout) for every stage."""
        for m in (self.local, *self.modules):
            m.train(mode)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under the whole model's names (a tied head, held by the last stage, under its own
        name too, as the whole model's state dict has it)."""
        return self.local.state_dict()

    def step(self, x: torch.Tensor, y: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        """Forward and backward of a batch x, y (B, T) cut into micro-batches (``kwargs``, such as a document mask,
        cut with them along dim 0); the mean loss of the micro-batches, on every rank of the group (the last stage
        computes it). Gradients are the mean over the micro-batches, and a tied head's gradient is added into the
        token table's and back, so both copies take the same step."""
        loss = self._run(self.schedule.step, x, y, kwargs).mean()
        if self.tp_mesh is not None:
            self._align_grads()
        if self.tied:
            self._sum_tied_grads()
        return loss

    def _align_grads(self) -> None:
        """Each tensor-parallel gradient in its parameter's placement: a stage's token table, row-parallel over the
        vocabulary, gets its gradient replicated (the whole table's) without the head's sharded one added to it as
        in the whole model; the optimizer and the tied sum need this rank's rows."""
        align_grads(self.parameters())

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, **kwargs: torch.Tensor) -> tuple[float, int]:
        """Forward only: the summed token cross-entropy of targets y (-100 skipped) and their count, on every rank
        of the group. A batch that does not split into the schedule's micro-batches is padded with ignored rows."""
        m = self.microbatches
        pad = -len(x) % m  # rows to add: at least m rows, a multiple of m
        if pad:
            x = torch.cat([x, x[:1].expand(pad, -1)])
            y = torch.cat([y, torch.full_like(y[:1], -100).expand(pad, -1)])
            kwargs = {k: torch.cat([v, v[:1].expand(pad, *v.shape[1:])]) for k, v in kwargs.items()}
        counts = torch.stack([(c != -100).sum() for c in y.tensor_split(m)]).to(torch.float64)
        means = self._run(self.schedule.eval, x, y, kwargs).to(torch.float64).cpu()
        total = float(sum(mu * c for mu, c in zip(means, counts) if c > 0))
        return total, int(counts.sum())

    def _run(self, fn, x: torch.Tensor, y: torch.Tensor, kwargs: dict[str, torch.Tensor]) -> torch.Tensor:
        """``fn`` (the schedule's step or eval) over the batch; each micro-batch's mean loss, on every rank."""
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        fn(*args, targets=y, target=y if self.last else None, losses=losses if self.last else None,
           return_outputs=False, **kwargs)
        m = self.microbatches
        out = (torch.stack([full_value(t).detach().float() for t in losses]) if self.last
               else torch.zeros(m, device=y.device))
        dist.broadcast(out, dist.get_global_rank(self.group, self.last_rank), group=self.group)
        return out

    def _table_rows(self) -> int:
        """Rows of the token table (or tied head) this rank holds: all of them, its tensor-parallel vocabulary
        shard's (vocab_size divides by tp), and of those its FSDP2 shard's."""
        rows = self.cfg.vocab_size // (self.tp_mesh.size() if self.tp_mesh is not None else 1)
        if self.dp_mesh is None:
            return rows
        chunks = torch.empty(rows, 0).chunk(self.dp_mesh.size())  # FSDP2's dim-0 split
        r = self.dp_mesh.get_local_rank()
        return chunks[r].size(0) if r < len(chunks) else 0

    def _sum_tied_grads(self) -> None:
        """The head's and the token table's gradients (this rank's shards of them) summed over the pipeline group,
        ranks holding neither adding zeros."""
        device = next(self.parameters()).device
        grad = torch.zeros(self._table_rows(), self.cfg.n_embd, device=device)
        for p in (self.table, self.head):
            if p is not None and p.grad is not None:
                grad += _local(p.grad)
        dist.all_reduce(grad, group=self.group)
        for p in (self.table, self.head):
            if p is not None:
                _local(p.grad).copy_(grad)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale every stage's gradients so that their global norm is at most ``max_norm`` (0: no clipping) as
        torch.nn.utils.clip_grad_norm_ does for one process; the norm before, over the whole model (a tied table
        counted once; a sharded gradient's norm is its whole norm, as DTensor computes it)."""
        grads = [p.grad for p in self.parameters() if p.grad is not None and not (self.tied and p is self.head)]
        device = next(self.parameters()).device
        sq = sum((full_value(torch.linalg.vector_norm(g)) ** 2 for g in grads), torch.zeros((), device=device))
        dist.all_reduce(sq, group=self.group)
        norm = sq.sqrt()
        if max_norm > 0:
            scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return float(norm)
