"""kiln.common.config: numeric fields declare their legal values (Domain), checked when a config is parsed."""

import pytest


DOMAIN_CLASSES = ["kiln.plan.HardwareConfig", "kiln.plan.BatchConfig", "kiln.plan.ParallelConfig",
                  "kiln.model.parallel.MeshLayout", "kiln.model.pipeline_parallel.PipelineConfig"]


@pytest.mark.parametrize("path", DOMAIN_CLASSES)
def test_every_declared_numeric_field_takes_0_minus_1_and_a_string_as_its_domain_says(path):
    """Each field with a Domain, given 0, -1 and a string: accepted exactly when the domain holds it, otherwise a
    one-line ConfigError naming where.field and the legal values (never an error later in the arithmetic)."""
    import importlib

    from kiln.common.config import ConfigError, domains, from_dict

    module, name = path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    declared = domains(cls)
    assert declared, f"{path} declares no domain"
    for field, (kind, domain) in declared.items():
        for value in (0, -1, "x", 2.5 if kind is int else None):
            legal = (value is None and domain.none) or (
                not isinstance(value, str) and value is not None and (kind is float or isinstance(value, int))
                and (value in domain.also or ((domain.low is None or (value > domain.low if domain.low_open
                                                                       else value >= domain.low))
                                              and (domain.high is None or value <= domain.high))))
            if legal:
                assert getattr(from_dict(cls, {field: value}, "cfg"), field) == value
                continue
            with pytest.raises(ConfigError) as e:
                from_dict(cls, {field: value}, "cfg")
            assert str(e.value).startswith(f"cfg.{field} ") and domain.describe() in str(e.value), (field, value)
