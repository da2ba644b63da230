"""What a training run reports while it runs: rank 0's progress lines and MLflow metrics, memory, peak FLOP/s.

``make_logger(job, info)`` is a batched MLflow logger on rank 0 (a no-op elsewhere or without a run id);
``PrintReporter`` prints progress lines (the Pipes worker sends them to Dagster instead).
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path
from typing import Any, Protocol

import torch

from kiln.train.checkpoint import list_checkpoints
from kiln.train.dist import DistInfo


class NullLogger:
    """Stands in for kiln.common.metrics.MetricLogger on ranks that do not report, or when no MLflow run is given."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def log_params(self, params: dict[str, Any]) -> None: ...

    def flush(self) -> None: ...


def make_logger(job, info: DistInfo):
    """Rank 0's batched MLflow logger (kiln.common.metrics.job_logger: into its launcher's spool when it forwards);
    MLflow is imported only where metrics are sent (it takes seconds)."""
    if not (info.is_main and job.mlflow_tracking_uri and job.mlflow_run_id):
        return NullLogger()
    from kiln.common.metrics import job_logger

    return job_logger(job.mlflow_tracking_uri, job.mlflow_run_id)


class Reporter(Protocol):
    def log(self, message: str) -> None: ...


class PrintReporter:
    def log(self, message: str) -> None:
        print(message, flush=True)


def _proc_status_kib(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_memory_gb(device: torch.device, baseline_gb: float = 0.0) -> float:
    """Peak memory of training: CUDA's allocator peak; on CPU the process's peak resident memory above
    ``baseline_gb`` (the interpreter and libraries, measured before the model was built)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    hwm = _proc_status_kib("VmHWM")
    peak = hwm / 1024**2 if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    return max(0.0, peak - baseline_gb)


def resident_gb() -> float:
    rss = _proc_status_kib("VmRSS")
    return rss / 1024**2 if rss is not None else 0.0


def resolve_peak_flops(peak_flops: float, device: torch.device, cpu_bf16: bool = False) -> float:
    """Per-device peak FLOP/s for MFU: the job's, the GPU table's, or a matmul measured now on CPU (0: none), in bf16
    for a run under bf16 autocast on CPU (``cpu_bf16``: on AMX, bf16 matmuls run several times fp32's peak)."""
    from kiln.plan.memory import gpu_peak_tflops, measure_matmul_peak

    if peak_flops != 0:
        return max(peak_flops, 0.0)
    if device.type == "cuda":
        return (gpu_peak_tflops(torch.cuda.get_device_name(device)) or 0.0) * 1e12
    return measure_matmul_peak("cpu", torch.bfloat16 if cpu_bf16 else None)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def checkpoint_table(root: Path) -> list[dict[str, Any]]:
    """One row per checkpoint on disk, oldest first: step, path, validation loss, format and size."""
    rows = []
    for p in list_checkpoints(root):
        meta = json.loads((p / "meta.json").read_text())
        rows.append({"step": meta["step"], "path": str(p), "val_loss": meta.get("val_loss"),
                     "format": meta.get("format"), "bytes": sum(f.stat().st_size for f in p.rglob("*") if f.is_file())})
    return rows


class SystemMetrics:
    """MLflow's own system-metrics logging (``mlflow.system_metrics``: CPU, memory, disk, network through psutil;
    GPU utilisation, memory, temperature and power through NVML on CUDA) into the job's MLflow run, from rank 0,
    every ``job.system_metrics_s`` seconds, as ``system/*`` metrics. A no-op without a run or with the interval 0,
    and in a worker whose launcher forwards its tracking (SPOOL_ENV, set for the workers alone): that launcher, on
    the same machine, samples the machine itself."""

    def __init__(self, job, info: DistInfo):
        from kiln.common.metrics import SPOOL_ENV

        self.monitor = None
        if not (info.is_main and job.mlflow_tracking_uri and job.mlflow_run_id and job.system_metrics_s > 0):
            return
        if os.environ.get(SPOOL_ENV):
            return
        import logging
        import sys

        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # its start/stop notes are noise here
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            # resume_logging: a restarted attempt in the same MLflow run continues its sample count
            self.monitor = SystemMetricsMonitor(job.mlflow_run_id, sampling_interval=job.system_metrics_s,
                                                samples_before_logging=1, resume_logging=True,
                                                tracking_uri=job.mlflow_tracking_uri)
            self.monitor.start()
        except Exception as e:  # psutil missing, tracking unreachable: train on without system metrics
            self.monitor = None
            print(f"system metrics are off: {type(e).__name__}: {e} (pip install psutil nvidia-ml-py)", file=sys.stderr)

    def stop(self) -> None:
        """Stop the monitor and publish the samples of its last, unfinished interval (MLflow drops them), so a run
        shorter than one interval still has a sample."""
        if self.monitor is None:
            return
        try:
            self.monitor.finish()
            last = self.monitor.aggregate_metrics()
            if last:
                self.monitor.publish_metrics(last)
                self.monitor.mlflow_logger.flush()
        except Exception:  # a run already ended elsewhere: the samples logged so far stand
            pass
        finally:
            self.monitor = None
