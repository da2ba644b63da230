"""``python -m kiln.filters FILE``: every quality signal of one file and the first rule that drops it, with every
registered filter at its default settings (the clean config's defaults)."""

from __future__ import annotations

import sys
from pathlib import Path

from kiln.common.text import normalize_text
from kiln.filters.base import Doc
from kiln.filters.registry import build_filters


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kiln.filters FILE", file=sys.stderr)
        return 2
    text = normalize_text(Path(args[0]).read_text(encoding="utf-8", errors="replace"))
    doc = Doc(args[0], "cli", Path(args[0]).resolve().as_uri(), text, "text/plain", "", len(text.encode()))
    verdict = None
    for f in build_filters(lambda spec: spec.config()):
        reason = f.reason(doc)
        if reason and verdict is None:
            verdict = (reason, f.detail(doc))
    for k, v in sorted(doc.signals.items()):
        if not k.startswith("_"):
            print(f"{k:36s} {v:.4g}" if isinstance(v, float) else f"{k:36s} {v}")
    print("kept" if verdict is None else f"dropped: {verdict[0]} ({verdict[1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
