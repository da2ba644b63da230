"""Benchmark: does the best AdamW learning rate of a narrow model stay the best at larger width? An lr sweep at several
widths under the standard parametrisation (SP) and under muP (kiln.model.mup, ``mup_base_width`` = the narrowest
width), on the demo's token shards.

python bench/bench_mup.py --shards DIR [--seeds 0,1] [--out bench/results/mup] [--workers 2]
python bench/bench_mup.py --shards DIR --quick        (2 widths, 3 lrs, 20 steps: a check that it runs, ~10 s)

DIR is a token_shards folder (train_*.bin, val_*.bin, manifest.json): a demo home's `.kiln/storage/token_shards/<v>`.

Every run is Kiln's own trainer (kiln.train.loop.main, in-process in one of ``--workers`` processes of one torch thread
each, checkpoints and tracking off), not a loop written here: in-process it costs about a second a run more (a
validation at step 0, the final checkpoint) and the sweep then measures exactly what a training job does (its optimizer
groups with muP's lrs, schedule, clipping, loader). The same seed, batches, schedule (linear warmup, cosine to 0.1 x lr)
and steps; only the width, the parametrisation and AdamW's lr differ. Depth and the head count are fixed (muP grows the
heads' width). Spike rollback is off, so a bad lr runs its course; a run whose loss turns nan/inf (the trainer drops
such updates and gives up after a few in a row) or whose final validation loss is not finite counts as loss = inf and is
shown as "diverged". muP at the base width is the SP model bit for bit (tests/kiln/model/test_mup.py), so those runs are
not repeated: the SP ones are reported for both.

Reported, for each seed (``--seeds``: initial weights and batch order): per (parametrisation, width) the final
validation loss at each lr and the best lr; per parametrisation how many factor-2 grid steps the best lr moves from the
narrowest to the widest width (muP's claim: about 0; SP's best lr falls with width). Over the seeds: each seed's move,
and per (parametrisation, width) how sharp the optimum is: the loss one grid step either side of the best lr minus the
best, beside the seeds' spread at the best lr (an optimum less sharp than the spread cannot be located). Markdown on
stdout and in ``--out``.md (with the command, commit, date and machine), every figure in ``--out``.json, loss vs lr per
width (the seeds' mean) in ``--out``.png.

Cost: one trainer step of the gpt2 shape (2 layers, 4 heads, seq 128, batch 8, vocabulary 4096) took 31, 58, 140 and
396 ms at widths 64, 128, 256, 512 on one thread of a 2-core Xeon; a validation batch about a third of that. The
defaults (8 lrs, 60 steps, 8 validation batches twice a run, 56 runs) are then about 585 s of training steps, 50 s of
validation and 40 s of run set-up, 675 s on one core: about 6 minutes with ``--workers 2`` where both cores are free,
up to about 10 where they are shared (two runs of width 512 at once were measured 1.2-1.9x faster than one after the
other, depending on what else ran).
Cost grows with steps x the sum of the widths' step times; ``--quick`` prints its wall time (about 10 s).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from provenance import machine_line, write_results  # noqa: E402

PARAMS = ("sp", "mup")  # the standard parametrisation, muP relative to the narrowest width
QUICK = {"widths": "64,128", "lr_exps": "-9:-7", "steps": 20, "eval_batches": 4}


def lr_exps(spec: str) -> list[int]:
    """"-12:-5" (every integer exponent from -12 to -5) or "-12,-10,-8" -> the exponents of the factor-2 grid."""
    if ":" in spec:
        lo, hi = (int(s) for s in spec.split(":"))
        return list(range(min(lo, hi), max(lo, hi) + 1))
    return sorted(int(s) for s in spec.split(","))


def job_for(param: str, width: int, exp: int, a: argparse.Namespace, vocab: int) -> dict:
    """A kiln.train.job.JobConfig dict (out_dir left to train_one): ``a.family`` at ``width``, AdamW at lr 2^exp, SP
    or muP."""
    shards = Path(a.shards)
    model = {"family": a.family, "vocab_size": vocab, "block_size": a.seq_len, "n_layer": a.n_layer,
             "n_head": a.n_head, "n_embd": width, "dropout": 0.0,
             "mup_base_width": a.base_width if param == "mup" else 0}
    if a.family == "gpt2":
        del model["family"]
    return {
        "task": "pretrain", "model": model,
        "optim": {"name": "adamw", "lr": 2.0 ** exp, "warmup_steps": a.warmup, "weight_decay": a.weight_decay},
        "seq_len": a.seq_len, "micro_batch": a.batch, "max_steps": a.steps, "eval_interval": a.steps,
        "eval_batches": a.eval_batches, "ckpt_interval": 10**9, "keep_last": 1, "log_interval": 10**9,
        "async_save": False, "system_metrics_s": 0, "peak_flops": -1, "seed": a.seed,
        "spikes": {"enabled": False},  # a sweep's bad lrs run their course; only non-finite losses stop a run
        "train_files": [str(p) for p in sorted(shards.glob("train_*.bin"))],
        "val_files": [str(p) for p in sorted(shards.glob("val_*.bin"))],
    }


class _Quiet:
    def log(self, message: str) -> None: ...

    def warning(self, message: str) -> None: ...


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)  # one thread per worker: two workers on two cores beat one run on two threads


def train_one(job: dict) -> dict:
    """Run one job through kiln's trainer in a fresh folder; its final validation loss (inf when it diverged)."""
    from kiln.train.loop import main
    from kiln.train.spikes import SpikeError

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-mup-") as tmp:
        job = {**job, "out_dir": str(Path(tmp) / "run")}
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        try:
            res = main(["--config", str(Path(tmp) / "job.json"), "--device", "cpu"], reporter=_Quiet())
            loss, why = float(res["final_val_loss"]), ""
        except SpikeError as e:  # non-finite losses, updates dropped until the trainer gave up
            loss, why = math.inf, str(e)
    if not math.isfinite(loss):
        loss, why = math.inf, why or "non-finite validation loss"
    return {"val_loss": loss, "diverged": math.isinf(loss), "why": why, "wall_s": time.perf_counter() - t0}


