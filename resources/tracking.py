"""MLflow tracking: one parent run per Dagster run, one child run per asset materialization, and run reuse.

Assets open their child run through assets._common.asset_output; set ``resources.mlflow.config.tracking_uri`` to share a server.
A recorded output is reused only while its files match the witnesses recorded with it.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from dagster import ConfigurableResource, Failure, RetryRequested
from pydantic import Field

from kiln.common.files import stable_hash
from kiln.common.metrics import MetricLogger


class MlflowResource(ConfigurableResource):
    """Tracks every asset materialization as an MLflow run nested under its Dagster run."""

    tracking_uri: str = Field(default="sqlite:///.kiln/mlflow.db", description="MLflow tracking URI (sqlite file, or an http:// server).")
    artifact_root: str = Field(default=".kiln/mlartifacts", description="Artifact folder for a new experiment with a local (sqlite) store; with an http(s) server the server's artifact store is used.")
    experiment: str = Field(default="kiln", description="MLflow experiment name.")
    ui_url: str = Field(default="http://127.0.0.1:5000", description="Base URL of the MLflow UI, for links in asset metadata.")
    reuse_runs: bool = Field(default=True, description="Reuse the outputs of a finished run whose reuse key (code version, config, input data versions) matches instead of recomputing.")

    def resolved_uri(self) -> str:
        if self.tracking_uri.startswith("sqlite:///") and not self.tracking_uri.startswith("sqlite:////"):
            path = Path(self.tracking_uri[len("sqlite:///"):]).resolve()
            path.parent.mkdir(parents=True, exist_ok=True)
            return f"sqlite:///{path}"
        return self.tracking_uri

    def is_server(self) -> bool:
        return self.tracking_uri.startswith(("http://", "https://", "databricks"))

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.resolved_uri())

    def experiment_id(self, client) -> str:
        """The experiment's id, created on first use; tagged as model training (EXPERIMENT_KIND), so MLflow's UI
        opens it on runs, metrics and charts rather than in its GenAI mode on (empty) traces."""
        exp = client.get_experiment_by_name(self.experiment)
        if exp is not None:
            if exp.tags.get(EXPERIMENT_KIND[0]) is None:  # made before the tag: tagged now
                client.set_experiment_tag(exp.experiment_id, *EXPERIMENT_KIND)
            self.relocate(exp.artifact_location)
            return exp.experiment_id
        location = None
        if not self.is_server():  # a tracking server keeps artifacts in its own store, reachable by every machine
            root = Path(self.artifact_root).expanduser().resolve()
            root.mkdir(parents=True, exist_ok=True)
            location = root.as_uri()
        try:
            return client.create_experiment(self.experiment, artifact_location=location, tags=dict([EXPERIMENT_KIND]))
        except Exception:  # created concurrently by another process
            return client.get_experiment_by_name(self.experiment).experiment_id

    def relocate(self, location: str) -> None:
        """A home that was copied or moved keeps an mlflow.db whose artifact folders are the old home's: new runs
        would write there, and the registry would point there. When this home's own sqlite store names another
        artifact root, every such location in it (experiments, runs, model versions) is moved under this home's.
        MLflow has no call to change an experiment's artifact location, so this updates its tables directly; only a
        store that sits in the home beside its artifact root is touched (a shared store is never rewritten)."""
        import sqlite3

        uri = self.resolved_uri()
        if self.is_server() or not uri.startswith("sqlite:///") or not location.startswith("file://"):
            return
        from urllib.parse import unquote, urlparse

        db = Path(uri.removeprefix("sqlite:///"))
        root = Path(self.artifact_root).expanduser().resolve()
        old_uri, new_uri = location.rstrip("/"), root.as_uri()
        old = unquote(urlparse(old_uri).path)
        if old == str(root) or db.parent != root.parent:
            return
        pairs = [(old_uri + "/", new_uri + "/"), (old + "/", str(root) + "/")]  # URIs, and plain paths
        with contextlib.closing(sqlite3.connect(db)) as con, con:
            con.execute("UPDATE experiments SET artifact_location = ? WHERE artifact_location IN (?, ?)",
                        (new_uri, old_uri, old_uri + "/"))
            for a, b in pairs:
                con.execute("UPDATE runs SET artifact_uri = replace(artifact_uri, ?, ?)", (a, b))
                con.execute("UPDATE model_versions SET source = replace(source, ?, ?), "
                            "storage_location = replace(storage_location, ?, ?)", (a, b, a, b))

    def run_url(self, experiment_id: str, run_id: str) -> str:
        return f"{self.ui_url.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"

    def parent_run(self, client, experiment_id: str, dagster_run_id: str, job_name: str) -> str:
        found = client.search_runs([experiment_id], f"tags.`dagster.run_id` = '{dagster_run_id}' and tags.`kiln.kind` = 'dagster_run'", max_results=1)
        if found:
            return found[0].info.run_id
        run = client.create_run(experiment_id, tags={"dagster.run_id": dagster_run_id, "kiln.kind": "dagster_run",
                                                     "dagster.job": job_name, "mlflow.runName": f"dagster {dagster_run_id[:8]}"})
        return run.info.run_id

    def reuse_key(self, context, reuse: dict[str, Any]) -> str:
        """Hash of the asset key, its code version, and what the caller says determines its output. Where the home
        is does not count: a copied or moved home finds its records, whose paths are moved with it (relocated)."""
        asset = context.asset_key.to_user_string()
        return stable_hash({"asset": asset, "code_version": asset_code_version(context), **reuse})[:32]

    def find_reusable(self, client, experiment_id: str, asset: str, key: str,
                      log=None, set_aside: bool = True, root: str | None = None,
                      full: bool = False) -> tuple[str, dict[str, Any]] | None:
        """(run id, recorded output) of the newest finished run of ``asset`` with this reuse key whose files are
        intact (output_problem); ``log`` is told which file failed for a run passed over. ``set_aside=False``
        only looks (``kiln status``): a damaged file is named but left where it is. ``root``: this home's storage
        root; an output recorded under another root has its paths moved to this one (a copied or moved home), and
        is reused only where its files are here. ``full``: hash every file (output_problem)."""
        runs = client.search_runs([experiment_id], f"tags.`kiln.reuse_key` = '{key}' and tags.`dagster.asset_key` = '{asset}' "
                                  "and attributes.status = 'FINISHED' and tags.`kiln.output_recorded` = 'true'",
                                  order_by=["attributes.start_time DESC"], max_results=5)
        said: set[str] = set()  # earlier runs often recorded the same files: each problem is told once
        for r in runs:
            recorded = self.read_record(client, r)
            if recorded is None:
                continue
            recorded, moved_from = relocated(recorded, root)
            problem = output_problem(recorded, set_aside, full)
            if problem is not None and moved_from is not None and problem.endswith(" is missing"):
                # a copied home without this output's files; a file that is here but damaged keeps its own reason
                problem = (f"it was computed in the home whose storage is {moved_from}, and its files are not here "
                           f"({problem})")
            if problem is None:
                return r.info.run_id, recorded
            if log is not None and problem not in said:
                said.add(problem)
                log(f"{asset}: not reusing the output of MLflow run {r.info.run_id} (same inputs, config and code): "
                    f"{problem}. Recomputing it (a training run resumes from its newest good checkpoint).")
        return None

    def read_record(self, client, run) -> dict[str, Any] | None:
        """The output recorded by MLflow run ``run``, or None. A home that was moved keeps its artifacts under its new
        artifact root, while the run still names the old folder: the record is read from the new one then."""
        try:
            with tempfile.TemporaryDirectory() as tmp:
                return json.loads(Path(client.download_artifacts(run.info.run_id, OUTPUT_ARTIFACT, tmp)).read_text())
        except Exception:
            pass
        uri = run.info.artifact_uri or ""
        if self.is_server() or not uri.startswith("file://"):
            return None
        old = Path(uri.removeprefix("file://"))  # <old artifact root>/<run id>/artifacts (experiment_id's layout)
        here = Path(self.artifact_root).expanduser().resolve() / Path(*old.parts[-2:]) / OUTPUT_ARTIFACT
        try:
            return json.loads(here.read_text())
        except (OSError, ValueError):
            return None

    @contextlib.contextmanager
    def asset_run(self, context, params: dict[str, Any] | None = None, tags: dict[str, Any] | None = None,
                  reuse: dict[str, Any] | None = None) -> Iterator["AssetRun"]:
        """Open a child run for the asset being materialized; it ends FINISHED or FAILED with the step.

        With ``reuse`` (the config and input data versions that determine the output), a finished run with
        the same reuse key is looked up first: if found, ``handle.reused`` holds its Output to return.
        """
        client = self.client()
        exp = self.experiment_id(client)
        dagster_run_id, job_name = run_identity(context)
        parent = self.parent_run(client, exp, dagster_run_id, job_name)
        asset = context.asset_key.to_user_string()
        key = self.reuse_key(context, reuse) if reuse is not None else ""
        root = storage_root(context)
        found = None
        if key and self.reuse_runs:
            found = self.find_reusable(client, exp, asset, key, context.log.warning, root=root)
        run_tags = {"mlflow.parentRunId": parent, "dagster.run_id": dagster_run_id, "dagster.asset_key": asset,
                    "kiln.kind": "asset", "mlflow.runName": asset, **{k: str(v) for k, v in (tags or {}).items()}}
        if key:
            run_tags["kiln.reuse_key"] = key
        if (code_version := asset_code_version(context)) is not None:
            run_tags["dagster.code_version"] = str(code_version)  # kiln status: an attempt of other code is not resumed
        if found:
            run_tags["kiln.reused_from"] = found[0]
        run = client.create_run(exp, tags=run_tags)
        handle = AssetRun(self, client, exp, run.info.run_id, parent, root)
        if found:
            context.log.info(f"{asset}: inputs, config and code unchanged since MLflow run {found[0]}; reusing its output")
            handle.reused = reused_output(found[1], self.run_url(exp, found[0]), found[0])
        if params:
            handle.logger.log_params(params)
        client.update_run(parent, "RUNNING")
        status = "FAILED"
        try:
            yield handle
            status = "FINISHED"
        except RetryRequested:  # preempted (resources.torchrun.Preempted): stopped with its work saved, not failed
            status = "KILLED"
            handle.logger.set_tags({"kiln.outcome": "preempted"})
            raise
        except Failure as e:  # interrupted by the user (resources.torchrun.Stopped): saved, stopped, not retried
            if getattr(e, "stopped", False):
                status = "KILLED"
                handle.logger.set_tags({"kiln.outcome": "stopped"})
            raise
        finally:
            handle.logger.flush()
            client.set_terminated(run.info.run_id, status)
            client.set_terminated(parent, status, end_time=int(time.time() * 1000))


def asset_code_version(context) -> str | None:
    """The code version of the asset ``context`` materializes (None outside an asset, or for one without): part of
    its reuse key and of its run folder's name, so that a new code version neither reuses nor resumes old runs."""
    try:
        return context.assets_def.specs_by_key[context.asset_key].code_version
    except Exception:
        return None


