"""Launches Kiln training jobs with torchrun through Dagster Pipes: one process, several, or several nodes.

The same torchrun command also runs under Slurm (``launcher: slurm`` submits ``slurm_script``) and on Kubernetes
(``k8s_manifests``, or a pod spec for dagster-k8s's PipesK8sClient); kiln.train.cluster renders the command and
those files, and ``python deploy/render.py`` writes them.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Iterator

from dagster import (
    DagsterExecutionInterruptedError,
    Failure,
    PipesFileContextInjector,
    PipesFileMessageReader,
    PipesTempFileContextInjector,
    PipesTempFileMessageReader,
    RetryRequested,
    open_pipes_session,
)
from pydantic import Field

from kiln.common.config import Domain
from kiln.common.files import atomic_write_json, atomic_write_text, stable_hash
from kiln.common.metrics import SPOOL_ENV, SpoolForwarder, operations_metrics
from kiln.tokens.shards import check_shard_files
from kiln.train.checkpoint import checkpoint_identity
from kiln.train.cluster import TorchrunSpec
from kiln.train.diskfull import describe, no_space, record
from kiln.train.job import TrainJob, job_file
from kiln.train.launch import RunSpec
from kiln.train.preempt import TORCHELASTIC_SIGNALS
from resources.base import failing_on_config_errors, failing_on_damage, resource_of, spec_of
from resources.pipes_worker import LAUNCHER_ENV, STOP_ENV
from resources.tracking import asset_code_version

PROJECT_ROOT = Path(__file__).resolve().parent.parent
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Failure|Interrupt)\b.*")
PR_SET_PDEATHSIG = 1  # linux/prctl.h
FULL_HASH_MAX_BYTES = 8 << 30  # token shards hashed in full before each launch up to this much (about 6 s at most)


SLURM_DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
              "DEADLINE")  # terminal JobState values (scontrol show job)


def stopped_failure(out: Path, seconds: float) -> Stopped:
    """The failure of a launch the user interrupted, saying what was saved (the workers' result.json) and how to
    resume."""
    path = out / "result.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    saved = (result.get("preemption") or {}).get("saved_step") if result.get("outcome") == "preempted" else None
    what = (f"step {saved} saved" if saved is not None else
            "the workers stopped before saving a step of their own (the newest good checkpoint stands)")
    return Stopped(f"stopped by an interrupt (Ctrl-C, or the run terminated) after {seconds:.0f}s: {what}; not "
                   f"retried. Materialize again to resume from it ({out / 'logbook.jsonl'})")


class Preempted(RetryRequested):
    """The job was preempted (a stop signal) and saved its last step: not a failure. Dagster puts the step up for
    retry, and the retry resumes from that checkpoint; resources.tracking ends the MLflow run as KILLED."""

    def __init__(self, message: str, max_retries: int, seconds_to_wait: float):
        super().__init__(max_retries=max_retries, seconds_to_wait=seconds_to_wait)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Stopped(Failure):
    """The run was interrupted (Ctrl-C in ``kiln run``, a run terminated from the Dagster UI): the workers saved their
    last step and stopped. Never retried, whatever the asset's retry policy (Dagster retries an interrupted step that
    has one); materializing again resumes from that step. resources.tracking ends the MLflow run as KILLED."""

    stopped = True  # read by resources.tracking

    def __init__(self, description: str):
        super().__init__(description=description, allow_retries=False)


def _exception_lines(lines: list[str]) -> list[str]:
    return [ln.strip() for ln in lines if EXCEPTION_LINE.match(ln.strip()) and "ChildFailedError" not in ln]


def root_cause(lines: list[str]) -> str:
    """The workers' last exception line (torchrun's own summary only says that a rank failed)."""
    found = _exception_lines(lines)
    return f"Worker error: {found[-1]}" if found else "Last lines:\n" + "".join(lines[-15:])


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc. torchrun starts its workers in sessions of their own, where a
    signal to torchrun's process group does not reach them."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and everything it started (found first: orphans lose their parent link)."""
    for target in [pid, *descendants(pid)]:
        try:
            os.kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def die_with_parent():
    """A ``preexec_fn`` that makes the child (torchrun) get SIGKILL when the thread that started it exits, on Linux
    (prctl PR_SET_PDEATHSIG); None elsewhere, where the workers' watch on the launcher still ends them.

    The signal fires when the *thread* that forked the child ends, not the process: ``_run`` starts torchrun and
    waits for it in one thread, which outlives the child unless its process dies (Dagster's step thread, or the
    ``kiln`` process, killed). libc is looked up here, before the fork; the child only calls it (no imports, no
    locks) and kills itself if its parent died before the signal was armed."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent, kill = os.getpid(), int(signal.SIGKILL)

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, kill, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), kill)

    return arm


def full_disk_failure(rec: dict[str, Any], log_path: Path) -> Failure:
    """The Failure for a full disk (a worker's stop request, or the launcher's own write): the path, the space left,
    what to do. Not retried: another attempt would find the same full disk."""
    who = f"rank {rec['rank']}" if "rank" in rec else "the launcher"
    return Failure(
        description=f"{describe(rec)}, on {who}. Not restarted by torchrun nor retried: another attempt would "
                    "find the disk full. Free space there, or point the storage root (resources.storage.root; its "
                    "cache when root is a URL) at a larger disk, then rematerialize: training resumes from the newest "
                    f"good checkpoint. Log: {log_path}",
        metadata={k: rec[k] for k in ("path", "free_bytes", "total_bytes", "error") if rec.get(k) is not None},
        allow_retries=False)


@contextlib.contextmanager
def _failing_on_a_full_disk(where: Path, log_path: Path) -> Iterator[None]:
    """The launcher's own writes (the job file): ENOSPC as full_disk_failure, naming ``where`` if the error names
    no file."""
    try:
        yield
    except OSError as e:
        full = no_space(e)
        if full is None:
            raise
        raise full_disk_failure(record(full, where), log_path) from None


def check_local_devices(device: str, nproc_per_node: int) -> None:
    """Fail before launching when this machine cannot give every local rank its GPU (the workers would each die
    with CUDA's own less helpful error)."""
    if device != "cuda":
        return
    from kiln.train.dist import cuda_problem

    problem = cuda_problem(nproc_per_node)
    if problem:
        raise Failure(problem)


class TorchrunResource(resource_of(
        TorchrunSpec, defaults={"worker": "resources.pipes_worker"},
        docs={"worker": "The module every worker runs (python -m WORKER --config job.json ...): the Pipes worker, "
                        "which reports to Dagster and runs kiln.train. tests.faults wraps it with injected faults."})):
    """How training processes are started: torchrun locally or across nodes (c10d rendezvous). The torchrun settings
    are kiln.train.cluster.TorchrunSpec's fields (declared there once); the launcher and its Slurm and retry settings
    are this resource's own."""

    launcher: str = Field(default="local", description="'local': torchrun on this machine (one node of a multi-node job); 'slurm': submit (sbatch) and follow (scontrol) a script that runs the same torchrun command on every node of an allocation (the run folder must be on storage the nodes share).")
    slurm_partition: str = Field(default="", description="Slurm partition for launcher 'slurm' (empty: the cluster's default).")
    slurm_account: str = Field(default="", description="Slurm account for launcher 'slurm' (empty: the user's default).")
    slurm_cpus_per_node: Annotated[int, Domain(0)] = Field(default=0, description="CPUs to ask for per node with launcher 'slurm' (0: the cluster's default).")
    slurm_poll_s: Annotated[float, Domain(0, low_open=True)] = Field(default=2.0, description="Seconds between looks at a Slurm job's state (scontrol show job).")
    preempt_retries: Annotated[int, Domain(0)] = Field(default=3, description="A preempted launch (stop signal, checkpoint saved) is retried this many times, each resuming from that checkpoint.")
    preempt_retry_wait_s: Annotated[float, Domain(0)] = Field(default=10.0, description="Seconds before the retry of a preempted launch.")

    # -- the command and the cluster files (kiln.train.cluster renders them)

    def torchrun_spec(self) -> TorchrunSpec:
        """This resource's torchrun settings, its workers running ``worker``."""
        return spec_of(self, TorchrunSpec)

    def command(self, nproc_per_node: int, job_path: Path | str, device: str, run_id: str = "kiln",
                python: str | None = None, rdzv_endpoint: str | None = None, node_rank: int | None = None,
                rdzv_id: str | None = None, worker: str | None = None) -> list[str]:
        """The exact torchrun command line (the same one an sbatch script or a Kubernetes Job runs): see
        kiln.train.cluster.TorchrunSpec.command. Several nodes without a rendezvous endpoint are a Failure."""
        with failing_on_config_errors():
            return self.torchrun_spec().command(nproc_per_node, job_path, device, run_id, python=python,
                                                rdzv_endpoint=rdzv_endpoint, node_rank=node_rank, rdzv_id=rdzv_id,
                                                worker=worker)

    def slurm_script(self, job_path: str, nproc_per_node: int, device: str, project_dir: str, run_id: str = "kiln",
                     partition: str = "", account: str = "", cpus_per_node: int = 0, python: str = "python",
                     output: str = "") -> str:
        """An sbatch script that runs this resource's torchrun command once per node: see
        kiln.train.cluster.TorchrunSpec.slurm_script."""
        with failing_on_config_errors():
            return self.torchrun_spec().slurm_script(job_path, nproc_per_node, device, project_dir, run_id, partition,
                                                     account, cpus_per_node, python=python, output=output)

    def k8s_manifests(self, job_path: str, nproc_per_node: int, device: str, image: str, run_id: str = "kiln",
                      pvc: str = "kiln-data", mount: str = "/data", workdir: str = "/app", namespace: str = "",
                      cpus_per_node: int = 8, memory_gb: int = 64) -> list[dict[str, Any]]:
        """A headless Service and an Indexed Job of ``nnodes`` pods running this resource's torchrun command: see
        kiln.train.cluster.TorchrunSpec.k8s_manifests."""
        with failing_on_config_errors():
            return self.torchrun_spec().k8s_manifests(job_path, nproc_per_node, device, image, run_id, pvc=pvc,
                                                      mount=mount, workdir=workdir, namespace=namespace,
                                                      cpus_per_node=cpus_per_node, memory_gb=memory_gb)

    def k8s_pipes_pod_spec(self, nproc_per_node: int, device: str, pvc: str = "kiln-data", mount: str = "/data",
                           workdir: str = "/app", cpus: int = 8, memory_gb: int = 64) -> dict[str, Any]:
        """``base_pod_spec`` for dagster-k8s's PipesK8sClient: see
        kiln.train.cluster.TorchrunSpec.k8s_pipes_pod_spec."""
        return self.torchrun_spec().k8s_pipes_pod_spec(nproc_per_node, device, pvc=pvc, mount=mount, workdir=workdir,
                                                       cpus=cpus, memory_gb=memory_gb)

    # -- local launch

    def launch(self, context, job: dict[str, Any], nproc_per_node: int, device: str) -> dict[str, Any]:
        """Write the job file, run it (torchrun here, or an sbatch script) under a Pipes session, stream logs,
        return result.json. Rank 0's progress reaches the Dagster log through Pipes."""
        out = Path(job["out_dir"])
        job_path, log_path = out / "job.json", out / "train.log"
        with _failing_on_a_full_disk(job_path, log_path):
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_json(job_path, job)
        (out / "result.json").unlink(missing_ok=True)
        (out / "slurm_job_id").unlink(missing_ok=True)
        cmd, injector, reader, own_log = self._plan_launch(context, out, job_path, nproc_per_node, device)
        context.log.info("launching: " + " ".join(cmd))
        threads = str(max(1, (os.cpu_count() or 1) // nproc_per_node))
        path = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path,
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads),
               "KILN_LAUNCH_ID": uuid.uuid4().hex[:12],  # one launch in the run's logbook (kiln.train.logbook)
               "TORCHELASTIC_SIGNALS_TO_HANDLE": TORCHELASTIC_SIGNALS}
        start = time.time()
        stops: list[dict[str, Any]] = []  # the workers' requests to stop the job (a full disk), read by _run
        with open_pipes_session(context=context, context_injector=injector, message_reader=reader) as session:
            env.update(session.get_bootstrap_env_vars())
            if self.launcher == "local":  # the workers end themselves once this process is gone
                env[LAUNCHER_ENV] = str(os.getpid())
                env[STOP_ENV] = f"kiln-stop-{uuid.uuid4().hex}"  # read in the workers' output (resources.pipes_worker)
            else:  # the workers run on other machines, where this pid means nothing and their output goes to a file
                env.pop(LAUNCHER_ENV, None)
                env.pop(STOP_ENV, None)
            with self.forwarding_tracking(job, out, env):
                try:
                    if self.launcher == "slurm":
                        rc, timed_out, tail = self._run_slurm(context, cmd, env, own_log)
                    else:
                        rc, timed_out, tail = self._run(cmd, env, own_log, stops)
                except (DagsterExecutionInterruptedError, KeyboardInterrupt) as e:  # the job was stopped first
                    raise stopped_failure(out, time.time() - start) from e
        slurm_ids = [m.group(1) for ln in tail[:1] if (m := re.search(r"Submitted batch job (\d+)", ln))]
        if slurm_ids:
            atomic_write_text(out / "slurm_job_id", slurm_ids[0])  # read back by TrainingLaunch for the metadata
        if own_log != log_path and log_path.exists():  # the job's own output, written on the cluster
            tail = log_path.read_text(errors="replace").splitlines(keepends=True)[-400:]
        if stops:
            raise full_disk_failure(stops[0], log_path)
        self._raise_if_preempted(out, time.time() - start)
        if timed_out:
            raise Failure(f"training exceeded torchrun.timeout_s={self.timeout_s}s and was killed; "
                          f"see {log_path}. Rematerialize to resume from the last checkpoint.")
        if rc != 0:
            raise Failure(
                f"{'sbatch' if self.launcher == 'slurm' else 'torchrun'} exited with code {rc} after "
                f"{time.time() - start:.0f}s. {root_cause(tail)}\n"
                f"Full log: {log_path}. Fix the cause and rematerialize: training resumes from the newest good "
                "checkpoint.",
            )
        result_path = out / "result.json"
        if not result_path.exists():
            raise Failure(f"training finished but wrote no {result_path}; see {log_path}")
        return json.loads(result_path.read_text())

    @contextlib.contextmanager
    def forwarding_tracking(self, job: dict[str, Any], out: Path, env: dict[str, str]) -> Iterator[None]:
        """Workers launched here (the local launcher) spool their MLflow records to ``out/tracking.jsonl`` (SPOOL_ENV;
        kiln.common.metrics.job_logger) and this process, which has MLflow loaded, sends them as they come and the
        rest when the workers end; it also samples the machine's system metrics into the run, as rank 0 would (the
        same machine). That spares each worker MLflow's import and store (kiln.common.metrics). Slurm's workers, on
        other machines, send their own."""
        env.pop(SPOOL_ENV, None)
        if self.launcher != "local" or not (job.get("mlflow_tracking_uri") and job.get("mlflow_run_id")):
            yield
            return
        from types import SimpleNamespace

        from kiln.train.telemetry import SystemMetrics

        spool = out / "tracking.jsonl"
        env[SPOOL_ENV] = str(spool)
        forwarder = SpoolForwarder(spool)
        forwarder.forward()  # what an earlier launch of this folder left unsent (its launcher killed) goes first
        sampled = SimpleNamespace(mlflow_tracking_uri=job["mlflow_tracking_uri"], mlflow_run_id=job["mlflow_run_id"],
                                  system_metrics_s=job.get("system_metrics_s", TrainJob.system_metrics_s))
        system = SystemMetrics(sampled, SimpleNamespace(is_main=True))  # SPOOL_ENV is in the workers' env alone
        forwarder.start()
        try:
            yield
        finally:
            system.stop()
            forwarder.stop()

    def _plan_launch(self, context, out: Path, job_path: Path, nproc_per_node: int, device: str):
        """(command, Pipes context injector, message reader, log file) for this resource's launcher."""
        if self.launcher == "slurm":
            script = out / "launch.sbatch"
            atomic_write_text(script, self.slurm_script(
                str(job_path), nproc_per_node, device, str(PROJECT_ROOT), context.run.run_id, self.slurm_partition,
                self.slurm_account, self.slurm_cpus_per_node, python=self.python or sys.executable,
                output=str(out / "train.log")))
            # the workers run on other machines: Pipes goes through files in the (shared) run folder
            pipes = out / ".pipes"
            pipes.mkdir(exist_ok=True)
            return (["sbatch", "--parsable", str(script)], PipesFileContextInjector(str(pipes / "context.json")),
                    PipesFileMessageReader(str(pipes / "messages.jsonl")), out / "sbatch.log")
        if self.launcher == "local":
            check_local_devices(device, nproc_per_node)
            return (self.command(nproc_per_node, job_path, device, context.run.run_id), PipesTempFileContextInjector(),
                    PipesTempFileMessageReader(), out / "train.log")
        raise Failure(f"torchrun.launcher must be 'local' or 'slurm', not {self.launcher!r} "
                      "(for Kubernetes see deploy/README.md)")

    def _raise_if_preempted(self, out: Path, seconds: float) -> None:
        """Raise Preempted when the workers stopped on a stop signal with their last step saved (result.json says
        so, whatever torchrun's or Slurm's exit code)."""
        path = out / "result.json"
        result = json.loads(path.read_text()) if path.exists() else {}
        if result.get("outcome") != "preempted":
            return
        p = result.get("preemption") or {}
        raise Preempted(f"preempted by {p.get('signal') or 'a stop signal'} after {seconds:.0f}s: step "
                        f"{p.get('saved_step')} saved in {p.get('save_s')}s; the retry resumes from it "
                        f"({out / 'logbook.jsonl'})",
                        self.preempt_retries, self.preempt_retry_wait_s)

    def _run_slurm(self, context, cmd: list[str], env: dict[str, str], own_log: Path) -> tuple[int, bool, list[str]]:
        """Submit the sbatch script and follow the job to its end through ``scontrol show job``, each state change in
        the Dagster log; (exit code, whether it timed out, sbatch's lines). Stopping the Dagster step scancels it."""
        sub = subprocess.run(cmd, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120)
        with open(own_log, "a", encoding="utf-8") as log:
            log.write(sub.stdout + sub.stderr)
        if sub.returncode != 0:
            raise Failure(f"sbatch exited with code {sub.returncode}: {sub.stderr.strip() or sub.stdout.strip()}; "
                          f"is Slurm reachable (SLURM_CONF, sinfo)? Script: {cmd[-1]}")
        found = re.search(r"(\d+)", sub.stdout)  # --parsable prints "<id>" or "<id>;<cluster>"
        if not found:
            raise Failure(f"sbatch printed no job id: {sub.stdout.strip()!r}; see {own_log}")
        job_id = found.group(1)
        context.log.info(f"Slurm job {job_id} submitted ({cmd[-1]})")
        lines = [f"Submitted batch job {job_id}\n"]
        deadline, state, info = time.time() + self.timeout_s, None, {}
        try:
            while state not in SLURM_DONE:
                if time.time() > deadline:
                    self._cancel(lines)
                    return 1, True, lines
                time.sleep(self.slurm_poll_s if state else 0.2)
                info = slurm_job(job_id, env) or info
                if info.get("JobState") != state:
                    state = info.get("JobState")
                    context.log.info(f"Slurm job {job_id}: {state} on {info.get('NodeList') or '-'} "
                                     f"(reason {info.get('Reason', '-')}, run time {info.get('RunTime', '-')})")
        except BaseException:  # the Dagster run was stopped: the job stops too (its workers save first)
            self._cancel(lines)
            raise
        code, _, sig = info.get("ExitCode", "1:0").partition(":")
        return (int(code) or (128 + int(sig or 0) if state != "COMPLETED" else 0)), False, lines

    def _run(self, cmd: list[str], env: dict[str, str], own_log: Path,
             stops: list[dict[str, Any]]) -> tuple[int, bool, list[str]]:
        """Run ``cmd``, appending its output to ``own_log``; (exit code, whether it timed out, its last lines).

        A worker's stop request, a line ``<env[STOP_ENV]> <json>`` in that output (resources.pipes_worker; the token
        is new for each launch), is appended to ``stops`` and ends torchrun and every worker at once (SIGKILL): the
        worker waits for that, so torchrun never restarts it. The output is still read to the end when ``own_log``
        cannot be written (a full disk), or the workers would block on a full pipe."""
        tail: list[str] = []
        timed_out = False
        token = f"{env[STOP_ENV]} " if env.get(STOP_ENV) else None
        with open(own_log, "a", encoding="utf-8") as log:
            # its own session (a stop signal reaches torchrun and the workers, not this process), ended with us
            proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True, preexec_fn=die_with_parent())

            def pump() -> None:
                writing = True
                for line in proc.stdout:  # type: ignore[union-attr]
                    at = line.find(token) if token else -1  # after any prefix torchrun may put on a line
                    if at >= 0:  # stop now, before torchrun can restart the worker that asked (it waits for this)
                        stops.append(stop_request(line[at + len(token):]))
                        kill_tree(proc.pid)
                    if writing:
                        try:
                            log.write(line)
                            log.flush()
                        except OSError as e:  # a full disk: keep reading
                            writing = False
                            with contextlib.suppress(OSError):
                                log.close()
                            line += f"(could not write {own_log}: {e}; its later lines are not kept)\n"
                    tail.append(line)
                    del tail[:-400]

            reader_thread = threading.Thread(target=pump, daemon=True)
            reader_thread.start()
            try:
                rc = proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:  # hung or too slow: stop everything now (checkpoints are atomic)
                self._cancel(tail)
                kill_tree(proc.pid)
                rc = proc.wait()
                timed_out = True
            except BaseException:  # the Dagster run was stopped: let torchrun stop its workers, then make sure
                self._cancel(tail)
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                finally:
                    kill_tree(proc.pid)
                raise
            finally:
                reader_thread.join(timeout=30)  # the log stays open until the last line is written
                if not reader_thread.is_alive():  # a reader still blocked (a grandchild holds the pipe) keeps it
                    proc.stdout.close()  # type: ignore[union-attr]
        return rc, timed_out, tail

    # -- a training asset's run

    @contextlib.contextmanager
    def training_run(self, context, spec: RunSpec, storage, mlflow) -> Iterator[TrainingLaunch]:
        """The MLflow run of a training asset, its run folder keyed by ``spec`` and the asset's code version (so a
        rerun resumes, and a new code version trains afresh instead of resuming, or finding finished, a run of the
        old code): the handle holds an identical earlier run's Output in ``reused``, or ``launch()`` runs the job."""
        where = context.asset_key.to_user_string()
        with failing_on_config_errors():  # the one config check: the job file is this job, which workers rebuild
            job = spec.validate(where)
        base = storage.local_base()
        spec = dataclasses.replace(spec, root=str(base))
        folder = run_folder_name(spec.key, asset_code_version(context))
        with mlflow.asset_run(context, params=spec.params(), tags=spec.tags(),
                              reuse={"key": spec.key, **spec.reuse}) as run:
            yield TrainingLaunch(self, context, spec, storage.path(where, folder), run, job)

    def _cancel(self, sbatch_lines: list[str]) -> None:
        """Cancel the Slurm job sbatch submitted (its id is on sbatch's first line); nothing for local runs."""
        if self.launcher != "slurm":
            return
        ids = [m.group(1) for ln in sbatch_lines if (m := re.search(r"Submitted batch job (\d+)", ln))]
        if ids:
            subprocess.run(["scancel", ids[0]], check=False, capture_output=True, timeout=60)


