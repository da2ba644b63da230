"""Every number a run config can set (each asset's config, its blocks, each resource) declares its legal values, and
a value outside them is refused in one line naming the key: by kiln run's preflight before any step runs
(jobs.preflight.check_numbers), and by the step itself when Dagster builds its config (a run launched from the UI)."""

import typing

import pytest
from pydantic import BaseModel, ValidationError

from assets._config import KilnConfig, check_config_values
from jobs.definitions import make_resources
from jobs.preflight import asset_configs, check_numbers
from kiln.common.config import ConfigError, model_domains

RESOURCES = {name: type(r) for name, r in make_resources().items() if isinstance(r, BaseModel)}


def is_number(annotation) -> bool:
    parts = {annotation, *typing.get_args(annotation)}
    parts |= {a for b in list(parts) for a in typing.get_args(b)}
    return bool(parts & {int, float}) and bool not in parts


def leaves(cls: type, path: str):
    """(path, owning class, field name) of every numeric field of Config class ``cls``, blocks included (a list of
    blocks, raw_documents.sources, as its first element: 'sources[0]')."""
    for name, f in cls.model_fields.items():
        block = next((a for a in (f.annotation, *typing.get_args(f.annotation))
                      if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if block is not None:
            many = typing.get_origin(f.annotation) is list
            yield from leaves(block, f"{path}.{name}{'[0]' if many else ''}")
        elif is_number(f.annotation):
            yield f"{path}.{name}", cls, name


CONFIGS = {**asset_configs(), **{f"resources.{k}": v for k, v in RESOURCES.items()}}
LEAVES = [leaf for where, cls in CONFIGS.items() for leaf in leaves(cls, where)]


def test_every_asset_and_resource_config_is_found_and_checks_its_numbers():
    assert {"tokenizer", "base_model", "training_plan", "rl_model", "release_bundle", "scaling_ladder"} <= set(CONFIGS)
    assert {"resources.torchrun", "resources.ray"} <= set(CONFIGS)
    assert all(issubclass(cls, KilnConfig) for where, cls in CONFIGS.items() if not where.startswith("resources."))
    assert len(LEAVES) > 250, len(LEAVES)


def test_every_numeric_field_declares_its_domain():
    missing = [path for path, cls, name in LEAVES if name not in model_domains(cls)]
    assert missing == [], f"declare a Domain (Annotated[int, Domain(...)]) for: {missing}"


def nested(path: str, value) -> dict:
    """{a: {b: value}} for path 'a.b'; {a: [{b: value}]} for 'a[0].b'."""
    out = value
    for key in reversed(path.split(".")):
        out = {key[:-3]: [{**SOURCE, **out}]} if key.endswith("[0]") else {key: out}
    return out


SOURCE = {"name": "notes", "kind": "local", "format": "text", "license": "CC0-1.0"}  # a source's required keys


def shaped(cls: type, name: str, value):
    origin = typing.get_origin(cls.model_fields[name].annotation)
    return [value] if origin is list else {"k": value} if origin is dict else value


@pytest.mark.parametrize("where", sorted(CONFIGS))
def test_0_minus_1_and_a_string_are_refused_exactly_where_the_domain_says_both_before_and_when_a_step_runs(where):
    cls = CONFIGS[where]
    for path, owner, name in (leaf for leaf in LEAVES if leaf[0].split(".")[0] == where.split(".")[0]
                              and leaf[0].startswith(where + ".")):
        kind, domain = model_domains(owner)[name]
        inner = path[len(where) + 1:]
        for value in (0, -1, "x"):
            data = nested(inner, shaped(owner, name, value))
            holds = not isinstance(value, str) and (value in domain.also or (
                (domain.low is None or (value > domain.low if domain.low_open else value >= domain.low))
                and (domain.high is None or (value < domain.high if domain.high_open else value <= domain.high))))
            if holds:
                check_config_values(cls, data, where)  # preflight passes it
                continue
            with pytest.raises(ConfigError) as e:  # preflight: one line naming the key and the legal values
                check_config_values(cls, data, where)
            assert str(e.value).startswith(path) and "\n" not in str(e.value), (path, value, str(e.value))
            if not isinstance(value, str):
                assert domain.describe() in str(e.value)
                with pytest.raises(ValidationError, match=name):  # the step, when Dagster builds its config
                    cls(**data)


def test_kiln_run_refuses_a_number_out_of_its_domain_before_anything_runs(tmp_path):
    keys = list(asset_configs())
    check_numbers({"ops": {"tokenizer": {"config": {"vocab_size": 4096}}}}, tmp_path, keys)
    with pytest.raises(ConfigError, match=r"^tokenizer\.vocab_size is 100: give >= 259$"):
        check_numbers({"ops": {"tokenizer": {"config": {"vocab_size": 100}}}}, tmp_path, keys)
    with pytest.raises(ConfigError, match=r"^base_model\.optim\.beta2 is 1: give 0 <= x < 1$"):
        check_numbers({"ops": {"base_model": {"config": {"optim": {"beta2": 1}}}}}, tmp_path, keys)
    with pytest.raises(ConfigError, match=r"^scaling_ladder\.widths\[2\] is 0: give >= 1$"):
        check_numbers({"ops": {"scaling_ladder": {"config": {"widths": [16, 32, 0]}}}}, tmp_path, keys)
    with pytest.raises(ConfigError, match=r"^resources\.torchrun\.nnodes is 0: give >= 1$"):
        check_numbers({"resources": {"torchrun": {"config": {"nnodes": 0}}}}, tmp_path, keys)
    check_numbers({"ops": {"tokenizer": {"config": {"vocab_size": 100}}}}, tmp_path, ["base_model"])  # not selected