def run_identity(context) -> tuple[str, str]:
    """(Dagster run id, job name); a directly invoked asset (tests, notebooks) has neither, so it gets a fresh id."""
    try:
        return context.run.run_id, context.run.job_name
    except Exception:  # DagsterInvalidPropertyError outside a run
        import uuid

        return f"direct-{uuid.uuid4().hex[:12]}", "direct_invocation"


# the experiment tag MLflow 3's UI reads to choose its layout (an untagged experiment may open in GenAI mode)
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
OUTPUT_ARTIFACT = "kiln_output.json"
PATH_KEYS = ("path", "dir", "checkpoint", "removed")


def output_paths(value: Any) -> list[str]:
    """Files and folders an output handle points to (checked before a recorded output is reused)."""
    if not isinstance(value, dict):
        return []
    return [v for k, v in value.items() if k in PATH_KEYS and isinstance(v, str) and v.startswith("/")]


def output_witnesses(value: Any) -> dict[str, dict[str, Any]]:
    """{path: witness} of the files and folders an output points to, recorded with it: a checkpoint by the checksums
    in its meta.json (nothing is read again), anything else by hashing it; a path inside another one is covered by
    that one's witness."""
    from kiln.common.files import witness
    from kiln.train.checkpoint import checkpoint_witness

    paths = sorted({p for p in output_paths(value) if Path(p).exists()})
    out = {}
    for p in paths:
        if any(p.startswith(other.rstrip("/") + "/") for other in paths if other != p):
            continue
        out[p] = checkpoint_witness(Path(p)) or witness(p)
    return out


