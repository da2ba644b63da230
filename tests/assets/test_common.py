"""asset_output, the output pattern written once: MLflow child run with reuse, staging folder, content-hash commit
(volatile files left out of the hash), data version and the Output with MLflow links; tiny assets in-process.

Run: python -m pytest tests/assets/test_common.py -q
"""

import json
import os
from pathlib import Path

import pytest
from dagster import AssetExecutionContext, Config, Output, asset, materialize

from assets._common import AssetOutput, asset_output, commit_output, content_version
from kiln.common.files import manifest_of_dir, stable_hash
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource

CALLS: list[str] = []


class NotesConfig(Config):
    text: str = "hello"
    took_s: float = 1.0


@asset(code_version="1")
def notes(context: AssetExecutionContext, config: NotesConfig, storage: KilnStorageResource,
          mlflow: MlflowResource) -> Output[dict]:
    """A staged folder with a volatile timings file, committed under its content hash."""
    with asset_output(context, mlflow, parent=storage.path("notes"), config=config,
                      inputs={"upstream": {"version": "up-1"}, "unused": None}, tags={"extra": "yes"}) as out:
        if out.reused:
            return out.reused
        CALLS.append("notes")
        (out.stage / "notes.txt").write_text(config.text)
        (out.stage / "timings.json").write_text(json.dumps({"took_s": config.took_s}))
        final = out.commit(volatile=("timings.json",))
        out.log_metrics({"chars": len(config.text)})
        out.log_artifact(final / "notes.txt")
        return out.result({"path": str(final / "notes.txt"), "version": out.version}, {"chars": len(config.text)})


@asset(code_version="1")
def summary(context: AssetExecutionContext, mlflow: MlflowResource) -> Output[dict]:
    """A plain dict (no folder): the data version is the hash of the value."""
    value = {"params": 123, "why": "fits"}
    with asset_output(context, mlflow, params=value, reuse={"value": value}) as out:
        if out.reused:
            return out.reused
        CALLS.append("summary")
        return out.result(value, {"params": 123}, version=stable_hash(value)[:16])


@asset(code_version="1")
def keyed(context: AssetExecutionContext, storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """A folder keyed by its inputs (not by its content); still versioned by its content."""
    with asset_output(context, mlflow, parent=storage.path("keyed"), tags={"input.x": "1"}) as out:
        assert out.reused is None  # no config, inputs or reuse: never reused
        (out.stage / "task.yaml").write_text("name: t\n")
        final = out.commit(folder=storage.path("keyed") / "key123")
        return out.result({"dir": str(final), "version": out.version})


@asset
def untracked(context: AssetExecutionContext, storage: KilnStorageResource) -> Output[dict]:
    """No MLflow run: the staging, commit and data version alone, into another parent."""
    with asset_output(context, None, parent=storage.path("untracked")) as out:
        (out.stage / "scores.json").write_text("{}")
        final = out.commit(into=storage.path("untracked", "step_0000010"))
        return out.result({"path": str(final / "scores.json"), "version": out.version}, {"step": 10})


@asset(code_version="1")
def broken(context: AssetExecutionContext, storage: KilnStorageResource, mlflow: MlflowResource) -> None:
    with asset_output(context, mlflow, parent=storage.path("broken"), reuse={"k": 1}) as out:
        (out.stage / "half.txt").write_text("half")
        raise RuntimeError("disk full")


@pytest.fixture
def resources(tmp_path: Path) -> dict:
    return {"storage": KilnStorageResource(root=str(tmp_path / "root")),
            "mlflow": MlflowResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                                     artifact_root=str(tmp_path / "art"), ui_url="http://mlflow.test")}


def materialized(result, name: str):
    """(value, data version, metadata) of one asset in a materialize() result."""
    mat = next(e for e in result.get_asset_materialization_events()
               if e.asset_key.to_user_string() == name).materialization
    return result.output_for_node(name), mat.tags["dagster/data_version"], mat.metadata


def run(assets, resources: dict, config: dict | None = None):
    result = materialize(assets, resources=resources, run_config={"ops": config or {}})
    assert result.success
    return result


def test_a_staged_folder_is_committed_under_its_content_hash_with_mlflow_links(resources, tmp_path):
    CALLS.clear()
    value, version, meta = materialized(run([notes], resources), "notes")
    final = Path(value["path"]).parent
    assert final == tmp_path / "root" / "notes" / version
    assert version == stable_hash({"notes.txt": manifest_of_dir(final)["notes.txt"]})[:16] == value["version"]
    assert sorted(p.name for p in final.iterdir()) == ["notes.txt", "timings.json"]
    assert [p.name for p in (tmp_path / "root" / "notes").iterdir()] == [version]  # no staging folder left
    assert meta["chars"].value == 5 and meta["mlflow_run"].value.startswith("http://mlflow.test/#/experiments/")
    client = resources["mlflow"].client()
    child = client.get_run(meta["mlflow_run_id"].value)
    assert child.info.status == "FINISHED" and child.data.metrics["chars"] == 5.0
    assert child.data.params["text"] == "hello" and child.data.tags["input.upstream"] == "up-1"
    assert child.data.tags["extra"] == "yes" and "input.unused" not in child.data.tags
    assert {a.path for a in client.list_artifacts(child.info.run_id)} == {"notes.txt", "kiln_output.json"}


