"""Tests for kiln.train.optim: which parameters Muon gets in each family (and under LoRA), the cosine and
warmup-stable-decay schedules' values, MuonAdamW as one torch Optimizer (its groups' kinds and defaults, hooks, its
state dict round trip, its own and torch.distributed.checkpoint's, giving bit-identical next steps, older
checkpoints without kinds), one LambdaLR driving both kinds, config errors, Muon's arithmetic against torch's own
(Newton-Schulz and the lr rule bit for bit, and whole steps against torch.optim.AdamW plus torch.optim.Muon), and on
FSDP2 (two gloo processes) each rank orthogonalising only the matrices it owns, with one process's numbers.

Run: python -m pytest tests/kiln/train/test_optim.py -q   (tiny models on CPU; a few seconds)
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from kiln.common.config import ConfigError, from_dict
from kiln.model.config import ModelConfig
from kiln.model.families import build_model
from kiln.model.lora import LoRAConfig, apply_lora
from kiln.train.optim import (NS_COEFFICIENTS, NS_EPS, NS_STEPS, MuonAdamW, OptimConfig, deal, lr_lambda,
                              make_optimizer, make_scheduler, muon_lr, newton_schulz, ns_dtype)
from ranks import on_ranks

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
    groups = {kind: [g for g in optimizer.param_groups if g["kind"] == kind] for kind in ("adamw", "muon")}
    (muon,) = groups["muon"]
    return names_of(model, muon["params"]), [names_of(model, g["params"]) for g in groups["adamw"]]


# -- which parameters go to Muon

def test_gpt2_muon_takes_the_blocks_attention_and_mlp_weights_only() -> None:
    model = tiny("gpt2")
    opt = make_optimizer(model, OptimConfig(name="muon"), CPU)
    assert isinstance(opt, MuonAdamW) and [g["kind"] for g in opt.param_groups] == ["adamw", "adamw", "muon"]
    muon, (decay, no_decay) = muon_and_adamw_names(model, opt)
    assert muon == [f"transformer.h.{i}.{w}" for i in range(2) for w in GPT2_MUON]
    assert decay == ["transformer.wte.weight", "transformer.wpe.weight"]  # the head is tied to wte
    assert no_decay == [n for n, p in model.named_parameters() if p.dim() == 1]  # norms and biases
    assert all(n.endswith(("bias", "ln_1.weight", "ln_2.weight", "ln_f.weight")) for n in no_decay)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0, 0.1]
    assert [g["lr"] for g in opt.param_groups] == [2e-3, 2e-3, 0.02]
    adamw_group, _, muon_group = opt.param_groups
    assert muon_group["momentum"] == 0.95 and muon_group["nesterov"] is True
    assert (muon_group["ns_coefficients"], muon_group["ns_steps"], muon_group["eps"]) == ((3.4445, -4.7750, 2.0315),
                                                                                          5, 1e-7)
    assert adamw_group["betas"] == (0.9, 0.95) and adamw_group["eps"] == 1e-8 and adamw_group["fused"] is True


def test_llama_muon_takes_the_layers_projections_not_embeddings_head_or_norms() -> None:
    model = tiny("llama")
    opt = make_optimizer(model, OptimConfig(name="muon", muon_lr=0.05, weight_decay=0.0), CPU)
    muon, (decay, no_decay) = muon_and_adamw_names(model, opt)
    assert muon == [f"model.layers.{i}.{w}" for i in range(2) for w in LLAMA_MUON]
    assert decay == ["model.embed_tokens.weight", "lm_head.weight"]
    assert no_decay == [f"model.layers.{i}.{n}_layernorm.weight" for i in range(2) for n in ("input", "post_attention")
                        ] + ["model.norm.weight"]
    assert opt.param_groups[2]["lr"] == 0.05


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
    assert opt.param_groups[2]["lr"] == pytest.approx(0.04 * 0.1, rel=1e-12)  # min_lr_ratio at the end


# -- config errors

@pytest.mark.parametrize("key,value,message", [
    ("name", "sgd", r"optim\.name: 'sgd' is not an optimizer; choose one of adamw, muon"),
    ("schedule", "linear", r"optim\.schedule: 'linear' is not a schedule; choose one of cosine, wsd"),
    ("decay_fraction", 1.5, r"optim\.decay_fraction is 1\.5: give 0 <= x <= 1"),
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
    n_adamw = sum(len(g["params"]) for g in opt.param_groups[:2])
    muon_ids = saved["param_groups"][2]["params"]
    assert muon_ids == list(range(n_adamw, len(list(model.parameters()))))  # one id space, AdamW's first
    assert set(saved["state"][muon_ids[0]]) == {"momentum_buffer"} and "exp_avg" in saved["state"][0]

    assert [g["kind"] for g in saved["param_groups"]] == ["adamw", "adamw", "muon"]

    other, older = twin(model, family), twin(model, family)
    resumed, from_older = make_optimizer(other, cfg, CPU), make_optimizer(older, cfg, CPU)
    resumed.load_state_dict(copy.deepcopy(saved))  # a load keeps the given tensors: each optimizer its own copy
    # a state whose groups say no kind (older checkpoints') takes the kinds by position
    older_state = copy.deepcopy(saved)
    from_older.load_state_dict({**older_state, "param_groups": [{k: v for k, v in g.items() if k != "kind"}
                                                                for g in older_state["param_groups"]]})
    assert [g["kind"] for g in from_older.param_groups] == ["adamw", "adamw", "muon"]
    for m, o in ((model, opt), (other, resumed), (older, from_older)):
        train_steps(m, o, 2, seed=2)
    assert_same_params(model, other)
    assert_same_params(model, older)


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


def test_add_param_group_takes_a_kind_and_its_defaults_and_refuses_other_groups() -> None:
    opt = make_optimizer(tiny("gpt2"), OptimConfig(name="muon"), CPU)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, 2))], "kind": "muon", "momentum": 0.9})
    added = opt.param_groups[-1]
    assert (added["lr"], added["weight_decay"], added["momentum"], added["ns_steps"]) == (0.02, 0.1, 0.9, 5)
    with pytest.raises(ValueError, match="kind is 'adamw' or 'muon', not None"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    with pytest.raises(ValueError, match=r"'muon' group holds matrices only, found shapes \[\(2,\)\]"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "kind": "muon"})
    with pytest.raises(TypeError, match="betas not Muon settings"):
        MuonAdamW([], muon={"betas": (0.9, 0.9)})
    assert len(opt.param_groups) == 4  # the refused groups left nothing behind


def test_muon_adamw_is_one_torch_optimizer_whose_groups_take_their_kinds_defaults() -> None:
    w, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.zeros(4))
    opt = MuonAdamW([{"params": [b], "kind": "adamw"}, {"params": [w], "kind": "muon", "lr": 0.5}],
                    adamw={"lr": 3e-4, "betas": (0.8, 0.9)}, muon={"momentum": 0.9})
    adamw, muon = opt.param_groups
    assert (adamw["lr"], adamw["betas"], adamw["eps"], adamw["weight_decay"]) == (3e-4, (0.8, 0.9), 1e-8, 1e-2)
    assert (muon["lr"], muon["momentum"], muon["weight_decay"], muon["nesterov"]) == (0.5, 0.9, 0.1, True)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    opt.step()
    assert calls == ["pre", "post"]
    assert set(opt.state[w]) == {"momentum_buffer"} and set(opt.state[b]) == {"step", "exp_avg", "exp_avg_sq"}
    assert b.tolist() == pytest.approx([-3e-4] * 4)  # AdamW's first step: lr * sign(grad)
    opt.zero_grad()
    assert w.grad is None and b.grad is None


# -- Muon's arithmetic, against torch's

def torch_private(name: str):
    """torch.optim._muon's private ``name``, the reference while this torch has it (a skip once it is gone)."""
    module = pytest.importorskip("torch.optim._muon")
    if not hasattr(module, name):
        pytest.skip(f"torch {torch.__version__} no longer has torch.optim._muon.{name}")
    return getattr(module, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_newton_schulz_is_torchs_bit_for_bit(dtype) -> None:
    zeropower = torch_private("_zeropower_via_newtonschulz")
    gen = torch.Generator().manual_seed(0)
    for shape in [(48, 16), (16, 48), (32, 32), (5, 3), (1, 7), (300, 97), (97, 300)]:
        g = torch.randn(shape, generator=gen).to(dtype)
        before = g.clone()
        ours = newton_schulz(g, dtype=torch.bfloat16)
        theirs = zeropower(g.clone(), NS_COEFFICIENTS, NS_STEPS, NS_EPS)
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs), shape
        assert torch.equal(g, before)  # the input is left as it was
    zeros = torch.zeros(4, 6, dtype=dtype)  # eps keeps the division finite
    assert torch.equal(newton_schulz(zeros, dtype=torch.bfloat16),
                       zeropower(zeros.clone(), NS_COEFFICIENTS, NS_STEPS, NS_EPS))
    assert not newton_schulz(zeros).isnan().any()


