"""Hyper-parameter sweeps: the points of a grid or of a seeded random search over a pretraining run's typed fields,
and the table, plots and best point of their results.

``points = expand([Swept("optim.lr", values=[1e-3, 2e-3]), Swept("optim.warmup_steps", values=[20, 50])])`` gives
four Points, each with a ``key`` (its Dagster partition: ``lr=0.001;warmup_steps=20``) and its field values;
``overrides(point)`` splits a point into the ``model``, ``batch`` and ``optim`` blocks a training plan and a job
take. A swept field is ``<block>.<field>`` of ModelConfig (``model.n_embd``), kiln.plan.memory.BatchConfig
(``batch.global_batch``) or kiln.train.optim.OptimConfig (``optim.lr``, ``optim.name``); its values are checked
against the field's type before anything trains. ``ranked(points, losses)`` and ``marginals(...)`` summarise the
results. Nothing here imports Dagster.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from kiln.common.config import ConfigError, domains

BLOCKS = ("model", "batch", "optim")  # where a swept field may live


def block_class(block: str):
    from kiln.model.config import ModelConfig
    from kiln.plan.memory import BatchConfig
    from kiln.train.optim import OptimConfig

    return {"model": ModelConfig, "batch": BatchConfig, "optim": OptimConfig}[block]


@dataclass
class Swept:
    """One swept field: a grid of ``values`` (numbers) or ``choices`` (strings, booleans as "true"/"false"), or,
    for a random search, a range ``low``..``high`` drawn uniformly (in log space when ``log``)."""

    field: str  # "<block>.<name>": optim.lr, batch.global_batch, model.n_embd, optim.name ...
    values: list = dataclasses.field(default_factory=list)
    choices: list = dataclasses.field(default_factory=list)
    low: float | None = None
    high: float | None = None
    log: bool = True


@dataclass
class Point:
    key: str  # the point's name and Dagster partition key, e.g. "lr=0.001;warmup_steps=20"
    values: dict[str, Any] = field(default_factory=dict)  # "<block>.<name>" -> value

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "values": dict(self.values)}


def field_type(path: str, where: str = "sweep") -> tuple[str, str, type]:
    """(block, name, python type: int, float, str or bool) of a swept field; an unknown block or field, or a
    field that is not a plain number, string or flag, is a ConfigError naming it and what may be swept."""
    block, _, name = path.partition(".")
    if block not in BLOCKS or not name:
        raise ConfigError(f"{where}: {path!r} is not a sweepable field; write <block>.<field> with block one of "
                          f"{', '.join(BLOCKS)} (e.g. optim.lr, batch.global_batch, model.n_embd)")
    known = {f.name: f for f in dataclasses.fields(block_class(block))}
    if name not in known:
        raise ConfigError(f"{where}: {path!r}: {block_class(block).__name__} has no field {name!r}; choose one of "
                          f"{', '.join(sorted(known))}")
    import types
    import typing

    tp = typing.get_type_hints(block_class(block))[name]  # a declared Domain (Annotated) left out
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        tp = args[0]  # "int | None" sweeps as int
    if tp in (bool, int, float, str):
        return block, name, tp
    hint = str(known[name].type).replace(" ", "")
    raise ConfigError(f"{where}: {path!r} is a {hint}, which a sweep cannot vary; sweep numbers, strings or flags")


def in_domain(path: str, values: list[Any], where: str) -> list[Any]:
    """``values`` of swept field ``path``, each inside the Domain the field declares (a point's run would refuse it
    when it starts; the grid refuses it first): a ConfigError naming the field and the legal values."""
    block, _, name = path.partition(".")
    declared = domains(block_class(block)).get(name)
    if declared is not None:
        kind, domain = declared
        for v in values:
            domain.check(v, kind, where)
    return values


def typed(value: Any, kind: type, where: str) -> Any:
    """``value`` as ``kind``, or a ConfigError saying which value of which field is wrong."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "false"):
            return str(value).lower() == "true"
    elif kind is int:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif isinstance(value, str) and value:
        return value
    raise ConfigError(f"{where}: {value!r} is not a valid {kind.__name__}")


def short_names(paths: list[str]) -> dict[str, str]:
    """Each field's name in point keys: the field alone (``lr``), or the whole path where two blocks share it."""
    names = [p.partition(".")[2] for p in paths]
    return {p: (n if names.count(n) == 1 else p) for p, n in zip(paths, names)}


