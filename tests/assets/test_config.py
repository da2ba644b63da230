"""schema_of: typed Dagster config generated from the core dataclasses (fields, types, defaults, docs, strictness).

Run: python -m pytest tests/assets/test_config.py -q  (the launchpad GraphQL test is marked slow)
"""

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from dagster import (
    Config,
    DagsterInvalidConfigError,
    Definitions,
    asset,
    define_asset_job,
    materialize,
    validate_run_config,
)
from dagster._core.snap import JobSnap
from pydantic import Field

from assets._config import DataclassConfig, field_docs, schema_of
from kiln.clean.config import CleanConfig
from kiln.common.config import ConfigError, from_dict
from kiln.model.config import ModelConfig
from kiln.model.lora import LoRAConfig
from kiln.plan.memory import BatchConfig, HardwareConfig, ParallelConfig
from kiln.train.optim import OptimConfig
from kiln.train.spikes import SpikeConfig

CORE = [CleanConfig, HardwareConfig, BatchConfig, ParallelConfig, ModelConfig, OptimConfig, SpikeConfig, LoRAConfig]
PRESETS = Path(__file__).resolve().parents[2] / "conf" / "presets"


class ProbeConfig(Config):
    model: schema_of(ModelConfig, optional=True) = Field(default_factory=schema_of(ModelConfig, optional=True))
    batch: schema_of(BatchConfig) = Field(default_factory=schema_of(BatchConfig), description="The token budget.")
    clean: schema_of(CleanConfig) = Field(default_factory=schema_of(CleanConfig))
    optim: schema_of(OptimConfig, defaults={"lr": 1e-4, "weight_decay": 0.0}) = Field(
        default_factory=schema_of(OptimConfig, defaults={"lr": 1e-4, "weight_decay": 0.0}))
    lora: schema_of(LoRAConfig) = Field(default_factory=schema_of(LoRAConfig))


SEEN: list[ProbeConfig] = []


@asset
def probe(config: ProbeConfig) -> None:
    SEEN.append(config)


def run_probe(run_config: dict) -> ProbeConfig:
    SEEN.clear()
    assert materialize([probe], run_config={"ops": {"probe": {"config": run_config}}}).success
    return SEEN[-1]


def snap_fields(snap, key: str) -> dict:
    return {f.name: f for f in snap.config_schema_snapshot.get_config_snap(key).fields}


def probe_job():
    return Definitions(assets=[probe], jobs=[define_asset_job("probe_job")]).resolve_job_def("probe_job")


def probe_config_fields() -> tuple[JobSnap, dict]:
    """(job snapshot, the probe op's config fields) as the webserver serves them to the launchpad."""
    snap = JobSnap.from_job_def(probe_job())
    root = snap_fields(snap, snap.mode_def_snaps[0].root_config_key)
    ops = snap_fields(snap, root["ops"].type_key)
    return snap, snap_fields(snap, snap_fields(snap, ops["probe"].type_key)["config"].type_key)


# ---------------------------------------------------------------------------------------------------- fields


@pytest.mark.parametrize("cls", CORE, ids=lambda c: c.__name__)
def test_every_core_dataclass_builds_a_schema_with_every_field_typed_defaulted_and_documented(cls):
    schema = schema_of(cls)
    fields = schema.to_fields_dict()
    assert list(fields) == [f.name for f in dataclasses.fields(cls)]
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        assert fields[f.name].description == docs[f.name] and len(docs[f.name]) > 5, f.name
        assert not fields[f.name].is_required, f.name
    assert schema().to_dataclass() == cls()  # defaults in -> the identical dataclass out
    assert schema_of(cls) is schema  # cached: one class per dataclass


