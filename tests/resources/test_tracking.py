"""MLflow tracking against a real ``mlflow server`` over HTTP (the multi-machine setup): runs nest under their
Dagster run with their metrics, artifacts go through the server, and a rerun reuses the recorded output
once its files check out (a damaged checkpoint or file is named and recomputed).
"""

import logging
import os
from pathlib import Path

import pytest
import torch
from dagster import AssetExecutionContext, DagsterInstance, Output, asset, materialize

from kiln.common.files import commit_dir, manifest_of_dir, sha256_bytes, stable_hash, staging_dir
from kiln.train.checkpoint import checkpoint_identity, save_checkpoint, verify_checkpoint
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource
from mlflow_server import running_server


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real tracking server on 127.0.0.1 with its own sqlite store and proxied artifact store."""
    root = tmp_path_factory.mktemp("mlflow-server")
    with running_server(root) as url:
        yield url, root


def _resource(url: str, tmp_path: Path) -> MlflowResource:
    return MlflowResource(tracking_uri=url, artifact_root=str(tmp_path / "never-used"), experiment="kiln-server-test",
                          ui_url=url)


def test_asset_runs_metrics_and_artifacts_go_through_the_server_and_a_rerun_is_reused(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    url, server_root = mlflow_server
    calls = []

    @asset(code_version="1")
    def summary(context: AssetExecutionContext, mlflow: MlflowResource) -> Output[dict]:
        with mlflow.asset_run(context, params={"size": 3}, reuse={"size": 3}) as run:
            if run.reused is not None:
                return run.reused
            calls.append(1)
            out = tmp_path / "summary.txt"
            out.write_text("three\n")
            for step in range(5):
                run.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
            run.log_artifact(out)
            return run.output({"path": str(out)}, "v1", {"lines": 1})

    res = _resource(url, tmp_path)
    first = materialize([summary], resources={"mlflow": res})
    assert first.success and calls == [1]
    client = MlflowClient(url)
    exp = client.get_experiment_by_name("kiln-server-test")
    # the server owns the artifact store: nothing is written under the client's local artifact_root
    assert exp.artifact_location.startswith("mlflow-artifacts:")
    assert not (tmp_path / "never-used").exists()
    child = client.search_runs([exp.experiment_id], "tags.`kiln.kind` = 'asset'")
    assert len(child) == 1 and child[0].info.status == "FINISHED"
    parent = client.get_run(child[0].data.tags["mlflow.parentRunId"])
    assert parent.data.tags["dagster.run_id"] == first.run_id and parent.info.status == "FINISHED"
    history = client.get_metric_history(child[0].info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(s, 1.0 / (s + 1)) for s in range(5)]
    assert child[0].data.params["size"] == "3"
    names = {a.path for a in client.list_artifacts(child[0].info.run_id)}
    assert {"summary.txt", "kiln_output.json"} <= names
    stored = list((server_root / "artifacts").rglob("summary.txt"))
    assert len(stored) == 1 and stored[0].read_text() == "three\n"
    # the same inputs, config and code: the recorded output is found through the server and reused
    second = materialize([summary], resources={"mlflow": res})
    assert second.success and calls == [1]
    reused = client.search_runs([exp.experiment_id], f"tags.`dagster.run_id` = '{second.run_id}' and tags.`kiln.kind` = 'asset'")
    assert reused[0].data.tags["kiln.reused_from"] == child[0].info.run_id


# -- reuse checks the recorded files first (in-process, a sqlite store)

REUSE_CALLS: list[str] = []


@asset(code_version="1")
def trained_ckpt(context: AssetExecutionContext, storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """A checkpoint in a run folder keyed by the inputs, as a training asset's output."""
    with mlflow.asset_run(context, reuse={"steps": 2}) as run:
        if run.reused is not None:
            return run.reused
        REUSE_CALLS.append("trained_ckpt")
        ckpt = save_checkpoint(storage.path("trained", "key1", "checkpoints"), 2, {"w": torch.arange(4096.0)}, {})
        return run.output({"checkpoint": str(ckpt), "out_dir": str(storage.path("trained", "key1"))},
                          checkpoint_identity(ckpt), {})


