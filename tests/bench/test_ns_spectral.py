"""bench/ns_spectral.py: both ways of fp32 Newton-Schulz timed on one shape against the fp64 iteration, the arms'
patches undone afterwards, and the machine line naming an instruction set held down."""

import torch
from bench_module import load_bench


def test_a_shapes_arms_time_both_ways_and_measure_both_against_fp64():
    bench = load_bench("ns_spectral")
    r = bench.shape_arms(64, 256, 2)
    assert r["small"] == 64 and r["large"] == 256 and r["products_ms"] > 0 and r["spectral_ms"] > 0
    assert r["speedup"] == r["products_ms"] / r["spectral_ms"] and r["taken"] is False
    assert 0 < r["products_err"] < 5e-6 and 0 < r["spectral_err"] < 5e-6


def test_the_patches_hold_only_inside_their_block():
    bench = load_bench("ns_spectral")
    optim = bench.optim
    pays, dtype = optim.spectral_pays, optim.ns_dtype
    with bench.iteration_only(), bench.fp32_newton_schulz():
        assert optim.spectral_pays(512, 512) is False and optim.ns_dtype(torch.device("cuda")) == torch.float32
    assert optim.spectral_pays is pays and optim.ns_dtype is dtype and optim.spectral_pays(512, 512)


def test_the_machine_line_says_when_the_instruction_set_is_held_down(monkeypatch):
    provenance = load_bench("provenance")
    for name in provenance.ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    assert "held down" not in provenance.machine_line()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert provenance.machine_line().endswith(
        " | instruction set held down: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2")
