"""Every bench under bench/ imports: a name it takes from Kiln that was renamed or moved fails here, not when someone
next runs the bench."""

from pathlib import Path

import pytest
from bench_module import BENCH, load_bench

SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py"))


def test_the_benches_are_found():
    assert {"bench_generate", "bench_nanogpt", "speedrun", "provenance"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_bench_imports_and_has_an_entry_point(name):
    mod = load_bench(name)
    if name != "provenance":  # the helper every bench imports
        assert callable(getattr(mod, "main", None)), f"bench/{name}.py has no main()"
    assert Path(mod.__file__).parent == BENCH
