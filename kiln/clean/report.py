"""What cleaning removed and why: ``CleanReport`` (documents and bytes per reason, edits, sources, stage times), the
error raised when nothing survives, and the tables and Markdown the clean_corpus asset shows from a report.

``python -c "import json, sys; from kiln.clean.report import rule_rows; print(rule_rows(json.load(open(sys.argv[1]))))" report.json``
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.clean.config import rule_keys


def example_of(doc_id: str, text: str, lines: int = 4, width: int = 160) -> dict[str, Any]:
    """A removed document as a person skims it: a one-line snippet and its first few non-empty lines."""
    first = [s.strip()[:width] for s in text.split("\n") if s.strip()][:lines]
    return {"id": doc_id, "snippet": " ".join(text.split())[:200], "lines": first}


@dataclass
class CleanReport:
    """What one cleaning run (or one shard of it) read, kept and removed, per reason and per source."""

    input_docs: int = 0
    input_bytes: int = 0  # sum of the input `bytes` column
    kept_docs: int = 0
    kept_bytes: int = 0  # UTF-8 bytes of the clean text kept
    kept_input_bytes: int = 0  # input bytes of kept docs: kept_input_bytes + dropped_bytes == input_bytes
    dropped_docs: int = 0
    dropped_bytes: int = 0  # input bytes of dropped docs
    reasons: dict[str, dict[str, Any]] = field(default_factory=dict)  # reason -> {docs, bytes, examples}
    edits: dict[str, dict[str, Any]] = field(default_factory=dict)  # rule that edits text -> {docs, items, bytes}
    sources: dict[str, dict[str, int]] = field(default_factory=dict)  # source -> kept/dropped docs and bytes
    dedup_rate: float = 0.0  # share of quality-passing docs dropped as URL, exact or near duplicates
    stage_seconds: dict[str, float] = field(default_factory=dict)  # CPU seconds per stage, summed over shards
    quality_model: dict[str, Any] = field(default_factory=dict)  # classifier training metrics and threshold
    token_outliers: dict[str, Any] = field(default_factory=dict)  # KL median, MAD and limit
    mix: dict[str, Any] = field(default_factory=dict)  # groups, target shares, rates, final shares
    shards: int = 0  # shards of the per-document stage
    seconds: float = 0.0
    docs_per_s: float = 0.0
    mb_per_s: float = 0.0  # input MB per second
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def _source(self, source: str) -> dict[str, int]:
        return self.sources.setdefault(
            source, {"kept_docs": 0, "kept_bytes": 0, "dropped_docs": 0, "dropped_bytes": 0}
        )

    def keep(self, source: str, input_bytes: int, clean_bytes: int) -> None:
        self.kept_docs += 1
        self.kept_bytes += clean_bytes
        self.kept_input_bytes += input_bytes
        src = self._source(source)
        src["kept_docs"] += 1
        src["kept_bytes"] += clean_bytes

    def drop(self, doc_id: str, source: str, input_bytes: int, reason: str, text: str, max_examples: int) -> None:
        self.dropped_docs += 1
        self.dropped_bytes += input_bytes
        r = self.reasons.setdefault(reason, {"docs": 0, "bytes": 0, "examples": []})
        r["docs"] += 1
        r["bytes"] += input_bytes
        if len(r["examples"]) < max_examples:
            r["examples"].append(example_of(doc_id, text))
        src = self._source(source)
        src["dropped_docs"] += 1
        src["dropped_bytes"] += input_bytes

    def edit(self, rule: str, items: int, nbytes: int) -> None:
        e = self.edits.setdefault(rule, {"docs": 0, "items": 0, "bytes": 0})
        e["docs"] += 1
        e["items"] += items
        e["bytes"] += nbytes

    def merge(self, other: dict[str, Any], max_examples: int) -> None:
        """Add a shard's report (as a dict) to this one."""
        for k in ("input_docs", "input_bytes", "dropped_docs", "dropped_bytes"):
            setattr(self, k, getattr(self, k) + other[k])
        for reason, v in other["reasons"].items():
            r = self.reasons.setdefault(reason, {"docs": 0, "bytes": 0, "examples": []})
            r["docs"] += v["docs"]
            r["bytes"] += v["bytes"]
            r["examples"] = (r["examples"] + v["examples"])[:max_examples]
        for rule, v in other["edits"].items():
            e = self.edits.setdefault(rule, {"docs": 0, "items": 0, "bytes": 0})
            for k in e:
                e[k] += v[k]
        for s, v in other["sources"].items():
            src = self._source(s)
            src["dropped_docs"] += v["dropped_docs"]
            src["dropped_bytes"] += v["dropped_bytes"]
        for k, v in other["stage_seconds"].items():
            self.stage_seconds[k] = self.stage_seconds.get(k, 0.0) + v

    def table(self) -> list[dict[str, Any]]:
        """One row per rule that removed anything: rule, documents removed, bytes removed (dropped or edited)."""
        return _rule_table(self.reasons, self.edits)


