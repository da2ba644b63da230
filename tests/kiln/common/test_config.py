"""kiln.common.config: every numeric field of every config a user writes declares its legal values (Domain), and
from_dict checks each when the config is parsed, naming the key: 0 processes or a negative rate is one line, never
a ZeroDivisionError or a traceback later in the arithmetic."""

import dataclasses
import importlib
import typing

import pytest

from kiln.common.config import ConfigError, Domain, _number_kind, domains, from_dict

# the configs a user writes (presets, job files, the clean config, a sandbox's limits, the arena's sampling); their
# nested blocks are found from these
ROOTS = ["kiln.train.job.JobConfig", "kiln.posttrain.dpo.DpoJob", "kiln.posttrain.ppo.PpoJob",
         "kiln.posttrain.reward.RewardJob", "kiln.posttrain.rl.RlJob", "kiln.plan.memory.HardwareConfig",
         "kiln.plan.memory.BatchConfig", "kiln.plan.memory.ParallelConfig", "kiln.plan.cost.CostConfig", "kiln.plan.layout.LayoutRequest",
         "kiln.plan.layout.ClusterConfig", "kiln.train.cluster.TorchrunSpec", "kiln.clean.config.CleanConfig",
         "kiln.sources.manifest.SourceSpec", "kiln.evaluation.sandbox.Limits", "kiln.arena.contestants.SamplingConfig"]


def resolve(path: str) -> type:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def config_classes() -> list[type]:
    """The root configs and every dataclass block inside them."""
    seen, todo = [], [resolve(p) for p in ROOTS]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        hints = typing.get_type_hints(cls)
        todo += [hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]
    return seen


def numeric_fields(cls: type) -> list[str]:
    """Fields whose values are numbers (int, float, optional ones, lists and mappings of them; not bool)."""
    out = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        parts = {hint, *typing.get_args(hint)} | {a for b in typing.get_args(hint) for a in typing.get_args(b)}
        if parts & {int, float} and bool not in parts:
            out.append(f.name)
    return out


CLASSES = config_classes()


def test_the_walk_finds_the_blocks_inside_the_roots():
    names = {c.__name__ for c in CLASSES}
    assert {"ModelConfig", "OptimConfig", "SpikeConfig", "LoRAConfig", "MeshLayout", "PipelineConfig",
            "MinHashConfig", "QualityModelConfig", "RepetitionConfig", "Olmo2Config"} <= names, names


def test_every_numeric_field_of_every_config_declares_its_domain():
    missing = [f"{c.__module__}.{c.__name__}.{name}" for c in CLASSES for name in numeric_fields(c)
               if name not in domains(c)]
    assert missing == [], f"declare a Domain (Annotated[int, Domain(...)]) for: {missing}"
    for c in CLASSES:  # and each declared default is inside its own domain
        instance = c() if all(f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
                              for f in dataclasses.fields(c)) else None
        for name, (kind, domain) in domains(c).items():
            if instance is not None:
                domain.check(getattr(instance, name), kind, f"{c.__name__}.{name}")


def legal(domain: Domain, kind: type, value) -> bool:
    if value is None:
        return domain.none
    if isinstance(value, str) or (kind is int and isinstance(value, float)):
        return False
    if value in domain.also:
        return True
    low_ok = domain.low is None or (value > domain.low if domain.low_open else value >= domain.low)
    high_ok = domain.high is None or (value < domain.high if domain.high_open else value <= domain.high)
    return low_ok and high_ok


def shaped(cls: type, name: str, value):
    """``value`` in the shape the field holds: a list or a mapping of it where the field is one."""
    hint = typing.get_type_hints(cls)[name]
    origin = typing.get_origin(hint)
    return [value] if origin is list else {"a*": value} if origin is dict else value


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_numeric_field_takes_0_minus_1_and_a_string_as_its_domain_says(cls):
    """Each field given 0, -1, a string (and 2.5 where a whole number is due): accepted exactly when the domain
    holds it, otherwise a one-line ConfigError naming where.field and the legal values."""
    for name, (kind, domain) in domains(cls).items():
        for value in (0, -1, "x", 2.5 if kind is int else None):
            data = {name: shaped(cls, name, value)}
            if legal(domain, kind, value):
                try:
                    from_dict(cls, data, "cfg")
                except ValueError as e:  # another rule of the class may refuse it (ConfigError is one), never the domain
                    assert not str(e).startswith(f"cfg.{name}"), (name, value, str(e))
                continue
            with pytest.raises(ConfigError) as e:
                from_dict(cls, data, "cfg")
            assert str(e.value).startswith(f"cfg.{name}") and domain.describe() in str(e.value), (name, value)
            assert "\n" not in str(e.value)


def test_a_domain_holds_for_each_element_of_a_list_or_mapping_and_names_it():
    with pytest.raises(ConfigError, match=r"^clean\.mix\.weights\.web\* is -1: give >= 0$"):
        from_dict(resolve("kiln.clean.config.CleanConfig"), {"mix": {"weights": {"books": 1, "web*": -1}}}, "clean")
    d = Domain(8)
    d.check([8, 16], int, "widths")
    with pytest.raises(ConfigError, match=r"^widths\[1\] is 4: give >= 8$"):
        d.check([8, 4], int, "widths")
    assert _number_kind(typing.Optional[typing.List[int]]) is int and _number_kind(dict[str, float]) is float
    assert Domain(0, 1, high_open=True).describe() == "0 <= x < 1" and Domain().describe() == "any number"


def test_a_job_made_in_code_is_checked_too():
    from kiln.posttrain.rl import RlJob

    optim = resolve("kiln.train.optim.OptimConfig")()
    optim.lr = 0  # changed after it was made (its own __post_init__ refuses lr=0 when it is made)
    with pytest.raises(ConfigError, match=r"^job\.optim\.lr is 0: give > 0$"):
        RlJob(init_from="c", train_files=["p"], optim=optim).check()
    with pytest.raises(ConfigError, match=r"^optim\.lr is 0: give > 0$"):
        resolve("kiln.train.optim.OptimConfig")(lr=0)


def test_record_from_reads_the_declared_keys_and_names_a_missing_one():
    from kiln.common.config import RecordError, record_from

    @dataclasses.dataclass(frozen=True)
    class Run:
        version: str
        steps: int
        lora: dict | None = None

    assert record_from(Run, {"version": "v1", "steps": 3, "other": 1}, "base_model") == Run("v1", 3)
    with pytest.raises(RecordError, match=r"base_model: no 'steps' \(it has: other, version\)"):
        record_from(Run, {"version": "v1", "other": 1}, "base_model")
    with pytest.raises(RecordError, match="unknown key 'other'"):
        record_from(Run, {"version": "v1", "steps": 3, "other": 1}, "base_model", strict=True)
    with pytest.raises(RecordError, match="expected a mapping, got NoneType"):
        record_from(Run, None, "base_model")
    assert record_from(Run, {"version": "v1", "steps": 3, "lora": {}}, "x", lora={"enabled": False}).lora == {"enabled": False}
