"""What the smoke preset must produce byte for byte: frozen data versions, clean shard hashes, weight digests and scores.

``python tests/frozen.py OUT.json`` runs the smoke preset in a fresh home and writes the record; the e2e suite
compares its own smoke run with ``tests/data/smoke_frozen.json``, or with ``smoke_frozen.<cpu kind>.json`` where one
was recorded on a machine of this CPU kind (``cpu_kind()``: floats match bit for bit only on one kind).

Left out, with the reason: eval_suite, contamination_report and eval_scores hash task files that name the run's
absolute storage root; dpo_model and rl_model versions hash per-run bookkeeping (their weights digests are
compared instead); release_bundle records the runs that made it (its weights file is compared instead).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
FROZEN = DATA / "smoke_frozen.json"


def cpu_kind() -> str:
    """This machine's CPU vendor and the vector ISA torch dispatches to, e.g. ``AuthenticAMD-AVX512``. Float results
    (the quality classifier's scores, every trained weight) are reproducible bit for bit on one kind, not across
    kinds: BLAS kernels differ by vendor and by ISA."""
    import platform

    import torch

    vendor = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                vendor = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{vendor}-{torch.backends.cpu.get_cpu_capability()}"


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def compare(got: dict, frozen: dict) -> tuple[list[str], dict]:
    """(entries that differ from the frozen record, {entry it leaves unrecorded: this run's value}), by dotted key
    (a shard's file name keeps its dots). A record made on another CPU kind holds null where a change moved floats
    that only a machine of that kind can give again (the change's commit says which); every other entry, and the set
    of keys, must match."""
    g, f = _flat(got), _flat(frozen)
    differ = sorted(k for k in set(g) | set(f) if k not in g or k not in f or (f[k] is not None and g[k] != f[k]))
    return differ, {k: g[k] for k in sorted(f) if f[k] is None and k in g}


def frozen_path() -> Path:
    """The record for this CPU kind (``smoke_frozen.<kind>.json``) where one was made on it, else the first one."""
    own = DATA / f"smoke_frozen.{cpu_kind()}.json"
    return own if own.is_file() else FROZEN


STABLE_VERSIONS = ("raw_documents", "clean_corpus", "tokenizer", "token_shards", "training_plan", "base_model",
                   "instruction_data", "preference_data", "sft_model", "judged_preferences")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _weights(checkpoint: str) -> str:
    import torch

    from kiln.train.checkpoint import load_state, weights_digest

    state, _ = load_state(Path(checkpoint), "cpu")
    return weights_digest(state["model"])


def record(home: Path, instance, result) -> dict:
    """The frozen record of one smoke run in ``home`` (a Dagster instance and the run's result)."""
    from dagster import AssetKey

    versions = {k: instance.get_latest_materialization_event(AssetKey(k)).asset_materialization.tags["dagster/data_version"]
                for k in STABLE_VERSIONS}
    root = home / "storage" / "clean_shards"
    shards = {str(f.relative_to(root)): _sha256(f) for f in sorted(root.rglob("*"))
              if f.is_file() and f.suffix == ".parquet"}
    out = result.output_for_node
    scores = {t: {k: v for k, v in s.items() if isinstance(v, (int, float))} for t, s in out("eval_scores")["tasks"].items()}
    return {
        "data_versions": versions,
        "clean_shards": shards,
        "clean_corpus_sha256": _sha256(Path(out("clean_corpus")["path"])),
        "weights": {k: _weights(out(k)["checkpoint"]) for k in ("base_model", "sft_model", "dpo_model", "rl_model")},
        "release_weights_sha256": _sha256(Path(out("release_bundle")["dir"]) / "model.safetensors"),
        "eval_scores": scores,
    }


if __name__ == "__main__":
    import sys
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from dagster import DagsterInstance

    from jobs.presets import load_preset
    from jobs.definitions import make_definitions

    home = Path(tempfile.mkdtemp(prefix="kiln-frozen-"))
    cache = sys.argv[2] if len(sys.argv) > 2 else str(home / "source-cache")
    instance = DagsterInstance.ephemeral()
    result = make_definitions(home, cache).resolve_job_def("kiln_pipeline_job").execute_in_process(
        run_config=load_preset("smoke"), instance=instance)
    Path(sys.argv[1]).write_text(json.dumps(record(home, instance, result), indent=1, sort_keys=True) + "\n")