@asset(code_version="1")
def committed(context: AssetExecutionContext, storage: KilnStorageResource, mlflow: MlflowResource) -> Output[dict]:
    """A folder committed under its content hash; the value points to the folder and to a file in it."""
    with mlflow.asset_run(context, reuse={"n": 3}) as run:
        if run.reused is not None:
            return run.reused
        REUSE_CALLS.append("committed")
        with staging_dir(storage.path("committed")) as stage:
            (stage / "sub").mkdir()
            (stage / "table.txt").write_text("x" * 5000)
            (stage / "sub" / "notes.txt").write_text("three\n")
            version = stable_hash(manifest_of_dir(stage))[:16]
            final = commit_dir(stage, storage.path("committed") / version)
        return run.output({"dir": str(final), "path": str(final / "table.txt"), "version": version}, version, {})


@pytest.fixture
def local_resources(tmp_path: Path) -> dict:
    return {"storage": KilnStorageResource(root=str(tmp_path / "storage")),
            "mlflow": MlflowResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=str(tmp_path / "art"),
                                     experiment="reuse-checks")}


def materialize_logged(assets, resources: dict) -> tuple[dict, list[str]]:
    """({asset: value}, the run's warnings) of one in-process materialization."""
    instance = DagsterInstance.ephemeral()
    result = materialize(assets, resources=resources, instance=instance)
    assert result.success
    warnings = [e.user_message for e in instance.all_logs(result.run_id) if e.level == logging.WARNING]
    return {a.key.to_user_string(): result.output_for_node(a.key.to_user_string()) for a in assets}, warnings


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_damaged_checkpoint_is_not_reused_and_its_file_is_named(local_resources):
    REUSE_CALLS.clear()
    first, _ = materialize_logged([trained_ckpt], local_resources)
    state = Path(first["trained_ckpt"]["checkpoint"]) / "state.pt"
    again, warnings = materialize_logged([trained_ckpt], local_resources)
    assert REUSE_CALLS == ["trained_ckpt"] and again == first and not warnings  # intact: reused
    t = state.stat().st_mtime_ns + 10**9
    os.utime(state, ns=(t, t))  # touched, same bytes: hashed, found equal, still reused
    materialize_logged([trained_ckpt], local_resources)
    assert REUSE_CALLS == ["trained_ckpt"]

    flip_a_byte(state)  # damaged after its run finished
    redone, warnings = materialize_logged([trained_ckpt], local_resources)
    assert REUSE_CALLS == ["trained_ckpt", "trained_ckpt"]  # computed again, not reused
    [warning] = warnings
    assert f"{state}: checksum mismatch" in warning and "not reusing the output of MLflow run" in warning
    assert state.exists() and not (state.parent / ".state.pt.damaged").exists()  # training rewrites checkpoints
    assert verify_checkpoint(Path(redone["trained_ckpt"]["checkpoint"]))["step"] == 2
    materialize_logged([trained_ckpt], local_resources)
    assert REUSE_CALLS == ["trained_ckpt", "trained_ckpt"]  # the rewritten checkpoint is reused again


def test_a_damaged_or_missing_file_of_a_committed_folder_is_named_and_the_recompute_restores_it(local_resources):
    REUSE_CALLS.clear()
    first, _ = materialize_logged([committed], local_resources)
    folder = Path(first["committed"]["dir"])
    materialize_logged([committed], local_resources)
    assert REUSE_CALLS == ["committed"]

    (folder / "table.txt").write_text("y" * 5000)  # same size, other bytes
    redone, warnings = materialize_logged([committed], local_resources)
    assert REUSE_CALLS == ["committed", "committed"] and redone == first
    [warning] = warnings
    assert f"{folder / 'table.txt'}: checksum mismatch" in warning and "set aside as .table.txt.damaged" in warning
    assert (folder / "table.txt").read_text() == "x" * 5000  # the recompute filled the file in again
    assert manifest_of_dir(folder) == {"sub/notes.txt": {"bytes": 6, "sha256": sha256_bytes(b"three\n")},
                                       "table.txt": {"bytes": 5000, "sha256": sha256_bytes(b"x" * 5000)}}

    (folder / "sub" / "notes.txt").unlink()
    _, warnings = materialize_logged([committed], local_resources)
    assert REUSE_CALLS == ["committed"] * 3
    assert [f"{folder / 'sub' / 'notes.txt'} is missing" in w for w in warnings] == [True]
    assert (folder / "sub" / "notes.txt").read_text() == "three\n"
    _, warnings = materialize_logged([committed], local_resources)
    assert REUSE_CALLS == ["committed"] * 3 and not warnings  # whole again: reused


