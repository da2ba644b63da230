"""Tests of kiln/clean/run.py (clean, the cleaning step end to end): each quality rule, exact and MinHash dedup, HTML, errors
(the config, report, text normalisation and corpus merge: test_config.py, test_report.py, tests/kiln/common/test_text.py, test_corpus.py).

Run: python -m pytest tests/kiln/clean/test_run.py -q
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.clean.config import CleanConfig
from kiln.clean.run import clean
from kiln.filters.base import Filter
from kiln.clean.dedup import shingles

REPO = Path(__file__).resolve().parents[3]

PROSE = (
    "The old lighthouse stood on a rocky point at the edge of the harbour, and for more than a century "
    "its keepers climbed the spiral stairs every evening to light the lamp.\n\n"
    "Ships coming home through the winter storms looked for its steady beam long before they could see "
    "the town itself. When the lamp was finally automated, the last keeper moved into a cottage near the "
    "quay, where he spent his afternoons repairing nets and telling visitors about the wrecks he had seen.\n\n"
    "Today the tower is a small museum, and children can still climb to the top to watch the boats."
)
OTHER_PROSE = (
    "Bread has been baked in this village since the middle ages, and the current bakery occupies a building "
    "that once housed the mill. Every morning before dawn the baker lights the wood oven, shapes the loaves "
    "by hand and sets them to rise on linen cloths. By seven o'clock a queue has formed outside the door, "
    "and most of the rye loaves are gone before the church bell rings nine. The recipe, she says, came from "
    "her grandmother and has never been written down."
)
LINES = [
    "The river runs slowly through the green valley below the hills",
    "Farmers along its banks have grown wheat there for many centuries",
    "In spring the water rises and covers the lowest of the meadows",
    "Herons wait patiently in the shallows for small fish to pass by",
    "A stone bridge built by the monks still carries the old road",
    "Children from the village swim near the mill during long summers",
    "The ferryman retired last year after four decades on the water",
    "Autumn storms sometimes bring down trees from the steep northern bank",
    "Old maps show that the river once followed a different course entirely",
    "Every evening the mist gathers over the reeds and the willows",
]


def violations() -> dict[str, str]:
    """One document per rule, each built to break exactly that rule first."""
    return {
        "gopher:too_few_words": "A short note about the weather.",
        "gopher:too_many_words": " ".join(["river"] * 100_001),
        "gopher:short_mean_word_length": " ".join(["it is a ox on to me so"] * 10),
        "gopher:long_mean_word_length": " ".join(["internationalization characteristically"] * 30),
        "gopher:symbol_to_word_ratio": " ".join(f"#{w}" if i % 4 == 0 else w for i, w in enumerate(PROSE.split())),
        "gopher:few_alpha_words": " ".join(f"{w} {i} {i * 7}" for i, w in enumerate(PROSE.split())),
        "gopher:duplicate_lines": "\n".join(LINES[:5] + [LINES[0]] * 5),
        "gopher:bullet_lines": "\n".join(f"- {line}" for line in LINES),
        "c4:ellipsis_lines": "\n".join(line + ("..." if i % 2 else ".") for i, line in enumerate(LINES)),
    }


def write_raw(path: Path, docs: list[dict[str, Any]], row_group_size: int | None = None) -> Path:
    rows = []
    for i, d in enumerate(docs):
        row = {"id": f"d{i}", "source": "test", "url": f"https://example.org/{i}", "content_type": "text/plain",
               "license": "CC0", **d}
        row["bytes"] = len(row["text"].encode())
        rows.append(row)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def run(tmp_path: Path, docs: list[dict[str, Any]], cfg: CleanConfig | None = None, row_group_size: int | None = None,
        **kw: Any):
    raw = write_raw(tmp_path / "raw.parquet", docs, row_group_size)
    report = clean(raw, tmp_path / "clean.parquet", tmp_path / "removed.parquet", cfg, **kw)
    kept = pq.read_table(tmp_path / "clean.parquet").to_pylist()
    removed = {r["id"]: r for r in pq.read_table(tmp_path / "removed.parquet").to_pylist()}
    return report, kept, removed


def pseudo_prose(seed: int, sentences: int = 14) -> list[str]:
    """Deterministic sentences of plausible words, for near-duplicate tests."""
    vocab = (
        "harbour village market river winter summer garden teacher doctor station morning evening window "
        "kitchen letter bridge forest mountain island castle library museum painter farmer sailor engine "
        "quietly slowly always never carried opened walked watched painted built found visited remembered "
        "green heavy bright narrow ancient gentle stormy golden wooden northern"
    ).split()
    rng = random.Random(seed)
    out = []
    for _ in range(sentences):
        words = [rng.choice(vocab) for _ in range(rng.randint(16, 24))]
        out.append(" ".join(words).capitalize() + ".")
    return out


# ---------------------------------------------------------------- rules


def test_each_rule_drops_its_violation_with_exact_reason(tmp_path: Path) -> None:
    cases = violations()
    docs = [{"id": reason, "text": text} for reason, text in cases.items()] + [{"id": "good", "text": PROSE}]
    report, kept, removed = run(tmp_path, docs)
    assert [d["id"] for d in kept] == ["good"]
    assert {i: r["reason"] for i, r in removed.items()} == {reason: reason for reason in cases}
    assert removed["gopher:too_few_words"]["detail"] == "words=6 < min_words=50"
    assert removed["gopher:duplicate_lines"]["detail"].startswith("duplicate_line_fraction=0.5 > ")
    assert all(r["duplicate_of"] is None for r in removed.values())
    assert kept[0]["text"] == PROSE and kept[0]["words"] == len(PROSE.split())


def test_thresholds_come_from_config(tmp_path: Path) -> None:
    short = "A short note about the weather."
    cfg = CleanConfig.from_dict({"min_words": 3, "min_stop_words": 1, "repetition": {"enabled": False}})
    report, kept, removed = run(tmp_path, [{"text": short}], cfg)
    assert [d["text"] for d in kept] == [short] and not removed


def test_custom_filter_datatrove_style(tmp_path: Path) -> None:
    class NoLighthouses(Filter):
        name = "custom:lighthouse"

        def reason(self, doc):
            return self.name if "lighthouse" in doc.text else None

    report, kept, removed = run(tmp_path, [{"text": PROSE}, {"text": OTHER_PROSE}], filters=[NoLighthouses()])
    assert removed["d0"]["reason"] == "custom:lighthouse" and [d["id"] for d in kept] == ["d1"]


# ---------------------------------------------------------------- dedup


def test_exact_duplicate_dropped_with_duplicate_of(tmp_path: Path) -> None:
    # whitespace-only differences normalise to the same text
    docs = [{"text": PROSE}, {"text": OTHER_PROSE}, {"text": PROSE.replace("\n\n", "\r\n\r\n") + "  \n"}]
    report, kept, removed = run(tmp_path, docs)
    assert [d["id"] for d in kept] == ["d0", "d1"]
    assert removed["d2"]["reason"] == "dedup:exact"
    assert removed["d2"]["duplicate_of"] == "d0" and removed["d2"]["detail"] == "duplicate of d0"
    assert report.dedup_rate == pytest.approx(1 / 3, abs=1e-3)


def test_exact_dedup_can_be_disabled(tmp_path: Path) -> None:
    cfg = CleanConfig.from_dict({"exact_dedup": False, "minhash": {"enabled": False}})
    report, kept, removed = run(tmp_path, [{"text": PROSE}, {"text": PROSE}], cfg)
    assert len(kept) == 2 and report.dedup_rate == 0.0


def test_near_duplicate_dropped_by_minhash_unrelated_kept(tmp_path: Path) -> None:
    original = pseudo_prose(seed=1)
    variant = original[1:2] + original[:1] + original[2:]  # first two sentences swapped, like the evals data
    words = " ".join(variant).split()
    words[40], words[120] = "lighthouse", "bakery"  # and a few words changed
    near, unrelated = " ".join(words), " ".join(pseudo_prose(seed=2))
    a, b = set(shingles(" ".join(original), 5)), set(shingles(near, 5))
    assert 0.75 < len(a & b) / len(a | b) < 0.95  # near, not exact

    docs = [{"text": " ".join(original)}, {"text": unrelated}, {"text": near}]
    prose_cfg = {"min_stop_words": 0, "language": {"enabled": False}}  # pseudo-prose: no stop words, no language
    report, kept, removed = run(tmp_path, docs, CleanConfig.from_dict(prose_cfg))
    assert [k["id"] for k in kept] == ["d0", "d1"]
    assert removed["d2"]["reason"] == "dedup:minhash" and removed["d2"]["duplicate_of"] == "d0"

    report, kept, removed = run(tmp_path, docs, CleanConfig.from_dict({"minhash": {"enabled": False}, **prose_cfg}))
    assert len(kept) == 3


# ---------------------------------------------------------------- html, report, order, progress


def test_html_document_cleaned_end_to_end(tmp_path: Path) -> None:
    menu = '<ul><li><a href="/">Home</a></li><li><a href="/shop">Shop</a></li><li><a href="/about">About</a></li></ul>'
    paras = "".join(f"<p>{p}</p>" for p in PROSE.split("\n\n"))
    html = (f"<html><head><title>Lighthouse</title></head><body><nav>{menu}</nav><article>{paras}</article>"
            f"<footer><nav>{menu}</nav><p>Copyright 2024 Harbour Trust</p></footer></body></html>")
    empty = f"<html><body><nav>{menu}</nav></body></html>"
    docs = [{"text": html, "content_type": "text/html"}, {"text": empty, "content_type": "text/html"}]
    report, kept, removed = run(tmp_path, docs)
    assert kept[0]["text"] == PROSE and kept[0]["title"] == "Lighthouse"
    assert kept[0]["content_type"] == "text/html" and kept[0]["bytes"] == len(PROSE.encode())
    assert removed["d1"]["reason"] == "extract:empty"


def test_examples_capped_per_reason(tmp_path: Path) -> None:
    report, _, _ = run(tmp_path, [{"text": f"short note {i}"} for i in range(5)] + [{"text": PROSE}])
    r = report.reasons["gopher:too_few_words"]
    assert r["docs"] == 5 and [e["id"] for e in r["examples"]] == ["d0", "d1", "d2"]


def test_input_errors_name_the_file_and_record(tmp_path: Path) -> None:
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "x", "text": "hi"}]), bad)
    with pytest.raises(ValueError, match=r"bad\.parquet: missing column\(s\) \['source', 'url'"):
        clean(bad, tmp_path / "o.parquet", tmp_path / "r.parquet")
    with pytest.raises(ValueError, match=r"record id='d0': content_type 'application/pdf'"):
        run(tmp_path, [{"text": PROSE, "content_type": "application/pdf"}])


# ---------------------------------------------------------------- config and boundaries


def test_clean_does_not_import_dagster() -> None:
    code = "import sys, kiln.clean.run, kiln.clean.extract; assert 'dagster' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


@pytest.mark.slow
def test_worker_processes_write_the_same_bytes_as_one(tmp_path: Path) -> None:
    docs = [{"text": PROSE, "source": "a"}, {"text": OTHER_PROSE, "source": "b"}, {"text": "short", "source": "b"},
            {"text": PROSE, "source": "c"}]
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        out.mkdir()
        raw = write_raw(out / "raw.parquet", docs)
        clean(raw, out / "clean.parquet", out / "removed.parquet", CleanConfig(shard_docs=1, workers=workers))
        outs.append([(out / n).read_bytes() for n in ("clean.parquet", "removed.parquet")])
    assert outs[0] == outs[1]