def output_problem(recorded: dict[str, Any], set_aside_damaged: bool = True, full: bool = False) -> str | None:
    """None when the files of a recorded output are intact, else what is wrong, naming the file: each file whose size
    or time changed is hashed against its witness. A damaged file (not a checkpoint's: training skips and rewrites
    those) is set aside, so that recomputing the output writes it again (kiln.common.files.commit_dir). An output
    recorded without witnesses has its checkpoints checked against their checksums. ``full``: every file is hashed,
    whatever its size and time (kiln verify, kiln status --verify)."""
    from kiln.common.files import check_witness, set_aside

    paths = output_paths(recorded["value"])
    for p in paths:
        if not Path(p).exists():
            return f"{p} is missing"
    witnesses = recorded.get("witnesses")
    if witnesses is None:
        return _checkpoint_problem(paths)
    for p, w in witnesses.items():
        found = check_witness(p, w, full)
        if found is None:
            continue
        bad, problem = found
        if set_aside_damaged and not w.get("checkpoint") and bad.is_file():
            problem += f"; set aside as {set_aside(bad).name}"
        return problem
    return None


def _checkpoint_problem(paths: list[str]) -> str | None:
    from kiln.train.checkpoint import CheckpointError, checkpoint_witness, verify_checkpoint

    for p in (p for p in paths if checkpoint_witness(Path(p)) is not None):
        try:
            verify_checkpoint(Path(p))
        except CheckpointError as e:
            return str(e)
    return None


