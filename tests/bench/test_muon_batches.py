"""bench/muon_batches.py: the demo model's Muon matrices stacked by shape, both ways of Newton-Schulz compared on the
same gradients, and the training step's two arms starting from the same weights."""

import torch
from bench_module import load_bench


def test_the_demo_models_muon_matrices_group_into_four_shapes_in_first_seen_order():
    bench = load_bench("muon_batches")
    mats = bench.muon_matrices(bench.demo_model(512))
    assert len(mats) == 28
    # per layer q, k, v, o then gate, up, down: first seen first
    groups = bench.same_shape(mats)
    assert [(len(g), *g[0].shape) for g in groups] == [(8, 256, 256), (8, 128, 256), (8, 704, 256), (4, 256, 704)]
    assert all(m.shape == g[0].shape for g in groups for m in g) and sum(map(len, groups)) == 28


def test_newton_schulz_arms_time_both_ways_and_compare_their_results():
    bench = load_bench("muon_batches")
    torch.manual_seed(0)
    mats = [torch.randn(16, 8) for _ in range(3)] + [torch.randn(8, 24) for _ in range(2)]
    r = bench.newton_schulz_arms(mats, torch.float32, 2)
    assert r["dtype"] == "float32" and r["one_ms"] > 0 and r["stacked_ms"] > 0
    assert r["speedup"] == r["one_ms"] / r["stacked_ms"]
    assert r["max_abs_diff"] < 1e-5  # the same matrices, orthogonalised each by itself either way
