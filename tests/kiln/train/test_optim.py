"""Tests for kiln.train.optim: which parameters Muon gets in each family (and under LoRA), the cosine and
warmup-stable-decay schedules' values, MuonAdamW's state dict round trip (its own and torch.distributed.checkpoint's)
giving bit-identical next steps, one LambdaLR driving both optimizers, config errors, and FullMatrixMuon on FSDP2's
dim-0 shards (two gloo processes) matching torch's Muon on the whole matrix bit for bit.

Run: python -m pytest tests/kiln/train/test_optim.py -q   (tiny models on CPU; a few seconds)
"""

from __future__ import annotations

import copy

import pytest
import torch

from kiln.common.config import ConfigError, from_dict
from kiln.model.config import ModelConfig
from kiln.model.families import build_model
from kiln.model.lora import LoRAConfig, apply_lora
from kiln.train.optim import (FullMatrixMuon, MuonAdamW, OptimConfig, lr_lambda, make_optimizer, make_scheduler,
                              muon_update)
from ports import free_port

CPU = torch.device("cpu")
GPT2_MUON = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
LLAMA_MUON = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def tiny(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    extra = {"n_kv_head": 1, "tie_embeddings": False} if family == "llama" else {}
    return build_model(ModelConfig(family=family, vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16,
                                   dropout=0.0, **extra))


def names_of(model: torch.nn.Module, params) -> list[str]:
    ids = {id(p) for p in params}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def muon_and_adamw_names(model, optimizer) -> tuple[list[str], list[list[str]]]:
    adamw, muon = optimizer.parts
    return (names_of(model, muon.param_groups[0]["params"]),
            [names_of(model, g["params"]) for g in adamw.param_groups])


# -- which parameters go to Muon

def test_gpt2_muon_takes_the_blocks_attention_and_mlp_weights_only() -> None:
    model = tiny("gpt2")
    opt = make_optimizer(model, OptimConfig(name="muon"), CPU)
    assert isinstance(opt, MuonAdamW) and isinstance(opt.parts[1], FullMatrixMuon)
    muon, (decay, no_decay) = muon_and_adamw_names(model, opt)
    assert muon == [f"transformer.h.{i}.{w}" for i in range(2) for w in GPT2_MUON]
    assert decay == ["transformer.wte.weight", "transformer.wpe.weight"]  # the head is tied to wte
    assert no_decay == [n for n, p in model.named_parameters() if p.dim() == 1]  # norms and biases
    assert all(n.endswith(("bias", "ln_1.weight", "ln_2.weight", "ln_f.weight")) for n in no_decay)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0, 0.1]
    assert [g["lr"] for g in opt.param_groups] == [2e-3, 2e-3, 0.02]
    muon_group = opt.parts[1].param_groups[0]
    assert muon_group["momentum"] == 0.95 and muon_group["nesterov"] is True


def test_llama_muon_takes_the_layers_projections_not_embeddings_head_or_norms() -> None:
    model = tiny("llama")
    opt = make_optimizer(model, OptimConfig(name="muon", muon_lr=0.05, weight_decay=0.0), CPU)
    muon, (decay, no_decay) = muon_and_adamw_names(model, opt)
    assert muon == [f"model.layers.{i}.{w}" for i in range(2) for w in LLAMA_MUON]
    assert decay == ["model.embed_tokens.weight", "lm_head.weight"]
    assert no_decay == [f"model.layers.{i}.{n}_layernorm.weight" for i in range(2) for n in ("input", "post_attention")
                        ] + ["model.norm.weight"]
    assert opt.parts[1].param_groups[0]["lr"] == 0.05


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_adamw_is_one_fused_adamw_with_decay_on_every_matrix(family) -> None:
    model = tiny(family)
    opt = make_optimizer(model, OptimConfig(lr=3e-4, weight_decay=0.05), CPU)
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True and opt.defaults["betas"] == (0.9, 0.95)
    decay, no_decay = ([id(p) for p in g["params"]] for g in opt.param_groups)
    assert decay == [id(p) for p in model.parameters() if p.dim() >= 2]  # in model order, as before muon existed
    assert no_decay == [id(p) for p in model.parameters() if p.dim() < 2]
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(3e-4, 0.05), (3e-4, 0.0)]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_lora_with_muon_keeps_the_adapters_on_adamw_and_the_frozen_weights_out(family) -> None:
    model = tiny(family)
    apply_lora(model, LoRAConfig(enabled=True, rank=2))
    opt = make_optimizer(model, OptimConfig(name="muon"), CPU)
    assert type(opt) is torch.optim.AdamW  # no block matrix is trainable: a LoRA run with muon is an AdamW run
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert adapters and all(n.endswith(("lora_A", "lora_B")) for n in adapters)
    assert len(adapters) == 2 * 2 * (4 if family == "gpt2" else 7)
    assert [names_of(model, g["params"]) for g in opt.param_groups] == [adapters, []]
    plain = make_optimizer(model, OptimConfig(), CPU)  # the same groups as name adamw
    assert [[id(p) for p in g["params"]] for g in plain.param_groups] == [
        [id(p) for p in g["params"]] for g in opt.param_groups]


