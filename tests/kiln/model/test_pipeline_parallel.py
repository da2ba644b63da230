"""Tests for kiln.model.pipeline_parallel: both families cut into pipeline stages over two gloo processes train as
one process does for 30 steps (AdamW, gradient clipping; the 1F1B schedule, and interleaved 1F1B with two stages per
rank; GPT-2's head tied to its token table across the first and last stage), each stage holding only its blocks under
the whole model's names; FSDP2 over the stages on a (pp 2, dp_shard 2) mesh of four processes, whose checkpoint
shards load into one whole model; tensor-parallel stages on a (pp 2, tp 2) mesh; and the pipeline's config errors.

Run: python -m pytest tests/kiln/model/test_pipeline_parallel.py -q   (a launch of two processes and two of four)
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from kiln.common.config import ConfigError
from kiln.model.config import ModelConfig
from kiln.model.pipeline_parallel import PipelineConfig, cut_stage, stage_layers
from ranks import on_ranks

STEPS = 30
SHARED = dict(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, dropout=0.0)
CASES = {  # name -> (ModelConfig fields beyond the shared ones, PipelineConfig)
    "gpt2-1f1b": ({}, PipelineConfig("1f1b", 1, 4)),  # tied head: the table on stage 0, the head on stage 1
    "llama-1f1b": ({"family": "llama", "n_kv_head": 2, "tie_embeddings": False}, PipelineConfig("1f1b", 1, 4)),
    "llama-interleaved": ({"family": "llama", "n_kv_head": 2, "tie_embeddings": True},
                          PipelineConfig("interleaved_1f1b", 2, 4)),  # 4 stages of one block, 2 per rank
    "gpt2-gpipe": ({}, PipelineConfig("gpipe", 1, 2)),
    "gpt2-zero-bubble": ({}, PipelineConfig("interleaved_zero_bubble", 2, 4)),  # backward split into input and weights
}


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, 64, (8, 16), generator=gen)
        out.append((x, (3 * x + 1) % 64))  # each token's successor is a function of it
    return out


def _train_both(fields: dict, pipe_cfg: PipelineConfig, group, dp_mesh=None, save_to: str | None = None,
                tp_mesh=None) -> dict:
    """The same seeded model trained STEPS steps here whole and as this rank's pipeline stages (with ``dp_mesh``
    also sharded by FSDP2 over it, each data-parallel rank taking its rows of the batch); what differs."""
    import torch.distributed as dist

    from kiln.model.families import build_model
    from kiln.model.parallel import clip_grad_norm, full_value
    from kiln.model.pipeline_parallel import Pipeline

    torch.manual_seed(0)
    one = build_model(ModelConfig(**{**SHARED, **fields}))
    dp, dp_size = (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh is not None else (0, 1)
    pipe = Pipeline(copy.deepcopy(one), pipe_cfg, group, torch.device("cpu"), batch=8 // dp_size, dp_mesh=dp_mesh,
                    tp_mesh=tp_mesh)
    opts = [torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1) for params in (one.parameters(), pipe.parameters())]
    loss_diff, norm_diff, losses = 0.0, 0.0, []
    for x, y in _batches(STEPS):
        whole = one(x, y)
        whole.backward()
        norms = [clip_grad_norm(one, 1.0)]
        rows = slice(dp * len(x) // dp_size, (dp + 1) * len(x) // dp_size)
        piped = pipe.step(x[rows], y[rows])
        if dp_mesh is not None:  # the mean over the data-parallel ranks' rows (equal counts of targets)
            dist.all_reduce(piped, group=dp_mesh.get_group())
            piped /= dp_size
        norms.append(pipe.clip_grad_norm(1.0))
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        loss_diff = max(loss_diff, abs(float(whole.detach()) - float(piped)))
        norm_diff = max(norm_diff, abs(norms[0] - norms[1]))
        losses.append(float(piped))
    # held-out loss, forward only: 6 rows (padded to the 4 micro-batches' multiple) with some targets skipped
    x, y = _batches(STEPS + 1)[-1]
    x, y = x[:6], y[:6].clone()
    y[1, :5] = -100
    with torch.no_grad():
        want = float(torch.nn.functional.cross_entropy(one(x).flatten(0, 1), y.flatten(), ignore_index=-100,
                                                       reduction="sum"))
    total, count = pipe.eval_loss(x, y) if dp_mesh is None else (want, int((y != -100).sum()))
    eval_diff = abs(total - want) / count if count == int((y != -100).sum()) else float("inf")
    whole_state = one.state_dict()
    mine = pipe.state_dict()
    # GPT-2's key bias has no true gradient (softmax ignores a constant added per query), so AdamW turns rounding
    # noise into lr-sized steps there: it is compared on its own, more loosely
    from kiln.model.tensor_parallel import canonical_state, interleaved_params

    full = canonical_state({name: full_value(t) for name, t in mine.items()}, interleaved_params(pipe.local))
    diffs = {name: float((t - whole_state[name]).abs().max()) for name, t in full.items()}  # GPT-2's q|k|v in order
    if save_to is not None:  # this rank's stages' weights as torch.distributed.checkpoint shards, by name
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": mine}, checkpoint_id=save_to)
        saved = {name: full_value(t).tolist() for name, t in mine.items()}  # lists: tensors die with the process
    key_bias = max([d for n, d in diffs.items() if n.endswith("attn.c_attn.bias")], default=0.0)
    return {"loss": loss_diff, "grad_norm": norm_diff, "key_bias": key_bias, "eval": eval_diff,
            "weights": max(d for n, d in diffs.items() if not n.endswith("attn.c_attn.bias")),
            "first": losses[0], "last": losses[-1], "stages": pipe.stage_ids, "names": sorted(mine),
            **({"saved": saved} if save_to is not None else {})}


def _worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        queue.put((rank, {name: _train_both(fields, pc, group) for name, (fields, pc) in CASES.items()}))
    finally:
        dist.destroy_process_group()


def _four_worker(rank: int, port: int, queue, root: str) -> None:
    """Rank ``rank`` of 4 on a (pp 2, dp_shard 2) mesh: each pipeline stage sharded by FSDP2 over two ranks."""
    import torch.distributed as dist

    from kiln.model.parallel import MeshLayout, build_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    try:
        mesh = build_mesh(MeshLayout(dp_shard=2, pp=2), "cpu")
        out = {name: _train_both(CASES[name][0], CASES[name][1], mesh["pp"].get_group(), mesh["dp_shard"],
                                 save_to=f"{root}/{name}") for name in FSDP_CASES}
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


FSDP_CASES = ("llama-interleaved", "gpt2-1f1b")  # tied heads whose table and head are FSDP2 shards


def _tp_worker(rank: int, port: int, queue) -> None:
    """Rank ``rank`` of 4 on a (pp 2, tp 2) mesh: each pipeline stage's layers split over two ranks."""
    import torch.distributed as dist

    from kiln.model.parallel import MeshLayout, build_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    try:
        mesh = build_mesh(MeshLayout(dp_shard=1, tp=2, pp=2), "cpu")
        out = {name: _train_both(CASES[name][0], CASES[name][1], mesh["pp"].get_group(), tp_mesh=mesh["tp"])
               for name in TP_CASES}
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


