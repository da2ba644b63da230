"""kiln verify and kiln status --verify: a byte flipped inside a finished output, its size and time kept, is passed
over by the quick check but found by hashing, named, set aside, and rebuilt identical by the next run."""

import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from jobs.cli import main


@pytest.mark.slow
def test_a_byte_flipped_in_place_is_found_set_aside_and_rebuilt_identical(tmp_path, capsys, monkeypatch,
                                                                        source_cache):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    preset = tmp_path / "p.yaml"
    preset.write_text(f"extends: smoke\nresources:\n  storage:\n    config: {{source_cache: {source_cache}}}\n")
    home = tmp_path / "home"
    run = ["run", "--preset", str(preset), "--select", "raw_documents,clean_corpus", "--home", str(home)]
    assert main(run) == 0
    assert main(["verify", "--preset", str(preset), "--home", str(home)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("kiln verify: 2 recorded outputs, ") and out[-1].endswith(": all intact"), out
    kept = next((home / "storage" / "clean_corpus").rglob("corpus.parquet"))
    good = kept.read_bytes()
    st = kept.stat()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x01  # bit rot: one bit, size and modification time kept
    kept.write_bytes(bytes(flipped))
    os.utime(kept, ns=(st.st_atime_ns, st.st_mtime_ns))

    def status(*extra: str) -> tuple[str, str]:
        """(clean_corpus's row, the whole status)"""
        assert main(["status", "--preset", str(preset), "--home", str(home), *extra]) == 0
        out = capsys.readouterr().out
        return next(line for line in out.splitlines() if line.startswith("clean_corpus ")), out

    assert " reuse " in status()[0]  # the quick check (size and time) cannot see it
    row, out = status("--verify")
    assert " recompute " in row and f"{kept}: checksum mismatch" in out and kept.read_bytes() == bytes(flipped)
    assert main(["verify", "--preset", str(preset), "--home", str(home)]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("kiln verify: damaged: clean_corpus (MLflow run ") and f"{kept}: checksum mismatch" in err
    assert f"set aside as .{kept.name}.damaged; the next kiln run recomputes it" in err
    assert out.splitlines()[-1].endswith(": 1 damaged (set aside; the next kiln run recomputes them)")
    assert not kept.exists() and (kept.parent / f".{kept.name}.damaged").read_bytes() == bytes(flipped)
    assert main(run) == 0  # recomputed, not reused: content-addressed, so the same bytes come back
    capsys.readouterr()
    assert kept.read_bytes() == good and pq.read_table(kept).num_rows > 0
    assert main(["verify", "--preset", str(preset), "--home", str(home)]) == 0