def test_the_same_config_and_inputs_reuse_the_recorded_output_and_a_new_config_does_not(resources):
    CALLS.clear()
    first = materialized(run([notes], resources), "notes")
    again = materialized(run([notes], resources), "notes")
    assert CALLS == ["notes"]
    assert again[0] == first[0] and again[1] == first[1]
    assert again[2]["reused_mlflow_run_id"].value == first[2]["mlflow_run_id"].value
    changed = materialized(run([notes], resources, {"notes": {"config": {"text": "other"}}}), "notes")
    assert CALLS == ["notes", "notes"] and changed[1] != first[1]


class SourceConfig(Config):
    text: str = "a"


@asset(code_version="1")
def source(context: AssetExecutionContext, config: SourceConfig, mlflow: MlflowResource) -> Output[dict]:
    """A plain value versioned by its config: the upstream of derived."""
    with asset_output(context, mlflow, config=config) as out:
        if out.reused:
            return out.reused
        version = stable_hash(config.text)[:16]
        return out.result({"text": config.text, "version": version}, version=version)


@asset(code_version="1")
def derived(context: AssetExecutionContext, source: dict, mlflow: MlflowResource) -> Output[dict]:
    """Reads source: reused while source's data version stays, recomputed when it moves."""
    with asset_output(context, mlflow, inputs={"source": source}) as out:
        if out.reused:
            return out.reused
        CALLS.append("derived")
        text = source["text"] * 2
        return out.result({"text": text, "version": stable_hash(text)[:16]}, version=stable_hash(text)[:16])


def test_an_upstream_data_version_change_recomputes_and_the_same_one_reuses(resources):
    CALLS.clear()
    first = materialized(run([source, derived], resources), "derived")
    again = materialized(run([source, derived], resources), "derived")
    assert CALLS == ["derived"] and again[1] == first[1]  # the same input version: the recorded output
    moved = materialized(run([source, derived], resources, {"source": {"config": {"text": "b"}}}), "derived")
    assert CALLS == ["derived", "derived"] and moved[0]["text"] == "bb" and moved[1] != first[1]
    assert resources["mlflow"].client().get_run(moved[2]["mlflow_run_id"].value).data.tags["input.source"] == \
        stable_hash("b")[:16]


def test_volatile_files_do_not_move_the_version(resources):
    resources["mlflow"] = resources["mlflow"].model_copy(update={"reuse_runs": False})
    CALLS.clear()
    slow = materialized(run([notes], resources, {"notes": {"config": {"took_s": 9.5}}}), "notes")
    fast = materialized(run([notes], resources, {"notes": {"config": {"took_s": 0.1}}}), "notes")
    assert CALLS == ["notes", "notes"] and slow[1] == fast[1]
    assert json.loads((Path(slow[0]["path"]).parent / "timings.json").read_text()) == {"took_s": 9.5}  # first kept


def test_a_plain_value_takes_the_given_version_and_is_reused(resources):
    CALLS.clear()
    value, version, meta = materialized(run([summary], resources), "summary")
    assert value == {"params": 123, "why": "fits"} and version == stable_hash(value)[:16]
    assert "mlflow_run" in meta
    assert materialized(run([summary], resources), "summary")[1] == version and CALLS == ["summary"]


def test_a_keyed_folder_and_an_untracked_asset(resources, tmp_path):
    value, version, meta = materialized(run([keyed, untracked], resources), "keyed")
    assert value["dir"] == str(tmp_path / "root" / "keyed" / "key123")
    assert version == content_version(Path(value["dir"])) and "mlflow_run" in meta
    value, version, meta = materialized(run([untracked], resources), "untracked")
    assert Path(value["path"]).parent == tmp_path / "root" / "untracked" / "step_0000010" / version
    assert meta["step"].value == 10 and not {"mlflow_run", "mlflow_run_id"} & set(meta)


def test_a_failing_body_leaves_no_staging_folder_and_a_failed_run(resources, tmp_path):
    result = materialize([broken], resources=resources, raise_on_error=False)
    assert not result.success
    assert list((tmp_path / "root" / "broken").iterdir()) == []
    client = resources["mlflow"].client()
    exp = client.get_experiment_by_name("kiln")
    runs = client.search_runs([exp.experiment_id], "tags.`dagster.asset_key` = 'broken'")
    assert [r.info.status for r in runs] == ["FAILED"]


def test_misuse_says_what_to_do(tmp_path):
    out = AssetOutput(None, None, None)
    with pytest.raises(RuntimeError, match="return out.reused first"):
        out.stage
    with pytest.raises(ValueError, match="commit\\(\\) the staged folder or pass version="):
        out.result({})
    staged = tmp_path / "s"
    staged.mkdir()
    (staged / "a.txt").write_text("a")
    (staged / "t.json").write_text("1")
    version = content_version(staged, ("t.json",))
    assert commit_output(staged, tmp_path / "p", ("t.json",)) == (tmp_path / "p" / version, version)