def test_gpt_schema_lists_types_defaults_and_the_trailing_comments():
    fields = schema_of(ModelConfig).to_fields_dict()
    got = {k: (f.config_type.key, f.default_value, f.description) for k, f in fields.items()}
    assert got["n_layer"] == ("Noneable.IntSourceType", 4, "transformer blocks")
    assert got["dropout"] == ("Noneable.Float", 0.0, "dropout on attention and MLP outputs (0 for pretraining)")
    assert got["bias"] == ("Noneable.BoolSourceType", True, "gpt2: biases in Linear and LayerNorm, as GPT-2 has (llama has none)")
    assert got["n_embd"][2] == "residual stream width; must divide by n_head"
    lora = schema_of(LoRAConfig).to_fields_dict()["targets"]  # a bare `list`: the element type comes from the default
    assert lora.config_type.key == "Noneable.Array.StringSourceType"
    assert lora.default_value == ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    hw = schema_of(HardwareConfig).to_fields_dict()["memory_gb"]
    assert hw.config_type.key == "Noneable.Float" and hw.default_value is None
    assert hw.description == "memory per device in GiB; None reads it (host RAM shared by CPU ranks)"


def test_clean_schema_has_the_inherited_gopher_keys_on_top_and_nested_sections():
    fields = schema_of(CleanConfig).to_fields_dict()
    assert fields["min_words"].default_value == 50
    assert fields["min_words"].description == "fewer whitespace-separated words than this: too short to be prose"
    assert fields["max_mean_word_length"].description == "... above this: URLs, hashes, base64"
    minhash = fields["minhash"]
    assert minhash.description == "near-duplicate removal"
    inner = minhash.config_type.fields
    assert inner["bands"].default_value == 14 and inner["bands"].description.startswith("LSH bands")
    assert inner["normalise"].default_value == "none" and "backend" not in inner  # one dedup algorithm, no LSH backend
    mix = fields["mix"].config_type.fields  # the doc of `weights` is the comment block above it
    assert mix["weights"].config_type.key == "Noneable.Map.String.Float"
    assert mix["weights"].description.startswith("Glob of source names -> weight. Empty: the natural mix")
    assert fields["exempt"].config_type.key == "Noneable.Map.String.Array.StringSourceType"
    assert fields["language"].config_type.fields["allowed"].default_value == ["en"]


def test_field_docs_take_metadata_then_trailing_comment_then_attribute_docstring_then_leading_comments():
    @dataclass
    class Made:
        a: int = 1  # trailing
        # leading, line one
        # and line two
        b: str = "x"
        c: float = field(default=0.5, metadata={"doc": "from metadata"})  # not this
        d: bool = False
        """An attribute docstring,
        on two lines."""

    assert field_docs(Made) == {"a": "trailing", "b": "leading, line one and line two", "c": "from metadata",
                                "d": "An attribute docstring, on two lines."}
    generated = dataclasses.make_dataclass("Gen", [("k", int, field(default=3, metadata={"doc": "generated"}))])
    assert schema_of(generated).to_fields_dict()["k"].description == "generated"


def test_field_docs_is_the_core_one_with_group_comments_and_inherited_docs():
    import kiln.common.config as core

    assert field_docs is core.field_docs  # one implementation, in the core that owns the dataclasses

    @dataclass
    class Base:
        task: str = ""  # which stage
        # thresholds, one comment for the run below
        low: float = 0.1
        high: float = 0.9
        sep: str = "#"  # a '#' inside a string is no comment

    @dataclass
    class Child(Base):
        task: str = "child"
        extra: int = 0

    assert field_docs(Child) == {"task": "which stage", "low": "thresholds, one comment for the run below",
                                 "high": "thresholds, one comment for the run below",
                                 "sep": "a '#' inside a string is no comment", "extra": ""}
    assert schema_of(Child).to_fields_dict()["extra"].description is None


def test_defaults_overrides_include_exclude_and_bad_arguments():
    sft = schema_of(OptimConfig, defaults={"lr": 1e-4, "warmup_steps": 20})
    assert sft().to_dataclass() == OptimConfig(lr=1e-4, warmup_steps=20)
    assert sft().to_dict(changed_only=True) == {"lr": 1e-4, "warmup_steps": 20}  # against OptimConfig's own defaults
    small = schema_of(SpikeConfig, include=["enabled", "max_rollbacks"])
    assert list(small.model_fields) == ["enabled", "max_rollbacks"]
    assert small(max_rollbacks=1).to_dataclass() == SpikeConfig(max_rollbacks=1)
    assert "vocab_size" not in schema_of(ModelConfig, optional=True, exclude=["vocab_size"]).model_fields
    nested = schema_of(CleanConfig, defaults={"minhash": {"bands": 7, "rows": 16}})
    assert nested().to_dataclass().minhash.bands == 7
    assert nested.to_fields_dict()["minhash"].config_type.fields["bands"].default_value == 7
    with pytest.raises(ConfigError, match="unknown field 'lrr' in defaults. Allowed keys: beta1"):
        schema_of(OptimConfig, defaults={"lrr": 1})
    with pytest.raises(ValueError, match="optional block has no defaults"):
        schema_of(OptimConfig, optional=True, defaults={"lr": 1})
    with pytest.raises(TypeError, match="is not a dataclass"):
        schema_of(dict)
    with pytest.raises(TypeError, match=r"Odd.when: type .*set.* has no Dagster config type"):
        schema_of(dataclasses.make_dataclass("Odd", [("when", set, field(default_factory=set))]))