# GPT-2's fused q|k|v and tied head (Llama's interleaved stages under pp x tp: tests/kiln/train/test_train_pipeline.py)
TP_CASES = ("gpt2-1f1b",)


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return on_ranks(_worker, 2)


@pytest.fixture(scope="module")
def tp_ranks() -> dict:
    return on_ranks(_tp_worker, 4, timeout_s=300)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("pp-fsdp")
    return on_ranks(_four_worker, 4, str(root)), root


def test_fsdp2_over_pipeline_stages_trains_as_one_process_and_its_checkpoint_loads_whole(four_ranks) -> None:
    from kiln.model.families import build_model
    from kiln.train.checkpoint import load_sharded

    results, tmp_path = four_ranks
    for name in FSDP_CASES:
        got = [results[r][name] for r in range(4)]
        for r in got:
            assert r["loss"] < 1e-5 and r["grad_norm"] < 1e-4 and r["weights"] < 1e-4 and r["key_bias"] < 1e-3, r
        assert got[0]["stages"] == got[1]["stages"] != got[2]["stages"] == got[3]["stages"]  # dp_shard is inner
        # the four ranks' shards of the two stages load into one whole model by name, every weight as trained
        model = build_model(ModelConfig(**{**SHARED, **CASES[name][0]}))
        state = {"model": model.state_dict()}
        load_sharded(state, tmp_path / name)
        model.load_state_dict(state["model"])
        saved = {k: v for r in got for k, v in r["saved"].items()}
        assert sorted(saved) == sorted(model.state_dict())
        for k, t in model.state_dict().items():
            assert torch.equal(t, torch.tensor(saved[k])), (name, k)


@pytest.mark.parametrize("case", TP_CASES)
def test_tensor_parallel_pipeline_stages_on_four_ranks_train_as_one_process(tp_ranks, case) -> None:
    """pp 2 x tp 2: each stage's layers split over two ranks (the held part of the family's plan), the sequence
    shards passed between stages; GPT-2's tied head summed across the first and last stage shard by shard."""
    got = [tp_ranks[r][case] for r in range(4)]
    for r in got:
        assert r["loss"] < 1e-5 and r["grad_norm"] < 1e-4 and r["weights"] < 1e-4 and r["key_bias"] < 1e-3, r
        assert r["eval"] < 1e-5 and r["last"] < 0.5 * r["first"], r
    assert got[0]["stages"] == got[1]["stages"] != got[2]["stages"] == got[3]["stages"]  # tp is the inner dim
    assert got[0]["loss"] == got[3]["loss"]  # every rank reports the last stage's loss