# ---- a config error is not retried --------------------------------------------------------------------------

ATTEMPTS: list[str] = []


def _retried_asset(error: Exception):
    from dagster import RetryPolicy

    @asset(name="retried", retry_policy=RetryPolicy(max_retries=2))
    def retried(context: AssetExecutionContext) -> Output[dict]:
        with asset_output(context, None) as out:
            ATTEMPTS.append(type(error).__name__)
            raise error
        return out  # pragma: no cover

    return retried


def test_a_config_error_fails_at_once_and_other_errors_are_retried():
    from kiln.common.config import ConfigError
    from kiln.plan.memory import PlanError

    for error, attempts in ((ConfigError("clean.min_wrds: unknown key"), 1), (PlanError("does not fit"), 1),
                            (RuntimeError("disk hiccup"), 3)):
        ATTEMPTS.clear()
        result = materialize([_retried_asset(error)], raise_on_error=False)
        assert not result.success and ATTEMPTS == [type(error).__name__] * attempts
        failure = [ev for ev in result.all_events if ev.is_step_failure][0].event_specific_data.error
        if attempts == 1:  # a dagster.Failure naming the error, which stays its cause
            assert failure.message.startswith(f"dagster._core.definitions.events.Failure: {type(error).__name__}: {error}")
            assert failure.cause.cls_name == type(error).__name__


def test_a_checkpoint_found_damaged_while_read_is_set_aside_and_fails_once_naming_it(tmp_path):
    """A reader's own check (a checkpoint's checksum) finding damage is not a dead end: the file is set aside, so
    the next run's reuse check of the output holding it finds it missing and recomputes it (output_problem)."""
    import torch
    from dagster import Failure

    from assets._common import failing_on_damage
    from kiln.train.checkpoint import load_state, save_checkpoint
    from resources.tracking import output_problem, output_witnesses

    ckpt = save_checkpoint(tmp_path / "checkpoints", 10, {"model": {"w": torch.arange(64.0)}, "step": 10},
                           {"model": {}})
    value = {"checkpoint": str(ckpt)}
    recorded = {"value": value, "witnesses": output_witnesses(value)}
    state = ckpt / "state.pt"
    data = bytearray(state.read_bytes())
    data[-100] ^= 0xFF  # size and time kept: the quick reuse check passes, the reader's checksum does not
    st = state.stat()
    state.write_bytes(bytes(data))
    os.utime(state, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert output_problem(recorded) is None
    with pytest.raises(Failure) as failed, failing_on_damage():
        load_state(ckpt)
    description = failed.value.description
    assert description.startswith(f"DamagedCheckpointError: {state}: checksum mismatch (expected ")
    assert description.endswith("; set aside as .state.pt.damaged: run again, and the output that holds it is "
                                 "recomputed (training resumes from its newest good checkpoint)")
    assert not failed.value.allow_retries and (ckpt / ".state.pt.damaged").read_bytes() == bytes(data)
    assert output_problem(recorded) == f"{state} is missing"  # so the next run recomputes it


def test_a_damaged_token_shard_is_found_before_a_launch_set_aside_and_named(tmp_path):
    """TrainingLaunch.verify_shards hashes every shard in full before the job starts: a shard whose bytes changed
    with its size and time kept fails the step once, set aside, so the next run recomputes the token shards."""
    from types import SimpleNamespace

    import numpy as np
    from dagster import Failure

    from kiln.tokens.shards import MANIFEST, _write_shard, check_shard_files
    from resources.torchrun import TrainingLaunch

    entry = _write_shard(tmp_path / "train_000000.bin", np.arange(1, 3000, dtype=np.uint16), np.dtype("<u2"), 0)
    (tmp_path / MANIFEST).write_text(json.dumps({"dtype": "uint16", "vocab_size": 4096,
                                                 "shards": [{"file": "train_000000.bin", "split": "train", **entry}]}))
    shard = tmp_path / "train_000000.bin"
    check_shard_files([shard])
    logged: list[str] = []
    launch = TrainingLaunch.__new__(TrainingLaunch)
    launch.context = SimpleNamespace(log=SimpleNamespace(info=logged.append))
    launch.verify_shards({"train_files": [str(shard)], "val_files": []})
    assert logged[0].startswith("verified 1 token shards (0.0 MB) by sha256 in ")
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[2000] ^= 0x01
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(Failure) as failed:
        launch.verify_shards({"train_files": [str(shard)], "val_files": []})
    assert f"DamagedShardError: shard {shard}: checksum mismatch" in failed.value.description
    assert "set aside as .train_000000.bin.damaged" in failed.value.description
    assert not shard.exists() and (tmp_path / ".train_000000.bin.damaged").read_bytes() == bytes(data)