def test_frozen_block_matrices_never_reach_muon() -> None:
    model = tiny("gpt2")
    model.transformer.h[0].attn.c_attn.weight.requires_grad_(False)
    muon, _ = muon_and_adamw_names(model, make_optimizer(model, OptimConfig(name="muon"), CPU))
    assert "transformer.h.0.attn.c_attn.weight" not in muon and len(muon) == 7
    everything = {n for g in make_optimizer(model, OptimConfig(name="muon"), CPU).param_groups
                  for n in names_of(model, g["params"])}
    assert everything == {n for n, p in model.named_parameters() if p.requires_grad}


# -- schedules

def test_cosine_schedule_values_at_warmup_decay_and_end() -> None:
    f = lr_lambda(OptimConfig(warmup_steps=4, min_lr_ratio=0.1), max_steps=14)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0  # the peak right after warmup
    assert f(9) == pytest.approx(0.55, abs=1e-15)  # half way: 0.1 + 0.9 * 0.5
    assert f(14) == pytest.approx(0.1, abs=1e-15) and f(100) == pytest.approx(0.1, abs=1e-15)


def test_wsd_schedule_values_at_warmup_stable_decay_and_end() -> None:
    f = lr_lambda(OptimConfig(warmup_steps=4, min_lr_ratio=0.1, schedule="wsd", decay_fraction=0.25), max_steps=20)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]  # warmup
    assert [f(s) for s in range(4, 16)] == [1.0] * 12  # stable until step round(20 * 0.75) = 15, its first decay step
    assert [f(s) for s in range(16, 21)] == pytest.approx([0.82, 0.64, 0.46, 0.28, 0.1], abs=1e-15)  # linear decay
    assert f(20) == 0.1 and f(1000) == 0.1  # the end, and after it


def test_wsd_decay_never_starts_before_warmup_ends() -> None:
    f = lr_lambda(OptimConfig(warmup_steps=4, min_lr_ratio=0.0, schedule="wsd", decay_fraction=1.0), max_steps=8)
    assert [f(s) for s in range(9)] == [0.25, 0.5, 0.75, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    flat = lr_lambda(OptimConfig(warmup_steps=2, schedule="wsd", decay_fraction=0.0), max_steps=6)
    assert [flat(s) for s in range(6)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_one_lambda_lr_drives_both_optimizers() -> None:
    cfg = OptimConfig(name="muon", lr=1e-3, muon_lr=0.04, warmup_steps=2, schedule="wsd", decay_fraction=0.5)
    model = tiny("gpt2")
    opt = make_optimizer(model, cfg, CPU)
    sched = make_scheduler(opt, cfg, max_steps=6)
    f = lr_lambda(cfg, 6)
    for step in range(7):
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-3 * f(step)] * 2 + [0.04 * f(step)], rel=1e-12)
        assert sched.get_last_lr()[0] == pytest.approx(1e-3 * f(step), rel=1e-12)  # the logged lr is AdamW's
        train_steps(model, opt, 1, seed=step)
        sched.step()
    assert opt.parts[1].param_groups[0]["lr"] == pytest.approx(0.04 * 0.1, rel=1e-12)  # min_lr_ratio at the end


# -- config errors

@pytest.mark.parametrize("key,value,message", [
    ("name", "sgd", r"optim\.name: 'sgd' is not an optimizer; choose one of adamw, muon"),
    ("schedule", "linear", r"optim\.schedule: 'linear' is not a schedule; choose one of cosine, wsd"),
    ("decay_fraction", 1.5, r"optim\.decay_fraction: 1\.5 must be between 0 and 1"),
])
def test_unknown_optimizer_or_schedule_is_an_error_naming_the_key(key, value, message) -> None:
    with pytest.raises(ConfigError, match=message):
        from_dict(OptimConfig, {key: value}, "job.optim")


# -- state dicts