def sweep(a: argparse.Namespace, vocab: int) -> list[dict]:
    """Every (parametrisation, width, lr) run, widest first over ``a.workers`` processes; muP at the base width is
    the SP run (the same model bit for bit) and is copied, not repeated."""
    exps = lr_exps(a.lr_exps)
    cells = [(p, w, e) for w in sorted(a.widths, reverse=True) for p in PARAMS for e in exps
             if not (p == "mup" and w == a.base_width)]
    runs: list[dict] = []
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=a.workers, mp_context=ctx, initializer=_init_worker) as pool:
        futures = {pool.submit(train_one, job_for(p, w, e, a, vocab)): (p, w, e) for p, w, e in cells}
        for done in as_completed(futures):
            (p, w, e), out = futures[done], done.result()
            runs.append({"param": p, "width": w, "lr_exp": e, "lr": 2.0**e, **out})
            shown = "diverged" if out["diverged"] else f"{out['val_loss']:.4f}"
            print(f"  {p:<4} width {w:>4} lr 2^{e:<3} val {shown:>8} ({out['wall_s']:.0f} s)", flush=True)
    for r in [r for r in runs if r["param"] == "sp" and r["width"] == a.base_width]:
        runs.append({**r, "param": "mup", "copied_from": "sp"})
    return sorted(runs, key=lambda r: (PARAMS.index(r["param"]), r["width"], r["lr_exp"]))


def summarise(runs: list[dict], widths: list[int], exps: list[int]) -> dict:
    """{param: {"by_width": {width: {"losses": [per lr], "best_exp": e or None}}, "shift": grid steps or None}}: the
    best lr per width (the lowest finite loss; None when every lr diverged) and how many factor-2 steps it moves from
    the narrowest to the widest width (positive: the wide model wants a larger lr)."""
    return _summary(lambda p, w: [next(r["val_loss"] for r in runs if (r["param"], r["width"], r["lr_exp"]) == (p, w, e))
                                  for e in exps], widths, exps)