def _rule_table(reasons: dict[str, dict], edits: dict[str, dict]) -> list[dict[str, Any]]:
    rows = [{"rule": r, "action": "drop", "documents": v["docs"], "bytes": v["bytes"]} for r, v in reasons.items()]
    rows += [{"rule": r, "action": "edit", "documents": v["docs"], "bytes": v["bytes"]} for r, v in edits.items()]
    return rows


class EmptyCorpusError(RuntimeError):
    """No document survived cleaning; the message says which rule removed the most and what to change."""

    def __init__(self, report: CleanReport, in_path: Path, keys: dict[str, str | None] | None = None) -> None:
        self.report = report
        counts = ", ".join(f"{r}={v['docs']}" for r, v in report.reasons.items()) or "none (the input is empty)"
        msg = f"clean: kept 0 of {report.input_docs} documents from {in_path}. Dropped per reason: {counts}."
        if report.reasons:
            top = next(iter(report.reasons))
            key = (keys or rule_keys()).get(top)
            if key:
                msg += f" Most drops come from '{top}' (config key clean.{key}): loosen clean.{key} or add sources."
            else:
                msg += f" Most drops come from '{top}', which no config key controls: add sources with real text."
        else:
            msg += " Add sources to the raw corpus."
        super().__init__(msg)


# ---------------------------------------------------------------- what the clean_corpus asset shows


def rule_rows(rep: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per rule that removed anything (drops, then edits): documents, MB and the first example's snippet."""
    return [{"rule": r["rule"], "action": r["action"], "documents": r["documents"], "MB": r["bytes"] / 1e6,
             "example": (rep["reasons"].get(r["rule"], {}).get("examples") or [{"snippet": ""}])[0]["snippet"][:90]}
            for r in _rule_table(rep["reasons"], rep["edits"])]


def stage_seconds_total(rep: dict[str, Any]) -> float:
    """CPU seconds of every stage summed over the shards (1.0 when none were recorded, so shares stay finite)."""
    return sum(rep["stage_seconds"].values()) or 1.0


def stage_rows(rep: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per stage, slowest first: CPU seconds and share of the total."""
    total_s = stage_seconds_total(rep)
    return [{"stage": k, "seconds": v, "share": f"{v / total_s:.1%}"}
            for k, v in sorted(rep["stage_seconds"].items(), key=lambda kv: -kv[1])]


def mix_rows(rep: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per mix group: target and final shares, rates, and its sources (none without clean.mix.weights)."""
    return [{"group": g, **{k: v for k, v in info.items() if k != "sources"}, "sources": ", ".join(info["sources"])}
            for g, info in rep["mix"].get("groups", {}).items()]


def examples_markdown(reasons: dict[str, dict]) -> str:
    """removed_examples.md: per reason its counts, then each example's id and first lines, indented."""
    parts = []
    for reason, v in reasons.items():
        parts.append(f"### {reason}: {v['docs']:,} documents, {v['bytes'] / 1e6:.3f} MB")
        for ex in v["examples"]:
            lines = "\n".join(f"    {line}" for line in ex.get("lines") or [ex["snippet"]])
            parts.append(f"`{ex['id']}`\n\n{lines}\n")
    return "\n".join(parts) or "_nothing removed_"


def report_metrics(rep: dict[str, Any]) -> dict[str, float]:
    """The numbers tracked per run: kept and dropped documents, kept bytes, dedup rate, documents removed per reason."""
    return {"kept_docs": rep["kept_docs"], "dropped_docs": rep["dropped_docs"], "kept_bytes": rep["kept_bytes"],
            "dedup_rate": rep["dedup_rate"], **{f"removed_docs.{r}": v["docs"] for r, v in rep["reasons"].items()}}


def source_rows(rep: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per source: documents and bytes kept and dropped."""
    return [{"source": s, **v} for s, v in rep["sources"].items()]


def mb_per_s_per_core(rep: dict[str, Any]) -> float:
    """Input MB over the summed stage seconds: throughput of one core, whatever ran in parallel."""
    return round(rep["input_bytes"] / 1e6 / stage_seconds_total(rep), 3)