def run_folder_name(key: str, code_version: str | None) -> str:
    """A training asset's run folder: its job's key (RunSpec.key) hashed with the asset's code version, so that a new
    code version trains afresh rather than resuming, or returning as finished, the old code's run; the key alone
    for an asset without a code version."""
    return stable_hash({"run": key, "code_version": code_version})[:16] if code_version else key


def stop_request(text: str) -> dict[str, Any]:
    """A worker's stop request (resources.pipes_worker.ask_launcher_to_stop) from the JSON after its token."""
    try:
        found = json.loads(text)
    except ValueError:
        found = None
    if isinstance(found, dict):
        return found
    return {"path": "unknown", "error": f"unreadable stop request {text.strip()!r}"}


def slurm_job(job_id: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """``scontrol show job -o ID`` as {field: value} (JobState, ExitCode, NodeList, Reason, RunTime, ...); {} when
    Slurm no longer knows the job."""
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True, timeout=60,
                         env=env)
    if out.returncode != 0:
        return {}
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", out.stdout))


class TrainingLaunch:
    """One training job inside its asset's MLflow run (made by ``TorchrunResource.training_run``)."""

    def __init__(self, torchrun: TorchrunResource, context, spec: RunSpec, out_dir: Path, run, job: TrainJob):
        self.torchrun, self.context, self.spec, self.out_dir, self.run = torchrun, context, spec, out_dir, run
        self.job = job  # the validated job (RunSpec.validate) that the job file holds
        self.reused = run.reused  # the Output of an identical earlier run, to return as it is
        self.result: dict[str, Any] = {}

    def verify_shards(self, job: dict[str, Any]) -> None:
        """Hash every token shard the job reads against its folder's manifest before launching, however recently the
        loader's quick check (size and time) passed it: a byte flipped with both kept is found here, named and set
        aside, so that the next run recomputes the token shards (failing_on_damage) instead of training on it.
        Skipped where the shards outweigh FULL_HASH_MAX_BYTES (the loader's quick check still runs): hashing took
        0.63-0.73 s per GB on a 2-core Xeon, no more than sha256 alone (bench/results/full_hash.md)."""
        shards = [f for f in [*job.get("train_files", []), *job.get("val_files", [])] if str(f).endswith(".bin")]
        total = sum(Path(f).stat().st_size for f in shards if Path(f).is_file())
        if not shards or total > FULL_HASH_MAX_BYTES:
            return
        start = time.perf_counter()
        with failing_on_damage():
            check_shard_files(shards, full=True)
        self.context.log.info(f"verified {len(shards)} token shards ({total / 1e6:,.1f} MB) by sha256 in "
                              f"{time.perf_counter() - start:.2f} s")

    def launch(self) -> dict[str, Any]:
        """Write the job file (the validated job, kiln.train.job.job_file), run it to the end, tag the MLflow run with
        its checkpoint; return result.json with the
        run's logbook, its cost and energy ledger, the Slurm job id and the peaks of the system metrics added. The
        logbook reaches MLflow however the launch ends (completed, preempted, failed)."""
        hardware = self.spec.plan["hardware"]
        job = job_file(dataclasses.replace(self.job, out_dir=str(self.out_dir),
                                           mlflow_tracking_uri=self.run.tracking_uri, mlflow_run_id=self.run.run_id))
        self.verify_shards(job)
        try:
            self.result = self.torchrun.launch(self.context, job, hardware["nproc_per_node"], hardware["device"])
        finally:
            operations = self.operations(hardware["device"])
        self.result.update(operations)
        self.run.set_tags({"checkpoint": self.result["checkpoint"]})
        return self.result

    def operations(self, device: str) -> dict[str, Any]:
        """The run's logbook rows, ledger, Slurm job id and system-metric peaks; the logbook table and ledger go
        to the MLflow run (an artifact and ``system/kiln.cost.*`` metrics: kiln.common.metrics.OPERATIONS_PREFIX),
        the outcome to its ``kiln.outcome`` tag."""
        from kiln.plan.cost import load_cost
        from kiln.train.energy import run_ledger
        from kiln.train.logbook import attempts, format_table

        rows = attempts(self.out_dir)
        ledger = run_ledger(rows, self.spec.plan, load_cost(device if device in ("cpu", "cuda") else "cpu"))
        job_file = self.out_dir / "slurm_job_id"
        ops = {"logbook": rows, "ledger": ledger, "system_metrics_peaks": self.run.system_peaks(),
               "slurm_job_id": job_file.read_text().strip() if job_file.exists() else None}
        try:
            self.run.log_text(format_table(rows), "logbook.md")
            self.run.log_metrics(operations_metrics(ledger, "cost."))
            self.run.set_tags({"kiln.outcome": rows[-1]["outcome"] if rows else "not started",
                               **({"slurm.job_id": ops["slurm_job_id"]} if ops["slurm_job_id"] else {})})
        except Exception as e:  # tracking trouble must not hide how the launch itself ended
            self.context.log.warning(f"could not record the logbook in MLflow: {e}")
        return ops

    def value(self, **extra: Any) -> dict[str, Any]:
        """The asset's value: result.json, the run folder, the data version (the final weights' identity)."""
        version = checkpoint_identity(Path(self.result["checkpoint"]))
        return {**self.result, "out_dir": str(self.out_dir), "version": version, "mlflow_run_id": self.run.run_id,
                **extra}

    def output(self, metadata: dict[str, Any], **extra: Any):
        """The Output, its metadata followed by the run's operations: logbook, cost and energy, system-metric peaks."""
        value = self.value(**extra)
        return self.run.output(value, value["version"], {**metadata, **operations_metadata(value)})