@pytest.mark.parametrize("case", list(CASES))
def test_a_pipeline_over_two_ranks_trains_as_one_process(two_ranks, case) -> None:
    r0, r1 = two_ranks[0][case], two_ranks[1][case]
    assert r0["loss"] == r1["loss"] and r0["last"] == r1["last"]  # every rank reports the last stage's loss
    for r in (r0, r1):
        assert r["loss"] < 1e-5 and r["grad_norm"] < 1e-4 and r["weights"] < 1e-4, r  # summation order apart
        assert r["key_bias"] < 1e-3 and r["eval"] < 1e-5, r  # eval_loss: the whole model's mean, every rank
    assert r0["last"] < 0.5 * r0["first"]  # and it learns
    looped = CASES[case][1].virtual_stages == 2
    assert (r0["stages"], r1["stages"]) == (([0, 2], [1, 3]) if looped else ([0], [1]))


def test_each_rank_holds_only_its_stages_under_the_whole_models_names(two_ranks) -> None:
    r0, r1 = two_ranks[0]["llama-1f1b"], two_ranks[1]["llama-1f1b"]
    assert "model.embed_tokens.weight" in r0["names"] and "model.embed_tokens.weight" not in r1["names"]
    assert "lm_head.weight" in r1["names"] and "model.norm.weight" in r1["names"] and "lm_head.weight" not in r0["names"]
    assert {n.split(".")[2] for n in r0["names"] if n.startswith("model.layers.")} == {"0", "1"}
    assert {n.split(".")[2] for n in r1["names"] if n.startswith("model.layers.")} == {"2", "3"}
    whole = ModelConfig(**{**SHARED, **CASES["llama-1f1b"][0]})
    from kiln.model.families import build_model

    assert sorted(set(r0["names"]) | set(r1["names"])) == sorted(build_model(whole).state_dict())
    i0, i1 = two_ranks[0]["llama-interleaved"], two_ranks[1]["llama-interleaved"]  # stages 0, 2 and 1, 3
    assert {n.split(".")[2] for n in i0["names"] if n.startswith("model.layers.")} == {"0", "2"}
    assert "lm_head.weight" in i1["names"] and "model.embed_tokens.weight" in i0["names"]


def test_stages_pass_hidden_states_on_and_the_last_gives_the_whole_models_logits_and_loss() -> None:
    from kiln.model.families import build_model

    torch.manual_seed(0)
    cfg = ModelConfig(**{**SHARED, "family": "llama", "n_kv_head": 2, "tie_embeddings": False})
    model = build_model(cfg).eval()
    stages = [cut_stage(model, s, 4) for s in range(4)]
    assert [[type(b).__name__ for b in st.blocks] for st in stages[:2]] == [["Block", "Skip", "Skip", "Skip"],
                                                                              ["Skip", "Block", "Skip", "Skip"]]
    x = torch.randint(0, 64, (2, 16))
    y = (3 * x + 1) % 64
    with torch.no_grad():
        h = x
        for st in stages[:3]:
            h = st(h, y)  # a stage before the last passes its hidden states on, targets or not
            assert h.shape == (2, 16, 32)
        torch.testing.assert_close(stages[3](h), model(x), atol=0, rtol=0)  # (B, T, V) logits
        torch.testing.assert_close(stages[3](h, y), model(x, y), atol=0, rtol=0)  # the loss
    assert stage_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


@pytest.mark.parametrize("pc, pp, match", [
    (PipelineConfig("zigzag"), 2, r"pipeline.schedule: 'zigzag'; choose one of gpipe, 1f1b, interleaved_1f1b"),
    (PipelineConfig("interleaved_1f1b", 1), 2, r"pipeline.virtual_stages: 1 with schedule interleaved_1f1b; the looped"),
    (PipelineConfig("1f1b", 2), 2, r"pipeline.virtual_stages: 2 with schedule 1f1b; 1f1b runs one stage per rank"),
    (PipelineConfig("1f1b"), 3, r"layout.pp: 3 ranks x 1 stages each must divide the 4 layers \(model.n_layer\); "
                                r"pp may be 1, 2, 4"),
    (PipelineConfig("interleaved_1f1b", 2), 4, r"pp may be 1, 2$"),
    (PipelineConfig("1f1b", 1, 3), 2, r"pipeline.microbatches: 3; a multiple of pp \(2\)"),
])
def test_a_pipeline_that_cannot_run_is_a_config_error_naming_the_field(pc, pp, match) -> None:
    with pytest.raises(ConfigError, match=match):
        pc.check(ModelConfig(**SHARED), pp)
    with pytest.raises(ConfigError, match=r"pipeline.microbatches: 4 must divide the batch of 6 sequences"):
        PipelineConfig("1f1b", 1, 4).check(ModelConfig(**SHARED), 2, batch=6)
