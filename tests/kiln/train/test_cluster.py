"""Tests for kiln.train.cluster: the exact torchrun command lines, the Slurm script and Kubernetes files made from
them, the files deploy/render.py writes (checked in, and valid for Kubernetes' schema), and deploy/render.py running
without Dagster.

Run: python -m pytest tests/kiln/train/test_cluster.py -q
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kiln.common.config import ConfigError
from kiln.train.cluster import K8S_GRACE_S, RDZV_PORT, TorchrunSpec, k8s_name, shell_words

ROOT = Path(__file__).resolve().parents[3]
WORKER = "resources.pipes_worker"
TAIL = ["-m", WORKER, "--config", "/runs/a/job.json", "--device", "cpu", "--timeout-s", "600"]


def test_single_node_command():
    cmd = TorchrunSpec(worker=WORKER).command(2, Path("/runs/a/job.json"), "cpu", "run1")
    assert cmd[0] == sys.executable
    assert cmd[1:] == ["-m", "torch.distributed.run", "--nproc_per_node=2", "--max_restarts=3", "--standalone", *TAIL]


def test_a_spec_without_a_worker_module_is_refused_by_name():
    with pytest.raises(ConfigError, match="torchrun.worker is empty"):
        TorchrunSpec().command(1, "j.json", "cpu")


def test_multi_node_command_uses_c10d_rendezvous():
    spec = TorchrunSpec(worker=WORKER, nnodes=2, node_rank=1, rdzv_endpoint="node0:29500", max_restarts=3)
    cmd = spec.command(8, Path("/runs/a/job.json"), "cpu", "run1")
    assert cmd[3:10] == ["--nproc_per_node=8", "--max_restarts=3", "--nnodes=2", "--node_rank=1",
                         "--rdzv_backend=c10d", "--rdzv_endpoint=node0:29500", "--rdzv_id=run1"]
    assert "--standalone" not in cmd


def test_command_arguments_override_the_spec():
    spec = TorchrunSpec(nnodes=3, rdzv_endpoint="h:1", rdzv_id="rid", pg_timeout_s=77, python="/py", worker="w.spec")
    cmd = spec.command(4, "j.json", "cuda")
    assert cmd[0] == "/py" and "--rdzv_id=rid" in cmd and "--node_rank=0" in cmd
    assert cmd[-8:] == ["-m", "w.spec", "--config", "j.json", "--device", "cuda", "--timeout-s", "77"]
    cmd = spec.command(4, "j.json", "cuda", python="python", rdzv_endpoint="x:2", node_rank=-1, rdzv_id="z",
                       worker="w.call")
    assert cmd[0] == "python" and "--rdzv_endpoint=x:2" in cmd and "--rdzv_id=z" in cmd and "w.call" in cmd
    assert not any(w.startswith("--node_rank") for w in cmd)


def test_multi_node_needs_an_endpoint():
    with pytest.raises(ConfigError, match="rdzv_endpoint"):
        TorchrunSpec(worker=WORKER, nnodes=2).command(1, Path("job.json"), "cpu")


def test_shell_words_quote_everything_but_variable_references():
    assert shell_words(["python", "a b", "it's", "--x=${HEAD}:1"]) == """python 'a b' 'it'"'"'s' "--x=${HEAD}:1\""""
    with pytest.raises(ValueError, match="cannot quote"):
        shell_words(['${A}"'])


def test_slurm_script_runs_the_same_command_on_every_node():
    spec = TorchrunSpec(worker=WORKER, nnodes=4, max_restarts=2, timeout_s=36 * 3600 + 90, pg_timeout_s=900)
    script = spec.slurm_script("/shared/runs/x/job.json", 8, "cuda", "/opt/kiln", "abc", partition="gpu",
                               account="ml", cpus_per_node=96)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash" and script.endswith("\n")
    for directive in ("--job-name=kiln-abc", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8",
                      "--cpus-per-task=96", "--partition=gpu", "--account=ml", "--time=36:01:30",
                      "--output=/shared/runs/x/slurm-%j.log"):
        assert f"#SBATCH {directive}" in lines
    srun = lines[-1]
    assert srun.startswith("srun --ntasks-per-node=1 --kill-on-bad-exit=1 python -m torch.distributed.run ")
    expected = spec.command(8, "/shared/runs/x/job.json", "cuda", python="python", node_rank=-1,
                            rdzv_endpoint=f"${{HEAD_NODE}}:{RDZV_PORT}", rdzv_id="${SLURM_JOB_ID}")
    assert srun.split(" ", 3)[3].replace('"', "").split() == expected  # the spec's command, word for word
    assert "--node_rank" not in srun  # c10d assigns node ranks
    assert 'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in lines
    assert "export OMP_NUM_THREADS=12" in lines
    assert "cd /opt/kiln" in lines
    if shutil.which("bash"):
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # valid shell


