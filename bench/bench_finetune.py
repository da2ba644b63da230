"""The finetune preset measured: a released model (SmolLM2-135M-Instruct) against what the preset makes of it.

Run: ``python bench/bench_finetune.py --variant lora --seed 0 --home /tmp/ft-lora-0 [--limit 100]``. It runs
``kiln run --preset finetune`` (with the variant's one field set on every training stage: lora, qlora or full, and the
seed) in that home, timing the whole run and each asset and taking the largest process's peak memory; then it scores,
on the same items, the imported model (pretrained_model's checkpoint) and the released weights (release_bundle):

- held-out bits per byte on the demo corpus's held-out documents (eval_suite's kiln_heldout_ppl: documents no stage
  trained on); target: the release at least 10% below the import;
- the standard benchmarks (kiln.evaluation.standard, lm-eval's own task definitions) on a seeded subsample of
  ``--limit`` items each, with standard errors; target: none below the import by more than the 95% interval of the
  difference (1.96 x sqrt(se_before^2 + se_after^2), the two scores taken as independent).

Writes bench/results/finetune_<variant>_seed<seed>.md and .json (command, commit, date, machine line inside). A second
call on a finished home reuses every asset (the run's time is then the reuse's; the first call's is kept in the JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from provenance import header, header_md, machine_line  # noqa: E402

VARIANTS = {"lora": {"enabled": True, "rank": 16, "alpha": 32.0},
            "qlora": {"enabled": True, "rank": 16, "alpha": 32.0, "quantize": "nf4"},
            "full": {"enabled": False}}
STAGES = ("base_model", "sft_model", "dpo_model", "rl_model")
TASKS = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "boolq", "openbookqa", "sciq", "mmlu",
         "lambada_openai")  # the multiple-choice and last-word sets; generation tasks (gsm8k, MATH, code) sit at 0 at 135M
STEP_LINE = re.compile(r"^✓ (\w+)\s+(?:(\d+)m)?(\d+)s")
CHAT = ("What does the SQL statement VACUUM do in SQLite?", "And how do I run it from Python?",
        "Thanks! Summarise that in one sentence.")  # one conversation, the same turns for both models, greedy


def variant_preset(variant: str, seed: int, path: Path) -> Path:
    ops = {stage: {"config": {"lora": VARIANTS[variant], "seed": seed}} for stage in STAGES}
    if variant == "full":  # every weight trains: the demo's fine-tuning rates, not the adapters' tenfold ones
        ops["base_model"]["config"]["optim"] = {"lr": 1.0e-4}
        ops["sft_model"]["config"]["optim"] = {"lr": 5.0e-5}
    import yaml

    # YAML, not JSON text: PyYAML reads JSON's 5e-05 as a string (its floats need a dot), which the preset refuses
    path.write_text(yaml.safe_dump({"extends": "finetune", "ops": ops}, sort_keys=False))
    return path


CHECK_FAILED = re.compile(r"^✗ (\w+)_(release_red_team|release_no_regression|contamination_below_threshold) failed")
STEP_FAILED = re.compile(r"^✗ (\w+) failed")
CHECK_LINE = re.compile(r"^\s+(red team: .*|.* is above the limit .*)$")


def parse_log(text: str) -> dict:
    """Asset seconds, the release gates that failed (with their reasons) and the steps that failed, from kiln run's
    output."""
    steps, checks, failed, reasons = {}, [], [], []
    for line in text.splitlines():
        m = STEP_LINE.match(line.strip())
        if m:
            steps[m.group(1)] = int(m.group(2) or 0) * 60 + int(m.group(3))
        if check := CHECK_FAILED.match(line.strip()):
            checks.append(check.group(2))
        elif step := STEP_FAILED.match(line.strip()):
            failed.append(step.group(1))
        if CHECK_LINE.match(line) and not line.strip().startswith("!") and line.strip() not in reasons:
            reasons.append(line.strip())
    return {"asset_s": steps, "checks_failed": checks, "check_reasons": reasons, "steps_failed": failed}


def run_preset(preset: Path, home: Path) -> dict:
    """kiln run of the preset in ``home``. A run whose only failures are release gates (asset checks: the release
    was written, its alias not moved) counts as finished, and the gates that failed are reported."""
    t0 = time.perf_counter()
    proc = subprocess.run([str(ROOT / ".venv" / "bin" / "kiln"), "run", "--preset", str(preset), "--home", str(home)],
                          cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    parsed = parse_log(proc.stdout)
    released = any((home / "storage").glob("release_bundle/*/SHA256SUMS"))
    if proc.returncode != 0 and (parsed["steps_failed"] or not parsed["checks_failed"] or not released):
        raise SystemExit(f"kiln run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # GiB: the largest process it waited for
    return {"wall_s": round(wall, 1), **parsed, "peak_rss_gib": round(peak, 2), "log": proc.stdout[-4000:]}


def run_from_log(path: Path) -> dict:
    """The first run's figures from its saved output (this bench's own log of a run that stopped before the bench
    could record it): wall time from kiln's last line, asset seconds, gates; peak memory is not in it."""
    text = path.read_text()
    m = re.search(r"kiln: run \S+ (?:FAILED|finished|succeeded) after (\d+)s", text)
    return {"wall_s": float(m.group(1)) if m else None, **parse_log(text), "peak_rss_gib": None,
            "from_log": str(path)}


