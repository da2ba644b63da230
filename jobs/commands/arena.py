"""``kiln arena``: blind side-by-side votes between models in the browser, with ratings."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


from jobs.commands._common import add_home, add_sampling, model_path
from kiln.release.load import load_any_model


def add_parser(sub: Any) -> None:
    ar = sub.add_parser("arena", help="blind side-by-side votes between two or more models in the browser, with ratings")
    ar.add_argument("models", nargs="+", metavar="MODEL", help="release bundle folder, checkpoint (or run folder), or "
                    "models:/NAME/VERSION; two or more")
    add_home(ar, "Kiln home: votes go to HOME/arena/<id>/votes.jsonl, "
                    "default prompts are its instruction_data's held-out ones")
    ar.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 (0 picks a free one)")
    ar.add_argument("--prompts", default=None, help="YAML, JSONL or text file of prompts (default: see --home, else "
                    "conf/arena_prompts.yaml)")
    add_sampling(ar, 60, "tokens each model samples per answer", 0.0, "0 answers greedily",
                 seed_help="seeds the pairing, the sides, sampling and the bootstrap")
    ar.add_argument("--tracking-uri", default=None, help="MLflow for models:/ references and the arena's run "
                    "(default: sqlite HOME/mlflow.db)")
    ar.set_defaults(fn=cmd_arena)


def display_name(ref: str, path: Path) -> str:
    """What the arena calls a model (its folder stays in its record): a registry reference as given, a release by
    the name in its kiln.json, a checkpoint as run@step, a run folder by its name; never a machine's whole path."""
    from kiln.release.bundle import is_release

    if ref.startswith("models:/"):
        return ref
    path = Path(path)
    if is_release(path):
        try:
            return json.loads((path / "kiln.json").read_text()).get("name") or path.name
        except (OSError, ValueError):
            return path.name
    if path.name.startswith("step_") and path.parent.name == "checkpoints":
        return f"{path.parents[1].name}@{path.name.removeprefix('step_').lstrip('0') or '0'}"
    return path.name


def unique_name(name: str, taken: list[str]) -> str:
    """``name``, or ``name (2)``, ``name (3)`` ... when it is taken."""
    n, out = 2, name
    while out in taken:
        out, n = f"{name} ({n})", n + 1
    return out


def cmd_arena(args: argparse.Namespace) -> int:
    from kiln.arena.app import serve
    from kiln.arena.contestants import SamplingConfig, model_contestant
    from kiln.arena.prompts import load_prompts
    from kiln.arena.session import Arena

    home = Path(args.home).resolve()
    uri = args.tracking_uri or f"sqlite:///{home / 'mlflow.db'}"
    if len(set(args.models)) < len(args.models) or len(args.models) < 2:
        raise SystemExit(f"kiln arena: give two or more different models, got {args.models}")
    sampling = SamplingConfig(args.max_new_tokens, args.temperature, args.top_k, args.seed)
    what = "give a release bundle folder, a checkpoint (or run folder), or models:/NAME/VERSION (or models:/NAME@ALIAS)"
    contestants = []
    for ref in args.models:
        path, _ = model_path(ref, uri)
        if not path.exists():
            raise SystemExit(f"kiln arena: {ref}: no such folder; {what}")
        try:
            model, enc = load_any_model(path)
        except (OSError, ValueError, RuntimeError) as e:  # not a model folder, damaged bundle, corrupt tokenizer
            raise SystemExit(f"kiln arena: cannot load {ref} ({path}): {e}; {what}") from e
        name = unique_name(display_name(ref, path), [c.name for c in contestants])
        contestants.append(model_contestant(name, str(path.resolve()), model, enc, sampling))
    try:
        prompts, source = load_prompts(args.prompts, home)
    except ValueError as e:
        raise SystemExit(f"kiln arena: {e}") from e

    def tracker(arena_id, members):
        from kiln.arena.tracking import ArenaTracker

        return ArenaTracker(uri, arena_id, members, home / "mlartifacts", prompts_from=source)

    try:
        arena = Arena(contestants, prompts, home / "arena", args.seed, sampling.key(), tracker)
    except ValueError as e:  # two references to the same weights, a damaged votes file
        raise SystemExit(f"kiln arena: {e}") from e
    print(f"kiln arena {arena.id}: {len(contestants)} models, {len(prompts)} prompts from {source}; "
          f"votes in {arena.log.path} ({arena.counts()['votes']} so far); MLflow {uri} experiment 'arena'")
    try:
        serve(arena, args.port, on_ready=lambda url: print(f"open {url} (Ctrl-C stops)", flush=True))
    except OSError as e:
        raise SystemExit(f"kiln {e}") from e
    print(f"kiln arena stopped: {arena.counts()['votes']} votes in {arena.log.path}")
    return 0
