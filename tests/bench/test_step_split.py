"""bench/step_split.py: both sides' steps split into their phases on the same tokens, the ratios taken from the
medians."""

from bench_module import load_bench


def test_both_sides_are_timed_phase_by_phase_and_the_ratios_come_from_their_medians():
    bench = load_bench("step_split")
    r = bench.split(vocab=256, steps=2, bf16=False)
    for side in ("Kiln", "nanoGPT"):
        assert set(r[side]["phases_ms"]) == set(bench.PHASES) and all(v > 0 for v in r[side]["phases_ms"].values())
        assert r[side]["without_optimizer_ms"] < r[side]["step_ms"]
    assert r["tokens_per_step"] == 2048
    assert r["tokens_per_s_ratio"] == r["nanoGPT"]["step_ms"] / r["Kiln"]["step_ms"]
    assert r["without_optimizer_ratio"] == r["nanoGPT"]["step_ms"] / r["Kiln"]["without_optimizer_ms"]
    assert 0 < r["optimizer_share"] < 1