def storage_root(context) -> str | None:
    """The storage root of the run's KilnStorageResource (outputs are paths under it), or None."""
    try:
        return str(Path(context.resources.storage.root).resolve())
    except Exception:
        return None


def relocated(recorded: dict[str, Any], root: str | None) -> tuple[dict[str, Any], str | None]:
    """(``recorded`` with every path under the storage root it was recorded under moved under ``root``, that old
    root, or None when nothing moved): the record of a home that was copied or moved, read in its new place."""
    old = recorded.get("storage_root")
    if not old or not root or old == root:
        return recorded, None
    old, root = old.rstrip("/"), root.rstrip("/")

    def move(v: Any) -> Any:
        if isinstance(v, str):
            return root + v[len(old):] if v == old or v.startswith(old + "/") else v.replace(old + "/", root + "/")
        if isinstance(v, dict):
            return {move(k): move(x) for k, x in v.items()}
        if isinstance(v, list):
            return [move(x) for x in v]
        return v

    return {**move({k: v for k, v in recorded.items() if k != "storage_root"}), "storage_root": root}, old


def reused_output(recorded: dict[str, Any], url: str, run_id: str):
    """The Output of a recorded earlier run: its value, data version and the metadata it showed (tables, plots,
    links; outputs recorded before that kept only their numbers and strings), with where it was reused from."""
    from dagster import DataVersion, MetadataValue, Output, deserialize_value

    meta = dict(recorded.get("metadata", {}))
    if recorded.get("metadata_serdes"):
        meta.update(deserialize_value(recorded["metadata_serdes"]))
    meta.update({"reused_from_mlflow_run": MetadataValue.url(url), "reused_mlflow_run_id": run_id})
    return Output(recorded["value"], data_version=DataVersion(recorded["data_version"]), metadata=rounded(meta))