def test_newton_schulz_runs_in_bf16_where_it_is_fast_and_in_fp32_on_cpus_without_avx512(monkeypatch) -> None:
    for capability, dtype in (("AVX512", torch.bfloat16), ("AVX2", torch.float32), ("DEFAULT", torch.float32)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert ns_dtype(CPU) == dtype, capability
        assert newton_schulz(torch.randn(6, 4)).dtype == dtype, capability
        assert ns_dtype(torch.device("cuda")) == torch.bfloat16  # no CUDA needed to choose
    g = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    fp32, bf16 = newton_schulz(g, dtype=torch.float32), newton_schulz(g, dtype=torch.bfloat16)
    assert (fp32 - bf16.float()).abs().max() < 0.02  # the same update, bf16's rounding apart
    assert not torch.equal(fp32, bf16.float())


def test_newton_schulz_takes_the_singular_values_near_one() -> None:
    gen = torch.Generator().manual_seed(0)
    for shape, dtype in itertools.product([(64, 32), (32, 64), (512, 128)], [torch.bfloat16, torch.float32]):
        g = torch.randn(shape, generator=gen)
        before, after = torch.linalg.svdvals(g), torch.linalg.svdvals(newton_schulz(g, dtype=dtype).float())
        assert before.max() / before.min() > 2.5, shape  # a spread of singular values ...
        assert 0.6 < after.min() and after.max() < 1.2, (shape, dtype)  # ... brought near 1


def test_fp32_newton_schulz_of_wide_enough_matrices_is_the_same_polynomial_through_the_gram_eigendecomposition(
        monkeypatch) -> None:
    import kiln.train.optim as optim

    assert [optim.spectral_pays(*s) for s in [(256, 512), (256, 704), (512, 512), (1024, 1024)]] == [True] * 4
    assert not any(optim.spectral_pays(*s) for s in [(256, 511), (256, 256), (128, 512), (64, 4096)])
    gen = torch.Generator().manual_seed(0)
    for shape in [(256, 704), (704, 256), (256, 512), (512, 512)]:
        g = torch.randn(shape, generator=gen)
        exact = newton_schulz(g.double(), dtype=torch.float64)  # the iteration, in fp64
        spectral = newton_schulz(g, dtype=torch.float32)
        with monkeypatch.context() as m:
            m.setattr(optim, "spectral_pays", lambda small, large: False)
            iteration = newton_schulz(g, dtype=torch.float32)
        assert spectral.shape == shape and spectral.dtype == torch.float32
        assert not torch.equal(spectral, iteration)  # the eigendecomposition was taken ...
        assert (spectral.double() - exact).abs().max() < 5e-6  # ... and gives the iteration's matrix
        assert (iteration.double() - exact).abs().max() < 5e-6
    small = torch.randn(16, 48, generator=gen)  # the polynomial itself, on a shape the rule leaves to the products
    x = small / small.norm()
    exact = newton_schulz(small.double(), dtype=torch.float64)
    assert (optim.spectral_newton_schulz(x).double() - exact).abs().max() < 1e-5


def test_fp32_newton_schulz_of_a_zero_or_non_finite_update_stays_torchs(monkeypatch) -> None:
    zeros = torch.zeros(256, 512)
    assert torch.equal(newton_schulz(zeros, dtype=torch.float32), zeros)  # eigh of a zero Gram matrix: zeros back
    bad = torch.randn(256, 512)
    bad[3, 5] = float("nan")  # eigh refuses it; the iteration runs and the NaN spreads, as in torch's Muon
    assert newton_schulz(bad, dtype=torch.float32).isnan().all()


def test_muon_lr_is_torchs_rule() -> None:
    adjust = torch_private("_adjust_lr")
    for shape in [(48, 16), (16, 48), (32, 32), (2048, 512), (3, 7)]:
        assert muon_lr(0.02, shape) == adjust(0.02, None, torch.Size(shape)), shape
    assert muon_lr(0.02, (64, 16)) == 0.04 and muon_lr(0.02, (16, 64)) == 0.02


@pytest.fixture
def bf16_newton_schulz(monkeypatch) -> None:
    """Newton-Schulz in torch's Muon's bf16 on every CPU, for the bit-for-bit comparisons with it; one matrix at a
    time, as torch's Muon runs it (stacks against one at a time: test_a_stack_is_orthogonalised_as_its_matrices_...)."""
    import kiln.train.optim as optim

    monkeypatch.setattr(optim, "ns_dtype", lambda device: torch.bfloat16)
    monkeypatch.setattr(optim, "NS_BATCH_BYTES", 0)


def test_ns_batches_stack_one_shape_where_newton_schulz_runs_in_bf16(monkeypatch) -> None:
    import kiln.train.optim as optim

    group = {"ns_coefficients": list(NS_COEFFICIENTS), "ns_steps": NS_STEPS, "eps": NS_EPS}  # a list, as loaded
    other = {**group, "ns_steps": 3}
    params = [(torch.zeros(4, 8), group), (torch.zeros(8, 4), group), (torch.zeros(8, 8), group),
              (torch.zeros(4, 8), other), (torch.zeros(4, 8), group), (torch.zeros(4, 8), group)]
    shapes = lambda batches: [[(tuple(p.shape), g["ns_steps"]) for p, g in b] for b in batches]  # noqa: E731
    monkeypatch.setattr(optim, "ns_dtype", lambda device: torch.bfloat16)
    # a tall matrix is not stacked with wide ones: torch's Muon multiplies it from its transposed layout
    assert shapes(optim.ns_batches(params)) == [[((4, 8), 5)] * 3, [((8, 4), 5)], [((8, 8), 5)], [((4, 8), 3)]]
    monkeypatch.setattr(optim, "NS_BATCH_BYTES", 2 * 32 * 2)  # room for two 4 x 8 bf16 matrices a batch
    assert shapes(optim.ns_batches(params))[:2] == [[((4, 8), 5)] * 2, [((4, 8), 5)]]
    monkeypatch.setattr(optim, "ns_dtype", lambda device: torch.float32)  # CPUs without AVX-512: one at a time
    assert shapes(optim.ns_batches(params)) == [[((4, 8), 5)], [((8, 4), 5)], [((8, 8), 5)], [((4, 8), 3)],
                                                [((4, 8), 5)], [((4, 8), 5)]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_stack_is_orthogonalised_as_its_matrices_one_at_a_time(dtype, monkeypatch) -> None:
    import kiln.train.optim as optim

    monkeypatch.setattr(optim, "ns_dtype", lambda device: dtype)
    gen = torch.Generator().manual_seed(0)
    updates = [torch.randn(96, 32, generator=gen) for _ in range(3)]  # tall: orthogonalised from the transposed side
    group = {"ns_coefficients": NS_COEFFICIENTS, "ns_steps": NS_STEPS, "eps": NS_EPS}
    stacked, alone = optim.orthogonalise(updates, group), [newton_schulz(u, dtype=dtype) for u in updates]
    for u, s, a in zip(updates, stacked, alone):
        assert s.shape == u.shape and s.dtype == dtype
        # each matrix by its own norm, the same iteration: at most bf16's rounding apart where its products are emulated
        assert (s.float() - a.float()).abs().max() < (1e-5 if dtype == torch.float32 else 0.02)
    if dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        # where Kiln stacks on CPU (native bf16 products), bit for bit: a stacked run keeps one-at-a-time weights
        assert all(torch.equal(s, a) for s, a in zip(stacked, alone))
    assert optim.orthogonalise(updates[:1], group)[0].shape == (96, 32)


class Both:
    """torch.optim.AdamW and torch.optim.Muon stepped one after the other, as one optimizer."""

    def __init__(self, *parts: torch.optim.Optimizer):
        self.parts = parts

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_muon_adamw_steps_as_torchs_adamw_and_muon_bit_for_bit(family, bf16_newton_schulz) -> None:
    cfg = OptimConfig(name="muon", lr=1e-2, weight_decay=0.1)
    model = tiny(family)
    ref = twin(model, family)
    opt = make_optimizer(model, cfg, CPU)
    muon, (decay, no_decay) = muon_and_adamw_names(model, opt)
    by_name = dict(ref.named_parameters())
    adamw = torch.optim.AdamW([{"params": [by_name[n] for n in decay], "weight_decay": 0.1},
                               {"params": [by_name[n] for n in no_decay], "weight_decay": 0.0}],
                              lr=1e-2, betas=(0.9, 0.95), fused=True)
    torch_muon = torch.optim.Muon([by_name[n] for n in muon], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    train_steps(model, opt, 3, seed=1)
    train_steps(ref, Both(adamw, torch_muon), 3, seed=1)
    assert_same_params(model, ref)
    ours = dict(model.named_parameters())
    for n in muon:
        assert torch.equal(opt.state[ours[n]]["momentum_buffer"], torch_muon.state[by_name[n]]["momentum_buffer"]), n


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_groups_alone_are_torchs_muon_bit_for_bit(nesterov, bf16_newton_schulz) -> None:
    torch.manual_seed(0)
    weights = [torch.randn(48, 16), torch.randn(16, 48), torch.randn(5, 3)]
    ours = [torch.nn.Parameter(w.clone()) for w in weights]
    ref = [torch.nn.Parameter(w.clone()) for w in weights]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov)
    theirs, mine = torch.optim.Muon(ref, **kw), MuonAdamW([{"params": ours, "kind": "muon"}], muon=kw)
    for _ in range(3):
        for p, q in zip(ours, ref):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        theirs.step()
        mine.step()
    for p, q in zip(ours, ref):
        assert torch.equal(p, q) and torch.equal(mine.state[p]["momentum_buffer"], theirs.state[q]["momentum_buffer"])


def test_deal_gives_the_costliest_matrices_out_first_each_to_the_least_loaded_rank() -> None:
    # one iteration's cost: (8, 8) 1536, (64, 16) and (16, 64) 36864 each, (32, 32) 98304
    assert deal([(8, 8), (64, 16), (16, 64), (8, 8), (32, 32)], 2) == ([4, 1, 2, 0, 3], [1, 1, 1, 1, 0])
    assert deal([(16, 16)] * 7, 3) == (list(range(7)), [0, 1, 2, 0, 1, 2, 0])  # equal costs: round robin
    assert deal([(4, 4), (2, 2)], 1) == ([0, 1], [0, 0])


# -- FSDP2: two gloo processes

def _join_gloo(rank: int, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)


def _count_newton_schulz() -> list[tuple[int, int]]:
    """The shapes kiln.train.optim orthogonalises in this process from now on, in order."""
    import kiln.train.optim as optim

    seen, ns = [], optim.newton_schulz
    optim.newton_schulz = lambda g, *args: seen.append(tuple(g.shape)) or ns(g, *args)
    return seen


def _sharded_muon_worker(rank: int, port: int, queue) -> None:
    """Rank ``rank`` of 2: MuonAdamW's Muon on dim-0 shards of 4 matrices (uneven rows; the last one's row on rank 0
    only), 3 steps; puts (rank, (whether each gathered weight and momentum equals one-process torch.optim.Muon's bit
    for bit and is still Shard(0)), the shapes this rank orthogonalised)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import kiln.train.optim as optim

    _join_gloo(rank, port)
    optim.ns_dtype = lambda device: torch.bfloat16  # torch's Muon's, on every CPU (this process only)
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        weights = [torch.randn(48, 16), torch.randn(16, 48), torch.randn(5, 3), torch.randn(1, 4)]
        grads = [[torch.randn_like(w) for w in weights] for _ in range(3)]
        ref = [torch.nn.Parameter(w.clone()) for w in weights]
        shards = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in weights]
        kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
        one, ours = torch.optim.Muon(ref, **kw), MuonAdamW([{"params": shards, "kind": "muon"}], muon=kw)
        seen = _count_newton_schulz()
        for step in grads:
            for p, q, g in zip(ref, shards, step):
                p.grad, q.grad = g.clone(), distribute_tensor(g.clone(), mesh, [Shard(0)])
            one.step()
            ours.step()
        queue.put((rank, ([(torch.equal(q.full_tensor(), p), q.placements == (Shard(0),),
                            torch.equal(ours.state[q]["momentum_buffer"].full_tensor(),
                                        one.state[p]["momentum_buffer"])) for p, q in zip(ref, shards)], seen)))
    finally:
        dist.destroy_process_group()


def test_muon_on_fsdp2_shards_orthogonalises_each_matrix_on_one_rank_with_one_process_numbers() -> None:
    results = on_ranks(_sharded_muon_worker, 2)
    # deal: (48, 16) to rank 0, (16, 48) to rank 1, then (5, 3) to rank 0 on the tie, (1, 4) to rank 1
    assert results == {0: ([(True, True, True)] * 4, [(48, 16), (5, 3)] * 3),
                       1: ([(True, True, True)] * 4, [(16, 48), (1, 4)] * 3)}


def _fsdp_model_worker(rank: int, port: int, queue) -> None:
    """Rank ``rank`` of 2: a tiny llama under FSDP2 (kiln's apply_fsdp) with make_optimizer's MuonAdamW, 3 steps on
    batches both ranks share, beside the same model and steps unsharded in this process; puts (rank, (the largest
    difference of any gathered parameter from the unsharded one, the muon matrices' shapes in order, the shapes this
    rank orthogonalised))."""
    import torch.distributed as dist

    from kiln.model.parallel import apply_fsdp

    _join_gloo(rank, port)
    try:
        cfg = OptimConfig(name="muon", lr=1e-2, weight_decay=0.1)
        one = tiny("llama")
        sharded = twin(one, "llama")
        apply_fsdp(sharded, CPU, bf16=False)
        train_steps(one, make_optimizer(one, cfg, CPU), 3, seed=1)
        opt = make_optimizer(sharded, cfg, CPU)
        seen = _count_newton_schulz()
        train_steps(sharded, opt, 3, seed=1)
        diff = max((p.full_tensor() - q).abs().max().item()
                   for p, q in zip(sharded.parameters(), one.parameters(), strict=True))
        queue.put((rank, (diff, [tuple(p.shape) for p in opt.param_groups[2]["params"]], seen)))
    finally:
        dist.destroy_process_group()


def test_fsdp2_training_with_muon_matches_one_process_with_the_work_split_between_ranks() -> None:
    results = on_ranks(_fsdp_model_worker, 2)
    (diff0, shapes, seen0), (diff1, _, seen1) = results[0], results[1]
    assert len(shapes) == 14 and diff0 == diff1 and diff0 <= 1e-6
    _, owner = deal(shapes, 2)
    for rank, seen in ((0, seen0), (1, seen1)):
        assert sorted(seen) == sorted([s for s, o in zip(shapes, owner) if o == rank] * 3)
    assert 0 < len(seen0) < 3 * 14 and len(seen0) + len(seen1) == 3 * 14


def test_lr_schedule_warmup_then_cosine_to_min() -> None:
    f = lr_lambda(OptimConfig(warmup_steps=4, min_lr_ratio=0.1), max_steps=14)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.55)  # half way: 0.1 + 0.9 * 0.5
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
