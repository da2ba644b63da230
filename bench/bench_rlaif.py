"""Benchmark: what do an AI judge's preference labels (RLAIF) do, against labels checkable by construction? On one
demo home, DPO and the reward model are trained three ways (``feedback``): checkable (preference_data's training pairs,
the default), judged (judged_preferences' pairs alone) and mixed (both), and measured on the same held-out
preference_data pairs, whose right answers are known. The judge's own agreement with those labels is beside them.

python bench/bench_rlaif.py --home HOME [--prompts 256] [--seed S] [--json out.json] [--md out.md]

HOME is a materialized demo home (``kiln run --preset demo --home HOME``); work on a copy (``cp -a``), as the bench
adds to it. It runs ``kiln run --preset rlhf`` (through ``python -m jobs.cli``) with a preset of its own: first
``--select judged_preferences`` (the SFT model judging two sampled answers for each of ``--prompts`` training prompts),
then ``--select dpo_model`` and ``--select reward_model`` once per feedback. Without ``--seed`` every other setting is
the preset's, so checkable DPO is the demo's own run, reused (its run key does not change with the option); with
``--seed`` the judge's prompts and sampling, and the DPO and reward runs' data order and initialisation, take that
seed, so every run trains again: an independent second measurement. Everything is read back from the assets' outputs.
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FEEDBACK = ("checkable", "judged", "mixed")


def handle(home: Path, asset: str) -> dict:
    """The latest output of ``asset`` in ``home`` (the IO manager's handle on disk)."""
    return pickle.loads((home / "storage" / "handles" / asset).read_bytes())


def preset_file(folder: Path, prompts: int, seed: int | None, feedback: str) -> Path:
    """The rlhf preset with the judge's prompt count, ``feedback`` for both stages, and the seed when given."""
    seeded = f"\n      seed: {seed}" if seed is not None else ""
    path = folder / f"rlaif-{feedback}.yaml"
    path.write_text(f"extends: {ROOT / 'conf/presets/rlhf.yaml'}\nops:\n"
                    f"  judged_preferences:\n    config:\n      prompts: {prompts}{seeded}\n"
                    f"  dpo_model:\n    config:\n      feedback: {feedback}{seeded}\n"
                    f"  reward_model:\n    config:\n      feedback: {feedback}{seeded}\n")
    return path


def kiln_run(home: Path, preset: Path, select: str) -> float:
    """``kiln run --preset PRESET --select SELECT`` in ``home``; its wall time (s). A failure ends the bench."""
    t0 = time.time()
    run = subprocess.run([sys.executable, "-m", "jobs.cli", "run", "--preset", str(preset), "--home", str(home),
                          "--select", select], cwd=ROOT, capture_output=True, text=True)
    took = time.time() - t0
    if run.returncode:
        print(run.stdout[-4000:], run.stderr[-4000:], sep="\n")
        raise SystemExit(f"kiln run --select {select} failed ({preset})")
    return took


def trained_before(value: dict, since: float) -> bool:
    """True when the run the value comes from finished before ``since`` (an earlier run reused, not trained now)."""
    result = Path(value["out_dir"]) / "result.json"
    return result.is_file() and result.stat().st_mtime < since


def judged_label_accuracy(judged: dict, instruction_data: dict) -> dict:
    """How often the judge's label is right on its own training pairs where it can be checked: arithmetic pairs in
    which exactly one of the two sampled answers is the exact sum."""
    from kiln.posttrain.instructions import arithmetic_reward
    from kiln.posttrain.sft import read_pairs

    answers = {r["prompt"]: r["answer"] for r in read_pairs(instruction_data["path"]) if r["kind"] == "arithmetic"}
    rows = [r for r in read_pairs(judged["path"]) if r["kind"] == "arithmetic"]
    checkable = [(arithmetic_reward(r["chosen"], answers[r["prompt"]]), arithmetic_reward(r["rejected"], answers[r["prompt"]]))
                 for r in rows if r["prompt"] in answers]
    decided = [c > r for c, r in checkable if c != r]
    n = len(decided)
    acc = sum(decided) / n if n else None
    return {"arithmetic_pairs": len(rows), "one_answer_right": n, "judge_right": sum(decided), "accuracy": acc,
            "stderr": math.sqrt(acc * (1 - acc) / n) if n else None,
            "both_right": sum(c == r == 1.0 for c, r in checkable), "both_wrong": sum(c == r == 0.0 for c, r in checkable)}


def feedback_of(value: dict) -> dict:
    """The value's feedback record; a run recorded before the option existed trained on the checkable pairs alone."""
    return value.get("feedback") or {"choice": "checkable", "pairs": {"checkable": value["pairs"]["train"], "judged": 0},
                                     "held_out_pairs": value["pairs"]["val"], "judged_preferences": None}


def measure(rows: list[dict], name: str) -> dict:
    return next(r for r in rows if r["measure"] == name)


def dpo_row(value: dict, call_s: float, reused: bool) -> dict:
    acc, margin = measure(value["before_after"], "preference_accuracy"), measure(value["before_after"], "preference_margin")
    final = value.get("final_val") or {}
    return {"feedback": value["feedback"]["choice"], "pairs": value["feedback"]["pairs"],
            "held_out_pairs": acc["items"],
            "preference_accuracy": {k: acc[k] for k in ("before", "after", "change", "stderr")},
            "preference_margin": {k: margin[k] for k in ("before", "after", "change", "stderr")},
            "dpo_reward_accuracy": final.get("reward_accuracy"), "dpo_reward_margin": final.get("reward_margin"),
            "train_wall_s": value["wall_s"], "call_s": call_s, "reused": reused, "version": value["version"]}


def reward_row(value: dict, call_s: float, reused: bool) -> dict:
    first, final = value.get("initial_val") or {}, value.get("final_val") or {}
    return {"feedback": value["feedback"]["choice"], "pairs": value["feedback"]["pairs"],
            "held_out_pairs": value["pairs"]["val"],
            "accuracy": {"before": first.get("accuracy"), "after": final.get("accuracy")},
            "margin": {"before": first.get("margin"), "after": final.get("margin")},
            "train_wall_s": value["wall_s"], "call_s": call_s, "reused": reused, "version": value["version"]}


def _se(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n) if n else float("nan")


def report(out: dict) -> str:
    j, lab = out["judge"], out["judged_label_accuracy"]
    a = j["agreement"]
    seed = out["seed"] if out["seed"] is not None else "the presets'"
    lines = [f"# bench_rlaif: {out['home']} (judge: the SFT model, rule {j['rule']}; {out['prompts']} prompts; seed "
             f"{seed}); judged_preferences took {out['judge_call_s']:.0f} s\n",
             "| the judge | value |", "|---|---:|",
             f"| agreement with the checkable labels (held-out preference_data pairs) | {a['agreement']:.3f} ± {a['stderr']:.3f} (n={a['n']}, {a['ties']} ties) |",
             f"| verdict flipped with the order shown (position bias) | {j['position_bias']['checkable']:.3f} |",
             f"| sampled pairs labelled (ties and identical answers left out) | {j['pairs_labelled']} of {j['pairs_judged']} judged, {j['identical_skipped']} identical |",
             f"| its labels on its own arithmetic pairs with one right answer | {lab['judge_right']} of {lab['one_answer_right']} right"
             + (f" ({lab['accuracy']:.3f} ± {lab['stderr']:.3f})" if lab["one_answer_right"] else "")
             + f"; {lab['both_wrong']} pairs both wrong, {lab['both_right']} both right, of {lab['arithmetic_pairs']} |",
             "", "DPO (held-out measures on the same preference_data pairs; change ± paired standard error):", "",
             "| feedback | pairs checkable | pairs judged | preference accuracy before -> after (change) | preference margin before -> after (change) | DPO held-out reward accuracy | train wall | call |",
             "|---|---:|---:|---|---|---:|---:|---:|"]
    for r in out["dpo"]:
        pa, pm = r["preference_accuracy"], r["preference_margin"]
        lines.append(f"| {r['feedback']} | {r['pairs']['checkable']} | {r['pairs']['judged']} | {pa['before']:.3f} -> "
                     f"{pa['after']:.3f} ({pa['change']:+.3f} ± {pa['stderr']:.3f}) | {pm['before']:.2f} -> {pm['after']:.2f} "
                     f"({pm['change']:+.2f} ± {pm['stderr']:.2f}) | {r['dpo_reward_accuracy']:.3f} | {r['train_wall_s']:.0f} s"
                     f"{' (reused)' if r['reused'] else ''} | {r['call_s']:.0f} s |")
    lines += ["", "Reward model (Bradley-Terry, arithmetic pairs; held out on preference_data's):", "",
              "| feedback | pairs checkable | pairs judged | held-out accuracy start -> end | held-out margin start -> end | train wall | call |",
              "|---|---:|---:|---|---|---:|---:|"]
    for r in out["reward"]:
        acc, m, n = r["accuracy"], r["margin"], r["held_out_pairs"]
        lines.append(f"| {r['feedback']} | {r['pairs']['checkable']} | {r['pairs']['judged']} | {acc['before']:.3f} -> "
                     f"{acc['after']:.3f} ± {_se(acc['after'], n):.3f} (n={n}) | {m['before']:.3f} -> {m['after']:.3f} | "
                     f"{r['train_wall_s']:.0f} s{' (reused)' if r['reused'] else ''} | {r['call_s']:.0f} s |")
    lines.append(f"\ntotal {out['wall_s']:.0f} s")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--home", required=True, help="a materialized demo home (work on a copy: the bench adds to it)")
    ap.add_argument("--prompts", type=int, default=256, help="training prompts the judge labels (two answers each)")
    ap.add_argument("--seed", type=int, default=None, help="seed of the judge's sampling and the DPO and reward runs "
                    "(default: the presets', so checkable DPO is the demo's own run)")
    ap.add_argument("--json", default="", help="write every figure here")
    ap.add_argument("--md", default="", help="write the tables here too")
    a = ap.parse_args()
    home = Path(a.home).resolve()
    if not (home / "storage" / "handles" / "sft_model").is_file():
        raise SystemExit(f"{home}: no sft_model: materialize the demo there first (kiln run --preset demo --home {home})")
    folder = Path(tempfile.mkdtemp(prefix="bench-rlaif-"))
    t0 = time.time()
    judge_call = kiln_run(home, preset_file(folder, a.prompts, a.seed, "checkable"), "judged_preferences")
    judged = handle(home, "judged_preferences")
    out: dict = {"home": str(home), "prompts": a.prompts, "seed": a.seed, "judge_call_s": judge_call,
                 "judge": {**judged["summary"], "version": judged["version"], "identity": judged["judge"],
                           "rule": judged["rule"], "principles": judged["principles"]},
                 "judged_label_accuracy": judged_label_accuracy(judged, handle(home, "instruction_data")),
                 "dpo": [], "reward": []}
    for stage, key, row in (("dpo_model", "dpo", dpo_row), ("reward_model", "reward", reward_row)):
        for feedback in FEEDBACK:
            start = time.time()
            call = kiln_run(home, preset_file(folder, a.prompts, a.seed, feedback), stage)
            value = handle(home, stage)
            value["feedback"] = feedback_of(value)
            assert value["feedback"]["choice"] == feedback, (stage, feedback, value["feedback"])
            out[key].append(row(value, call, trained_before(value, start)))
            print(f"{stage} {feedback}: {call:.0f} s", file=sys.stderr, flush=True)
    out["wall_s"] = time.time() - t0
    text = report(out)
    print(text)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    if a.md:
        Path(a.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
