"""Launches Kiln training jobs with torchrun through Dagster Pipes: one process, several, or several nodes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dagster import (
    ConfigurableResource,
    Failure,
    PipesTempFileContextInjector,
    PipesTempFileMessageReader,
    open_pipes_session,
)
from pydantic import Field

from kiln.storage import atomic_write_json


EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Failure|Interrupt)\b.*")


def root_cause(lines: list[str]) -> str:
    """The workers' last exception line (torchrun's own summary only says that a rank failed)."""
    found = [ln.strip() for ln in lines if EXCEPTION_LINE.match(ln.strip()) and "ChildFailedError" not in ln]
    return f"Worker error: {found[-1]}" if found else "Last lines:\n" + "".join(lines[-15:])


class TorchrunResource(ConfigurableResource):
    """How training processes are started: torchrun locally or across nodes (c10d rendezvous)."""

    nnodes: int = Field(default=1, description="Machines in the job; each runs this same launch.")
    node_rank: int = Field(default=0, description="This machine's rank among nnodes (multi-node only).")
    rdzv_endpoint: str = Field(default="", description="host:port of the c10d rendezvous for multi-node runs.")
    rdzv_id: str = Field(default="", description="Rendezvous job id (defaults to the Dagster run id).")
    max_restarts: int = Field(default=0, description="torchrun restarts the whole worker group this many times after a failure.")
    timeout_s: int = Field(default=6 * 3600, description="Upper bound on the whole launch; the job is killed past it.")
    pg_timeout_s: int = Field(default=600, description="Process-group timeout: a hung collective fails after this.")
    python: str = Field(default="", description="Python interpreter for the workers (default: this one).")

    def command(self, nproc_per_node: int, job_path: Path, device: str, run_id: str = "kiln") -> list[str]:
        """The exact torchrun command line (the same one an sbatch script or a Kubernetes Job would run)."""
        cmd = [self.python or sys.executable, "-m", "torch.distributed.run",
               f"--nproc_per_node={nproc_per_node}", f"--max_restarts={self.max_restarts}"]
        if self.nnodes > 1:
            if not self.rdzv_endpoint:
                raise Failure(f"torchrun.nnodes={self.nnodes} needs torchrun.rdzv_endpoint (host:port of node 0)")
            cmd += [f"--nnodes={self.nnodes}", f"--node_rank={self.node_rank}", "--rdzv_backend=c10d",
                    f"--rdzv_endpoint={self.rdzv_endpoint}", f"--rdzv_id={self.rdzv_id or run_id}"]
        else:
            cmd += ["--standalone"]
        return cmd + ["-m", "resources.pipes_worker", "--config", str(job_path), "--device", device,
                      "--timeout-s", str(self.pg_timeout_s)]

    def launch(self, context, job: dict[str, Any], nproc_per_node: int, device: str) -> dict[str, Any]:
        """Write the job file, run torchrun under a Pipes session, stream logs, return result.json."""
        out = Path(job["out_dir"])
        out.mkdir(parents=True, exist_ok=True)
        job_path = out / "job.json"
        atomic_write_json(job_path, job)
        (out / "result.json").unlink(missing_ok=True)
        cmd = self.command(nproc_per_node, job_path, device, context.run.run_id)
        context.log.info("launching: " + " ".join(cmd))
        project_root = Path(__file__).resolve().parent.parent
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(project_root), os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))}
        log_path = out / "train.log"
        with open_pipes_session(context=context, context_injector=PipesTempFileContextInjector(),
                                message_reader=PipesTempFileMessageReader()) as session:
            env.update(session.get_bootstrap_env_vars())
            with open(log_path, "a", encoding="utf-8") as log:
                proc = subprocess.Popen(cmd, cwd=project_root, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
                tail: list[str] = []

                def pump() -> None:
                    for line in proc.stdout:  # type: ignore[union-attr]
                        log.write(line)
                        log.flush()
                        tail.append(line)
                        del tail[:-400]

                reader = threading.Thread(target=pump, daemon=True)
                reader.start()
                start = time.time()
                try:
                    rc = proc.wait(timeout=self.timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    raise Failure(f"training exceeded torchrun.timeout_s={self.timeout_s}s and was killed; "
                                  f"see {log_path}. Rematerialize to resume from the last checkpoint.")
                except BaseException:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=30)
                    raise
                reader.join(timeout=10)
        if rc != 0:
            raise Failure(
                f"torchrun exited with code {rc} after {time.time() - start:.0f}s. {root_cause(tail)}\n"
                f"Full log: {log_path}. Fix the cause and rematerialize: training resumes from the newest good checkpoint."
            )
        result_path = out / "result.json"
        if not result_path.exists():
            raise Failure(f"training finished but wrote no {result_path}; see {log_path}")
        return json.loads(result_path.read_text())
