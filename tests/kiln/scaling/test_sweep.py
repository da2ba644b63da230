"""kiln.scaling.sweep: a sweep's points from a grid or a seeded random search, checked against the fields' types."""

import math

import pytest

from kiln.common.config import ConfigError
from kiln.scaling.sweep import Swept, expand, field_type, marginals, overrides, ranked


def test_grid_is_every_combination_with_readable_keys():
    points = expand([Swept("optim.lr", values=[1e-3, 2e-3]), Swept("optim.warmup_steps", values=[20, 50.0]),
                     Swept("optim.name", choices=["adamw", "muon"])])
    assert len(points) == 8
    assert points[0].key == "lr=0.001;warmup_steps=20;name=adamw"
    assert points[-1].values == {"optim.lr": 2e-3, "optim.warmup_steps": 50, "optim.name": "muon"}
    assert isinstance(points[-1].values["optim.warmup_steps"], int)  # 50.0 from YAML is the int field's 50
    assert len({p.key for p in points}) == 8


def test_a_name_two_blocks_share_is_written_in_full():
    points = expand([Swept("model.n_embd", values=[64]), Swept("batch.seq_len", values=[64, 128])])
    assert [p.key for p in points] == ["n_embd=64;seq_len=64", "n_embd=64;seq_len=128"]
    ov = overrides(points[1])
    assert ov == {"model": {"n_embd": 64}, "batch": {"seq_len": 128}, "optim": {}}


def test_random_search_is_seeded_in_range_and_in_log_space():
    swept = [Swept("optim.lr", low=1e-4, high=1e-2), Swept("optim.warmup_steps", low=10, high=100, log=False)]
    a = expand(swept, mode="random", samples=64, seed=3)
    b = expand(swept, mode="random", samples=64, seed=3)
    c = expand(swept, mode="random", samples=64, seed=4)
    assert [p.key for p in a] == [p.key for p in b] != [p.key for p in c]
    lrs = [p.values["optim.lr"] for p in a]
    assert all(1e-4 <= x <= 1e-2 for x in lrs)
    below = sum(x < 1e-3 for x in lrs) / len(lrs)  # log-uniform: half the draws below the geometric middle
    assert 0.3 < below < 0.7
    assert all(isinstance(p.values["optim.warmup_steps"], int) and 10 <= p.values["optim.warmup_steps"] <= 100 for p in a)


@pytest.mark.parametrize("swept, message", [
    ([Swept("optim.lrr", values=[1e-3])], "OptimConfig has no field 'lrr'"),
    ([Swept("trainer.lr", values=[1e-3])], "not a sweepable field"),
    ([Swept("optim.warmup_steps", values=[2.5])], "2.5 is not a valid int"),
    ([Swept("optim.name", values=[3.0])], "3.0 is not a valid str"),
    ([Swept("optim.lr", values=[])], "no values"),
    ([], "fields is empty"),
    ([Swept("optim.lr", values=[1e-3]), Swept("optim.lr", values=[2e-3])], "swept more than once"),
    ([Swept("optim.lr", low=1e-3, high=1e-4)], "low < high"),
])
def test_bad_sweeps_are_named(swept, message):
    with pytest.raises(ConfigError, match=message):
        expand(swept, mode="random" if any(s.low is not None for s in swept) else "grid")


def test_a_range_in_grid_mode_is_refused():
    with pytest.raises(ConfigError, match="set mode: random"):
        expand([Swept("optim.lr", low=1e-4, high=1e-2)])


def test_field_types_follow_the_dataclasses():
    assert field_type("optim.lr")[2] is float
    assert field_type("batch.micro_batch")[2] is int  # int | None sweeps as int
    assert field_type("model.tie_embeddings")[2] is bool
    assert field_type("optim.schedule")[2] is str


def test_ranking_puts_diverged_points_last_and_marginals_take_the_best():
    rows = [{"key": "a", "final_val_loss": 3.0}, {"key": "b", "final_val_loss": math.nan},
            {"key": "c", "final_val_loss": 2.5}]
    order = ranked(rows)
    assert [r["key"] for r in order] == ["c", "a", "b"]
    assert [r["rank"] for r in order] == [1, 2, None] and order[-1]["note"] == "diverged"
    pts = [{"values": {"optim.lr": 1e-3, "optim.name": "adamw"}}, {"values": {"optim.lr": 1e-3, "optim.name": "muon"}},
           {"values": {"optim.lr": 2e-3, "optim.name": "muon"}}]
    assert marginals(pts, [3.0, 2.0, math.inf]) == {"optim.lr": [(1e-3, 2.0)]}


def test_a_swept_value_or_range_outside_its_fields_domain_is_refused_by_the_grid_naming_it():
    with pytest.raises(ConfigError, match=r"^sweep\.fields\[1\] \(optim\.lr\) value is -0\.5: give > 0$"):
        expand([Swept("batch.global_batch", values=[8, 16]), Swept("optim.lr", values=[1e-3, -0.5])])
    with pytest.raises(ConfigError, match=r"^sweep\.fields\[0\] \(optim\.beta2\) range is 1\.5: give 0 <= x < 1$"):
        expand([Swept("optim.beta2", low=0.9, high=1.5)], mode="random", samples=2)
    assert len(expand([Swept("optim.beta2", low=0.9, high=0.99)], mode="random", samples=3)) == 3
