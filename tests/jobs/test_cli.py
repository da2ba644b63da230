"""The kiln command line's preset handling."""

import sys
from pathlib import Path

import pytest

from kiln.common.config import deep_merge
from jobs.presets import load_preset, select_config
from jobs.cli import main


def test_deep_merge_overrides_leaves_only():
    base = {"ops": {"a": {"config": {"x": 1, "y": {"z": 2}}}, "b": {"config": {"k": 1}}}}
    over = {"ops": {"a": {"config": {"y": {"z": 3}}}}}
    assert deep_merge(base, over) == {"ops": {"a": {"config": {"x": 1, "y": {"z": 3}}}, "b": {"config": {"k": 1}}}}


def test_select_config_keeps_selected_ops():
    cfg = load_preset("smoke")
    assert set(select_config(cfg, ["tokenizer"])["ops"]) == {"tokenizer"}


def test_unknown_preset_lists_known_ones():
    with pytest.raises(SystemExit, match="known presets: .*smoke"):
        load_preset("nope")


def test_preset_with_bad_top_level_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("opps: {}\n")
    with pytest.raises(SystemExit, match="unknown top-level key"):
        load_preset(str(bad))


def test_presets_extending_each_other_in_a_cycle_are_one_line_naming_the_files(tmp_path, capsys):
    own = tmp_path / "own.yaml"
    own.write_text(f"extends: {own}\nops: {{}}\n")
    with pytest.raises(SystemExit) as err:
        load_preset(str(own))
    assert str(err.value) == (f"kiln: presets extend each other in a cycle: {own} -> {own}; remove the `extends:` "
                              f"line that closes it in {own}")
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(f"extends: {b}\n")
    b.write_text(f"extends: {a}\nops: {{}}\n")
    with pytest.raises(SystemExit) as err:
        main(["config", "--preset", str(a)])
    assert str(err.value) == (f"kiln: presets extend each other in a cycle: {a} -> {b} -> {a}; remove the `extends:` "
                              f"line that closes it in {b}")
    b.write_text("extends: [smoke]\n")
    with pytest.raises(SystemExit, match=r"b\.yaml: `extends:` names one preset .* not \['smoke'\]"):
        load_preset(str(a))
    b.write_text("extends: smoke\n")  # no cycle: a -> b -> smoke
    assert load_preset(str(a)) == load_preset("smoke")