def test_an_asset_config_made_from_a_job_dataclass_with_typed_blocks_gives_its_job_fields():
    from assets.alignment import DpoModelConfig
    from assets.training import BaseModelConfig
    from kiln.posttrain.dpo import DpoJob
    from kiln.train.job import JobConfig

    base = BaseModelConfig(eval_interval=20, optim={"warmup_steps": 10, "lr": 2e-3})  # lr written out at its default
    assert base.job_fields() == {"eval_interval": 20, "ckpt_interval": 200, "keep_last": 2, "keep_every": 0,
                                 "async_save": True, "log_interval": 25, "seed": 1337, "eval_batches": 16, "document_mask": False,
                                 "optim": {"name": "muon", "schedule": "wsd", "warmup_steps": 10}, "spikes": {}, "lora": {}}
    # the schema's own defaults (pretraining's Muon + warmup-stable-decay) reach the job beside what was written
    defaults = BaseModelConfig().job_fields()  # the core job dataclass is the one home of these defaults
    assert {k: v for k, v in defaults.items() if k not in ("optim", "spikes", "lora")} == {
        k: getattr(JobConfig(), k) for k in defaults if k not in ("optim", "spikes", "lora")}
    assert base.to_dict(changed_only=True) == {  # against the dataclass; added blocks too
        "eval_interval": 20, "optim": {"name": "muon", "schedule": "wsd", "warmup_steps": 10}}
    dpo = DpoModelConfig().job_fields()
    assert (dpo["beta"], dpo["eval_pairs"], dpo["max_steps"], dpo["micro_batch"]) == (DpoJob.beta, DpoJob.eval_pairs, 40, 16)
    assert dpo["optim"] == {"lr": 1e-4, "warmup_steps": 10, "weight_decay": 0.0} and dpo["lora"] == {}


def test_source_spec_required_fields_and_attribute_docstrings():
    from kiln.sources import SourceSpec, specs_from_dicts

    fields = schema_of(SourceSpec).to_fields_dict()
    assert [k for k, f in fields.items() if f.is_required] == ["name", "kind", "format", "license"]
    assert fields["kind"].description.startswith('Where the files come from: "pip" (PyPI package)')
    assert fields["include"].config_type.key == "Noneable.Array.StringSourceType"
    given = {"name": "mine", "kind": "local", "path": "/data/*.jsonl", "format": "jsonl", "license": "CC0"}
    typed = schema_of(SourceSpec)(**given)
    assert specs_from_dicts([typed.to_dict()], "s") == specs_from_dicts([given], "s")


# ---------------------------------------------------------------------------------------------------- validation


def test_a_typo_in_a_nested_block_is_refused_by_dagster_naming_the_field():
    job = probe_job()
    with pytest.raises(DagsterInvalidConfigError, match=r'unexpected config entry "bandz" at path '
                                                         r"root:ops:probe:config:clean:minhash"):
        validate_run_config(job, {"ops": {"probe": {"config": {"clean": {"minhash": {"bandz": 3}}}}}})
    with pytest.raises(DagsterInvalidConfigError, match=r'unexpected config entry "n_layr" at path root:ops:probe:config:model'):
        validate_run_config(job, {"ops": {"probe": {"config": {"model": {"n_layr": 3}}}}})