def storable_metadata(metadata: dict[str, Any]) -> str:
    """``metadata`` (MetadataValues, numbers, strings) in Dagster's serialized form, for reuse to show it again; an
    entry Dagster cannot serialize is left out."""
    from dagster import serialize_value

    keep = {}
    for k, v in metadata.items():
        try:
            serialize_value(v)
        except Exception:  # noqa: BLE001 - a value of a type serdes does not know: shown only when computed
            continue
        keep[k] = v
    return serialize_value(keep)


def rounded(metadata: dict[str, Any], digits: int = 4) -> dict[str, Any]:
    """The metadata with each plain float to ``digits`` significant digits, as people read it (a loss 4.814, not
    4.814364790916443); the asset's value keeps full precision, so do MLflow's metrics."""
    from dagster import FloatMetadataValue

    def one(v: Any) -> Any:
        if isinstance(v, FloatMetadataValue) and v.value is not None:
            return float(f"{v.value:.{digits}g}")
        return float(f"{v:.{digits}g}") if isinstance(v, float) else v

    return {k: one(v) for k, v in metadata.items()}


class AssetRun:
    """A child MLflow run: its id, URL, a batched metric logger, artifact upload, and output recording."""

    def __init__(self, resource: MlflowResource, client, experiment_id: str, run_id: str, parent_id: str,
                 storage_root: str | None = None):
        self.client, self.experiment_id, self.run_id, self.parent_id = client, experiment_id, run_id, parent_id
        self.storage_root = storage_root  # recorded with each output, whose paths are under it
        self.tracking_uri = resource.resolved_uri()
        self.url = resource.run_url(experiment_id, run_id)
        self.logger = MetricLogger(self.tracking_uri, run_id)
        self.reused = None  # the Output of an earlier identical run, when one can be reused

    def output(self, value: Any, data_version: str, metadata: dict[str, Any]):
        """The asset's Output, with the handle recorded in MLflow so an identical later run can reuse it: the value,
        and a witness of each file or folder it points to (output_witnesses) to check that run's files against."""
        from dagster import DataVersion, Output

        metadata = rounded(metadata)
        plain = {k: v for k, v in metadata.items() if isinstance(v, (int, float, str, bool))}
        record = {"value": value, "data_version": data_version, "metadata": plain,
                  "metadata_serdes": storable_metadata(metadata), "witnesses": output_witnesses(value),
                  "storage_root": self.storage_root}
        self.client.log_text(self.run_id, json.dumps(record, default=str), OUTPUT_ARTIFACT)
        self.logger.set_tags({"kiln.output_recorded": "true", "kiln.data_version": data_version})
        return Output(value, data_version=DataVersion(data_version), metadata=metadata)

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        self.logger.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.logger.set_tags(tags)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def system_peaks(self) -> dict[str, float]:
        """{metric: highest value} of the run's MLflow system metrics (``system/*``: CPU, memory, GPU utilisation,
        memory, temperature, power), {} when none were logged; Kiln's own operations figures there are not peaks."""
        from kiln.common.metrics import OPERATIONS_PREFIX

        keys = [k for k in self.client.get_run(self.run_id).data.metrics
                if k.startswith("system/") and not k.startswith(OPERATIONS_PREFIX)]
        return {k.removeprefix("system/"): max(m.value for m in self.client.get_metric_history(self.run_id, k))
                for k in keys}