def test_help_lists_the_commands_with_examples(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kiln [-h] {run,sweep,ablate,generate,chat,status,verify,config,plan,lineage,logbook,arena} ...")
    assert "kiln run --preset smoke --select eval_scores,release_bundle" in out
    assert "kiln plan --preset gpt2-124m-8gpu  the training plan a preset gets on its hardware" in out
    verbs = out.split("\ncommands:\n", 1)[1].split("\noptions:", 1)[0].splitlines()[1:]
    assert [line.split()[0] for line in verbs if line.strip()] == ["run", "sweep", "ablate", "generate", "chat", "status",
                                                                  "verify", "config", "plan", "lineage", "logbook", "arena"]
    assert all(len(line.split(None, 1)) == 2 for line in verbs if line.strip())  # each verb with its one line


@pytest.mark.parametrize("verb", ["run", "sweep", "ablate", "generate", "chat", "status", "verify", "config", "plan", "lineage",
                                  "logbook", "arena"])
def test_each_verbs_help_says_what_it_does_and_its_defaults(capsys, verb):
    with pytest.raises(SystemExit) as exit_:
        main([verb, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]
    assert description[0].isupper() and description.rstrip().endswith(".") and "options:" not in description
    flat = " ".join(out.split())
    if verb in ("run", "status", "verify", "config", "plan"):
        assert "--preset PRESET name under conf/presets" in flat and "(default: demo)" in flat
    if verb == "generate":
        assert "(default: 60)" in flat and "(default: 0.8)" in flat and "(default: 0)" in flat


def test_run_rejects_unknown_asset(tmp_path):
    with pytest.raises(SystemExit, match="unknown asset"):
        main(["run", "--preset", "smoke", "--select", "tokenizr", "--home", str(tmp_path)])


def test_run_names_a_typo_in_a_preset_on_one_line_before_anything_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    preset = tmp_path / "typo.yaml"
    preset.write_text("extends: smoke\nops:\n  clean_corpus:\n    config:\n      clean:\n        minhash: {bandz: 7}\n"
                      "  training_plan:\n    config:\n      model: {n_layers: 2}\n")
    assert main(["run", "--preset", str(preset), "--home", str(tmp_path / "home")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kiln:")]
    assert err == [f"kiln: preset {preset}: unknown key 'bandz' in ops.clean_corpus.config.clean.minhash; "
                   "did you mean 'bands'? (and 1 more error)"]
    assert not (tmp_path / "home" / "storage").exists()  # refused before any asset ran
    preset.write_text("ops:\n  training_plan:\n    config:\n      batch: {seq_len: long}\n")
    assert main(["run", "--preset", str(preset), "--home", str(tmp_path / "home")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kiln:")]
    assert len(err) == 1 and 'Value "long"' in err[0] and err[0].endswith("(ops.training_plan.config.batch.seq_len)")



def test_run_refuses_an_unknown_op_or_resource_name_in_a_preset_before_anything_runs(tmp_path, capsys, monkeypatch):
    """A misspelt op is not dropped with the ops outside --select: the whole preset's names are checked first."""
    from dagster import JobDefinition

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    ran = []
    monkeypatch.setattr(JobDefinition, "execute_in_process", lambda *a, **k: ran.append(k) or pytest.fail("the run started"))
    preset = tmp_path / "misspelt.yaml"
    preset.write_text("extends: smoke\nops:\n  trainng_plan:\n    config:\n      batch: {max_steps: 5}\n")
    assert main(["run", "--preset", str(preset), "--select", "tokenizer", "--home", str(tmp_path / "home")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"kiln: preset {preset}: unknown op 'trainng_plan' in ops; did you mean 'training_plan'?"]
    preset.write_text("resources:\n  mlfow:\n    config: {tracking_uri: x}\n  gpus:\n    config: {}\nops:\n  tokeniser: {}\n")
    assert main(["run", "--preset", str(preset), "--home", str(tmp_path / "home")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"kiln: preset {preset}: unknown op 'tokeniser' in ops; did you mean 'tokenizer'? (and 2 more errors)"]
    preset.write_text("resources:\n  mlfow:\n    config: {tracking_uri: x}\n")
    assert main(["run", "--preset", str(preset), "--home", str(tmp_path / "home")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"kiln: preset {preset}: unknown resource 'mlfow' in resources; did you mean 'mlflow'?"]
    assert ran == [] and not (tmp_path / "home" / "storage").exists()


@pytest.mark.slow
def test_a_failed_run_says_first_which_step_failed_and_why_and_where_the_trace_is(tmp_path, capsys, monkeypatch,
                                                                                    source_cache):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    preset = tmp_path / "strict.yaml"
    preset.write_text(f"extends: smoke\nresources:\n  storage:\n    config: {{source_cache: {source_cache}}}\n"
                      "ops:\n  clean_corpus: {config: {clean: {min_words: 50000}}}\n")
    home = tmp_path / "home"
    args = ["run", "--preset", str(preset), "--select", "raw_documents,clean_corpus", "--home", str(home)]
    assert main(args) == 1
    err = capsys.readouterr().err.splitlines()
    step, _, why = err[0].partition(" failed: ")
    assert step.startswith("kiln: clean_corpus") and why.startswith("EmptyCorpusError: clean: kept 0 of ")
    assert "clean.min_words" in why
    assert err[1].startswith(f"kiln: full trace in {home / 'logs'}/") and err[1].endswith(".log")
    log = Path(err[1].split(" in ", 1)[1])
    assert len(err) == 3 and err[2].startswith(f"kiln: run {log.stem} FAILED after ")
    trace = log.read_text()
    assert trace.startswith(f"== step {step[len('kiln: '):]} failed ==\n")
    assert "kiln.clean.report.EmptyCorpusError: clean: kept 0 of " in trace and 'File "' in trace
    assert main([*args, "--verbose"]) == 1  # the same, then the full traces
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"{step} failed: EmptyCorpusError:") and f"kiln: step {step[len('kiln: '):]} failed:" in err
    assert any(line.startswith("kiln.clean.report.EmptyCorpusError: ") for line in err[3:])
    # the same selection from the plain smoke preset succeeds, and DAGSTER_HOME's instance holds what it materialized
    ok = tmp_path / "ok.yaml"
    ok.write_text(f"extends: smoke\nresources:\n  storage:\n    config: {{source_cache: {source_cache}}}\n")
    assert main(["run", "--preset", str(ok), "--select", "raw_documents,clean_corpus", "--home", str(home)]) == 0
    out = capsys.readouterr().out.splitlines()
    run_id = out[0].split()[2].rstrip(",")
    assert out[0] == f"kiln: run {run_id}, preset {ok}, 2 assets; full log: {home / 'logs' / (run_id + '-events.log')}"
    done = [line for line in out if line.startswith(f"kiln: run {run_id} materialized 2 assets in ")]
    assert len(done) == 1 and done[0].endswith(f"(preset {ok})"), out
    from dagster import AssetKey, DagsterInstance

    with DagsterInstance.get() as instance:
        assert instance.get_latest_materialization_event(AssetKey("clean_corpus")).run_id == run_id


@pytest.mark.slow
def test_kiln_sweep_speaks_like_kiln_run_and_a_wrong_typed_value_is_one_line_before_anything_runs(
        tmp_path, capsys, monkeypatch, source_cache):
    """kiln sweep shares kiln run's console: a line as each asset starts and ends, one per point, the ranking, and
    every Dagster event in the log file only; a swept value of the wrong type is one line naming where it is."""
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    sweep = ("ops:\n  sweep_grid:\n    config:\n      plan:\n        model: {n_layer: 2, n_head: 2, n_embd: 32, "
             "block_size: 64}\n        batch: {seq_len: 64, global_batch: 8}\n      fields:\n        - {field: "
             "optim.lr, values: [%s, 0.01]}\n      max_steps: 3\n      eval_batches: 1\n")
    preset = tmp_path / "sweep.yaml"
    head = f"extends: smoke\nresources:\n  storage:\n    config: {{source_cache: {source_cache}}}\n"
    preset.write_text(head + sweep % '"abc"')
    home = tmp_path / "home"
    assert main(["sweep", "--preset", str(preset), "--home", str(home)]) == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        'kiln sweep: sweep_grid: Invalid scalar at path root:ops:sweep_grid:config:fields[0]:values[0]. Value "abc" of '
        'type "<class \'str\'>" is not valid for expected type "Float" (ops.sweep_grid.config.fields.0.values.0)']
    assert len(out.splitlines()) == 1 and not (home / "storage").exists()  # the log line; nothing ran
    preset.write_text(head + sweep % "0.001")
    assert main(["sweep", "--preset", str(preset), "--home", str(home)]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    log = Path(lines[0].split("full log: ")[1])
    assert lines[0] == f"kiln sweep: preset {preset}; full log: {log}" and err == ""
    assert [line.split()[1] for line in lines if line.startswith("✓")] == [
        "pretrained_model", "raw_documents", "clean_corpus", "tokenizer", "token_shards", "sweep_grid", "sweep",
        "sweep", "sweep_results"]
    assert [line for line in lines if line.startswith("▶")].count("▶ sweep") == 2  # each point its own start
    assert "kiln sweep: 2 points: lr=0.001, lr=0.01" in lines and len(lines) <= 30, lines
    assert not any("DEBUG" in line or "STEP_" in line or "Traceback" in line for line in lines)
    assert "STEP_SUCCESS" in log.read_text()  # Dagster's events are all in the log file


@pytest.mark.slow
def test_kiln_ablate_refuses_a_mistyped_data_field_in_one_line_naming_the_valid_ones_before_anything_trains(
        tmp_path, capsys, monkeypatch, source_cache):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    preset = tmp_path / "ablate.yaml"
    preset.write_text(f"extends: smoke\nresources:\n  storage:\n    config: {{source_cache: {source_cache}}}\n"
                      "ops:\n  ablation_grid:\n    config:\n      fields:\n        - {field: clean.olmo3.enabled, "
                      "choices: [\"false\"]}\n")
    home = tmp_path / "home"
    assert main(["ablate", "--preset", str(preset), "--home", str(home)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("kiln ablate: ablation_grid failed: ConfigError: ablation_grid.fields[0].field: "
                              "'clean.olmo3.enabled': clean has no data field 'olmo3'; choose one of ")
    assert "olmo2" in err[-1] and not (home / "storage" / "ablation" / "runs").exists()  # nothing trained
    preset.write_text("extends: smoke\n")
    assert main(["ablate", "--preset", str(preset), "--home", str(home)]) == 2
    assert "has no ablation_grid block" in capsys.readouterr().err


def test_the_innermost_error_is_the_one_the_asset_raised():
    from dagster._utils.error import serializable_error_info_from_exc_info
    from dagster import Failure

    from jobs.errors import innermost_error
    from kiln.common.config import ConfigError

    def info(raise_it):
        try:
            raise_it()
        except Exception:
            return serializable_error_info_from_exc_info(sys.exc_info())

    def wrapped():
        try:
            raise ConfigError("clean.min_wrds: unknown key.\nDid you mean 'min_words'?")
        except ConfigError as e:
            raise Failure(description="ConfigError: clean.min_wrds", allow_retries=False) from e

    def failure():
        raise Failure(description="torchrun exited with code 1.\nFull log: train.log")

    assert innermost_error(info(wrapped)) == ("ConfigError", "clean.min_wrds: unknown key. Did you mean 'min_words'?")
    assert innermost_error(info(failure)) == ("Failure", "torchrun exited with code 1. Full log: train.log")

# ---- kiln lineage / kiln generate on a real (tiny) release ----------------------------------------------------

import json  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402

LINEAGE_EXTRA = {
    "name": "kiln-cli-test",
    "lineage": {"raw_documents": "raw111", "clean_corpus": "clean222", "token_shards": "shards333", "sft_model": "sft444"},
    "sources": [{"name": "docs-a", "kind": "pip", "package": "sphinx", "version": "8.1.0", "license": "BSD-2-Clause"}],
    "filters": {"min_words": 20, "minhash_threshold": 0.8},
    "training": {"base_model": {"steps": 30, "final_val_loss": 3.25}},
    "eval": {"val_bits_per_byte": 1.9},
    "mlflow_runs": {"base_model": "run-base", "sft_model": "run-sft"},
}


@pytest.fixture
def release(tmp_path, tiny_tokenizer) -> tuple[Path, Path]:
    """(bundle, the checkpoint it came from) for a tiny model trained-like on the tiny tokenizer."""
    import torch

    from kiln.train.checkpoint import save_checkpoint
    from kiln.model.config import ModelConfig
    from kiln.model.gpt2.model import GPT
    from kiln.release.bundle import write_release

    _, tok = tiny_tokenizer
    cfg = ModelConfig(vocab_size=320, block_size=32, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    ckpt = save_checkpoint(tmp_path / "run" / "checkpoints", 9, {"model": GPT(cfg).state_dict()}, {"model": asdict(cfg), "task": "sft"},
                           extra_files={"tokenizer.json": tok})
    (tmp_path / "run" / "job.json").write_text(json.dumps({"task": "sft", "train_files": ["/s/instruction_data/v1/pairs.jsonl"],
                                                           "mlflow_run_id": "run-sft"}))
    write_release(ckpt, tmp_path / "release", card="# card\n", extra=LINEAGE_EXTRA)
    return tmp_path / "release", ckpt


def test_lineage_of_a_release_prints_a_tree_and_json(release, capsys):
    bundle, ckpt = release
    assert main(["lineage", str(bundle)]) == 0
    tree = capsys.readouterr().out
    assert tree.startswith(f"release kiln-cli-test {bundle}\n  from checkpoint {ckpt} (step 9, task sft)")
    for needle in ("clean_corpus: clean222", "- docs-a:", "version=8.1.0", "minhash_threshold: 0.8",
                   "final_val_loss: 3.25", "val_bits_per_byte: 1.9", "sft_model: run-sft", "tokenizer: kiln-bpe-300"):
        assert needle in tree, (needle, tree)
    assert main(["lineage", str(bundle), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["lineage"] == LINEAGE_EXTRA["lineage"] and info["sources"] == LINEAGE_EXTRA["sources"]
    assert info["source_checkpoint"] == str(ckpt) and info["step"] == 9 and info["release"] == str(bundle)


def test_lineage_of_a_checkpoint_and_of_a_damaged_release(release, capsys):
    bundle, ckpt = release
    assert main(["lineage", str(ckpt.parent.parent), "--json"]) == 0  # a run folder resolves to its newest checkpoint
    info = json.loads(capsys.readouterr().out)
    assert info["checkpoint"] == str(ckpt) and info["job"]["train_files"] == ["/s/instruction_data/v1/pairs.jsonl"]
    assert info["mlflow_runs"] == {"sft": "run-sft"}
    (bundle / "kiln.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"kiln\.json: checksum does not match SHA256SUMS"):
        main(["lineage", str(bundle)])
    with pytest.raises(SystemExit, match="no checkpoint found"):
        main(["lineage", str(bundle.parent / "nowhere")])


def test_a_damaged_or_missing_checksum_list_is_named(release, capsys):
    bundle, _ = release
    sums = bundle / "SHA256SUMS"
    good = sums.read_text()
    sums.write_text(good + "garbage\n")
    n = len(good.splitlines()) + 1
    for verb in ("lineage", "generate"):
        with pytest.raises(SystemExit) as err:
            main([verb, str(bundle)])
        assert f"{sums}: line {n} is not '<sha256>  <file name>' (got 'garbage'); the checksum list is damaged" in str(err.value)
    sums.write_text(good.replace("  kiln.json", "  ../kiln.json"))  # a name that points out of the bundle
    with pytest.raises(SystemExit, match=r"SHA256SUMS: line \d+ is not '<sha256>  <file name>' \(got '[0-9a-f]{64}  \.\./kiln\.json'\)"):
        main(["lineage", str(bundle)])
    sums.unlink()  # a bundle without its checksums is not taken for a checkpoint folder
    for verb in ("lineage", "generate"):
        with pytest.raises(SystemExit) as err:
            main([verb, str(bundle)])
        assert f"{sums}: missing, so nothing in {bundle} can be verified" in str(err.value)
        assert "no checkpoint found" not in str(err.value)


def test_generate_from_release_and_checkpoint_agree(release, capsys):
    bundle, ckpt = release
    args = ["--prompt", "The cat", "--prompt", "A dog", "--max-new-tokens", "8", "--temperature", "0"]
    assert main(["generate", str(bundle), *args]) == 0
    from_release = capsys.readouterr().out.splitlines()
    assert main(["generate", str(ckpt), *args]) == 0
    assert capsys.readouterr().out.splitlines() == from_release  # same weights, greedy: same text
    assert len(from_release) == 2 and from_release[0].startswith("The cat") and from_release[1].startswith("A dog")
    assert main(["generate", str(bundle), "--chat", "--prompt", "hi", "--max-new-tokens", "4", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("hi ->")


def test_lineage_and_generate_resolve_a_registered_model(release, tmp_path, capsys):
    from kiln.release.registry import register_release

    bundle, _ = release
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    register_release(uri, "kiln-cli", bundle, scores={"val_loss": 3.0}, lineage=LINEAGE_EXTRA["lineage"])
    assert main(["lineage", "models:/kiln-cli@candidate", "--tracking-uri", uri]) == 0
    tree = capsys.readouterr().out
    assert f"release kiln-cli-test {bundle.resolve()}" in tree and "registry:" in tree and "version: 1" in tree
    assert main(["generate", "models:/kiln-cli/1", "--tracking-uri", uri, "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("The")
    with pytest.raises(SystemExit, match="no alias 'prod'"):
        main(["lineage", "models:/kiln-cli@prod", "--tracking-uri", uri])


def test_plan_prints_the_gpt2_124m_decisions_for_one_and_eight_gpus(capsys):
    assert main(["plan", "--preset", "gpt2-124m-1gpu"]) == 0
    one = capsys.readouterr().out
    assert "124.5M parameters" in one and "vocabulary 50,304" in one
    assert "ranks        1: none" in one and "micro_batch 128 x grad_accum 4 x 1 ranks" in one
    assert main(["plan", "--preset", "gpt2-124m-8gpu", "--json"]) == 0
    eight = json.loads(capsys.readouterr().out)
    assert (eight["parallelism"], eight["micro_batch"], eight["grad_accum"], eight["world_size"]) == ("ddp", 64, 1, 8)
    assert eight["tokens_per_step"] == 512 * 1024 and eight["model"]["vocab_size"] == 50304


def test_plan_that_cannot_fit_exits_non_zero_saying_what_would(tmp_path, capsys):
    preset = tmp_path / "small-gpu.yaml"
    preset.write_text("extends: gpt2-124m-1gpu\nops:\n  training_plan:\n    config:\n"
                      "      hardware: {device: cuda, nproc_per_node: 1, memory_gb: 1}\n")
    assert main(["plan", "--preset", str(preset)]) == 2
    err = capsys.readouterr().err
    assert "small-gpu.yaml" in err and "GiB" in err and "Otherwise use a smaller model" in err


def test_plan_names_an_unknown_key(tmp_path, capsys):
    preset = tmp_path / "typo.yaml"
    preset.write_text("ops:\n  training_plan:\n    config:\n      batch: {seq_len: 64, global_btach: 8}\n")
    assert main(["plan", "--preset", str(preset)]) == 2
    assert capsys.readouterr().err == (f"kiln: preset {preset}: unknown key 'global_btach' in "
                                       "ops.training_plan.config.batch; did you mean 'global_batch'?\n")


@pytest.mark.parametrize("value", ["long", '"64"', "6.5"])
def test_plan_refuses_what_run_refuses_with_the_same_line(tmp_path, capsys, monkeypatch, value):
    """A string or a float for an integer field: kiln run refuses it before anything runs, so kiln plan must too."""
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    preset = tmp_path / "typed.yaml"
    preset.write_text(f"extends: smoke\nops:\n  training_plan:\n    config:\n      batch: {{seq_len: {value}}}\n")
    assert main(["plan", "--preset", str(preset)]) == 2
    plan = capsys.readouterr().err
    assert main(["run", "--preset", str(preset), "--select", "training_plan", "--home", str(tmp_path / "home")]) == 2
    run = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kiln:")]
    assert plan.splitlines() == run and len(run) == 1, (plan, run)
    assert run[0].startswith(f"kiln: preset {preset}: ") and run[0].endswith("(ops.training_plan.config.batch.seq_len)")


def _pretrained_preset(tmp_path: Path, folder: Path, extra: str = "") -> Path:
    preset = tmp_path / "import.yaml"
    preset.write_text(f"ops:\n  pretrained_model:\n    config:\n      path: {folder}\n  training_plan:\n    config:\n"
                      "      batch: {seq_len: 32, global_batch: 8, max_steps: 10}\n"
                      "      hardware: {device: cpu, nproc_per_node: 1, memory_gb: 4}\n" + extra)
    return preset


def test_plan_of_a_preset_with_a_pretrained_model_uses_its_architecture(tmp_path, capsys):
    from hfmodels import save_tiny

    from assets.training import TrainingPlanConfig
    from kiln.pretrained.source import import_pretrained

    folder = save_tiny(tmp_path / "tiny-llama", "llama", "smollm", extra_rows=0)  # the chat tokens grow the embedding
    preset = _pretrained_preset(tmp_path, folder)
    assert main(["plan", "--preset", str(preset), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    record = import_pretrained(folder, tmp_path / "imported")  # what the pretrained_model asset hands training_plan
    conf = load_preset(str(preset))["ops"]["training_plan"]["config"]
    want = TrainingPlanConfig(**conf).planned(record["n_vocab"], {"path": str(folder), "model": record["model"]}).single
    assert {k: v for k, v in got.items() if k != "pretrained"} == json.loads(json.dumps(want.to_dict()))
    assert got["model"]["family"] == "llama" and (got["model"]["n_layer"], got["model"]["n_embd"]) == (2, 32)
    assert got["model"]["vocab_size"] == record["n_vocab"] == record["imported_vocab"] + 2  # <|user|>, <|assistant|>
    assert got["pretrained"] == {"source": str(folder.resolve()), "family": "llama",
                                 "imported_vocab": record["imported_vocab"], "added_tokens": record["added_tokens"],
                                 "n_vocab": record["n_vocab"]}
    assert main(["plan", "--preset", str(preset)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"pretrained   {folder.resolve()} (llama: config.json and tokenizer.json; ")
    assert f"{want.params / 1e6:,.1f}M parameters" in out and "2 layers x 4 heads x 32 wide" in out


def test_plan_names_a_missing_pretrained_folder_and_its_key(tmp_path, capsys):
    missing = tmp_path / "models" / "smollm2-135m"
    assert main(["plan", "--preset", str(_pretrained_preset(tmp_path, missing))]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kiln: preset {tmp_path / 'import.yaml'}: pretrained_model.path: {missing}: not a folder")


def test_plan_refuses_a_model_size_beside_a_pretrained_model(tmp_path, capsys):
    from hfmodels import save_tiny

    folder = save_tiny(tmp_path / "tiny-gpt2", "gpt2")
    assert main(["plan", "--preset", str(_pretrained_preset(tmp_path, folder, "      model_preset: tiny\n"))]) == 2
    assert "the architecture comes from pretrained_model.path" in capsys.readouterr().err


def test_plan_of_the_layout_presets_shows_the_choice_the_runner_up_and_metas_layout(capsys):
    """The four presets with a training_plan.layout block: GPT-2 124M on one GPU splits nothing, Llama 3 8B on 8
    GPUs takes tp 2 x FSDP 4, 70B on 64 FSDP over all 64, 405B on 16,384 H100s Meta's tp 8 x pp 16 x 128-way data
    parallelism (kiln/plan/layout.py and tests/kiln/plan/test_layout.py hold the cost model and its checks)."""
    from assets.training import TrainingPlanConfig

    sizes = {}
    for preset in ("gpt2-124m-1gpu-layout", "llama3-8b-8gpu", "llama3-70b-64gpu"):
        assert main(["plan", "--preset", preset, "--json"]) == 0
        lay = json.loads(capsys.readouterr().out)["chosen"]["layout"]
        sizes[preset] = (lay["dp_replicate"], lay["dp_shard"], lay["tp"], lay["pp"])
    assert sizes == {"gpt2-124m-1gpu-layout": (1, 1, 1, 1), "llama3-8b-8gpu": (1, 4, 2, 1),
                     "llama3-70b-64gpu": (1, 64, 1, 1)}
    assert main(["plan", "--preset", "llama3-405b-16k-h100"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model        405.85B parameters (llama): 126 blocks x 16384 wide")
    assert "16,384 x H100" in out and "layout       tp 8 x pp 16 x dp_" in out and "interleaved 1F1B v 8" in out
    for head in ("  tp ", "  pp ", "memory/rank ", "comm/step ", "bubble ", "step ", "throughput ", "runner-up ",
                 "reference    Meta's Llama 3 405B layout", "run ", "considered "):
        assert "\n" + head in out, head
    assert "as given it does not fit" in out  # Meta's no-checkpointing layout under Kiln's activation count
    conf = load_preset("llama3-405b-16k-h100")["ops"]["training_plan"]["config"]
    planned = TrainingPlanConfig(**conf).planned(128256)  # one entry point: a layout block plans the cluster
    assert planned.single is None and planned.layout.chosen.layout.pp == 16


def test_plan_of_the_mixture_of_experts_presets_counts_active_parameters_and_weighs_expert_parallelism(capsys):
    """The Qwen3-30B-A3B-sized presets on 8 and 64 H100s: total and active parameters, FLOPs from the active ones,
    and a line saying what expert parallelism would cost or save."""
    for preset, gpus in (("qwen3-30b-a3b-8gpu", 8), ("qwen3-30b-a3b-64gpu", 64)):
        assert main(["plan", "--preset", preset]) == 0
        out = capsys.readouterr().out
        assert out.startswith("model        30.08B parameters (2.90B active per token) (moe): 48 blocks x 2048 wide")
        assert "128 experts of 768, 8 per token" in out and f"cluster      {gpus} x H100" in out
        assert "\n  ep " in out and "memory/rank " in out and "considered " in out


def test_the_training_plan_of_a_layout_preset_is_the_job_base_model_launches() -> None:
    """The training_plan asset trains the chosen layout: Llama 3 8B's tp 2 x dp_shard 4 becomes the job's layout,
    FSDP2 and 32 micro-batches of one sequence, and the job built from it passes the launcher's checks on 8 ranks;
    405B's HSDP layout, which the job does not run, is an error saying what to pin."""
    from assets.training import TrainingPlanConfig
    from kiln.common.config import ConfigError
    from kiln.train.launch import RunSpec

    conf = load_preset("llama3-8b-8gpu")["ops"]["training_plan"]["config"]
    plan = TrainingPlanConfig(**conf).planned(128256).launch()
    assert (plan["world_size"], plan["parallelism"], plan["micro_batch"], plan["grad_accum"]) == (8, "fsdp", 1, 32)
    assert plan["layout"] == {"dp_replicate": 1, "dp_shard": 4, "tp": 2, "pp": 1} and "pipeline" not in plan
    assert plan["global_batch"] == 8 * 1 * 32 // 2 and plan["reason"].startswith("layout tp 2 x dp_shard 4")
    assert "reshards the weights after each forward" in plan["reason"]  # the plan kept them gathered
    spec = RunSpec("pretrain", {"train_files": [], "val_files": []}, plan, {}, "tokenizer.json")
    job = spec.validate("base_model")
    assert job.layout.tp == 2 and job.parallelism == "fsdp" and job.model.n_layer == 32
    conf = load_preset("llama3-405b-16k-h100")["ops"]["training_plan"]["config"]
    with pytest.raises(ConfigError, match=r"\(HSDP\), which the training job does not run; pin "
                                          r"training_plan.parallel.strategy: fsdp"):
        TrainingPlanConfig(**conf).planned(128256).launch()


def test_chat_with_a_gguf_file_keeps_the_conversation(tmp_path, capsys):
    from ggufmodels import write_gguf
    from hfmodels import save_tiny
    from kiln.release.load import load_chat_model
    from jobs.cli import main

    path = write_gguf(save_tiny(tmp_path / "hf", "llama", "smollm"), tmp_path / "m.gguf", "Q8_0", style="smollm")
    assert main(["chat", str(path), "--message", "the model reads", "--message", "/reset", "--message", "text and",
                 "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out.count("you> ") == 2 and out.count("model> ") == 2 and "you> text and" in out
    model, enc, template = load_chat_model(path)
    assert template.startswith("{% for m in messages %}<|im_start|>")  # the GGUF's own ChatML template
    assert main(["generate", str(path), "--chat", "--prompt", "hello", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("hello ->")


def test_a_process_count_of_0_is_one_line_from_kiln_plan_not_a_traceback(tmp_path, capsys):
    preset = tmp_path / "zero.yaml"
    preset.write_text("extends: smoke\nops:\n  training_plan:\n    config:\n      hardware: {nproc_per_node: 0}\n")
    assert main(["plan", "--preset", str(preset)]) == 2
    assert capsys.readouterr().err.strip() == (f"kiln: preset {preset}: training_plan.hardware.nproc_per_node is 0: "
                                               "give >= 1")