def test_unknown_keys_given_in_python_are_refused_by_from_dict_with_its_message():
    model = schema_of(ModelConfig, optional=True)(n_layr=3)  # direct invocation and tests: no Dagster validation
    with pytest.raises(ConfigError, match=r"training_plan.model: unknown key 'n_layr'. Did you mean 'n_layer'\?"):
        model.to_dataclass("training_plan.model")
    assert model.to_dict() == {"n_layr": 3}
    clean = schema_of(CleanConfig)(minhash={"bandz": 3})
    with pytest.raises(ConfigError, match=r"clean_corpus.clean.minhash: unknown key 'bandz'. Did you mean 'bands'\?"):
        clean.to_dataclass("clean_corpus.clean")
    probe_config = ProbeConfig(model={"n_layers": 2})
    with pytest.raises(ConfigError, match=r"m: unknown key 'n_layers'"):
        probe_config.model.to_dataclass("m")
    SEEN.clear()
    probe(ProbeConfig(model={"n_layer": 2}, clean={"minhash": {"bands": 7, "rows": 16}}))  # direct invocation, valid
    assert SEEN[-1].model.to_dict() == {"n_layer": 2} and SEEN[-1].clean.to_dataclass().minhash.bands == 7
    # invoking the asset directly hands the config to Dagster's validation, which refuses the key (never drops it)
    with pytest.raises(DagsterInvalidConfigError, match=r'unexpected config entry "n_layers" at path root:config:model'):
        probe(probe_config)
    with pytest.raises(DagsterInvalidConfigError, match=r'unexpected config entry "bandz" at path root:config:clean:minhash'):
        probe(ProbeConfig(clean={"minhash": {"bandz": 3}}))


def test_a_string_where_an_int_belongs_is_refused():
    job = probe_job()
    with pytest.raises(DagsterInvalidConfigError, match=r'root:ops:probe:config:batch:seq_len. Value "long"'):
        validate_run_config(job, {"ops": {"probe": {"config": {"batch": {"seq_len": "long"}}}}})
    with pytest.raises(DagsterInvalidConfigError, match=r"config:optim:lr"):
        validate_run_config(job, {"ops": {"probe": {"config": {"optim": {"lr": "fast"}}}}})
    with pytest.raises(DagsterInvalidConfigError, match=r"config:clean:language:allowed"):
        validate_run_config(job, {"ops": {"probe": {"config": {"clean": {"language": {"allowed": "en"}}}}}})


def test_value_errors_still_come_from_the_core_with_the_same_message():
    model = schema_of(ModelConfig, optional=True)(n_embd=100, n_head=3)
    with pytest.raises(ValueError, match=r"model.n_embd \(100\) must be divisible by model.n_head \(3\)"):
        model.to_dataclass("training_plan.model")
    clean = schema_of(CleanConfig)(min_words=500, max_words=100)
    with pytest.raises(ConfigError, match="clean.min_words=500 exceeds clean.max_words=100"):
        clean.to_dataclass("clean_corpus.clean")


# ---------------------------------------------------------------------------------------------------- round trips


def test_run_config_reaches_the_asset_typed_and_round_trips_exactly():
    got = run_probe({"model": {"n_layer": 2, "n_embd": 64}, "batch": {"seq_len": 64},
                     "clean": {"min_words": 10, "minhash": {"bands": 7, "rows": 16, "num_perm": 112},
                               "exempt": {"docs-*": ["c4:*"]}, "mix": {"weights": {"wiki*": 2}}},
                     "optim": {"warmup_steps": 5}, "lora": {"enabled": True, "targets": ["attn.c_attn"]}})
    assert got.model.to_dict() == {"n_layer": 2, "n_embd": 64}  # unset mode: only what was set
    assert got.model.to_dataclass("m", base={"n_layer": 12, "n_head": 2, "block_size": 32}) == ModelConfig(
        n_layer=2, n_head=2, n_embd=64, block_size=32)
    assert got.batch.to_dataclass() == BatchConfig(seq_len=64)
    clean = got.clean.to_dataclass("clean")
    assert clean == CleanConfig.from_dict({"min_words": 10, "minhash": {"bands": 7, "rows": 16},
                                           "exempt": {"docs-*": ["c4:*"]}, "mix": {"weights": {"wiki*": 2}}})
    assert type(clean.mix.weights["wiki*"]) is float  # Dagster hands a Float field float(value)
    assert json.dumps(got.clean.to_dict(changed_only=True), sort_keys=True) == json.dumps(
        {"min_words": 10, "minhash": {"bands": 7, "rows": 16}, "exempt": {"docs-*": ["c4:*"]}, "mix": {"weights": {"wiki*": 2.0}}},
        sort_keys=True)
    assert got.optim.to_dataclass() == OptimConfig(lr=1e-4, weight_decay=0.0, warmup_steps=5)
    assert got.lora.to_dataclass() == LoRAConfig(enabled=True, targets=["attn.c_attn"])
    empty = run_probe({})
    assert empty.clean.to_dataclass() == CleanConfig() and empty.model.to_dict() == {}
    assert empty.clean.to_dict(changed_only=True) == {}
    # the same values of the same types: every hash of the config (shard caches, reuse keys) stays where it was
    assert json.dumps(dataclasses.asdict(empty.clean.to_dataclass())) == json.dumps(dataclasses.asdict(CleanConfig()))