def mean_summary(by_seed: dict, widths: list[int], exps: list[int]) -> dict:
    """The summaries' losses averaged over the seeds (inf where any seed diverged), in ``summarise``'s shape."""
    def mean(p: str, w: int) -> list[float]:
        cols = [s[p]["by_width"][w]["losses"] for s in by_seed.values()]
        return [sum(c[i] for c in cols) / len(cols) for i in range(len(exps))]

    return _summary(mean, widths, exps)


def _summary(losses_of, widths: list[int], exps: list[int]) -> dict:
    """``summarise``'s shape from ``losses_of(param, width)`` (the loss at each lr exponent)."""
    out: dict = {}
    for p in PARAMS:
        by_width = {}
        for w in widths:
            losses = losses_of(p, w)
            finite = [(loss, e) for loss, e in zip(losses, exps) if math.isfinite(loss)]
            best = min(finite)[1] if finite else None
            by_width[w] = {"losses": losses, "best_exp": best, "best_lr": 2.0**best if best is not None else None,
                           "best_loss": min(finite)[0] if finite else math.inf}
        lo, hi = by_width[min(widths)]["best_exp"], by_width[max(widths)]["best_exp"]
        out[p] = {"by_width": by_width, "shift": hi - lo if lo is not None and hi is not None else None}
    return out


def across_seeds(by_seed: dict, widths: list[int], exps: list[int]) -> dict:
    """Per parametrisation: each seed's move of the best lr, the move on the seeds' mean loss, and per width the best
    lr per seed, the mean curve's best, how much higher the mean loss is one grid step either side of it
    (``sharpness``: the smaller of the two; None at the grid's edge) and the seeds' spread (max - min) there."""
    mean = mean_summary(by_seed, widths, exps)
    out: dict = {}
    for p in PARAMS:
        rows = {}
        for w in widths:
            m = mean[p]["by_width"][w]
            best = m["best_exp"]
            sides = []
            if best is not None:
                i = exps.index(best)
                sides = [m["losses"][j] - m["best_loss"] for j in (i - 1, i + 1) if 0 <= j < len(exps)]
            at_best = [s[p]["by_width"][w]["losses"][exps.index(best)] for s in by_seed.values()] if best is not None else []
            rows[w] = {"best_exp_per_seed": [s[p]["by_width"][w]["best_exp"] for s in by_seed.values()],
                       "mean_best_exp": best, "mean_best_loss": m["best_loss"],
                       "sharpness": min(sides) if len(sides) == 2 else None,
                       "seed_spread_at_best": max(at_best) - min(at_best) if at_best else None}
        out[p] = {"shift_per_seed": [s[p]["shift"] for s in by_seed.values()], "shift_of_mean": mean[p]["shift"],
                  "by_width": rows}
    return out


def across_table(across: dict, widths: list[int], base: int) -> str:
    """Markdown of ``across_seeds``."""
    names = {"sp": "standard parametrisation", "mup": f"muP (mup_base_width {base})"}
    fmt = (lambda e: f"2^{e}" if e is not None else "-")
    num = (lambda x: f"{x:.4f}" if x is not None and math.isfinite(x) else "-")
    lines = ["| parametrisation | width | best lr per seed | best lr of the mean loss | mean loss there | "
             "loss one step either side, the lesser rise | seeds' spread there |", "|---|---:|---|---:|---:|---:|---:|"]
    for p in PARAMS:
        for w in widths:
            r = across[p]["by_width"][w]
            lines.append(f"| {names[p]} | {w} | {', '.join(fmt(e) for e in r['best_exp_per_seed'])} | "
                         f"{fmt(r['mean_best_exp'])} | {num(r['mean_best_loss'])} | {num(r['sharpness'])} | "
                         f"{num(r['seed_spread_at_best'])} |")
    lines += ["", f"| parametrisation | grid steps the best lr moves from width {min(widths)} to {max(widths)}, per seed "
              "| on the mean loss |", "|---|---|---:|"]
    for p in PARAMS:
        per = ", ".join(str(x) if x is not None else "-" for x in across[p]["shift_per_seed"])
        lines.append(f"| {names[p]} | {per} | {across[p]['shift_of_mean'] if across[p]['shift_of_mean'] is not None else '-'} |")
    return "\n".join(lines)


