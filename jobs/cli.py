"""The ``kiln`` command line: run the pipeline with a preset, sample from a model, show a model's lineage.

kiln run --preset demo            materialize every asset with conf/presets/demo.yaml
kiln run --preset smoke --select eval_scores,release_bundle
kiln generate .kiln/storage/release_bundle/<version> --prompt "The"
kiln lineage .kiln/storage/release_bundle/<version>
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

PROJECT = Path(__file__).resolve().parent.parent
PRESETS = PROJECT / "conf" / "presets"


def load_preset(name_or_path: str) -> dict[str, Any]:
    """Run config of a preset (a name under conf/presets or a YAML path); unknown presets name the known ones."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PRESETS / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
        raise SystemExit(f"kiln: no preset '{name_or_path}' ({path}); known presets: {known}")
    data = yaml.safe_load(path.read_text()) or {}
    unknown = set(data) - {"ops", "resources", "execution", "loggers", "extends"}
    if unknown:
        raise SystemExit(f"kiln: {path}: unknown top-level key(s) {sorted(unknown)}; a preset is Dagster run config (ops: ...)")
    base = data.pop("extends", None)
    return deep_merge(load_preset(base), data) if base else data


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key; any other value in ``override`` replaces the base's."""
    out = dict(base)
    for k, v in override.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def select_config(run_config: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """Keep only the op config of the selected assets (Dagster rejects config for assets not in the run)."""
    ops = {k: v for k, v in (run_config.get("ops") or {}).items() if k in keys}
    return {**run_config, "ops": ops}


def cmd_run(args: argparse.Namespace) -> int:
    home = Path(args.home).resolve()
    os.environ.setdefault("DAGSTER_HOME", str(home / "dagster"))
    Path(os.environ["DAGSTER_HOME"]).mkdir(parents=True, exist_ok=True)
    from dagster import AssetKey, DagsterInstance

    from jobs.definitions import ALL_ASSETS, make_definitions

    defs = make_definitions(home)
    names = [a.key.to_user_string() for a in ALL_ASSETS]
    keys = [k.strip() for k in args.select.split(",")] if args.select else names
    bad = [k for k in keys if k not in names]
    if bad:
        raise SystemExit(f"kiln: unknown asset(s) {bad}; assets are: {', '.join(names)}")
    run_config = select_config(load_preset(args.preset), keys)
    job = defs.resolve_job_def("kiln_pipeline_job")
    start = time.time()
    with DagsterInstance.get() as instance:
        result = job.execute_in_process(run_config=run_config, instance=instance, raise_on_error=False,
                                        asset_selection=[AssetKey(k) for k in keys], tags={"kiln/preset": args.preset})
    took = time.time() - start
    if not result.success:
        for ev in result.all_events:
            if ev.is_step_failure:
                print(f"kiln: step {ev.step_key} failed:\n{ev.event_specific_data.error.to_string()}", file=sys.stderr)
        print(f"kiln: run {result.run_id} FAILED after {took:.0f}s", file=sys.stderr)
        return 1
    print(f"kiln: run {result.run_id} materialized {len(keys)} assets in {took:.0f}s (preset {args.preset})")
    for k in keys:
        try:
            value = result.output_for_node(k)
        except Exception:
            continue
        where = value.get("dir") or value.get("path") or value.get("checkpoint") if isinstance(value, dict) else None
        if where:
            print(f"  {k:18s} {where}")
    print("Open the UI with: make ui   (Dagster at http://127.0.0.1:3000, MLflow at http://127.0.0.1:5000)")
    return 0


def load_any_model(path: str):
    """A release bundle or a checkpoint (folder, checkpoints root or run folder) -> (model, tokenizer)."""
    p = Path(path)
    if (p / "SHA256SUMS").is_file():
        from kiln.release import load_release

        return load_release(p)
    from kiln.checkpoint import load_for_inference

    model, enc, _ = load_for_inference(p)
    return model, enc


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    model, enc = load_any_model(args.model)
    g = torch.Generator().manual_seed(args.seed)
    for prompt in args.prompt:
        ids = torch.tensor([enc.encode(prompt, allowed_special="all")])
        out = model.generate(ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                             stop_token=enc.eot_token, generator=g)
        text = enc.decode([t for t in out[0].tolist()[ids.size(1):] if t != enc.eot_token])
        print(f"{prompt}{text}")
    return 0


def cmd_lineage(args: argparse.Namespace) -> int:
    p = Path(args.model)
    info_path = p / "kiln.json"
    if info_path.is_file():
        info = json.loads(info_path.read_text())
        print(json.dumps({"release": str(p), "name": info.get("name"), "checkpoint": info.get("source_checkpoint"),
                          "lineage": info.get("lineage"), "mlflow_runs": info.get("mlflow_runs")}, indent=2))
        return 0
    from kiln.checkpoint import resolve_checkpoint, verify_checkpoint

    ckpt = resolve_checkpoint(p)
    meta = verify_checkpoint(ckpt)
    job_path = ckpt.parent.parent / "job.json"
    job = json.loads(job_path.read_text()) if job_path.is_file() else {}
    print(json.dumps({"checkpoint": str(ckpt), "step": meta["step"], "task": meta.get("task"),
                      "train_files": job.get("train_files"), "init_from": job.get("init_from"),
                      "mlflow_run_id": job.get("mlflow_run_id")}, indent=2))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    print(yaml.safe_dump(load_preset(args.preset), sort_keys=False), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="materialize assets with a preset")
    run.add_argument("--preset", default="demo", help="name under conf/presets (smoke, demo, gpt2-124m-1gpu, ...) or a YAML path")
    run.add_argument("--select", default="", help="comma-separated asset names (default: all)")
    run.add_argument("--home", default=str(PROJECT / ".kiln"), help="folder for storage, MLflow and Dagster history")
    run.set_defaults(fn=cmd_run)
    gen = sub.add_parser("generate", help="sample text from a release bundle or checkpoint")
    gen.add_argument("model")
    gen.add_argument("--prompt", action="append", default=None)
    gen.add_argument("--max-new-tokens", type=int, default=60)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(fn=cmd_generate)
    conf = sub.add_parser("config", help="print a preset's full run config (extends resolved)")
    conf.add_argument("--preset", default="demo")
    conf.set_defaults(fn=cmd_config)
    lin = sub.add_parser("lineage", help="which data, configs and runs made a release or checkpoint")
    lin.add_argument("model")
    lin.set_defaults(fn=cmd_lineage)
    args = parser.parse_args(argv)
    if getattr(args, "prompt", "x") is None:
        args.prompt = ["The"]
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