def test_from_dataclass_and_back():
    cfg = CleanConfig.from_dict({"min_words": 7, "pii": {"emails": False}})
    assert schema_of(CleanConfig).from_dataclass(cfg).to_dataclass() == cfg
    assert isinstance(schema_of(CleanConfig).from_dataclass(cfg), DataclassConfig)


BLOCKS = {("training_plan", "batch"): BatchConfig, ("training_plan", "hardware"): HardwareConfig,
          ("training_plan", "parallel"): ParallelConfig, ("base_model", "optim"): OptimConfig,
          ("base_model", "spikes"): SpikeConfig, ("sft_model", "optim"): OptimConfig, ("dpo_model", "optim"): OptimConfig,
          ("rl_model", "optim"): OptimConfig, ("dpo_model", "lora"): LoRAConfig, ("rl_model", "lora"): LoRAConfig}


def test_every_preset_block_gives_the_dataclass_and_dict_that_from_dict_gives():
    from jobs.presets import load_preset

    seen = 0
    for preset in sorted(PRESETS.glob("*.yaml")):
        ops = load_preset(preset.stem).get("ops") or {}
        for (op, block), cls in BLOCKS.items():
            raw = ((ops.get(op) or {}).get("config") or {}).get(block)
            if raw is None:
                continue
            seen += 1
            typed = schema_of(cls)(**raw)
            assert typed.to_dataclass() == from_dict(cls, raw), (preset.stem, op, block)
            assert typed.to_dict(changed_only=True) == {k: v for k, v in raw.items() if v != dataclasses.asdict(cls())[k]}
        model = ((ops.get("training_plan") or {}).get("config") or {}).get("model")
        if model is not None:
            assert schema_of(ModelConfig, optional=True)(**model).to_dict() == model
    assert seen >= 8


# ---------------------------------------------------------------------------------------------------- launchpad


def test_the_job_snapshot_shows_nested_typed_fields_with_defaults_and_descriptions():
    snap, fields = probe_config_fields()
    assert set(fields) == {"model", "batch", "clean", "optim", "lora"}
    assert fields["batch"].description == "The token budget."
    batch = snap_fields(snap, fields["batch"].type_key)
    assert batch["seq_len"].type_key == "Noneable.IntSourceType"
    assert json.loads(batch["seq_len"].default_value_as_json_str) == 256
    assert batch["seq_len"].description == "tokens per training sequence (at most model.block_size)"
    clean = snap_fields(snap, fields["clean"].type_key)
    minhash = snap_fields(snap, clean["minhash"].type_key)
    assert json.loads(minhash["num_perm"].default_value_as_json_str) == 112
    assert minhash["num_perm"].description == "hash permutations per signature; must equal bands * rows"
    optim = snap_fields(snap, fields["optim"].type_key)
    assert json.loads(optim["lr"].default_value_as_json_str) == 1e-4  # the override is what the launchpad shows
    model = snap_fields(snap, fields["model"].type_key)
    assert json.loads(model["n_layer"].default_value_as_json_str) is None and model["n_layer"].description == "transformer blocks"
    quantize = snap_fields(snap, fields["lora"].type_key)["quantize"]  # QLoRA's switch: an enum of the two choices
    assert json.loads(quantize.default_value_as_json_str) == "none"
    assert {v.value for v in snap.config_schema_snapshot.get_config_snap(quantize.type_key.removeprefix("Noneable.")).enum_values} == {"none", "nf4"}
    assert quantize.description == "the targets' frozen weights: as they are, or 4-bit NF4 (QLoRA)"


