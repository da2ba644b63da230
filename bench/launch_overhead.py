"""Benchmark, side by side in one run: a small tracked training job launched through torchrun the way the local
launcher launches it (rank 0 spools its MLflow records, the launcher sends them and samples system metrics:
resources.torchrun's ``forwarding_tracking``), against the same job whose worker imports MLflow and sends its own
records (how every worker tracked before, and how Slurm's still do).

python bench/launch_overhead.py [--launches 4] [--steps 20] [--out bench/results/STEM]

The corpus is Kiln's own source (a 512-token BPE); the model is the smoke preset's size (GPT-2, 2 layers of 64,
sequences of 64, 16 a step). Each arm launches ``--launches`` times, taking turns, each into a new run folder and a
new MLflow run of one sqlite store; a launch is timed from torchrun's start until every record is in MLflow. Both
arms must leave the same metric keys, the same number of points of each training metric and the same params in
their runs (checked, and reported). Reported: the median seconds of each arm and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from provenance import write_results  # noqa: E402

ARMS = ("spooled", "worker sends")
RUN_OWN = ("job.out_dir", "job.mlflow_run_id", "peak_flops_per_device")  # params each launch has its own value of


def make_job(work: Path, steps: int) -> dict:
    from kiln.model.config import padded_vocab
    from kiln.tokens.shards import shard_paths, write_shards
    from kiln.tokens.tokenizer import save_encoding, train_bpe

    docs = [(f"d{i}", p.read_text()) for i, p in enumerate(sorted((ROOT / "kiln").rglob("*.py")))]
    enc = train_bpe((t for _, t in docs), 512)
    save_encoding(enc, work / "tokenizer.json")
    write_shards(enc, docs, work / "shards", shard_tokens=1 << 20, val_permille=100, num_workers=1)
    return {"task": "pretrain", "tokenizer": str(work / "tokenizer.json"),
            "model": {"vocab_size": padded_vocab(enc.n_vocab), "block_size": 64, "n_layer": 2, "n_head": 2,
                      "n_embd": 64},
            "train_files": [str(p) for p in shard_paths(work / "shards", "train")],
            "val_files": [str(p) for p in shard_paths(work / "shards", "val")], "seq_len": 64, "micro_batch": 16,
            "max_steps": steps, "eval_interval": 10, "eval_batches": 4, "ckpt_interval": 10, "keep_last": 1,
            "log_interval": 10}


def launch(arm: str, job: dict, out: Path, client, experiment: str, uri: str) -> tuple[float, str]:
    """One launch of ``job`` into ``out`` and a new MLflow run; seconds until its records are all in MLflow."""
    import json

    from resources.torchrun import TorchrunResource

    run_id = client.create_run(experiment, tags={"mlflow.runName": f"{arm} {out.name}"}).info.run_id
    job = {**job, "out_dir": str(out), "mlflow_tracking_uri": uri, "mlflow_run_id": run_id}
    out.mkdir(parents=True)
    (out / "job.json").write_text(json.dumps(job))
    resource = TorchrunResource()
    cmd = resource.command(1, out / "job.json", "cpu")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    if arm == "spooled":
        with resource.forwarding_tracking(job, out, env):
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    else:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{arm}: torchrun exited with {proc.returncode}:\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    client.set_terminated(run_id, "FINISHED")
    return seconds, run_id


def recorded(client, run_id: str) -> dict:
    """What a run holds: its metric keys, the number of points of each training metric, its params."""
    data = client.get_run(run_id).data
    return {"keys": sorted(data.metrics),
            "points": {k: len(client.get_metric_history(run_id, k)) for k in sorted(data.metrics)
                       if not k.startswith("system/")},
            "params": {k: v for k, v in data.params.items() if k not in RUN_OWN}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launches", type=int, default=4, help="launches of each arm, taking turns")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="", help="results stem: STEM.md and STEM.json")
    a = p.parse_args(argv)
    from mlflow.tracking import MlflowClient  # the launcher's process has MLflow loaded: so does this one

    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    runs: dict[str, list[str]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        job = make_job(work, a.steps)
        uri = f"sqlite:///{work / 'mlflow.db'}"
        client = MlflowClient(uri)
        experiment = client.create_experiment("launch-overhead")
        launch(ARMS[1], job, work / "warm-up", client, experiment, uri)  # the store's tables; files into the cache
        for i in range(a.launches):
            for arm in (ARMS if i % 2 == 0 else ARMS[::-1]):
                seconds, run_id = launch(arm, job, work / f"{arm.replace(' ', '-')}-{i}", client, experiment, uri)
                times[arm].append(seconds)
                runs[arm].append(run_id)
                print(f"{arm}: launch {i + 1}/{a.launches} {seconds:.2f} s", flush=True)
        records = {arm: [recorded(client, r) for r in runs[arm]] for arm in ARMS}
    base = records[ARMS[1]][0]
    same = all(r["points"] == base["points"] and r["params"] == base["params"] and
               set(r["keys"]) == set(base["keys"]) for arm in ARMS for r in records[arm])
    median = {arm: statistics.median(times[arm]) for arm in ARMS}
    ratio = median[ARMS[1]] / median[ARMS[0]]
    lines = [f"{a.launches} launches of each arm, taking turns, of a {a.steps}-step job (GPT-2 2 x 64, 16 x 64 tokens "
             "a step, tracked in a sqlite MLflow store), one process under torchrun, OMP_NUM_THREADS=1.", "",
             "| arm | median s a launch | each launch, s |", "|---|---:|---|",
             *[f"| {arm} | {median[arm]:.2f} | {', '.join(f'{t:.2f}' for t in times[arm])} |" for arm in ARMS], "",
             f"A launch whose worker sends its own records takes **{ratio:.2f}x** as long as one whose worker spools "
             f"them to the launcher ({median[ARMS[1]] - median[ARMS[0]]:.2f} s more a launch). Both arms' runs hold "
             f"{'the same' if same else 'DIFFERENT'} metric keys, points and params ({len(base['keys'])} metrics, "
             f"{sum(base['points'].values())} training points, {len(base['params'])} params)."]
    print("\n".join(lines))
    result = {"median_s": median, "launch_s": times, "ratio": ratio, "same_records": same, "recorded": base,
              "launches": a.launches, "steps": a.steps}
    if a.out:
        write_results(a.out, "A tracked launch: worker spooling to its launcher against sending to MLflow itself",
                      lines, result)
        print(f"wrote {a.out}.md and .json")
    if not same:
        odd = next(r for arm in ARMS for r in records[arm] if r != base)
        raise SystemExit("the two arms recorded different things in MLflow: " + "; ".join(
            f"{k}: {base[k]!r} against {odd[k]!r}" for k in base if base[k] != odd[k])[:2000])
    return result


if __name__ == "__main__":
    main()
