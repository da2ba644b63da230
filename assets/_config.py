"""Typed Dagster config generated from the core's config dataclasses: each default and one-line doc has one home.

Use: ``Model = schema_of(ModelConfig, optional=True)``, then ``model: Model = Field(default_factory=Model)`` in a Config;
an asset's plain job fields: ``class SftModelConfig(schema_of(JobConfig, include=(...), defaults={...})): optim: ...``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import types
import typing
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from dagster import Config
from pydantic import ConfigDict, Field, PrivateAttr, create_model, model_validator

from kiln.common.config import (ConfigError, check_model_domains, class_docstring, deep_merge, domains, field_docs,
                                from_dict, model_domains)

__all__ = ["DataclassConfig", "KilnConfig", "check_config_values", "field_docs", "schema_of"]


class KilnConfig(Config):
    """Base of every asset's config: each number inside the Domain its field declares
    (``n: Annotated[int, Domain(1)] = Field(...)``, kiln.common.config.Domain), checked when Dagster builds the
    config for a step, and by ``kiln run``'s preflight for the whole run before the first asset."""

    @model_validator(mode="after")
    def _numbers_in_their_domains(self):
        check_model_domains(self, type(self).__name__)
        return self


def _block_class(annotation: Any) -> type | None:
    """The config block class of a field's annotation (``Block``, ``Optional[Block]``), else None."""
    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, Config):
            return a
    return None


def check_config_values(cls: type, data: dict[str, Any] | None, where: str) -> None:
    """ConfigError naming ``where.<path>`` for the first value in run-config ``data`` (for Config class ``cls``) that
    is outside its field's Domain, blocks included: what a step would refuse when it starts, checked before any
    runs (kiln run's preflight). Keys that are no field are left to Dagster's check, which names them."""
    declared = model_domains(cls)
    for name, value in (data or {}).items():
        f = cls.model_fields.get(name)
        if f is None or (value is None and f.default is None):
            continue
        if name in declared:
            kind, domain = declared[name]
            domain.check(value, kind, f"{where}.{name}")
        elif (block := _block_class(f.annotation)) is not None:
            if isinstance(value, dict):
                check_config_values(block, value, f"{where}.{name}")
            elif isinstance(value, list):  # a list of blocks (raw_documents.sources)
                for i, item in enumerate(value):
                    if isinstance(item, dict):
                        check_config_values(block, item, f"{where}.{name}[{i}]")


class DataclassConfig(KilnConfig):
    """Base of the classes schema_of makes: the dataclass mirrored and the conversions back to it."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    core: ClassVar[type]  # the dataclass this class mirrors
    unset_mode: ClassVar[bool] = False  # every field defaults to None, meaning "not set"
    core_defaults: ClassVar[dict[str, Any]] = {}  # the dataclass's own defaults, nested blocks as dicts
    _unknown: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_unknown_keys(cls, data: Any, handler):
        """Keys given in Python (tests, direct invocation) that are no field are kept aside and handed on by
        to_dict, so from_dict refuses them with its usual message (where, the key, the closest field). Run
        config never gets here with one: Dagster's validation refuses it first, naming the path."""
        unknown = {}
        if isinstance(data, dict):
            unknown = {k: v for k, v in data.items() if k not in cls.model_fields}
            data = {k: v for k, v in data.items() if k not in unknown}
        made = handler(data)
        if unknown:
            made._unknown = unknown
        return made

    def _convert_to_config_dictionary(self) -> dict[str, Any]:
        """Dagster's run-config form of this block (direct invocation and RunConfig objects pass through it): with
        any unknown keys, so that Dagster's validation refuses them naming the path instead of dropping them."""
        return {**super()._convert_to_config_dictionary(), **self._unknown}

    def to_dict(self, changed_only: bool = False) -> dict[str, Any]:
        """The fields as a plain dict; nested blocks as dicts. In unset mode, only the fields that were set.

        ``changed_only`` keeps only values that differ from the dataclass's own defaults (not this class's
        ``defaults=`` overrides): what a job file must carry for the core to rebuild the same dataclass."""
        return _plain(self, type(self).core_defaults if changed_only else None)

    def job_fields(self) -> dict[str, Any]:
        """The fields as a job file takes them: each plain field as it is, each nested block (optim, spikes, lora)
        with only what differs from its dataclass's defaults, so that a default written out or left out gives the
        same job and the same run-folder key."""
        out = {name: value.to_dict(changed_only=True) if isinstance(value, DataclassConfig) else copy.deepcopy(value)
               for name in type(self).model_fields for value in [getattr(self, name)]}
        return {**out, **copy.deepcopy(self._unknown)}

    def to_dataclass(self, where: str = "config", base: dict[str, Any] | None = None) -> Any:
        """The core dataclass, built by kiln.common.config.from_dict (so its errors name ``where.<key>``).

        ``base`` (a dict of fields, e.g. a named model preset) is overridden by the fields set here."""
        return from_dict(type(self).core, deep_merge(base or {}, self.to_dict()), where)

    @classmethod
    def from_dataclass(cls, obj: Any) -> DataclassConfig:
        """This class holding the values of a core dataclass instance (fields this class leaves out are dropped)."""
        values = dataclasses.asdict(obj)
        return cls(**{k: v for k, v in values.items() if k in cls.model_fields})


