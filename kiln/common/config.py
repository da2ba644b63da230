"""Strict construction of config dataclasses from plain dicts (YAML, JSON, run config).

Unknown keys are errors that name the key, where it was found and the keys that are allowed.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import textwrap
import typing
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config key or value is wrong; the message names it and says what to do."""


def from_dict(cls: type[T], data: dict[str, Any] | None, where: str = "config") -> T:
    """Build dataclass ``cls`` from ``data``; nested dataclass fields are built recursively.

    Raises ConfigError for an unknown key (with a close-match suggestion) or a non-mapping.
    """
    data = dict(data or {})
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, list(fields), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"{where}: unknown key '{key}'.{hint} Allowed keys: {', '.join(sorted(fields))}."
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        ftype = hints.get(name)
        if dataclasses.is_dataclass(ftype) and isinstance(value, dict):
            value = from_dict(ftype, value, f"{where}.{name}")
        kwargs[name] = value
    return cls(**kwargs)


def to_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def _type_name(tp: Any) -> str:
    """A field's annotation as written: a string under ``from __future__ import annotations``, else the type."""
    return tp if isinstance(tp, str) else tp.__name__ if isinstance(tp, type) else str(tp)


def check_types(cfg: Any, where: str) -> None:
    """ConfigError naming the key when a scalar field has the wrong type (e.g. a quoted number in YAML)."""
    for f in dataclasses.fields(cfg):
        value, tname = getattr(cfg, f.name), _type_name(f.type)
        allowed = _TYPES.get(tname)
        if allowed and (not isinstance(value, allowed) or (bool not in allowed and isinstance(value, bool))):
            raise ConfigError(f"{where}.{f.name} must be {tname}, got {value!r}.")
        if tname == "list[str]" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ConfigError(f"{where}.{f.name} must be a list of strings, got {value!r}.")


def field_docs(cls: type) -> dict[str, str]:
    """{field: one-line description} of a config dataclass, base classes included.

    A field written by hand is described by its trailing ``# comment`` in the source; a field made programmatically
    (``dataclasses.make_dataclass``) by ``field(metadata={"doc": ...})``, which wins when both exist.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass) and klass.__dict__.get("__dataclass_fields__") is not None:
            docs.update(_source_comments(klass))
    for f in dataclasses.fields(cls):
        if f.metadata.get("doc"):
            docs[f.name] = f.metadata["doc"]
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


def _source_comments(klass: type) -> dict[str, str]:
    """{field: comment} from ``klass``'s source: the field's trailing ``# comment``, else the comment lines right
    above a run of uncommented fields (one comment for a group such as the n-gram thresholds)."""
    try:
        src = textwrap.dedent("".join(inspect.getsourcelines(klass)[0]))
        body = ast.parse(src).body[0].body  # type: ignore[attr-defined]
    except (OSError, TypeError, SyntaxError, IndexError, AttributeError):
        return {}
    lines = src.splitlines()
    out, group, prev_end = {}, "", 0
    for node in body:
        above = [s.strip()[1:].strip() for s in lines[prev_end : node.lineno - 1] if s.strip().startswith("#")]
        prev_end = node.end_lineno
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            group = ""
            continue
        group = " ".join(above) or group
        tail = lines[node.end_lineno - 1][node.end_col_offset :]
        out[node.target.id] = tail.split("#", 1)[1].strip() if "#" in tail else group
        if "#" in tail:
            group = ""
    return out