def newest(pattern: str, home: Path) -> Path:
    found = sorted((home / "storage").glob(pattern), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"{home}: nothing matches storage/{pattern}; did the run finish?")
    return found[-1]


def heldout_bpb(model, enc, suite_dir: Path, limit: int | None) -> dict:
    from kiln.evaluation.suite import run_suite

    row = run_suite(model, enc, suite_dir, ["kiln_heldout_ppl"], limit=limit, batch_size=8)["kiln_heldout_ppl"]
    return {"bits_per_byte": row["bits_per_byte"], "items": row.get("items")}


def transcript(path: Path, max_new_tokens: int = 96) -> list[dict]:
    """The CHAT turns through ``kiln chat``'s session (the model's own chat template, KV cache kept across turns),
    greedy, on a release bundle, a checkpoint or a GGUF file."""
    from kiln.release.load import load_chat_model
    from kiln.model.chat import ChatSession

    model, enc, template = load_chat_model(path, None)
    session = ChatSession(model, enc, template, max_new_tokens=max_new_tokens, temperature=0.0)
    return [{"user": turn, "model": "".join(session.reply(turn))} for turn in CHAT]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="lora")
    ap.add_argument("--seed", type=int, default=0, help="every training stage's seed (initialisation of adapters, order)")
    ap.add_argument("--home", required=True, help="the Kiln home the preset runs in (reused when it finished)")
    ap.add_argument("--limit", type=int, default=100, help="items per benchmark (a seeded subsample)")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--eval-seed", type=int, default=1234, help="seed of the benchmark subsample (the same before/after)")
    ap.add_argument("--out", default="")
    ap.add_argument("--heldout-limit", type=int, default=None, help="held-out passages scored (default: all)")
    ap.add_argument("--first-run-log", default="", help="this bench's saved output of an earlier run in --home that "
                    "stopped before it was recorded: its time and asset seconds are the first run's")
    args = ap.parse_args(argv)
    print(f"machine: {machine_line()}", flush=True)
    import tempfile

    from kiln.evaluation.registry import REGISTRY
    from kiln.evaluation.standard.run import fitting_limit, prepare

    # an unknown name fails here, before the run, listing the known ones; a group (mmlu) takes at least two items
    # per subtask, so that each has a standard error
    limits = {task: fitting_limit(REGISTRY.benchmark(task), args.limit) for task in args.tasks.split(",")}
    cache0 = Path(args.home) / "storage" / "cache" / "sources"
    with tempfile.TemporaryDirectory() as tmp:  # every task, limit and the data checked before the run
        for task, k in limits.items():
            prepare([task], cache0 if cache0.is_dir() else ROOT / ".kiln" / "storage" / "cache" / "sources",
                    Path(tmp) / task, k, args.eval_seed)
    home = Path(args.home)
    home.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or ROOT / "bench" / "results" / f"finetune_{args.variant}_seed{args.seed}")
    previous = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").is_file() else {}
    if args.first_run_log and not previous.get("first_run"):
        previous = {"first_run": run_from_log(Path(args.first_run_log))}
    cache_prefilled = any((home / "storage" / "cache" / "sources").glob("*/.kiln-source.json"))
    run = run_preset(variant_preset(args.variant, args.seed, home / "bench_preset.yaml"), home)
    run["cache_prefilled"] = cache_prefilled
    print(f"kiln run: {run['wall_s']:.0f} s, peak RSS {run['peak_rss_gib']:.2f} GiB", flush=True)

    import torch

    from kiln.release.load import load_any_model
    from kiln.common.files import stable_hash
    from kiln.evaluation.standard import run_standard
    from kiln.train.checkpoint import checkpoint_identity, load_for_inference

    torch.set_num_threads(max(1, torch.get_num_threads()))
    imported = newest("pretrained_model/*/checkpoints/step_0000000", home)
    release = newest("release_bundle/*/SHA256SUMS", home).parent
    suite_dir = newest("eval_suite/*/kiln_heldout_ppl.yaml", home).parent
    cache = home / "storage" / "cache" / "sources"
    rows, bpb = {}, {}
    # the imported model's scores depend only on it, the held-out documents and the items: another variant's or
    # seed's results file with the same ones is reused (and says so) rather than scored again
    same = {"imported": checkpoint_identity(imported), "suite": stable_hash(sorted(p.name for p in suite_dir.iterdir())),
            "tasks": args.tasks, "limit": args.limit, "eval_seed": args.eval_seed,
            "heldout_limit": args.heldout_limit}
    reused_from = None
    for f in sorted((ROOT / "bench" / "results").glob("finetune_*.json")):
        doc = json.loads(f.read_text())
        if doc.get("imported_inputs") == same and doc.get("imported_scores"):
            rows["imported"], bpb["imported"], reused_from = doc["imported_scores"], doc["heldout_bpb"]["imported"], f.name
            print(f"imported: scores reused from {f.name}", flush=True)
            break
    for label, path in (("imported", imported), ("finetuned", release)):
        if label in rows:
            continue
        model, enc = (load_for_inference(path)[:2] if label == "imported" else load_any_model(path))
        t0 = time.perf_counter()
        bpb[label] = heldout_bpb(model, enc, suite_dir, args.heldout_limit)
        rows[label] = {}
        for task, k in limits.items():
            scores, _ = run_standard(model, enc, [task], cache_dir=cache, limit=k, seed=args.eval_seed, batch_size=8)
            rows[label].update(scores)
        print(f"{label}: {bpb[label]['bits_per_byte']:.4f} bits per byte held out; benchmarks in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    chats = {"imported": transcript(imported), "finetuned": transcript(release)}
    change = bpb["finetuned"]["bits_per_byte"] / bpb["imported"]["bits_per_byte"] - 1
    table = []
    for task in args.tasks.split(","):
        b, a = rows["imported"].get(task) or {}, rows["finetuned"].get(task) or {}
        if b.get("score") is None or a.get("score") is None:
            table.append({"task": task, "missing": True})
            continue
        sb, sa = b.get("stderr") or 0.0, a.get("stderr") or 0.0
        half = 1.96 * math.sqrt(sb ** 2 + sa ** 2)
        table.append({"task": task, "metric": b["primary"], "items": a.get("items"), "before": b["score"],
                      "before_se": sb, "after": a["score"], "after_se": sa, "diff": a["score"] - b["score"],
                      "interval": half, "forgot": a["score"] < b["score"] - half})
    result = {**header(argv if argv is not None else sys.argv), "variant": args.variant, "seed": args.seed,
              "home": str(home), "run": {k: v for k, v in run.items() if k != "log"},
              "first_run": previous.get("first_run") or {k: v for k, v in run.items() if k != "log"},
              "heldout_bpb": bpb, "bpb_change": change, "bpb_target_met": change <= -0.10,
              "benchmarks": table, "forgetting_target_met": not any(r.get("forgot") for r in table),
              "imported": str(imported), "release": str(release), "chat": chats, "imported_inputs": same,
              "imported_scores": rows["imported"], "imported_scores_from": reused_from}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    first = result["first_run"]
    cached = bool(first.get("cache_prefilled", cache_prefilled))
    peaks = [float(m) for f in (home / "storage").glob("*/*/train.log")
             for m in re.findall(r"\| ([0-9.]+) GiB \|", f.read_text())]
    train_peak = max(peaks, default=float("nan"))
    md = [f"# finetune preset, {args.variant}, seed {args.seed}", "", *header_md(argv if argv is not None else sys.argv),
          f"`kiln run --preset finetune` with every training stage's `lora` = {json.dumps(VARIANTS[args.variant])} and "
          f"seed {args.seed}, in {home}: {first['wall_s']:.0f} s on its first run (package fetches and the source "
          f"download included when the home's source cache was empty; {'it was filled beforehand' if cached else 'it was empty'}), "
          + (f"the largest process's peak RSS {first['peak_rss_gib']:.2f} GiB." if first.get("peak_rss_gib") is not None
             else f"peak RSS not recorded (figures from {first.get('from_log')}); the training processes' own logs "
                  f"peak at {train_peak:.2f} GiB.")
          + (f" Release gates that failed (the release was written, its alias not moved): "
             f"{', '.join(first['checks_failed'])}: {'; '.join(first.get('check_reasons', []))}." if first.get("checks_failed") else ""),
          "",
          "| asset | seconds |", "|---|---:|", *[f"| {k} | {v} |" for k, v in first["asset_s"].items()], "",
          f"Held-out bits per byte (demo corpus, {bpb['imported']['items']} held-out documents): imported "
          f"{bpb['imported']['bits_per_byte']:.4f}, fine-tuned {bpb['finetuned']['bits_per_byte']:.4f} "
          f"({change:+.1%}; target -10%: {'met' if change <= -0.10 else 'missed'}).", "",
          f"Benchmarks, {args.limit} seeded items each (a group at least two per subtask: mmlu 114; seed {args.eval_seed}), imported -> fine-tuned; 'forgot' where the "
          f"fine-tuned score is below the imported one by more than the 95% interval of the difference:", "",
          "| task | metric | items | imported | fine-tuned | difference | 95% interval | forgot |",
          "|---|---|---:|---:|---:|---:|---:|---|",
          *[f"| {r['task']} | {r['metric']} | {r['items']} | {r['before']:.3f} ± {r['before_se']:.3f} | "
            f"{r['after']:.3f} ± {r['after_se']:.3f} | {r['diff']:+.3f} | ±{r['interval']:.3f} | {'yes' if r['forgot'] else 'no'} |"
            if not r.get("missing") else f"| {r['task']} | - | - | - | - | - | - | not scored |" for r in table], "",
          "`kiln chat` (the model's chat template, greedy, 96 tokens a turn at most), one conversation, imported then "
          "fine-tuned:", ""]
    for label in ("imported", "finetuned"):
        md += [f"**{label}**", "", "~~~~"]
        for t in chats[label]:
            md += [f"you> {t['user']}", f"model> {t['model'].strip()}"]
        md += ["~~~~", ""]
    out.with_suffix(".md").write_text("\n".join(md))
    print(f"wrote {out.with_suffix('.md')}", flush=True)
    return result


if __name__ == "__main__":
    main()
