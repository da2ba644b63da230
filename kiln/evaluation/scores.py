"""Score tables and numbers: each task's primary metric beside chance, MLflow metric names, bits per byte.

In code: ``score_rows(full, clean)``, ``flat_metrics(full, clean)``, ``bits_per_byte(val_loss, enc, texts)``.
"""

from __future__ import annotations

import math
from typing import Any

from kiln.evaluation.registry import REGISTRY


def primary_metric(task: str, row: dict[str, Any]) -> str | None:
    """The metric ``task`` is judged by (its spec's ``primary``), when ``row`` holds a number for it."""
    return REGISTRY.primary(task, row)


def score_rows(full: dict[str, dict], clean: dict[str, dict]) -> list[dict[str, Any]]:
    """One table row per task: its primary metric on all items and on clean items, beside chance."""
    rows = []
    for task, row in full.items():
        metric = primary_metric(task, row)
        c = clean.get(task, {})
        rows.append({"task": task, "metric": metric or "-", "score": row.get(metric) if metric else "-",
                     "chance": row.get("chance") if row.get("chance") is not None else "-",
                     "items": row.get("items"), "contaminated": row.get("contaminated", "unchecked"),
                     "clean score": c.get(metric, "-") if metric else "-", "clean items": c.get("items", "-")})
    return rows


def flat_metrics(full: dict[str, dict], clean: dict[str, dict], prefix: str = "") -> dict[str, float]:
    """MLflow metric names and values: ``<prefix><task>.<metric>`` and ``<prefix><task>.clean.<metric>``; a metric
    name MLflow refuses is written with what it allows (``pass@1`` -> ``pass_at_1``)."""
    out = {}
    for subset, rows in (("", full), (".clean", clean)):
        for task, row in rows.items():
            for m, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and m not in ("items", "chance"):
                    out[f"{prefix}{task}{subset}.{mlflow_name(m)}"] = v
    return out


def mlflow_name(metric: str) -> str:
    """``metric`` in the characters MLflow accepts (letters, digits, _ - . space : /): ``@`` reads ``_at_``, any
    other character becomes ``_``."""
    import re

    return re.sub(r"[^0-9A-Za-z_\-. :/]", "_", metric.replace("@", "_at_"))


def bits_per_byte(loss: float, encoding: Any, texts: list[str]) -> float:
    """A loss in nats per token as bits per byte of UTF-8 text, at the tokens per byte ``encoding`` gives ``texts``."""
    sample = "".join(texts)
    tokens_per_byte = len(encoding.encode_ordinary(sample)) / max(len(sample.encode()), 1)
    return loss / math.log(2) * tokens_per_byte