def test_an_output_recorded_without_witnesses_still_has_its_checkpoint_verified(tmp_path):
    from resources.tracking import output_problem, output_witnesses

    ckpt = save_checkpoint(tmp_path / "checkpoints", 3, {"w": torch.arange(64.0)}, {})
    value = {"checkpoint": str(ckpt), "path": str(tmp_path / "gone.json")}
    assert output_problem({"value": value}) == f"{tmp_path / 'gone.json'} is missing"
    del value["path"]
    assert output_problem({"value": value}) is None  # recorded before witnesses were: checked by its checksums
    assert output_witnesses(value)[str(ckpt)]["checkpoint"] is True
    flip_a_byte(ckpt / "state.pt")
    assert output_problem({"value": value}).startswith(f"{ckpt / 'state.pt'}: checksum mismatch")


def test_a_reused_materialization_shows_the_metadata_of_the_computed_one(tmp_path, local_resources) -> None:
    """Tables, plots, JSON, links and paths of an asset's page come back when a rerun reuses its output (not only
    its numbers and strings), with where it was reused from added."""
    from dagster import AssetKey, MetadataValue

    calls = []

    @asset(code_version="1")
    def report(context: AssetExecutionContext, mlflow: MlflowResource) -> Output[dict]:
        with mlflow.asset_run(context, params={"n": 2}, reuse={"n": 2}) as run:
            if run.reused is not None:
                return run.reused
            calls.append(1)
            return run.output({"n": 2}, "v2", {
                "rows": 2, "loss": 4.814364790916443, "why": "because",
                "table": MetadataValue.md("| a | b |\n|---|---|\n| 1 | 2 |"),
                "plot": MetadataValue.md("![loss](data:image/png;base64,iVBORw0KGgo=)"),
                "model": MetadataValue.json({"n_layer": 2, "family": "gpt2"}),
                "run": MetadataValue.url("http://127.0.0.1:5000/#/runs/x"), "folder": MetadataValue.path(str(tmp_path)),
            })

    instance = DagsterInstance.ephemeral()
    resources = local_resources
    pages = []
    for _ in range(2):
        assert materialize([report], resources=resources, instance=instance).success
        pages.append(instance.get_latest_materialization_event(AssetKey("report")).asset_materialization.metadata)
    assert calls == [1]  # the second was reused
    reused = {k: v for k, v in pages[1].items() if not k.startswith("reused_")}
    assert reused == pages[0] and {"reused_from_mlflow_run", "reused_mlflow_run_id"} <= set(pages[1])
    assert pages[1]["table"].value.startswith("| a | b |") and pages[1]["model"].value == {"n_layer": 2, "family": "gpt2"}
    assert pages[0]["loss"].value == pages[1]["loss"].value == 4.814 and pages[0]["rows"].value == 2  # rounded for people
    # the experiment opens in MLflow's model-training layout, not its GenAI one
    mlflow = resources["mlflow"]
    exp = mlflow.client().get_experiment_by_name(mlflow.experiment)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"


