"""kiln.evaluation.matrix: a cell is reused only when scored from the same inputs and whole; a run's cells of one
benchmark give the score against step with its 95% interval and chance."""

import json

from kiln.evaluation.matrix import CELL_FILE, cell_folder, cell_inputs, cells, plot_series, reusable, series, write_cell

RECORD = {"lm_eval": "0.4.13", "package": {"sha256": "abc"}, "limit": 10, "seed": 1234, "sample_sha256": "s1",
          "benchmarks": {"piqa": {"version": 1.0}}}


def write(root, step, score, inputs):
    return write_cell(cell_folder(root, "run1", step, "piqa"), inputs,
                      {"acc_norm": score, "acc_norm_stderr": 0.05, "items": 10, "chance": 0.5}, None,
                      "acc_norm,none", step, "run1", 1.0)


def test_a_cell_is_reused_only_from_the_same_inputs_and_whole(tmp_path):
    inputs = cell_inputs("ckpt-a", "piqa", RECORD, None)
    cell = write(tmp_path, 10, 0.6, inputs)
    folder = cell_folder(tmp_path, "run1", 10, "piqa")
    assert reusable(folder, inputs) == cell and cell["score"] == 0.6 and cell["stderr"] == 0.05
    assert reusable(folder, cell_inputs("ckpt-b", "piqa", RECORD, None)) is None  # another checkpoint
    assert reusable(folder, cell_inputs("ckpt-a", "piqa", {**RECORD, "sample_sha256": "s2"}, None)) is None
    assert reusable(folder, cell_inputs("ckpt-a", "piqa", RECORD, "report-v2")) is None  # another clean set
    doc = json.loads((folder / CELL_FILE).read_text())
    (folder / CELL_FILE).write_text(json.dumps({**doc, "score": 0.9}))  # edited after writing: the digest fails
    assert reusable(folder, inputs) is None
    (folder / CELL_FILE).write_text("{")
    assert reusable(folder, inputs) is None and cells(tmp_path) == []
    assert reusable(tmp_path / "nowhere", inputs) is None


def test_series_and_plot_parts(tmp_path):
    for step, score in ((20, 0.62), (10, 0.55), (30, 0.7)):
        write(tmp_path, step, score, cell_inputs(f"ckpt-{step}", "piqa", RECORD, None))
    pts = series(tmp_path, "run1", "piqa")
    assert pts == [(10, 0.55, 0.05), (20, 0.62, 0.05), (30, 0.7, 0.05)]
    parts = plot_series(pts, 0.5)
    assert parts["series"]["score"][0] == (10, 0.55) and parts["hlines"] == {"chance": 0.5}
    lo, hi = parts["bands"]["95% interval"][0][1:]
    assert abs(lo - (0.55 - 0.098)) < 1e-9 and abs(hi - (0.55 + 0.098)) < 1e-9
    assert series(tmp_path, "run2", "piqa") == [] and len(cells(tmp_path)) == 3
