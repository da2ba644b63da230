"""Tests for kiln.model.tensor_parallel: tensor + sequence parallelism on two gloo processes trains both families as one
process does (AdamW steps with gradient clipping: losses, logits and weights; 30 for a tied llama with activation
checkpointing and a masked prompt, and for Muon; a few for muP models of both families), with the vocabulary-parallel
fused loss (masked targets too), a tied head still tied, activation checkpointing; FSDP2 over the tensor-parallel shards
on a 2 x 2 mesh (four processes); their sharded checkpoints loaded in one process with the same logits; and the layout
checks.

Run: python -m pytest tests/kiln/model/test_tensor_parallel.py -q   (a launch of two processes and one of four)
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from kiln.common.config import ConfigError
from kiln.model.config import ModelConfig
from kiln.model.tensor_parallel import check_tp
from ranks import on_ranks

STEPS = 30
SHORT = 5  # steps for the cases whose 30-step curve the training job's tests check
CASES = {  # name -> ModelConfig fields beyond the shared ones
    "gpt2": {},  # tied head, biases, the fused q|k|v projection
    "llama": {"family": "llama", "n_kv_head": 2, "tie_embeddings": False},  # grouped-query attention
    "llama-tied": {"family": "llama", "n_kv_head": 2, "tie_embeddings": True},
    # muP at twice its base width (kiln.model.mup): the attention scale and the output multiplier on sharded tensors
    "gpt2-mup": {"mup_base_width": 16},
    "llama-mup": {"family": "llama", "n_kv_head": 2, "tie_embeddings": True, "mup_base_width": 16},
}
SHARED = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0)


def _batches(n: int, masked: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, 64, (4, 16), generator=gen)
        y = (3 * x + 1) % 64  # a rule to learn: each token's successor is a function of it
        if masked:
            y[:, :5] = -100  # a prompt left out of the loss
        out.append((x, y))
    return out


def _train_both(fields: dict, checkpoint_blocks: bool, masked: bool, mesh, dp_mesh=None, optim: str = "adamw",
                save_to: str | None = None, steps: int = STEPS) -> dict:
    """The same seeded model trained ``steps`` steps in this process whole and tensor-parallel (over ``mesh``; with
    ``dp_mesh`` also FSDP2-sharded over it, each data-parallel rank taking its rows of the batch); what differs."""
    import torch.distributed as dist

    from kiln.model.families import build_model, of
    from kiln.model.parallel import apply_fsdp, clip_grad_norm, full_value
    from kiln.model.tensor_parallel import apply_tp

    torch.manual_seed(0)
    one = build_model(ModelConfig(**{**SHARED, **fields}))
    tp = apply_tp(copy.deepcopy(one), mesh)
    if dp_mesh is not None:
        apply_fsdp(tp, torch.device("cpu"), False, dp_mesh)
    dp, dp_size = (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh is not None else (0, 1)
    tp.checkpoint_blocks = one.checkpoint_blocks = checkpoint_blocks
    if optim == "muon":  # kiln's MuonAdamW: Muon on the block matrices, AdamW on the rest
        import kiln.train.optim as kiln_optim
        from kiln.train.optim import OptimConfig, make_optimizer

        # Newton-Schulz in fp32 on every CPU (this worker process only): in bf16 (what AVX-512 CPUs get) a last-bit
        # difference in one gradient, from the other summation order, flips bf16 roundings of the update and the two
        # curves drift apart by 5e-4 in 30 steps, which says nothing about tensor parallelism
        kiln_optim.ns_dtype = lambda device: torch.float32

        opts = [make_optimizer(m, OptimConfig(name="muon", lr=1e-2), torch.device("cpu")) for m in (one, tp)]
    else:
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (one, tp)]
    loss_diff, norm_diff = 0.0, 0.0
    for x, y in _batches(steps, masked):
        losses, norms = [], []
        rows = slice(dp * len(x) // dp_size, (dp + 1) * len(x) // dp_size)
        for model, opt, (bx, by) in zip((one, tp), opts, ((x, y), (x[rows], y[rows]))):
            loss = model(bx, by)
            loss.backward()
            norms.append(clip_grad_norm(model, 1.0))
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(full_value(loss.detach())))
        if dp_mesh is not None:  # the mean over data-parallel ranks (equal counts of targets: nothing masked)
            mean = torch.tensor(losses[1])
            dist.all_reduce(mean, group=dp_mesh.get_group())
            losses[1] = mean.item() / dp_size
        loss_diff = max(loss_diff, abs(losses[0] - losses[1]))
        norm_diff = max(norm_diff, abs(norms[0] - norms[1]))
    with torch.no_grad():
        logits = (full_value(tp(x)) - one(x)).abs().max().item()
        want = one(x)  # what the tensor-parallel checkpoint must give back in one process
    if save_to is not None:  # as the trainer's Checkpointer writes them
        from dataclasses import asdict

        from kiln.train.checkpointer import Checkpointer

        sharded = not of(tp.config).parallelize.tp_interleaved  # GPT-2's rank-interleaved q|k|v: a full checkpoint, gathered
        ckpt = Checkpointer(Path(save_to), dist.get_rank(), dist.get_world_size(), sharded=sharded, async_save=False,
                            keep_last=1)
        ckpt.save(steps, tp, opts[1], {}, {"model": asdict(tp.config)})
    from kiln.model.tensor_parallel import canonical_state, interleaved_params

    full = canonical_state({n: full_value(p.detach()) for n, p in tp.named_parameters()}, interleaved_params(tp))
    weights = max((full[n] - q.detach()).abs().max().item()  # in the model's own order (GPT-2's q|k|v)
                  for (n, _), q in zip(tp.named_parameters(), one.parameters(), strict=True))
    head, emb = tp.lm_head.weight, tp.get_submodule(of(tp.config).parts.embedding_module).weight
    return {"loss": loss_diff, "grad_norm": norm_diff, "logits": logits, "weights": weights, "last": losses[0],
            "first_block": {n: str(tuple(p.placements)) for n, p in tp.named_parameters() if ".0." in n},
            "tied": head is emb, "head": str(tuple(head.placements)),
            "x": x.tolist(), "want": want.tolist()}  # lists: a tensor on the queue dies with its process


def _worker(rank: int, port: int, queue, root: str) -> None:
    import torch.distributed as dist

    from kiln.model.parallel import MeshLayout, build_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = build_mesh(MeshLayout(tp=2), "cpu")  # (dp_replicate 1, dp_shard 1, tp 2)
        sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
        mesh = mesh["tp"]
        # the plain families for their shard placements and checkpoints (their 30-step curves under the training job:
        # tests/kiln/train/test_train_tensor_parallel.py)
        out = {name: _train_both(CASES[name], False, False, mesh, save_to=f"{root}/{name}", steps=SHORT)
               for name in ("gpt2", "llama")}
        out.update({name: _train_both(CASES[name], False, False, mesh, steps=SHORT)
                    for name in ("gpt2-mup", "llama-mup")})
        # a tied llama, with a prompt masked out of the loss and activation checkpointing
        out["llama-tied"] = _train_both(CASES["llama-tied"], True, True, mesh)
        out["gpt2-muon"] = _train_both(CASES["gpt2"], False, False, mesh, optim="muon")
        out["mesh"] = sizes
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def _fsdp_worker(rank: int, port: int, queue, root: str) -> None:
    """Rank ``rank`` of 4 on a (dp_shard 2, tp 2) mesh: a tied llama under FSDP2 x TP, with Muon."""
    import torch.distributed as dist

    from kiln.model.parallel import MeshLayout, build_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    try:
        mesh = build_mesh(MeshLayout(dp_shard=2, tp=2), "cpu")
        queue.put((rank, _train_both(CASES["llama-tied"], False, False, mesh["tp"], mesh["dp_shard"], optim="muon",
                                     save_to=root)))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tp-checkpoints")


@pytest.fixture(scope="module")
def two_ranks(saved) -> dict:
    return on_ranks(_worker, 2, str(saved))


def numbers(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("x", "want")}


def one_process_logits(root: Path, x: torch.Tensor) -> torch.Tensor:
    """The logits of the newest checkpoint under ``root``, loaded in this process as any reader loads it."""
    from kiln.model.families import build_model
    from kiln.train.checkpoint import latest_good_checkpoint, load_state

    state, meta = load_state(latest_good_checkpoint(root))
    model = build_model(ModelConfig(**meta["model"]))
    model.load_state_dict(state["model"])
    with torch.no_grad():
        return model.eval()(x)


@pytest.mark.parametrize("case", ["gpt2", "llama"])
def test_a_tensor_parallel_checkpoint_loads_in_one_process_with_the_same_logits(two_ranks, saved, case) -> None:
    got = two_ranks[0][case]
    want = torch.tensor(got["want"])
    torch.testing.assert_close(one_process_logits(saved / case, torch.tensor(got["x"])), want, atol=2e-4, rtol=0)


def test_fsdp2_over_tensor_parallel_shards_follows_one_process_on_a_2x2_mesh(tmp_path) -> None:
    results = on_ranks(_fsdp_worker, 4, str(tmp_path))
    got = [results[r] for r in range(4)]
    assert all(numbers(g) == numbers(got[0]) for g in got)  # every rank gathers the same weights and sees the same loss
    r0 = got[0]
    assert r0["loss"] < 1e-5 and r0["grad_norm"] < 1e-4 and r0["weights"] < 1e-4, r0
    # FSDP2's dim-0 shards of TP's dim-1 shards; a TP dim-0 shard sharded again on dim 0 is strided
    assert r0["first_block"]["model.layers.0.self_attn.o_proj.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert r0["first_block"]["model.layers.0.self_attn.q_proj.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert r0["tied"] and r0["last"] < 3.0
    # its sharded checkpoint (2 x 2 shards) loads in one process
    torch.testing.assert_close(one_process_logits(tmp_path, torch.tensor(r0["x"])), torch.tensor(r0["want"]),
                               atol=2e-4, rtol=0)


@pytest.mark.parametrize("case", [*CASES, "gpt2-muon"])
def test_tensor_parallel_training_follows_one_process(two_ranks, case) -> None:
    r0, r1 = two_ranks[0][case], two_ranks[1][case]
    assert numbers(r0) == numbers(r1)  # both ranks hold the same loss, norms and gathered weights
    assert r0["loss"] < 1e-5 and r0["grad_norm"] < 1e-4, r0  # summation order apart, the same curve
    assert r0["logits"] < 2e-4, r0
    if case in ("gpt2", "llama", "gpt2-mup", "llama-mup"):  # SHORT steps: too few to learn the rule
        assert r0["weights"] < 1e-4, r0
        return
    # GPT-2's key bias has no gradient (softmax ignores a constant per query), so AdamW turns rounding noise into
    # lr-sized steps there; every other weight stays within 1e-4
    assert r0["weights"] < (1e-3 if case.startswith("gpt2") else 1e-4), r0
    assert r0["last"] < 3.0, r0  # it learns the rule: ln(64) = 4.16 is chance
    assert r0["head"] == "(Shard(dim=0),)"  # vocabulary-parallel head


def test_tied_heads_stay_tied_and_each_weight_is_sharded_as_megatron_does(two_ranks) -> None:
    got = two_ranks[0]
    assert got["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 2}  # build_mesh's named dims, size 1 kept
    assert got["gpt2"]["tied"] and got["llama-tied"]["tied"] and not got["llama"]["tied"]
    llama = got["llama"]["first_block"]
    for name in ("q_proj", "k_proj", "v_proj"):
        assert llama[f"model.layers.0.self_attn.{name}.weight"] == "(Shard(dim=0),)"
    assert llama["model.layers.0.self_attn.o_proj.weight"] == "(Shard(dim=1),)"
    assert llama["model.layers.0.mlp.down_proj.weight"] == "(Shard(dim=1),)"
    assert llama["model.layers.0.input_layernorm.weight"] == "(Replicate(),)"
    gpt = got["gpt2"]["first_block"]
    assert gpt["transformer.h.0.attn.c_attn.weight"] == "(Shard(dim=0),)"  # q_r | k_r | v_r, rows rank-interleaved
    assert gpt["transformer.h.0.attn.c_proj.bias"] == "(Replicate(),)"


@pytest.mark.parametrize("fields, tp, message", [
    ({"n_head": 4, "n_embd": 32}, 3, "parallel.tp: 3 does not divide model.n_head (4); legal values for this model: 1, 2, 4"),
    ({"family": "llama", "n_head": 4, "n_kv_head": 1, "n_embd": 32}, 2, "does not divide model.n_kv_head (1)"),
    ({"n_head": 4, "n_embd": 32, "vocab_size": 63}, 2, "does not divide model.vocab_size (63)"),
    ({"n_head": 4, "n_embd": 32}, 0, "parallel.tp: 0 must be at least 1"),
])
def test_a_layout_the_model_cannot_split_is_a_config_error_naming_the_field(fields, tp, message) -> None:
    cfg = ModelConfig(**{**SHARED, **fields})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_tp(cfg, tp)


def test_every_divisor_layout_passes() -> None:
    cfg = ModelConfig(**{**SHARED, "n_head": 4})
    for tp in (1, 2, 4):
        check_tp(cfg, tp)
    # QK-norm's per-head weights are held whole by every rank (kiln.model.tensor_parallel.LocalReplicated)
    check_tp(ModelConfig(**{**SHARED, "family": "llama", "n_head": 4, "n_embd": 32, "qk_norm": True}), 2)