def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int, seed: int) -> None:
    """``n`` optimizer steps on random batches of 2 x 8 tokens drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, 64, (2, 9), generator=g)  # (B, T + 1)
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def twin(model: torch.nn.Module, family: str) -> torch.nn.Module:
    other = tiny(family, seed=99)
    other.load_state_dict(model.state_dict())
    return other


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_state_dict_round_trip_gives_bit_identical_next_steps(family) -> None:
    cfg = OptimConfig(name="muon", lr=1e-2, weight_decay=0.1)
    model = tiny(family)
    opt = make_optimizer(model, cfg, CPU)
    train_steps(model, opt, 3, seed=1)
    saved = copy.deepcopy(opt.state_dict())
    n_adamw = sum(len(g["params"]) for g in opt.parts[0].param_groups)
    muon_ids = saved["param_groups"][2]["params"]
    assert muon_ids == list(range(n_adamw, len(list(model.parameters()))))  # one id space, AdamW's first
    assert set(saved["state"][muon_ids[0]]) == {"momentum_buffer"} and "exp_avg" in saved["state"][0]

    other = twin(model, family)
    resumed = make_optimizer(other, cfg, CPU)
    resumed.load_state_dict(saved)
    train_steps(model, opt, 2, seed=2)
    train_steps(other, resumed, 2, seed=2)
    assert_same_params(model, other)


def test_distributed_checkpoint_state_dict_round_trip_by_parameter_name() -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    cfg, full = OptimConfig(name="muon"), StateDictOptions(full_state_dict=True)
    model = tiny("llama")
    opt = make_optimizer(model, cfg, CPU)
    train_steps(model, opt, 3, seed=1)
    _, osd = get_state_dict(model, opt, options=full)
    osd = copy.deepcopy(osd)
    assert set(osd["state"]["model.layers.0.mlp.up_proj.weight"]) == {"momentum_buffer"}
    assert set(osd["state"]["lm_head.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert osd["param_groups"][2]["params"][0] == "model.layers.0.self_attn.q_proj.weight"

    other = twin(model, "llama")
    resumed = make_optimizer(other, cfg, CPU)
    set_state_dict(other, resumed, model_state_dict=model.state_dict(), optim_state_dict=osd, options=full)
    train_steps(model, opt, 2, seed=2)
    train_steps(other, resumed, 2, seed=2)
    assert_same_params(model, other)


def test_loading_another_optimizers_state_says_so() -> None:
    model = tiny("gpt2")
    adamw_state = make_optimizer(model, OptimConfig(), CPU).state_dict()
    with pytest.raises(ValueError, match=r"2 parameter groups where MuonAdamW has 3: .*another optim\.name"):
        make_optimizer(model, OptimConfig(name="muon"), CPU).load_state_dict(adamw_state)


def test_add_param_group_is_refused_rather_than_lost() -> None:
    opt = make_optimizer(tiny("gpt2"), OptimConfig(name="muon"), CPU)
    with pytest.raises(NotImplementedError, match="optimizer.parts"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


# -- FullMatrixMuon

def test_full_matrix_muon_update_is_torchs_muon_bit_for_bit_on_plain_tensors() -> None:
    """The per-parameter step FullMatrixMuon runs on shards, on whole tensors: torch's Muon's numbers exactly."""
    torch.manual_seed(0)
    weights = [torch.randn(48, 16), torch.randn(16, 48), torch.randn(5, 3)]
    ours = [torch.nn.Parameter(w.clone()) for w in weights]
    ref = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    group = opt.param_groups[0]
    state: dict = {id(p): {} for p in ours}
    for _ in range(3):
        grads = [torch.randn_like(w) for w in weights]
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        with torch.no_grad():
            for p in ours:
                muon_update(p, state[id(p)], group)
    for p, q in zip(ours, ref):
        assert torch.equal(p, q) and torch.equal(state[id(p)]["momentum_buffer"], opt.state[q]["momentum_buffer"])


def _sharded_muon_worker(rank: int, port: int, queue) -> None:
    """Rank ``rank`` of 2: FullMatrixMuon on dim-0 shards of 3 matrices (one with uneven rows), 3 steps; puts
    (rank, whether each gathered weight and momentum equals one-process torch.optim.Muon's bit for bit)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        weights = [torch.randn(48, 16), torch.randn(16, 48), torch.randn(5, 3)]
        grads = [[torch.randn_like(w) for w in weights] for _ in range(3)]
        ref = [torch.nn.Parameter(w.clone()) for w in weights]
        shards = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in weights]
        kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
        one, ours = torch.optim.Muon(ref, **kw), FullMatrixMuon(shards, **kw)
        for step in grads:
            for p, q, g in zip(ref, shards, step):
                p.grad, q.grad = g.clone(), distribute_tensor(g.clone(), mesh, [Shard(0)])
            one.step()
            ours.step()
        queue.put((rank, [(torch.equal(q.full_tensor(), p), q.placements == (Shard(0),),
                           torch.equal(ours.state[q]["momentum_buffer"].full_tensor(), one.state[p]["momentum_buffer"]))
                          for p, q in zip(ref, shards)]))
    finally:
        dist.destroy_process_group()


def test_full_matrix_muon_on_fsdp2_shards_matches_one_process_bit_for_bit() -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_sharded_muon_worker, args=(free_port(), queue), nprocs=2, start_method="spawn")
    results = dict(queue.get() for _ in range(2))
    assert results == {r: [(True, True, True)] * 3 for r in (0, 1)}
