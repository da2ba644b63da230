"""The torchrun command that starts a Kiln training job, and the cluster files that run it: a Slurm sbatch script
(``srun`` on every node), a Kubernetes Indexed Job with its rendezvous Service, and a pod spec for dagster-k8s's
PipesK8sClient.

``TorchrunSpec(nnodes=2, timeout_s=86400).slurm_script("/shared/run/job.json", 8, "cuda", "/shared/kiln")``;
resources.torchrun builds its commands and files here, and ``python deploy/render.py`` writes them to disk.
Everything here is plain values and text; nothing is started and nothing here imports Dagster.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from kiln.common.config import ConfigError, Domain
from kiln.train.preempt import TORCHELASTIC_SIGNALS

RDZV_PORT = 29500
# a deleted or evicted pod's SIGTERM-to-SIGKILL time: torchrun passes SIGTERM on and gives its workers 30 s to save
K8S_GRACE_S = 60


def shell_words(args: list[str]) -> str:
    """Shell words: shell-quoted, except words holding ``${VAR}`` references, which are double-quoted to expand."""
    out = []
    for a in args:
        if "${" in a:
            if any(c in a for c in '"`\\'):
                raise ValueError(f"cannot quote {a!r} for the shell")
            out.append(f'"{a}"')
        else:
            out.append(shlex.quote(a))
    return " ".join(out)


def k8s_name(run_id: str) -> str:
    """A DNS-1123 name for a run's Kubernetes objects: ``kiln-<run_id>``, lower case, at most 50 characters."""
    return re.sub(r"[^a-z0-9-]", "-", f"kiln-{run_id}".lower())[:50].strip("-")


def _limits(device: str, nproc_per_node: int, cpus: int, memory_gb: int) -> dict[str, Any]:
    limits: dict[str, Any] = {"cpu": str(cpus), "memory": f"{memory_gb}Gi"}
    if device == "cuda":
        limits["nvidia.com/gpu"] = nproc_per_node
    return limits


def _volumes(pvc: str) -> list[dict[str, Any]]:
    return [{"name": "data", "persistentVolumeClaim": {"claimName": pvc}},
            {"name": "shm", "emptyDir": {"medium": "Memory"}}]


def _volume_mounts(mount: str) -> list[dict[str, Any]]:
    return [{"name": "data", "mountPath": mount}, {"name": "shm", "mountPath": "/dev/shm"}]


