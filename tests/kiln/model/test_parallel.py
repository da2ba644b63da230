"""Tests for kiln.model.parallel on one process: activation checkpointing and compile change nothing numerically,
parameter names stay those of the Hugging Face layout, and misuse is named. DDP and FSDP2 on several processes
are tested in test_train_distributed.py.

Run: python -m pytest tests/kiln/model/test_parallel.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.model.config import ModelConfig
from kiln.model.families import build_model
from kiln.common.config import ConfigError
from kiln.model.parallel import MeshLayout, clip_grad_norm, describe, gradient_sync, param_digest, parallelize

CFG = dict(vocab_size=320, block_size=32, n_layer=2, n_head=2, n_embd=32)


FAMILY = {"gpt2": {}, "llama": {"family": "llama", "n_head": 4, "n_kv_head": 2}}  # llama: grouped-query attention


def make(dropout: float = 0.0, family: str = "gpt2") -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(**{**CFG, **FAMILY[family]}, dropout=dropout))


def loss_and_grads(model: torch.nn.Module, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 320, (3, 16), generator=g)
    y = torch.randint(0, 320, (3, 16), generator=g)
    torch.manual_seed(seed)  # the same dropout masks for both models
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", list(FAMILY))
def test_activation_checkpointing_gives_bit_identical_loss_and_gradients_even_with_dropout(family) -> None:
    plain, recomputed = make(0.1, family), make(0.1, family)
    parallelize(recomputed, "none", activation_checkpointing=True, compile=False, device=torch.device("cpu"))
    assert recomputed.checkpoint_blocks and not plain.checkpoint_blocks
    (l1, g1), (l2, g2) = loss_and_grads(plain), loss_and_grads(recomputed)
    assert torch.equal(l1, l2)
    for name in g1:
        assert torch.equal(g1[name], g2[name]), name
    with torch.no_grad():  # no recomputation (nor its bookkeeping) when nothing is kept for backward
        recomputed(torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("family", list(FAMILY))
def test_compile_keeps_parameter_names_and_outputs(family) -> None:
    plain, compiled = make(family=family), make(family=family)
    out = parallelize(compiled, "none", activation_checkpointing=True, compile=True, device=torch.device("cpu"),
                      compile_backend="eager")  # the wiring, without the C++ toolchain inductor needs
    assert out is compiled
    assert list(compiled.state_dict()) == list(plain.state_dict())  # release export needs the HF names
    (l1, g1), (l2, g2) = loss_and_grads(plain), loss_and_grads(compiled)
    assert torch.allclose(l1, l2) and all(torch.allclose(g1[n], g2[n], atol=1e-6) for n in g1)


def test_strategies_need_a_process_group_and_a_known_name() -> None:
    with pytest.raises(ValueError, match=r"job\.parallelism='ddp' needs several ranks: launch with torchrun"):
        parallelize(make(), "ddp", False, False, torch.device("cpu"))
    with pytest.raises(ValueError, match="must be one of none, ddp, fsdp, not 'zero'"):
        parallelize(make(), "zero", False, False, torch.device("cpu"))
    assert describe("fsdp", True, True) == "fsdp, activation checkpointing, torch.compile"
    assert describe("none", False, False) == "one rank"


def test_gradient_sync_is_a_no_op_unwrapped_and_clipping_reports_the_norm() -> None:
    m = make()
    with gradient_sync(m, enabled=False):
        loss_and_grads(m)
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in m.parameters()])).item()
    assert clip_grad_norm(m, 0) == pytest.approx(total)  # 0: measured, not clipped
    assert clip_grad_norm(m, 0.5) == pytest.approx(total)  # the norm before clipping ...
    after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in m.parameters()])).item()
    assert after == pytest.approx(min(total, 0.5), rel=1e-4)  # ... and the gradients clipped to 0.5


def test_param_digest_tells_models_apart() -> None:
    a, b = make(), make()
    assert param_digest(a) == param_digest(b)
    with torch.no_grad():
        b.transformer.h[1].mlp.c_fc.bias[3] += 1e-7
    assert param_digest(a) != param_digest(b)


def test_parallel_config_fills_dp_shard_with_the_ranks_the_other_sizes_leave() -> None:
    assert MeshLayout().resolve(8) == MeshLayout(1, 8, 1)
    assert MeshLayout(tp=8).resolve(64).sizes == (1, 1, 8, 8)  # (pp, dp_replicate, dp_shard, tp)
    assert MeshLayout(dp_replicate=2, tp=2).resolve(8).sizes == (1, 2, 2, 2)
    assert MeshLayout(dp_replicate=2, tp=2).resolve(8).describe() == "dp_replicate 2 x dp_shard 2 x tp 2"
    assert MeshLayout(tp=8, pp=16).resolve(16384).sizes == (16, 1, 128, 8)  # Llama 3 405B's layout
    assert MeshLayout(tp=8, pp=16).resolve(16384).describe() == "pp 16 x dp_shard 128 x tp 8"
    assert MeshLayout().resolve(1).describe() == "one rank"


@pytest.mark.parametrize("parallel, world, message", [
    (MeshLayout(tp=3), 8, "parallel: pp 1 x dp_replicate 1 x dp_shard -1 x tp 3 must multiply to the world size 8; "
                              "each size must divide it (1, 2, 4, 8)"),
    (MeshLayout(dp_shard=2, tp=2), 8, "must multiply to the world size 8"),
    (MeshLayout(tp=0), 8, "parallel.tp: 0 must be at least 1"),
    (MeshLayout(pp=0), 8, "parallel.pp: 0 must be at least 1"),
    (MeshLayout(pp=3), 8, "parallel: pp 3 x dp_replicate 1 x dp_shard -1 x tp 1 must multiply to the world size 8"),
    (MeshLayout(dp_shard=0), 8, r"parallel.dp_shard: 0 must be at least 1 \(or -1"),
])
def test_a_layout_that_does_not_fit_the_world_is_a_config_error_naming_the_field(parallel, world, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(1, 2", r"\(1, 2").replace("8)", r"8\)")):
        parallel.resolve(world)


def test_the_model_decides_which_tensor_parallel_sizes_are_legal() -> None:
    cfg = ModelConfig(**{**CFG, **FAMILY["llama"]})  # 4 heads, 2 key/value heads
    assert MeshLayout(tp=2).resolve(4, cfg).sizes == (1, 1, 2, 2)
    assert MeshLayout(pp=2).resolve(4, cfg).sizes == (2, 1, 2, 1)
    with pytest.raises(ConfigError, match=r"parallel.pp: 4 pipeline stages must divide the 2 layers \(model.n_layer\); "
                                          "pp may be 1, 2"):
        MeshLayout(pp=4).resolve(4, cfg)
    with pytest.raises(ConfigError, match=r"parallel.tp: 4 does not divide model.n_kv_head \(2\)"):
        MeshLayout(tp=4).resolve(4, cfg)
    gpt2 = ModelConfig(**{**CFG, "n_head": 4})
    assert MeshLayout(dp_replicate=2, dp_shard=1, tp=2).resolve(4, gpt2).sizes == (1, 2, 1, 2)
    assert MeshLayout(tp=2).resolve(4, gpt2).sizes == (1, 1, 2, 2)  # FSDP2 x TP: its q|k|v rows rank-interleaved
