"""Tests for the cleaning step (kiln.clean): each quality rule, exact and MinHash dedup, HTML, report accounting, errors, config.

Run: python -m pytest tests/kiln/clean/test_clean.py -q
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

from kiln.clean.config import CleanConfig, default_filters
from kiln.clean.report import CleanReport, EmptyCorpusError
from kiln.clean.run import clean
from kiln.common.text import normalize_text
from kiln.filters.base import Doc, Filter
from kiln.filters.gopher_quality import text_signals
from kiln.common.config import ConfigError
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


def test_good_prose_passes_every_rule() -> None:
    text = normalize_text(PROSE)
    doc = Doc("good", "test", "", text, "text/plain", "CC0", len(text), signals=text_signals(text))
    assert doc.signals["words"] > 50 and doc.signals["alpha_word_fraction"] == 1.0
    filters = default_filters(CleanConfig())
    assert [f.name for f in filters] == ["url", "gopher_quality", "language", "gopher_repetition", "c4", "fineweb",
                                         "olmo2", "dirty_words"]
    assert [f.reason(doc) for f in filters] == [None] * len(filters)
    assert doc.signals["language"] == "en" and doc.signals["stop_words"] >= 2


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


def test_normalisation() -> None:
    raw = "caf\u0065\u0301\u00a0au\u200blait\r\n\r\n\r\n\r\n    indented code   \n\x00end\u2028"
    assert normalize_text(raw) == "caf\u00e9 aulait\n\n    indented code\nend"


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


def test_report_accounting_adds_up_and_order_is_input_order(tmp_path: Path) -> None:
    cases = violations()
    docs = [{"text": PROSE, "source": "a"}, {"text": OTHER_PROSE, "source": "b"}]
    docs += [{"text": t, "source": "b"} for t in cases.values()] + [{"text": PROSE, "source": "a"}]
    calls: list[str] = []
    cfg = CleanConfig(batch_size=3, progress_every=4, shard_docs=4)
    report, kept, removed = run(tmp_path, docs, cfg, row_group_size=4, progress=calls.append)
    assert report.shards == 5  # shards never mix sources: a | b b b b | b b b b | b b | a

    assert report.input_docs == len(docs) == report.kept_docs + report.dropped_docs
    assert report.input_bytes == sum(len(d["text"].encode()) for d in docs)
    assert report.input_bytes == report.kept_input_bytes + report.dropped_bytes
    assert report.dropped_docs == sum(r["docs"] for r in report.reasons.values()) == len(removed)
    assert report.dropped_bytes == sum(r["bytes"] for r in report.reasons.values()) == sum(
        r["bytes"] for r in removed.values())
    assert report.kept_bytes == sum(k["bytes"] for k in kept)
    assert report.sources == {
        "a": {"kept_docs": 1, "kept_bytes": len(PROSE.encode()), "dropped_docs": 1,
              "dropped_bytes": len(PROSE.encode())},
        "b": {"kept_docs": 1, "kept_bytes": len(OTHER_PROSE.encode()), "dropped_docs": len(cases),
              "dropped_bytes": sum(len(t.encode()) for t in cases.values())},
    }
    ex = report.reasons["dedup:exact"]["examples"]
    assert ex == [{"id": f"d{len(docs) - 1}", "snippet": " ".join(PROSE.split())[:200],
                   "lines": [p[:160] for p in PROSE.split("\n\n")]}]  # a few lines each, for a person to judge
    assert all(len(e["snippet"]) <= 200 for r in report.reasons.values() for e in r["examples"])
    assert report.to_dict()["config"]["minhash"]["num_perm"] == 112

    assert [k["id"] for k in kept] == ["d0", "d1"]
    assert list(removed) == [f"d{i}" for i in range(2, len(docs))]
    # every progress_every docs, then one final call; a logger's .info can take the messages
    read = [c for c in calls if " docs read" in c]
    assert [c.split(" docs read")[0] for c in read] == ["clean: 5", "clean: 9", "clean: 12", "clean: done, 12"]
    assert "clean: quality classifier skipped: 0 reference and 2 other documents" in " ".join(calls)
    assert read[0].startswith("clean: 5 docs read, ") and read[-1].endswith(" MB/s") and "docs/s" in read[-1]


def test_examples_capped_per_reason(tmp_path: Path) -> None:
    report, _, _ = run(tmp_path, [{"text": f"short note {i}"} for i in range(5)] + [{"text": PROSE}])
    r = report.reasons["gopher:too_few_words"]
    assert r["docs"] == 5 and [e["id"] for e in r["examples"]] == ["d0", "d1", "d2"]


def test_empty_corpus_error_names_top_reason_and_key(tmp_path: Path) -> None:
    docs = [{"text": f"short note {i}"} for i in range(3)] + [{"text": "\n".join(f"- {l}" for l in LINES)}]
    with pytest.raises(EmptyCorpusError) as err:
        run(tmp_path, docs)
    msg = str(err.value)
    assert "kept 0 of 4 documents" in msg
    assert "gopher:too_few_words=3, gopher:bullet_lines=1" in msg
    assert "clean.min_words" in msg and "loosen" in msg and "add sources" in msg
    assert isinstance(err.value.report, CleanReport) and err.value.report.dropped_docs == 4
    assert not (tmp_path / "clean.parquet").exists() and not (tmp_path / "removed.parquet").exists()


def test_input_errors_name_the_file_and_record(tmp_path: Path) -> None:
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "x", "text": "hi"}]), bad)
    with pytest.raises(ValueError, match=r"bad\.parquet: missing column\(s\) \['source', 'url'"):
        clean(bad, tmp_path / "o.parquet", tmp_path / "r.parquet")
    with pytest.raises(ValueError, match=r"record id='d0': content_type 'application/pdf'"):
        run(tmp_path, [{"text": PROSE, "content_type": "application/pdf"}])


# ---------------------------------------------------------------- config and boundaries


def test_config_defaults_are_fineweb_minhash() -> None:
    mh = CleanConfig().minhash
    assert (mh.enabled, mh.ngram, mh.num_perm, mh.bands, mh.rows) == (True, 5, 112, 14, 8)


def test_unknown_config_key_is_an_error() -> None:
    with pytest.raises(ConfigError, match="unknown key 'min_word'.*Did you mean 'min_words'"):
        CleanConfig.from_dict({"min_word": 10})
    with pytest.raises(ConfigError, match=r"clean\.minhash: unknown key 'perms'"):
        CleanConfig.from_dict({"minhash": {"perms": 64}})


def test_wrong_value_type_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"clean\.min_words must be a whole number \(>= 0\), got '50'"):
        CleanConfig.from_dict({"min_words": "50"})
    with pytest.raises(ConfigError, match=r"clean\.minhash\.enabled must be bool, got 1"):
        CleanConfig.from_dict({"minhash": {"enabled": 1}})
    assert CleanConfig.from_dict({"max_symbol_to_word_ratio": 1}).max_symbol_to_word_ratio == 1


def test_num_perm_must_equal_bands_times_rows() -> None:
    with pytest.raises(ConfigError, match=r"num_perm=128 must equal bands \* rows = 14 \* 8 = 112"):
        CleanConfig.from_dict({"minhash": {"num_perm": 128}})
    cfg = CleanConfig.from_dict({"minhash": {"num_perm": 128, "bands": 16, "rows": 8}, "min_words": 20})
    assert cfg.minhash.bands == 16 and cfg.min_words == 20


def test_clean_does_not_import_dagster() -> None:
    code = "import sys, kiln.clean.run, kiln.clean.extract; assert 'dagster' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_the_generated_config_pickles_for_worker_processes() -> None:
    import pickle

    cfg = CleanConfig.from_dict({"min_words": 20, "c4": {"min_sentences": 2}, "minhash": {"enabled": False}})
    again = pickle.loads(pickle.dumps(cfg))
    assert type(again) is CleanConfig and again == cfg and again.c4.min_sentences == 2
    assert again.shard_stage_hash() == cfg.shard_stage_hash()


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
