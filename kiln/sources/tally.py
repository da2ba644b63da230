"""What the readers skip, per source: a count per reason, the first items with file and offset, input bytes read or
lost, and the source's ``on_bad_input`` policy (skip and count, or stop with a message that says what to do).

Use from Python: ``tally = Tally(spec, stats); tally("binary", "a.txt", 6, "NUL bytes")``; ``why_no_documents(spec, stats)``.
"""

from __future__ import annotations

from typing import Any

from kiln.sources.manifest import SourceError, SourceSpec

SKIP_REASONS = ("decode_errors", "binary", "too_large", "bad_record", "corrupt", "not_text", "missing_field",
                "wrong_type", "unsupported_encoding", "bad_link", "duplicate")
COUNTERS = ("documents", "bytes", "files", "empty", *SKIP_REASONS, "lost_bytes")  # lost: input in no record read
SKIP_LOG_MAX = 50  # skipped items listed (file, offset, reason) per source; all are counted
EXPECTED = ("not_text", "duplicate")  # skipped by design, never bad input: no mode stops on them
SCHEMA = ("missing_field", "wrong_type")  # usually a wrong `text_field`: these stop unless `on_bad_input: skip`

LABELS = {"decode_errors": "invalid {encoding}", "binary": "binary", "too_large": "over max_record_bytes",
          "bad_record": "malformed record", "corrupt": "corrupt or truncated", "not_text": "not HTTP 200 text/HTML",
          "missing_field": "no text field", "wrong_type": "text field not a string",
          "unsupported_encoding": "unsupported content-encoding", "bad_link": "unreadable link",
          "duplicate": "second name of a file"}
FIXES = {
    "decode_errors": "set `encoding:` on the source to the files' real encoding, or exclude the files",
    "binary": "check `format:` and `include:`, or drop binary files with `exclude:`",
    "too_large": "raise `max_record_bytes:` on the source, or split the files",
    "bad_record": "check `format:` (these are not one JSON object per line), or fix or exclude the files",
    "corrupt": "download or copy the files again (they are truncated or damaged), or exclude them",
    "not_text": "point the source at archives of HTML or text pages (images, scripts and redirects are skipped)",
    "missing_field": "set `text_field:` to the field (column) that holds the text",
    "wrong_type": "set `text_field:` to the field (column) that holds the text as a string",
    "unsupported_encoding": "recompress or re-crawl without that content-encoding",
    "bad_link": "fix or remove the links (dangling, a loop, or leading out of the package)",
    "duplicate": "nothing: each file is read once",
}


def stops(spec: SourceSpec, reason: str) -> bool:
    """Whether bad input of this kind stops the run: always in "fail" mode, never in "skip" mode, and by default
    only for records without a string text field."""
    if reason in EXPECTED:
        return False
    return spec.on_bad_input == "fail" or (reason in SCHEMA and spec.on_bad_input != "skip")


class Tally:
    """Counts one source's skipped input by reason and lists the first few; raises where ``stops`` says so."""

    def __init__(self, spec: SourceSpec, counts: dict[str, Any]) -> None:
        self.spec, self.counts = spec, counts
        self.input_bytes = 0  # input inside records read, whatever became of them: + lost_bytes == the files' sizes
        for key in COUNTERS:
            counts.setdefault(key, 0)
        self.log: list[dict[str, Any]] = counts.setdefault("skipped", [])

    def __call__(self, reason: str, rel: str, offset: int | None, detail: str, fix: str = "", *, record: str = "",
                 count: int = 1, lost: int = 0) -> None:
        """Skip ``count`` items of ``reason`` at byte ``offset`` of file ``rel``; ``lost`` input bytes were in no record."""
        if stops(self.spec, reason):
            where = " ".join(filter(None, (rel, record))) + (f" at byte {offset}" if offset is not None else "")
            raise SourceError(
                f"source '{self.spec.name}': {where}: {detail}. Fix: {fix or FIXES[reason]}; or set "
                f"`on_bad_input: skip` to skip and count such input."
            )
        self.counts[reason] += count
        self.counts["lost_bytes"] += lost
        if len(self.log) < SKIP_LOG_MAX:
            text = f"{record}: {detail}" if record else detail
            self.log.append({"file": rel, "offset": offset, "reason": reason, "detail": text[:200]})

    def read(self, nbytes: int) -> None:
        """``nbytes`` of input were read as (part of) a record, whatever became of it."""
        self.input_bytes += nbytes

    def stops(self, reason: str) -> bool:
        return stops(self.spec, reason)


def label(spec: SourceSpec, reason: str) -> str:
    return LABELS[reason].format(encoding=spec.encoding or "UTF-8")


def why_no_documents(spec: SourceSpec, stats: dict[str, Any]) -> str:
    """Why a source gave no documents, from its stats: nothing matched, all empty, or what skipped its input, with
    the first skipped item and what to do."""
    skipped = {r: stats[r] for r in SKIP_REASONS if stats.get(r)}
    if not stats.get("files") and not skipped:
        return "no file matched; check the include patterns, `exclude:` and `format:`"
    parts = ([f"empty {stats['empty']}"] if stats.get("empty") else []) + [
        f"{label(spec, r)} {n}" for r, n in skipped.items()]
    text = f"{stats.get('files', 0)} file(s), nothing kept: {', '.join(parts)}"
    real = {r: n for r, n in skipped.items() if r not in EXPECTED} or skipped
    if not real:
        return text + "; the files hold only blank text"
    first = next((s for s in stats.get("skipped", []) if s["reason"] in real), None)
    if first:
        at = f" at byte {first['offset']}" if first["offset"] is not None else ""
        text += f"; first: {first['file']}{at}: {first['detail']}"
    return text + f". Fix: {FIXES[max(real, key=real.get)]}"
