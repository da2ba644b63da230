"""Strict construction of config dataclasses from plain dicts (YAML, JSON, run config).

Unknown keys are errors that name the key, where it was found and the keys that are allowed.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import io
import textwrap
import tokenize
import typing
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config key or value is wrong; the message names it and says what to do."""


def read_yaml(path: Any, what: str, instead: str) -> Any:
    """The parsed YAML file at ``path``; an unreadable file or bad YAML is a ConfigError naming the file, ``what`` it
    should be ("the principles file") and what to give ``instead``."""
    import pathlib

    import yaml

    try:
        return yaml.safe_load(pathlib.Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read {what} ({e}); {instead}") from e


@dataclasses.dataclass(frozen=True)
class Domain:
    """The legal values of a numeric config field, declared with its type: ``nnodes: Annotated[int, Domain(1)] = 1``
    (at least 1), ``Domain(0, 1, low_open=True)`` (0 < x <= 1), ``Domain(0, 1, high_open=True)`` (0 <= x < 1),
    ``also=(-1,)`` for a marker value ("-1: what the others leave"), ``none=True`` where None means "choose for me";
    ``Domain()`` declares a number with no bounds. On a list or a mapping it holds for each element or value
    (``widths: Annotated[list[int], Domain(8)]``). from_dict checks every declared field when a config is parsed,
    so 0 processes or a negative degree is one line naming the key, not a ZeroDivisionError."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple = ()
    none: bool = False

    def describe(self) -> str:
        parts = []
        lt, gt = ("<" if self.low_open else "<="), ("<" if self.high_open else "<=")
        if self.low is not None and self.high is not None:
            parts.append(f"{self.low:g} {lt} x {gt} {self.high:g}")
        elif self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        elif self.high is not None:
            parts.append(f"{gt} {self.high:g}")
        else:
            parts.append("any number" if not self.also else "")
        parts += [repr(a) for a in self.also] + (["None"] if self.none else [])
        return " or ".join(p for p in parts if p)

    def check(self, value: Any, kind: type, key: str) -> None:
        if value is None and self.none:
            return
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                self.check(v, kind, f"{key}[{i}]")
            return
        if isinstance(value, dict):
            for k, v in value.items():
                self.check(v, kind, f"{key}.{k}")
            return
        ok_type = (isinstance(value, (int, float)) if kind is float else isinstance(value, int))
        if not ok_type or isinstance(value, bool):
            raise ConfigError(f"{key} must be {'a number' if kind is float else 'a whole number'} "
                              f"({self.describe()}), got {value!r}")
        if value in self.also:
            return
        below = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        above = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if below or above:
            raise ConfigError(f"{key} is {value!r}: give {self.describe()}")


@functools.cache
def domains(cls: type) -> dict[str, tuple[type, Domain]]:
    """{field: (int or float, its Domain)} of the fields of dataclass ``cls`` that declare one (read once a class)."""
    out = {}
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        if typing.get_origin(hint) is not typing.Annotated:
            continue
        base, *extra = typing.get_args(hint)
        found = [d for d in extra if isinstance(d, Domain)]
        if found:
            out[name] = (_number_kind(base), found[0])
    return out


def _number_kind(hint: Any) -> type:
    """float or int: the number type inside a field's hint (``int | None``, ``list[int]``, ``dict[str, float]``)."""
    args = [a for a in (typing.get_args(hint) or (hint,)) if a is not type(None)]
    if float in args:
        return float
    if int in args:
        return int
    for a in args:
        if typing.get_args(a):
            return _number_kind(a)
    return int


@functools.cache
def model_domains(cls: type) -> dict[str, tuple[type, Domain]]:
    """{field: (int or float, its Domain)} of a pydantic model class (the Dagster configs and resources built on
    the core's dataclasses): the Domain in each field's ``Annotated`` metadata (read once a class)."""
    out = {}
    for name, f in getattr(cls, "model_fields", {}).items():
        found = [d for d in f.metadata if isinstance(d, Domain)]
        if found:
            out[name] = (_number_kind(f.annotation), found[0])
    return out


def check_model_domains(model: Any, where: str) -> None:
    """ConfigError naming ``where.<field>`` for the first field of pydantic ``model`` outside its declared Domain (a
    block inside it is a model that checked its own when it was made). None in a field whose default is None means
    "not set": never out of its domain."""
    fields = type(model).model_fields
    for name, (kind, domain) in model_domains(type(model)).items():
        value = getattr(model, name)
        if not (value is None and fields[name].default is None):
            domain.check(value, kind, f"{where}.{name}")


def check_domains(obj: Any, where: str) -> None:
    """ConfigError naming ``where.<field>`` for the first field of dataclass ``obj``, or of a dataclass inside it,
    outside its declared Domain (for objects made in code rather than by from_dict)."""
    declared = domains(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name in declared:
            kind, domain = declared[f.name]
            domain.check(value, kind, f"{where}.{f.name}")
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_domains(value, f"{where}.{f.name}")


def from_dict(cls: type[T], data: dict[str, Any] | None, where: str = "config", check: bool = True) -> T:
    """Build dataclass ``cls`` from ``data``; nested dataclass fields are built recursively.

    Raises ConfigError for an unknown key (with a close-match suggestion), a non-mapping, or a value outside the
    Domain its field declares (check_domains); ``check=False`` leaves the Domains to the caller (data validated
    before, e.g. a job file kiln.train.job.job_file wrote).
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
            value = from_dict(ftype, value, f"{where}.{name}", check)
        kwargs[name] = value
    declared = domains(cls) if check else {}
    for name, value in kwargs.items():  # before the class sees them: its own checks assume numbers in range
        if name in declared:
            kind, domain = declared[name]
            domain.check(value, kind, f"{where}.{name}")
    return cls(**kwargs)


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key; any other value in ``override`` replaces the base's (``base`` is not changed)."""
    out = dict(base)
    for k, v in override.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def to_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def _type_name(tp: Any) -> str:
    """A field's annotation as written: a string under ``from __future__ import annotations``, else the type; the
    type inside ``Annotated[type, Domain(...)]``."""
    if typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    name = tp if isinstance(tp, str) else tp.__name__ if isinstance(tp, type) else str(tp)
    if name.startswith("Annotated[") and name.endswith("]"):
        depth = 0
        for i, ch in enumerate(name[len("Annotated["):], len("Annotated[")):
            depth += ch == "["
            depth -= ch == "]"
            if ch == "," and depth == 0:
                return name[len("Annotated["):i].strip()
    return name


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
    """{field: one-line description} of a config dataclass, base classes included (a field's doc is looked up in
    the class that declares it; a redeclaration without a doc keeps the base class's).

    In order: ``field(metadata={"doc": ...})`` (a field made programmatically, ``dataclasses.make_dataclass``);
    the field's trailing ``# comment``; the string literal just below it (an attribute docstring); the comment
    lines just above it, which also describe the uncommented fields that follow (one comment for a group such
    as the n-gram thresholds). A field with none of these gets "".
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass) and "__dataclass_fields__" in vars(klass):
            docs.update({k: v for k, v in _source_docs(klass).items() if v})
    for f in dataclasses.fields(cls):
        if f.metadata.get("doc"):
            docs[f.name] = str(f.metadata["doc"])
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


def class_docstring(klass: type) -> str | None:
    """The docstring written in a class's source (None without one; not the signature a dataclass makes up)."""
    parsed = _parse_class(klass)
    return ast.get_docstring(parsed[0]) if parsed else None


def _parse(src: str) -> ast.Module:
    """ast.parse, tried again when CPython 3.11's per-interpreter AST recursion counter was upset by a parse on
    another thread (cpython gh-106905: a spurious "AST constructor recursion depth mismatch" SystemError)."""
    for attempt in range(3):
        try:
            return ast.parse(src)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _parse_class(klass: type) -> tuple[ast.ClassDef, dict[int, tuple[str, bool]]] | None:
    """(class AST, {line: (comment text, alone on its line)}) of a class's source; None without source."""
    try:
        src = textwrap.dedent(inspect.getsource(klass))
        node = _parse(src).body[0]
        comments = {tok.start[0]: (tok.string[1:].strip(), not tok.line[: tok.start[1]].strip())
                    for tok in tokenize.generate_tokens(io.StringIO(src).readline) if tok.type == tokenize.COMMENT}
    except (OSError, TypeError, SyntaxError, IndexError, tokenize.TokenError):
        return None
    return (node, comments) if isinstance(node, ast.ClassDef) else None


def _source_docs(klass: type) -> dict[str, str]:
    """{field: doc} from ``klass``'s own body: trailing comment, else attribute docstring, else the comments above
    it or above the run of uncommented fields it belongs to."""
    parsed = _parse_class(klass)
    if parsed is None:
        return {}
    node, comments = parsed
    out, group, prev_end = {}, "", node.lineno
    for stmt, after in zip(node.body, [*node.body[1:], None]):
        above = [comments[n][0] for n in range(prev_end + 1, stmt.lineno) if n in comments and comments[n][1]]
        prev_end = stmt.end_lineno or stmt.lineno
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            group = ""
            continue
        group = " ".join(above) or group
        trailing = [comments[n][0] for n in range(stmt.lineno, prev_end + 1) if n in comments and not comments[n][1]]
        below = (after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                 and isinstance(after.value.value, str) else "")
        out[stmt.target.id] = trailing[0] if trailing else " ".join(inspect.cleandoc(below).split()) or group
        if trailing:
            group = ""
    return out


class RecordError(ValueError):
    """A recorded output (an asset's value, read back as a typed record) lacks a key the reader needs, or carries
    one the record does not declare; the message names the key and the output."""


def record_from(cls: type[T], data: Any, where: str, strict: bool = False, **nested: Any) -> T:
    """Dataclass ``cls`` from a recorded output ``data``, each field its key's value as recorded (no conversion): a
    field without a default is a key ``data`` must hold, one with a default may be absent. A missing key, or with
    ``strict`` a key ``cls`` does not declare, is a RecordError naming it and ``where`` (the output it is read from);
    without ``strict`` the other keys are left unread. ``nested``: {field: the value to use instead of the recorded
    one} (a record built from the field's own value)."""
    if not isinstance(data, typing.Mapping):
        raise RecordError(f"{where}: expected a mapping, got {type(data).__name__}")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    names = {f.name for f in fields}
    missing = [f.name for f in fields if f.name not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise RecordError(f"{where}: no {', '.join(repr(k) for k in missing)} (it has: {', '.join(sorted(data)) or 'nothing'})")
    if strict and set(data) - names:
        unknown = sorted(set(data) - names)
        raise RecordError(f"{where}: unknown key {', '.join(repr(k) for k in unknown)}; {cls.__name__} declares "
                          f"{', '.join(sorted(names))}")
    return cls(**{**{k: v for k, v in data.items() if k in names}, **nested})  # type: ignore[call-arg]