def _plain(config: DataclassConfig, defaults: dict[str, Any] | None) -> dict[str, Any]:
    out = {}
    for name in type(config).model_fields:
        value = getattr(config, name)
        if isinstance(value, DataclassConfig):
            # a block the dataclass does not declare (a field a subclass adds) is compared with its own defaults
            value = _plain(value, None if defaults is None else defaults.get(name, type(value).core_defaults))
            keep = bool(value) or not (config.unset_mode or defaults is not None)
        else:
            keep = not (config.unset_mode and value is None) and (
                defaults is None or name not in defaults or value != defaults[name])
            value = copy.deepcopy(value)
        if keep:
            out[name] = value
    return {**out, **copy.deepcopy(config._unknown)}


# ---------------------------------------------------------------------------------------------------- types


def _element_type(default: Any) -> Any:
    """The element type a bare ``list`` holds, read from its default (one scalar type throughout), else Any."""
    kinds = {type(v) for v in default} if isinstance(default, list) else set()
    return kinds.pop() if len(kinds) == 1 and kinds <= {str, int, float, bool} else Any


def _annotation(tp: Any, default: Any, where: str) -> Any:
    """The pydantic annotation (one Dagster config type) for a dataclass field type."""
    if tp is Any or tp in (int, float, str, bool):  # Dagster hands a float field float(value), an int included
        return tp
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            return Optional[_annotation(rest[0], default, where)]  # noqa: UP045 (a runtime-built type)
    elif tp is list or origin is list:
        return list[_annotation(args[0] if args else _element_type(default), None, where)]
    elif (tp is dict or origin is dict) and (not args or args[0] is str):
        return dict[str, _annotation(args[1] if args else Any, None, where)]
    elif origin is Literal:
        return tp
    raise TypeError(f"{where}: type {tp!r} has no Dagster config type; use int, float, bool, str, list[...], "
                    "dict[str, ...], Any, a Literal, a nested dataclass, or X | None of one of these")


def block_defaults(cls: type, name: str) -> dict[str, Any]:
    """The fields of dataclass ``cls``'s default ``name`` block that differ from that block's own defaults (a stage's
    optimizer: DpoJob's AdamW at lr 1e-4), for ``schema_of(block, defaults=...)``: the stage's dataclass stays the one
    place its defaults are written."""
    block = getattr(_core_instance(cls), name)
    own = type(block)()
    return {f.name: getattr(block, f.name) for f in dataclasses.fields(block)
            if getattr(block, f.name) != getattr(own, f.name)}


# ---------------------------------------------------------------------------------------------------- schema_of

_CACHE: dict[str, type[DataclassConfig]] = {}