def operations_metadata(result: dict[str, Any]) -> dict[str, Any]:
    """Dagster metadata of a training run's operations (kiln.train.logbook, kiln.train.energy, MLflow system
    metrics)."""
    from dagster import MetadataValue

    from kiln.train.energy import ledger_table
    from kiln.train.logbook import format_table

    def md(rows: list[dict[str, Any]]) -> MetadataValue:
        cols = list(rows[0]) if rows else []
        fmt = lambda v: "" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
        return MetadataValue.md("\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                                          + ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows])
                                if rows else "_none_")

    ledger = result.get("ledger") or {}
    meta: dict[str, Any] = {"logbook": MetadataValue.md(format_table(result.get("logbook") or []))}
    if ledger:
        meta.update({"cost_and_energy": md(ledger_table(ledger)), "device_hours": ledger["device_hours"],
                     "energy_kwh": ledger["energy_kwh"], "energy_basis": ledger["energy_basis"],
                     f"cost_{ledger['currency'].lower()}": ledger["cost"]})
    peaks = result.get("system_metrics_peaks") or {}
    meta["system_metrics_peaks"] = md([{"metric": k, "peak": v} for k, v in sorted(peaks.items())])
    if result.get("slurm_job_id"):
        meta["slurm_job_id"] = result["slurm_job_id"]
    return meta