@dataclass(frozen=True)
class TorchrunSpec:
    """How torchrun starts a job's workers: nodes, c10d rendezvous, restarts, time limits, interpreter, worker."""

    nnodes: Annotated[int, Domain(1)] = 1  # machines in the job; each runs the same command
    node_rank: Annotated[int, Domain(0)] = 0  # this machine's rank among nnodes (informative: c10d assigns ranks)
    rdzv_endpoint: str = ""  # host:port of the c10d rendezvous for several nodes
    rdzv_id: str = ""  # rendezvous job id (default: the run id)
    max_restarts: Annotated[int, Domain(0)] = 3  # torchrun restarts the whole worker group this many times after a worker dies; each restart resumes from the newest good checkpoint (a full disk stops the job instead)
    timeout_s: Annotated[int, Domain(1)] = 6 * 3600  # upper bound on the whole launch, killed past it (Slurm time limit, Kubernetes active deadline)
    pg_timeout_s: Annotated[int, Domain(1)] = 600  # process-group timeout: a hung collective fails after this
    python: str = ""  # the workers' interpreter (default: this one)
    slurm_signal_s: Annotated[int, Domain(0)] = 120  # Slurm sends SIGUSR1 this many seconds before the time limit (sbatch --signal)
    worker: str = ""  # the module every worker runs (python -m WORKER --config job.json); the launcher names its own

    def command(self, nproc_per_node: int, job_path: Path | str, device: str, run_id: str = "kiln",
                python: str | None = None, rdzv_endpoint: str | None = None, node_rank: int | None = None,
                rdzv_id: str | None = None, worker: str | None = None) -> list[str]:
        """The exact torchrun command line (the same one an sbatch script or a Kubernetes Job runs).

        Several nodes use c10d rendezvous: ranks are assigned by the rendezvous, so ``node_rank`` is informative
        only, and cluster files leave it out by passing ``node_rank=-1``. Arguments given here override the
        spec's own. Raises ConfigError for several nodes without a rendezvous endpoint.
        """
        endpoint = self.rdzv_endpoint if rdzv_endpoint is None else rdzv_endpoint
        if not (worker or self.worker):
            raise ConfigError("torchrun.worker is empty: name the module every worker runs (Kiln's launcher runs "
                              "resources.pipes_worker)")
        cmd = [python or self.python or sys.executable, "-m", "torch.distributed.run",
               f"--nproc_per_node={nproc_per_node}", f"--max_restarts={self.max_restarts}"]
        if self.nnodes > 1:
            if not endpoint:
                raise ConfigError(f"torchrun.nnodes={self.nnodes} needs torchrun.rdzv_endpoint (host:port of node 0)")
            rank = self.node_rank if node_rank is None else node_rank
            cmd += [f"--nnodes={self.nnodes}"] + ([f"--node_rank={rank}"] if rank >= 0 else [])
            cmd += ["--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", f"--rdzv_id={rdzv_id or self.rdzv_id or run_id}"]
        else:
            cmd += ["--standalone"]
        return cmd + ["-m", worker or self.worker, "--config", str(job_path), "--device", device,
                      "--timeout-s", str(self.pg_timeout_s)]

    # -- Slurm

    def slurm_script(self, job_path: str, nproc_per_node: int, device: str, project_dir: str, run_id: str = "kiln",
                     partition: str = "", account: str = "", cpus_per_node: int = 0, python: str = "python",
                     output: str = "") -> str:
        """An sbatch script that runs this spec's torchrun command once per node (``srun``, one task each).

        The first node of the allocation hosts the c10d rendezvous; Slurm's job id is the rendezvous id; the time
        limit is ``timeout_s``, and SIGUSR1 comes ``slurm_signal_s`` before it (the workers save and stop, as on
        preemption). The output goes to ``output`` (default: ``slurm-%j.log`` beside the job file). Submit with
        ``sbatch FILE`` (``sbatch --wait`` blocks until it ends).
        """
        hours, rem = divmod(self.timeout_s, 3600)
        lines = ["#!/bin/bash", f"#SBATCH --job-name=kiln-{run_id}", f"#SBATCH --nodes={self.nnodes}",
                 "#SBATCH --ntasks-per-node=1", f"#SBATCH --time={hours:02d}:{rem // 60:02d}:{rem % 60:02d}",
                 f"#SBATCH --signal=USR1@{self.slurm_signal_s}",  # before the time limit: save and stop (kiln.train.preempt)
                 f"#SBATCH --output={output or Path(job_path).parent / 'slurm-%j.log'}"]
        if device == "cuda":
            lines.append(f"#SBATCH --gpus-per-node={nproc_per_node}")
        if cpus_per_node:
            lines.append(f"#SBATCH --cpus-per-task={cpus_per_node}")
        if partition:
            lines.append(f"#SBATCH --partition={partition}")
        if account:
            lines.append(f"#SBATCH --account={account}")
        threads = max(1, cpus_per_node // nproc_per_node) if cpus_per_node else 1
        cmd = self.command(nproc_per_node, job_path, device, run_id, python=python,
                           rdzv_endpoint=f"${{HEAD_NODE}}:{RDZV_PORT}", node_rank=-1, rdzv_id="${SLURM_JOB_ID}")
        lines += [
            "set -euo pipefail",
            f"cd {shlex.quote(project_dir)}",
            'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f"export OMP_NUM_THREADS={threads}",
            f"export TORCHELASTIC_SIGNALS_TO_HANDLE={TORCHELASTIC_SIGNALS}  # torchrun passes SIGUSR1 on to its workers",
            f"export PYTHONPATH={shlex.quote(project_dir)}${{PYTHONPATH:+:$PYTHONPATH}}",
            "srun --ntasks-per-node=1 --kill-on-bad-exit=1 " + shell_words(cmd),
        ]
        return "\n".join(lines) + "\n"

    # -- Kubernetes

    def k8s_manifests(self, job_path: str, nproc_per_node: int, device: str, image: str, run_id: str = "kiln",
                      pvc: str = "kiln-data", mount: str = "/data", workdir: str = "/app", namespace: str = "",
                      cpus_per_node: int = 8, memory_gb: int = 64) -> list[dict[str, Any]]:
        """A headless Service and an Indexed Job of ``nnodes`` pods running this spec's torchrun command.

        Pod 0 (``<name>-0.<name>``, DNS through the Service) hosts the c10d rendezvous. The run folder (job file,
        shards, checkpoints) lives on the PersistentVolumeClaim ``pvc``, mounted at ``mount`` on every pod.
        Failed pods are not recreated: torchrun restarts workers in place (``max_restarts``), and launching the
        job again resumes from the newest good checkpoint. Apply with ``kubectl apply -f FILE``.
        """
        name = k8s_name(run_id)
        meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": "kiln", "kiln/run": name}}
        if namespace:
            meta["namespace"] = namespace
        endpoint = f"{name}-0.{name}:{RDZV_PORT}"
        cmd = self.command(nproc_per_node, job_path, device, run_id, python="python", rdzv_endpoint=endpoint,
                           node_rank=-1, rdzv_id=name)
        limits = _limits(device, nproc_per_node, cpus_per_node, memory_gb)
        service = {"apiVersion": "v1", "kind": "Service", "metadata": meta,
                   "spec": {"clusterIP": "None", "selector": {"kiln/run": name},
                            "ports": [{"name": "rendezvous", "port": RDZV_PORT}]}}
        container = {
            "name": "trainer", "image": image, "command": cmd, "workingDir": workdir,
            "env": [{"name": "OMP_NUM_THREADS", "value": str(max(1, cpus_per_node // nproc_per_node))},
                    {"name": "PYTHONPATH", "value": workdir}],
            "ports": [{"containerPort": RDZV_PORT, "name": "rendezvous"}],
            "resources": {"limits": limits, "requests": dict(limits)},
            "volumeMounts": _volume_mounts(mount),
        }
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": {
            "completionMode": "Indexed", "completions": self.nnodes, "parallelism": self.nnodes, "backoffLimit": 0,
            "activeDeadlineSeconds": self.timeout_s,
            "template": {"metadata": {"labels": {"kiln/run": name}}, "spec": {
                "subdomain": name, "restartPolicy": "Never", "containers": [container],
                "terminationGracePeriodSeconds": K8S_GRACE_S, "volumes": _volumes(pvc)}}}}
        return [service, job]

    def k8s_pipes_pod_spec(self, nproc_per_node: int, device: str, pvc: str = "kiln-data", mount: str = "/data",
                           workdir: str = "/app", cpus: int = 8, memory_gb: int = 64) -> dict[str, Any]:
        """``base_pod_spec`` for dagster-k8s's ``PipesK8sClient().run(context=..., image=..., command=
        self.command(...), base_pod_spec=...)``: one pod per launch (one node), Pipes over the pod's logs."""
        limits = _limits(device, nproc_per_node, cpus, memory_gb)
        return {"restartPolicy": "Never", "terminationGracePeriodSeconds": K8S_GRACE_S, "containers": [{
                    "name": "dagster-pipes-execution", "workingDir": workdir,
                    "env": [{"name": "PYTHONPATH", "value": workdir},
                            {"name": "OMP_NUM_THREADS", "value": str(max(1, cpus // nproc_per_node))}],
                    "resources": {"limits": limits, "requests": dict(limits)},
                    "volumeMounts": _volume_mounts(mount)}],
                "volumes": _volumes(pvc)}