LAUNCHPAD_QUERY = """
query ($selector: PipelineSelector!) {
  runConfigSchemaOrError(selector: $selector) {
    __typename
    ... on RunConfigSchema {
      allConfigTypes { key ... on CompositeConfigType { fields { name description isRequired configTypeKey defaultValueAsJson } } }
    }
  }
}"""

PROBE_FILE = '''
from dagster import Config, Definitions, asset, define_asset_job
from pydantic import Field
from assets._config import schema_of
from kiln.clean.config import CleanConfig
from kiln.model.config import ModelConfig

class ProbeConfig(Config):
    model: schema_of(ModelConfig, optional=True) = Field(default_factory=schema_of(ModelConfig, optional=True))
    clean: schema_of(CleanConfig) = Field(default_factory=schema_of(CleanConfig))

@asset
def probe(config: ProbeConfig) -> None: ...

defs = Definitions(assets=[probe], jobs=[define_asset_job("probe_job")])
'''


@pytest.mark.slow
def test_the_launchpad_graphql_schema_has_the_nested_typed_fields(tmp_path):
    from dagster import instance_for_test
    from dagster_graphql.test.utils import define_out_of_process_context, execute_dagster_graphql, infer_job_selector

    (tmp_path / "probe_defs.py").write_text(PROBE_FILE)
    with instance_for_test() as instance, \
            define_out_of_process_context(str(tmp_path / "probe_defs.py"), "defs", instance) as context:
        result = execute_dagster_graphql(context, LAUNCHPAD_QUERY, {"selector": infer_job_selector(context, "probe_job")})
    data = result.data["runConfigSchemaOrError"]
    assert data["__typename"] == "RunConfigSchema", result
    types = {t["key"]: t for t in data["allConfigTypes"]}
    composites = [{f["name"]: f for f in t["fields"]} for t in types.values() if t.get("fields")]
    probe_cfg = next(c for c in composites if set(c) == {"model", "clean"})
    clean = {f["name"]: f for f in types[probe_cfg["clean"]["configTypeKey"]]["fields"]}
    assert clean["min_words"]["configTypeKey"] == "Noneable.IntSourceType"
    assert json.loads(clean["min_words"]["defaultValueAsJson"]) == 50
    assert clean["min_words"]["description"] == "fewer whitespace-separated words than this: too short to be prose"
    minhash = {f["name"]: f for f in types[clean["minhash"]["configTypeKey"]]["fields"]}
    assert minhash["normalise"]["description"].startswith('"datatrove": numbers to 0') and not minhash["normalise"]["isRequired"]
    model = {f["name"]: f for f in types[probe_cfg["model"]["configTypeKey"]]["fields"]}
    assert model["n_embd"]["description"] == "residual stream width; must divide by n_head"


# ---------------------------------------------------------------------------------------------------- guards


def _unwrap(config_type):
    """The block (or scalar) inside Noneable and Array wrappers."""
    while getattr(config_type, "inner_type", None) is not None and not getattr(config_type, "key_type", None):
        config_type = config_type.inner_type
    return config_type


def _block(config_type, dotted: str):
    """The Dagster config block at a dotted path (``ops.clean_corpus.config.clean``) of a config type."""
    for name in dotted.split("."):
        config_type = _unwrap(config_type).fields[name].config_type
    return _unwrap(config_type)


def _all_fields(config_type, path: str = ""):
    """(dotted path, Dagster Field) of every field under a config block, nested blocks and list items included."""
    config_type = _unwrap(config_type)
    if getattr(config_type, "key_type", None) is not None:  # a Map: its values
        yield from _all_fields(config_type.inner_type, f"{path}.*")
        return
    for name, f in (getattr(config_type, "fields", None) or {}).items():
        yield f"{path}.{name}".lstrip("."), f
        yield from _all_fields(f.config_type, f"{path}.{name}")