def test_a_copied_or_moved_home_reuses_its_outputs_with_their_paths_moved(tmp_path) -> None:
    """The reuse key does not hold where the home is: a copy (`cp -a`) and a move (`mv`) of a home find its records,
    whose paths (value, witnesses, metadata) are moved under the new storage root, and reuse them where the files are
    there; the home's MLflow store is pointed at its own artifact folder, so nothing is written into the old home."""
    import shutil

    from dagster import AssetKey, MetadataValue

    calls = []

    @asset(code_version="1")
    def notes(context: AssetExecutionContext, mlflow: MlflowResource, storage: KilnStorageResource) -> Output[dict]:
        with mlflow.asset_run(context, params={"n": 1}, reuse={"n": 1}) as run:
            if run.reused is not None:
                return run.reused
            calls.append(1)
            out = Path(storage.root) / "notes" / "notes.txt"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("kept\n")
            return run.output({"path": str(out)}, "n1", {"file": MetadataValue.path(str(out))})

    def home(root: Path) -> dict:
        return {"storage": KilnStorageResource(root=str(root / "storage")),
                "mlflow": MlflowResource(tracking_uri=f"sqlite:///{root / 'mlflow.db'}",
                                         artifact_root=str(root / "art"), experiment="moves")}

    def run_in(root: Path) -> tuple[dict, dict]:
        instance = DagsterInstance.ephemeral()
        result = materialize([notes], resources=home(root), instance=instance)
        assert result.success
        meta = instance.get_latest_materialization_event(AssetKey("notes")).asset_materialization.metadata
        return result.output_for_node("notes"), meta

    def files(root: Path) -> set[str]:
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}

    first, _ = run_in(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    before = files(tmp_path / "a")
    copied, meta = run_in(tmp_path / "b")
    assert calls == [1] and copied["path"] == str((tmp_path / "b" / "storage" / "notes" / "notes.txt").resolve())
    assert meta["file"].value == copied["path"] and "reused_from_mlflow_run" in meta
    assert files(tmp_path / "a") == before  # the copy wrote nothing into the original home
    mlflow = home(tmp_path / "b")["mlflow"]
    exp = mlflow.client().get_experiment_by_name("moves")
    assert exp.artifact_location == (tmp_path / "b" / "art").resolve().as_uri()  # its store points into itself
    shutil.copy(tmp_path / "a" / "mlflow.db", tmp_path / "db-only.db")
    shutil.move(str(tmp_path / "a"), str(tmp_path / "c"))  # the original home moved: its old folders are gone
    moved, _ = run_in(tmp_path / "c")
    assert calls == [1] and moved["path"].startswith(str((tmp_path / "c").resolve()))
    assert not (tmp_path / "a").exists()  # nothing written back where the home was
    (tmp_path / "d").mkdir()
    shutil.copy(tmp_path / "db-only.db", tmp_path / "d" / "mlflow.db")  # the records, but not the files
    fresh, _ = run_in(tmp_path / "d")
    assert calls == [1, 1] and fresh["path"].startswith(str((tmp_path / "d").resolve()))

    def why_not(root: Path) -> list[str]:
        """What find_reusable says of the moved home's record, looked at from the home at ``root``."""
        mlflow = home(root)["mlflow"]
        client = mlflow.client()
        exp = client.get_experiment_by_name("moves")
        run = client.search_runs([exp.experiment_id], "tags.`dagster.asset_key` = 'notes'", max_results=1)[0]
        said: list[str] = []
        found = mlflow.find_reusable(client, exp.experiment_id, "notes", run.data.tags["kiln.reuse_key"], said.append,
                                     set_aside=False, root=str((root / "storage").resolve()))
        assert found is None
        return said

    shutil.copytree(tmp_path / "c", tmp_path / "e")  # a copy whose file is there, but damaged: the damage is the reason
    (tmp_path / "e" / "storage" / "notes" / "notes.txt").write_text("kapt\n")  # 5 bytes, as recorded
    (said,) = set(why_not(tmp_path / "e"))
    assert "notes.txt: checksum mismatch" in said and "not here" not in said, said
    shutil.copytree(tmp_path / "c", tmp_path / "f")  # a copy without the file: it is not here
    (tmp_path / "f" / "storage" / "notes" / "notes.txt").unlink()
    (said,) = set(why_not(tmp_path / "f"))
    assert "and its files are not here (" in said and said.endswith("notes.txt is missing). Recomputing it (a training "
                                                                    "run resumes from its newest good checkpoint).")