def finite_or_null(x):
    """``x`` with every inf/nan float (a diverged loss) as None, which JSON can hold ("diverged": true says why)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite_or_null(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_or_null(v) for v in x]
    return x


def _loss(x: float) -> str:
    return "diverged" if math.isinf(x) else f"{x:.4f}"


def tables(summary: dict, widths: list[int], exps: list[int], base: int) -> str:
    """Markdown: per parametrisation the loss at each (width, lr) and the best lr, then the best lr's move."""
    names = {"sp": "standard parametrisation", "mup": f"muP (mup_base_width {base})"}
    lines = []
    for p in PARAMS:
        lines += [f"### {names[p]}: final validation loss", "",
                  "| width | " + " | ".join(f"2^{e}" for e in exps) + " | best lr |",
                  "|---:|" + "---:|" * len(exps) + "---:|"]
        for w in widths:
            row = summary[p]["by_width"][w]
            best = f"2^{row['best_exp']}" if row["best_exp"] is not None else "-"
            cells = [f"**{_loss(x)}**" if e == row["best_exp"] else _loss(x) for x, e in zip(row["losses"], exps)]
            lines.append(f"| {w} | " + " | ".join(cells) + f" | {best} |")
        lines.append("")
    lines += [f"### best lr from width {min(widths)} to {max(widths)}", "",
              f"| parametrisation | best lr at {min(widths)} | best lr at {max(widths)} | grid steps moved |",
              "|---|---:|---:|---:|"]
    for p in PARAMS:
        bw = summary[p]["by_width"]
        lo, hi, shift = bw[min(widths)]["best_exp"], bw[max(widths)]["best_exp"], summary[p]["shift"]
        fmt = (lambda e: f"2^{e}" if e is not None else "-")
        lines.append(f"| {names[p]} | {fmt(lo)} | {fmt(hi)} | {shift if shift is not None else '-'} |")
    return "\n".join(lines)