@pytest.fixture(scope="module")
def pipeline_schema():
    from jobs.definitions import defs

    assert defs.resolve_job_def("kiln_pipeline_job") is not None and defs.resolve_job_def("checkpoint_eval_job") is not None
    return {name: defs.resolve_job_def(name).run_config_schema.config_type
            for name in ("kiln_pipeline_job", "checkpoint_eval_job", "sweep_grid_job", "sweep_results_job",
                         "ablation_grid_job")}


def test_every_asset_config_field_is_typed_documented_and_defaulted(pipeline_schema):
    from assets.evals import checkpoint_evals
    from assets.ablation import ablation_grid
    from assets.scaling import sweep_grid, sweep_results
    from jobs.definitions import ALL_ASSETS

    seen, required = 0, []
    for job, assets in (("kiln_pipeline_job", ALL_ASSETS), ("checkpoint_eval_job", [checkpoint_evals]),
                        ("sweep_grid_job", [sweep_grid]), ("sweep_results_job", [sweep_results]),
                        ("ablation_grid_job", [ablation_grid])):
        for a in assets:
            name = a.key.to_user_string()
            for path, f in _all_fields(_block(pipeline_schema[job], f"ops.{name}.config")):
                seen += 1
                if f"{name}.{path}" != "raw_documents.sources.storage_options":  # fsspec's own options: any keys
                    assert "Any" not in f.config_type.key, f"{name}.{path} is untyped ({f.config_type.key})"
                assert f.description and len(f.description) > 5, f"{name}.{path} has no description"
                if f.is_required:
                    required.append(f"{name}.{path}")
                else:
                    assert f.default_provided, f"{name}.{path} has neither a default nor is it required"
    assert seen > 250
    # only a source entry's identity has no default: each inline source must say what it is
    assert required == [f"raw_documents.sources.{k}" for k in ("name", "kind", "format", "license")] + [
        "sweep_grid.fields.field", "ablation_grid.fields.field"]  # each list entry names what it is (a source, a field)


def test_every_registered_filter_has_its_section_in_the_clean_schema_and_its_rule_keys(pipeline_schema):
    from kiln.clean.config import rule_keys
    from kiln.common.config import field_docs
    from kiln.filters import registry

    clean = _block(pipeline_schema["kiln_pipeline_job"], "ops.clean_corpus.config.clean")
    keys = rule_keys()
    specs = registry.filters()
    assert len(specs) >= 8
    for spec in specs:
        docs = field_docs(spec.config)
        block = _block(clean, spec.section) if spec.section else clean
        if spec.section:
            assert clean.fields[spec.section].description == field_docs(CleanConfig)[spec.section], spec.name
        for f in dataclasses.fields(spec.config):
            assert f.name in block.fields, f"clean_corpus.clean.{spec.prefix}{f.name} ({spec.name}) is not in the schema"
            assert block.fields[f.name].description == docs[f.name], (spec.name, f.name)
        assert spec.rule_keys() and set(spec.rule_keys()) <= set(keys), spec.name
    for reason, key in keys.items():  # every key a drop reason names is a field the launchpad shows
        if key is not None:
            parent, _, leaf = key.rpartition(".")
            assert leaf in (_block(clean, parent) if parent else clean).fields, (reason, key)


def test_every_registered_eval_task_is_in_the_default_suites_and_the_chance_table(pipeline_schema):
    from assets.evals import CheckpointEvalsConfig, EvalScoresConfig
    from kiln.evaluation.registry import REGISTRY
    from kiln.evaluation.suite import CHANCE

    local = [s.name for s in REGISTRY.local()]
    assert len(local) >= 4
    suites = CheckpointEvalsConfig().suites
    shown = json.loads(_block(pipeline_schema["checkpoint_eval_job"], "ops.checkpoint_evals.config")
                       .fields["suites"].default_value_as_json_str)
    assert shown == suites == REGISTRY.suites()  # the launchpad shows the registry's suites as the default
    assert sorted(t for tasks in suites.values() for t in tasks) == sorted(local)
    assert EvalScoresConfig().tasks == []  # eval_scores: empty means every task eval_suite built (all registered)
    for spec in REGISTRY.local():
        assert spec.name in CHANCE and CHANCE[spec.name] == spec.chance, spec.name
        assert CHANCE.get(spec.name + "_clean") == spec.chance, spec.name
    assert set(REGISTRY.standard()) <= set(CHANCE)