def _core_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return copy.deepcopy(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _core_instance(cls: type) -> Any:
    """The dataclass with every default, or None when some field has none."""
    try:
        return cls()
    except TypeError:
        return None


def _check_names(cls: type, what: str, names, allowed: list[str]) -> None:
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise ConfigError(f"schema_of({cls.__name__}): unknown field '{unknown[0]}' in {what}. "
                          f"Allowed keys: {', '.join(sorted(allowed))}.")


def _nested_field(hint: type, default: Any, optional: bool, override: Any, doc: str | None) -> tuple[Any, Any]:
    """(annotation, pydantic Field) of a nested dataclass block: its own generated class, defaulting to the
    parent's default instance of it (with any ``defaults=`` overrides for the block)."""
    sub_defaults = override if isinstance(override, dict) else None
    nested = schema_of(hint, optional=optional, defaults=sub_defaults)
    if default is dataclasses.MISSING and not optional:
        return nested, Field(description=doc)
    if optional or default == _core_instance(hint):
        value = nested()
    else:
        value = nested(**deep_merge({k: v for k, v in dataclasses.asdict(default).items() if k in nested.model_fields},
                                    sub_defaults or {}))
    return nested, Field(default=value, description=doc)


def _field(cls: type, f: dataclasses.Field, hint: Any, optional: bool, defaults: dict[str, Any],
           doc: str | None) -> tuple[Any, Any]:
    """(annotation, pydantic Field) mirroring one dataclass field (with its Domain, checked when the block is made)."""
    default = _core_default(f)
    if dataclasses.is_dataclass(hint):
        return _nested_field(hint, default, optional, defaults.get(f.name), doc)
    annotation = _annotation(hint, default, f"{cls.__name__}.{f.name}")
    if optional:
        annotation = Optional[annotation]  # noqa: UP045
    if f.name in domains(cls):
        annotation = Annotated[annotation, domains(cls)[f.name][1]]
    if optional:
        return annotation, Field(default=None, description=doc)
    if f.name in defaults:
        default = copy.deepcopy(defaults[f.name])
    if default is dataclasses.MISSING:
        return annotation, Field(description=doc)
    return annotation, Field(default=default, description=doc)


def schema_of(cls: type, *, optional: bool = False, defaults: dict[str, Any] | None = None,
              include: list[str] | tuple[str, ...] | None = None, exclude: list[str] | tuple[str, ...] = (),
              name: str | None = None) -> type[DataclassConfig]:
    """A dagster ``Config`` class mirroring dataclass ``cls``: one typed field per dataclass field, nested
    dataclasses as nested Config classes, each default from the dataclass and each description from the field's
    ``# comment``; Dagster refuses unknown keys and wrong types naming the field.

    optional: every field defaults to None ("not set") and ``to_dict`` leaves it out (for blocks whose defaults
        come from elsewhere, e.g. ``model`` fields overriding a named model preset).
    defaults: {field: default} that differ from the dataclass's (nested blocks as dicts), e.g. fine-tuning's
        optimizer; the dataclass stays the home of every other default.
    include / exclude: the fields to mirror (others keep their dataclass default when converted back).
    name: the class name (default ``<cls>Schema``, or ``<cls>Overrides`` when optional).
    Classes are cached: the same arguments return the same class."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"schema_of: {cls!r} is not a dataclass")
    if optional and defaults:
        raise ValueError(f"schema_of({cls.__name__}): an optional block has no defaults; drop optional or defaults")
    key = json.dumps([f"{cls.__module__}.{cls.__qualname__}", optional, defaults or {}, include, list(exclude), name],
                     sort_keys=True, default=repr)
    if key not in _CACHE:
        _CACHE[key] = _build(cls, optional, dict(defaults or {}), include, tuple(exclude), name)
    return _CACHE[key]


def _build(cls: type, optional: bool, defaults: dict[str, Any], include, exclude: tuple[str, ...],
           name: str | None) -> type[DataclassConfig]:
    all_fields = [f for f in dataclasses.fields(cls) if f.init]
    allowed = [f.name for f in all_fields]
    for what, names in (("defaults", defaults), ("include", include or ()), ("exclude", exclude)):
        _check_names(cls, what, names, allowed)
    chosen = [f for f in all_fields if (include is None or f.name in include) and f.name not in exclude]
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    fields = {f.name: _field(cls, f, hints[f.name], optional, defaults, docs.get(f.name) or None) for f in chosen}
    doc = class_docstring(cls) or f"Fields of {cls.__module__}.{cls.__qualname__}."
    model = create_model(name or f"{cls.__name__}{'Overrides' if optional else 'Schema'}", __base__=DataclassConfig,
                         __doc__=doc, __module__=__name__, **fields)
    model.core = cls
    model.unset_mode = optional
    model.core_defaults = {f.name: (dataclasses.asdict(d) if dataclasses.is_dataclass(d) else d)
                           for f in chosen if (d := _core_default(f)) is not dataclasses.MISSING}
    return model