def plot(summary: dict, widths: list[int], exps: list[int], base: int, path: Path) -> None:
    """Loss vs lr (log2 axis), one line per width, one panel per parametrisation; diverged points left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=90, sharey=True)
    titles = {"sp": "standard parametrisation", "mup": f"muP (base width {base})"}
    for ax, p in zip(axes, PARAMS):
        for w in widths:
            row = summary[p]["by_width"][w]
            pts = [(e, x) for e, x in zip(exps, row["losses"]) if math.isfinite(x)]
            if pts:
                line, = ax.plot(*zip(*pts), marker=".", label=f"width {w}")
                if row["best_exp"] is not None:
                    ax.plot([row["best_exp"]], [row["best_loss"]], marker="*", markersize=11, color=line.get_color())
        ax.set(title=titles[p], xlabel="log2 AdamW lr", xticks=exps)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("final val loss (nats/token)")
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", required=True, help="a token_shards folder (train_*.bin, val_*.bin, manifest.json)")
    p.add_argument("--family", default="gpt2", choices=("gpt2", "llama"))
    p.add_argument("--widths", default="64,128,256,512", help="comma-separated n_embd values (multiples of --n-head)")
    p.add_argument("--base-width", type=int, default=0, help="muP's mup_base_width (default: the narrowest width)")
    p.add_argument("--lr-exps", default="-12:-5", help="AdamW lrs 2^e: 'lo:hi' (every integer) or 'e1,e2,...'")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4, help="fixed across widths (muP widens the heads)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run (61k tokens at the defaults)")
    p.add_argument("--warmup", type=int, default=-1, help="warmup steps (default: 10%% of --steps)")
    p.add_argument("--weight-decay", type=float, default=0.0,
                   help="AdamW's decay (0: the sweep measures the lr alone; torch couples decay to the lr)")
    p.add_argument("--eval-batches", type=int, default=8,
                   help="validation micro-batches (the same windows for every run) at the start and end of each run")
    p.add_argument("--seeds", default="1337", help="comma-separated seeds; each runs the whole grid")
    p.add_argument("--workers", type=int, default=2, help="runs at once, one torch thread each (one per free core)")
    p.add_argument("--quick", action="store_true", help=f"a quick check: {QUICK}")
    p.add_argument("--out", default="", help="write STEM.md, STEM.json and STEM.png (default: bench/results/mup, "
                                             "mup_quick with --quick)")
    a = p.parse_args(argv)
    if a.quick:
        for k, v in QUICK.items():
            setattr(a, k, v)
    shards = Path(a.shards)
    if not (shards / "manifest.json").is_file():
        p.error(f"--shards {a.shards!r}: not a token_shards folder (no manifest.json); run `make demo` first and pass "
                ".kiln/storage/token_shards/<version>")
    a.widths = sorted(int(w) for w in str(a.widths).split(","))
    a.base_width = a.base_width or a.widths[0]
    a.warmup = a.warmup if a.warmup >= 0 else max(1, a.steps // 10)
    exps = lr_exps(a.lr_exps)
    from kiln.model.config import padded_vocab

    manifest = json.loads((shards / "manifest.json").read_text())
    vocab = padded_vocab(manifest["vocab_size"])
    seeds = [int(v) for v in str(a.seeds).split(",") if v.strip()]
    n_runs = len(exps) * (2 * len(a.widths) - (a.base_width in a.widths))
    print(f"machine: {machine_line()}", flush=True)
    print(f"{shards} ({manifest.get('encoding')}): {a.family}, {a.n_layer} layers, {a.n_head} heads, "
          f"widths {a.widths}, muP base {a.base_width}; AdamW lr 2^{exps[0]}..2^{exps[-1]}; {a.steps} steps of "
          f"{a.batch} x {a.seq_len} tokens; {n_runs} runs per seed, seeds {seeds}, on {a.workers} workers", flush=True)
    t0 = time.perf_counter()
    per_seed, lines = {}, []
    for seed in seeds:
        a.seed = seed
        runs = sweep(a, vocab)
        per_seed[seed] = {"runs": runs, "summary": summarise(runs, a.widths, exps)}
        lines += [f"## seed {seed}", "", tables(per_seed[seed]["summary"], a.widths, exps, a.base_width), ""]
    wall = time.perf_counter() - t0
    across = across_seeds({s: v["summary"] for s, v in per_seed.items()}, a.widths, exps)
    lines += ["## over the seeds", "", across_table(across, a.widths, a.base_width)]
    print()
    print("\n".join(lines))
    print(f"\n{len(seeds)} seeds x {n_runs} runs in {wall:.0f} s")
    settings = {k: v for k, v in vars(a).items() if k not in ("out", "seed")}
    result = {"shards": str(shards), "manifest_sha256": manifest.get("sha256"), "settings": settings, "lr_exps": exps,
              "seeds": seeds, "wall_s": wall, "across_seeds": across,
              "per_seed": {str(s): {"runs": v["runs"], "summary": {
                  p: {"shift": x["shift"], "by_width": {str(w): y for w, y in x["by_width"].items()}}
                  for p, x in v["summary"].items()}} for s, v in per_seed.items()}}
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / ("mup_quick" if a.quick else "mup")
    about = (f"Token shards {shards} ({manifest.get('encoding')}): {a.family}, {a.n_layer} layers, {a.n_head} heads, "
             f"widths {a.widths}, muP base width {a.base_width}; AdamW lr 2^{exps[0]} .. 2^{exps[-1]} (factor 2), "
             f"warmup {a.warmup} then cosine; {a.steps} steps of {a.batch} x {a.seq_len} tokens "
             f"({a.steps * a.batch * a.seq_len:,} tokens a run); final validation loss on {a.eval_batches} held-out "
             f"batches; seeds {seeds}; {a.workers} workers of one thread; {wall:.0f} s in all.")
    write_results(out, "muP against the standard parametrisation: the best AdamW lr across widths", [about, "", *lines],
                  finite_or_null(result), indent=2)
    plot(mean_summary({s: v["summary"] for s, v in per_seed.items()}, a.widths, exps), a.widths, exps, a.base_width,
         out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.md')}, .json and .png")
    return result


if __name__ == "__main__":
    main()