def test_slurm_script_defaults_and_quoting():
    script = TorchrunSpec(worker=WORKER, timeout_s=59).slurm_script("/sh ared/r's/job.json", 3, "cpu", "/opt/k iln",
                                                     python="/usr/bin/python3", output="/o/train.log")
    lines = script.splitlines()
    assert "#SBATCH --time=00:00:59" in lines and "#SBATCH --output=/o/train.log" in lines
    assert not any(ln.startswith(("#SBATCH --gpus", "#SBATCH --cpus", "#SBATCH --partition", "#SBATCH --account"))
                   for ln in lines)
    assert "export OMP_NUM_THREADS=1" in lines and "cd '/opt/k iln'" in lines
    assert "'/sh ared/r'\"'\"'s/job.json'" in lines[-1]
    if shutil.which("bash"):
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_slurm_script_asks_for_a_stop_signal_before_the_time_limit_and_torchrun_passes_it_on():
    script = TorchrunSpec(worker=WORKER, slurm_signal_s=90).slurm_script("/shared/runs/x/job.json", 2, "cpu", "/opt/kiln")
    assert "#SBATCH --signal=USR1@90" in script.splitlines()
    assert "export TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in script


def test_kubernetes_indexed_job_and_rendezvous_service():
    spec = TorchrunSpec(worker=WORKER, nnodes=2, max_restarts=3, timeout_s=7200)
    service, job = spec.k8s_manifests("/data/runs/x/job.json", 8, "cuda", "registry.example/kiln:1", "Run_42",
                                      pvc="runs", namespace="ml")
    name = "kiln-run-42"  # a DNS-1123 name from the run id
    assert k8s_name("Run_42") == name and len(k8s_name("A" * 80)) == 50
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert service["metadata"] == {"name": name, "namespace": "ml", "labels": {"app.kubernetes.io/name": "kiln", "kiln/run": name}}
    job_spec = job["spec"]
    assert job["kind"] == "Job" and job_spec["completionMode"] == "Indexed"
    assert job_spec["completions"] == job_spec["parallelism"] == 2 and job_spec["activeDeadlineSeconds"] == 7200
    pod = job_spec["template"]["spec"]
    assert pod["subdomain"] == name == service["spec"]["selector"]["kiln/run"] == job_spec["template"]["metadata"]["labels"]["kiln/run"]
    assert pod["terminationGracePeriodSeconds"] == K8S_GRACE_S
    [container] = pod["containers"]
    assert container["command"] == spec.command(8, "/data/runs/x/job.json", "cuda", python="python", node_rank=-1,
                                                rdzv_endpoint=f"{name}-0.{name}:29500", rdzv_id=name)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "runs"}} in pod["volumes"]
    assert yaml.safe_load_all(yaml.safe_dump_all([service, job])) is not None
    cpu_job = spec.k8s_manifests("/data/j.json", 2, "cpu", "img", "r")[1]
    assert "nvidia.com/gpu" not in cpu_job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "namespace" not in cpu_job["metadata"]
    pipes = spec.k8s_pipes_pod_spec(8, "cuda", pvc="runs")
    assert pipes["containers"][0]["name"] == "dagster-pipes-execution"
    assert pipes["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert pipes["terminationGracePeriodSeconds"] == K8S_GRACE_S


def _render(out: Path, *args: str) -> None:
    proc = subprocess.run([sys.executable, "deploy/render.py", "--out", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_checked_in_deploy_examples_are_what_the_renderer_writes(tmp_path):
    _render(tmp_path)
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(p.name for p in (ROOT / "deploy" / "examples").iterdir())
    for name in written:
        assert (tmp_path / name).read_bytes() == (ROOT / "deploy" / "examples" / name).read_bytes(), name
    [k8s] = [n for n in written if n.endswith(".k8s.yaml")]
    service, job = yaml.safe_load_all((tmp_path / k8s).read_text())
    assert job["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountPath"] == "/shared/kiln/.kiln/storage"


def test_deploy_render_loads_no_dagster(tmp_path):
    """deploy/render.py, run as a script, never imports Dagster (nor torch): it needs only kiln.train.cluster."""
    code = ("import runpy, sys; "
            f"sys.argv = ['deploy/render.py', '--out', {str(tmp_path)!r}]; "
            "runpy.run_path('deploy/render.py', run_name='__main__'); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pydantic') "
            "or m == 'dagster' or m.startswith(('dagster.', 'dagster_'))); "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(list(tmp_path.iterdir())) == 3


K8S_VERSION = "1.34"  # the Kubernetes API version the rendered files are checked against (kubernetes-validate's schemas)


def test_rendered_kubernetes_files_validate_against_the_kubernetes_schema(tmp_path):
    """No cluster runs here: the Job, its Service and the dagster-k8s pod spec are checked against Kubernetes' own
    OpenAPI schema (strict: an unknown field is an error), and a broken manifest is refused."""
    import kubernetes_validate

    _render(tmp_path)
    [k8s] = tmp_path.glob("*.k8s.yaml")
    service, job = yaml.safe_load_all(k8s.read_text())
    for doc in (service, job):
        assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION
    assert job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 60
    [pipes] = tmp_path.glob("*.pipes-k8s.yaml")
    spec = yaml.safe_load(pipes.read_text())
    container = {**spec["base_pod_spec"]["containers"][0], "image": spec["image"], "command": spec["command"]}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kiln-pipes"},
           "spec": {**spec["base_pod_spec"], "containers": [container]}}  # as PipesK8sClient fills it in
    assert kubernetes_validate.validate(pod, K8S_VERSION, strict=True) == K8S_VERSION
    broken = json.loads(json.dumps(job))
    broken["spec"]["template"]["spec"]["containers"][0]["resources"]["limitz"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="limitz"):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
