"""The standard benchmarks in Kiln's score rows, beside its own tasks: on all the sampled items and on the clean ones.

``full, clean = score_benchmarks(model, encoding, prepared, report)`` gives, per benchmark, the row shape
kiln.evaluation.suite.score_full_and_clean gives local tasks ({<metric>: score, <metric>_stderr, chance, items,
contaminated, contaminated_share, lm_eval_task, version}), so the score tables, MLflow metrics and the card take them
as they are. ``report``: kiln.evaluation.standard.contamination.check_benchmarks's (None: unchecked).
"""

from __future__ import annotations

from typing import Any, Callable

from kiln.evaluation.standard.contamination import clean_prepared
from kiln.evaluation.standard.run import Prepared, evaluate_lm, scores


def _rows(out: dict[str, Any], prepared: Prepared) -> dict[str, dict[str, Any]]:
    rows = {}
    for name, s in scores(out, prepared).items():
        metric = s["primary"].split(",", 1)[0]
        rows[name] = {metric: s["score"], f"{metric}_stderr": s["stderr"], "chance": s["chance"], "items": s["items"],
                      "lm_eval_task": s["lm_eval_task"], "version": s["version"]}
    return rows


def score_benchmarks(model: Any, encoding: Any, prepared: Prepared, report: dict[str, dict[str, Any]] | None = None,
                     batch_size: int = 16, seed: int = 1234, device: str = "cpu",
                     progress: Callable[[str], None] | None = None) -> tuple[dict[str, dict], dict[str, dict]]:
    """(full, clean) score rows of the prepared benchmarks for a Kiln model, through Kiln's lm-eval adapter."""
    from kiln.evaluation.adapter import KilnLM

    was_training = model.training
    lm = KilnLM(model, encoding, device=device, batch_size=batch_size, seed=seed, progress=progress)
    try:
        full = _rows(evaluate_lm(lm, prepared, seed=seed), prepared)
        rescore = clean_prepared(prepared, report) if report else None
        again = _rows(evaluate_lm(lm, rescore, seed=seed), rescore) if rescore is not None else {}
    finally:
        model.train(was_training)
    clean: dict[str, dict[str, Any]] = {}
    for name, row in full.items():
        if report is None or name not in report:
            continue
        r = report[name]
        row.update(contaminated=r["contaminated"], contaminated_share=r["share"])
        clean[name] = (dict(row) if not r["contaminated"] else again.get(name)
                       or {"chance": row["chance"], "items": 0})
    return full, clean