def show(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    return f"{v:g}" if isinstance(v, float) else str(v)


def training_kind(path: str, where: str) -> type:
    """The python type of a training field (``field_type``), checking that it may be swept."""
    return field_type(path, where)[2]


def expand(swept: list[Swept], mode: str = "grid", samples: int = 8, seed: int = 0,
           where: str = "sweep", kind_of: Callable[[str, str], type] = training_kind,
           check: Callable[[str, list[Any], str], list[Any]] = in_domain) -> list[Point]:
    """The sweep's points: every combination of the fields' values (``grid``), or ``samples`` draws (``random``:
    ranges drawn uniformly, in log space where ``log``; values and choices picked uniformly) seeded by ``seed``.
    Duplicates are dropped. An empty grid, a field swept twice, a value of the wrong type or a range with
    low >= high is a ConfigError naming the field. ``kind_of(path, where)`` types a field (and refuses one that
    may not be swept) and ``check(path, values, where)`` holds the values to its domain: a training run's fields by
    default; kiln.scaling.ablation passes its data fields'."""
    import numpy as np

    if mode not in ("grid", "random"):
        raise ConfigError(f"{where}.mode: {mode!r}; choose grid or random")
    if not swept:
        raise ConfigError(f"{where}.fields is empty: name at least one field to sweep (e.g. optim.lr with values)")
    paths = [s.field for s in swept]
    if len(set(paths)) != len(paths):
        raise ConfigError(f"{where}.fields: {sorted({p for p in paths if paths.count(p) > 1})} swept more than once")
    axes: list[list[Any]] = []
    for i, s in enumerate(swept):
        at = f"{where}.fields[{i}] ({s.field})"
        kind = kind_of(s.field, f"{where}.fields[{i}].field")
        given = list(s.values) + list(s.choices)
        if s.low is not None or s.high is not None:
            if mode != "random":
                raise ConfigError(f"{at}: low/high are a random search's range; set mode: random, or give values")
            if given:
                raise ConfigError(f"{at}: give values/choices or a low..high range, not both")
            if kind not in (int, float):
                raise ConfigError(f"{at}: a range needs a numeric field; {s.field} is a {kind.__name__}")
            if s.low is None or s.high is None or not s.low < s.high or (s.log and s.low <= 0):
                raise ConfigError(f"{at}: the range needs low < high{' and low > 0 (log: true)' if s.log else ''}; "
                                  f"got low={s.low}, high={s.high}")
            check(s.field, [s.low, s.high], f"{at} range")  # every draw lies between the two
            axes.append([])  # drawn below
            continue
        if not given:
            raise ConfigError(f"{at}: no values: give values (numbers), choices (strings) or, with mode: random, "
                              "a low..high range")
        axes.append(check(s.field, [typed(v, kind, f"{at} value") for v in given], f"{at} value"))
    if mode == "grid":
        combos = list(itertools.product(*axes))
    else:
        if samples < 1:
            raise ConfigError(f"{where}.samples: {samples}; a random search needs at least 1 sample")
        rng = np.random.default_rng(seed)
        combos = []
        for _ in range(samples):
            combo = []
            for s, axis in zip(swept, axes):
                if axis:
                    combo.append(axis[int(rng.integers(len(axis)))])
                    continue
                lo, hi = (math.log(s.low), math.log(s.high)) if s.log else (s.low, s.high)
                x = float(rng.uniform(lo, hi))
                x = math.exp(x) if s.log else x
                kind = kind_of(s.field, where)
                combo.append(int(round(x)) if kind is int else float(f"{x:.4g}"))
            combos.append(tuple(combo))
    names = short_names(paths)
    points, seen = [], set()
    for combo in combos:
        key = ";".join(f"{names[p]}={show(v)}" for p, v in zip(paths, combo))
        if key not in seen:
            seen.add(key)
            points.append(Point(key, dict(zip(paths, combo))))
    return points


def overrides(point: Point | dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{"model": {...}, "batch": {...}, "optim": {...}}: the point's values by block."""
    values = point.values if isinstance(point, Point) else point["values"]
    out: dict[str, dict[str, Any]] = {b: {} for b in BLOCKS}
    for path, v in values.items():
        block, _, name = path.partition(".")
        out[block][name] = v
    return out


def ranked(rows: list[dict[str, Any]], metric: str = "final_val_loss") -> list[dict[str, Any]]:
    """The result rows best first (lowest ``metric``); a diverged point (nan or inf) ranks last, marked so."""
    def score(r: dict[str, Any]) -> float:
        v = r.get(metric)
        return v if isinstance(v, (int, float)) and math.isfinite(v) else math.inf

    out = sorted(rows, key=score)
    for i, r in enumerate(out):
        r["rank"] = i + 1 if math.isfinite(score(r)) else None
        if not math.isfinite(score(r)):
            r["note"] = "diverged"
    return out


def marginals(points: list[dict[str, Any]], losses: list[float]) -> dict[str, list[tuple[float, float]]]:
    """For each numeric swept field, the best loss at each of its values (over the other fields' values): the
    points of a "loss vs field" plot. String fields are left out (no axis to draw them on)."""
    out: dict[str, dict[float, float]] = {}
    for p, loss in zip(points, losses):
        if not (isinstance(loss, (int, float)) and math.isfinite(loss)):
            continue
        for path, v in p["values"].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                best = out.setdefault(path, {})
                best[float(v)] = min(best.get(float(v), math.inf), loss)
    return {path: sorted(by.items()) for path, by in out.items()}
