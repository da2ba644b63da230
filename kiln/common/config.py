"""Strict construction of config dataclasses from plain dicts (YAML, JSON, run config).

Unknown keys are errors that name the key, where it was found and the keys that are allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
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
