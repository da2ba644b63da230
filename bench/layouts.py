"""Benchmark, side by side in one run: every layout the training job runs, on CPU processes (gloo), against one
process. A tiny pretraining job (a 300-token BPE over a synthetic corpus; GPT-2 of 2 blocks and Llama of 4, width
48; 30 steps of 2 micro-batches of 4 sequences) is trained under each layout with ``python -m kiln.train`` (torchrun
for several ranks) and alone; reported per layout: the largest |difference| of its training and validation losses
from the one-process run, tokens/s against it, and whether a restart from its step-20 checkpoint (as after a
SIGKILL) ends bit-identical to the uninterrupted run. Then the resharding matrix: a checkpoint saved under one layout
resumed under another, with the largest difference of the continued curve from one process.

python bench/layouts.py [--out bench/results/layouts] [--only NAME ...]: prints the machine line first; writes OUT.md
(both tables) and OUT.json with the command, commit, date and machine.

On two cores the tokens/s ratios show communication and process overhead, not what a layout gains on GPUs
(bench/gpu.sh measures those); the loss differences and bit-identical restarts are the point.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from provenance import header, header_md, machine_line  # noqa: E402

STEPS, RESUME_AT = 30, 20
FAMILIES = {"gpt2": {"n_layer": 2},
            "llama": {"family": "llama", "n_layer": 4, "n_kv_head": 2, "tie_embeddings": False}}
FSDP_ROWS = {"micro_batch": 2, "eval_batches": 8}  # two data-parallel ranks of 2 sequences: the same 4 a micro-step
# name -> (family, processes, job fields)
LAYOUTS = {
    "ddp 2": ("gpt2", 2, {"parallelism": "ddp", **FSDP_ROWS}),
    "fsdp 2": ("gpt2", 2, {"parallelism": "fsdp", **FSDP_ROWS}),
    "tp 2": ("gpt2", 2, {"layout": {"tp": 2}}),
    "pp 2 (1f1b)": ("gpt2", 2, {"layout": {"pp": 2}}),
    "pp 2 x dp_shard 2": ("gpt2", 4, {"layout": {"pp": 2}, **FSDP_ROWS}),
    "dp_shard 2 x tp 2": ("gpt2", 4, {"layout": {"tp": 2, "dp_shard": 2}, **FSDP_ROWS}),
    "llama tp 2": ("llama", 2, {"layout": {"tp": 2}}),
    "llama fsdp 2": ("llama", 2, {"parallelism": "fsdp", **FSDP_ROWS}),
    "llama pp 2 (interleaved, 2 stages per rank)": ("llama", 2, {"layout": {"pp": 2}, "pipeline": {
        "schedule": "interleaved_1f1b", "virtual_stages": 2}}),
    "llama pp 2 x tp 2": ("llama", 4, {"layout": {"pp": 2, "tp": 2}, "pipeline": {
        "schedule": "interleaved_1f1b", "virtual_stages": 2}}),
    "llama dp_shard 2 x tp 2": ("llama", 4, {"layout": {"tp": 2, "dp_shard": 2}, **FSDP_ROWS}),
}
# saved under -> resumed under (None: one process)
RESHARDS = [("tp 2", None), ("pp 2 (1f1b)", None), ("dp_shard 2 x tp 2", None), ("fsdp 2", "tp 2"),
            ("llama fsdp 2", "llama tp 2"),
            ("llama pp 2 (interleaved, 2 stages per rank)", "llama fsdp 2"),
            ("llama pp 2 x tp 2", None), ("llama fsdp 2", "llama pp 2 (interleaved, 2 stages per rank)")]


class Data:
    """The tokenizer, shards and job files of one benchmark run, in a temporary folder."""

    def __init__(self, root: Path):
        from kiln.model.config import padded_vocab
        from kiln.tokens.shards import shard_paths, write_shards
        from kiln.tokens.tokenizer import save_encoding, train_bpe
        from tests.conftest import make_docs

        docs = make_docs()
        enc = train_bpe((t for _, t in docs), 300)
        self.root, self.tokenizer = root, root / "tokenizer.json"
        save_encoding(enc, self.tokenizer)
        write_shards(enc, docs, root / "shards", shard_tokens=16384, val_permille=200, num_workers=1)
        self.files = {split: [str(p) for p in shard_paths(root / "shards", split)] for split in ("train", "val")}
        self.model = {"vocab_size": padded_vocab(enc.n_vocab), "block_size": 32, "n_head": 2, "n_embd": 48,
                      "dropout": 0.0}

    def job(self, folder: Path, family: str, fields: dict) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        job = {"task": "pretrain", "out_dir": str(folder / "run"), "tokenizer": str(self.tokenizer),
               "model": {**self.model, **FAMILIES[family]}, "optim": {"lr": 1e-2, "warmup_steps": 5, "weight_decay": 0.0},
               "train_files": self.files["train"], "val_files": self.files["val"], "seq_len": 32, "micro_batch": 4,
               "grad_accum": 2, "max_steps": STEPS, "eval_interval": 10, "eval_batches": 4, "ckpt_interval": 10,
               "keep_last": 3, "log_interval": 5, "seed": 1234, **fields}
        (folder / "job.json").write_text(json.dumps(job, indent=1))
        return folder / "job.json"


def train(job: Path, nproc: int) -> dict:
    """Run the job; its result.json."""
    args = ["-m", "kiln.train", "--config", str(job), "--device", "cpu", "--timeout-s", "120"]
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"{job} on {nproc} processes failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads((Path(json.loads(job.read_text())["out_dir"]) / "result.json").read_text())


def cut_back(result: dict, dest: Path) -> None:
    """A copy of ``result``'s run folder in ``dest``/run holding its checkpoints up to RESUME_AT, no result."""
    run = Path(result["checkpoint"]).parents[1]
    shutil.copytree(run, dest / "run")
    for ckpt in (dest / "run" / "checkpoints").glob("step_*"):
        if int(ckpt.name.removeprefix("step_")) > RESUME_AT:
            shutil.rmtree(ckpt)
    (dest / "run" / "result.json").unlink()


def differences(res: dict, ref: dict) -> float:
    curve = [abs(a[1] - b[1]) for a, b in zip(res["curve"], ref["curve"])]
    val = [abs(a["val_loss"] - b["val_loss"]) for a, b in zip(res["history"], ref["history"])]
    return max(curve + val)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "layouts")
    p.add_argument("--only", nargs="*", default=None, help="layout names to run (default: all)")
    a = p.parse_args()
    print(f"machine: {machine_line()}", flush=True)
    names = [n for n in LAYOUTS if a.only is None or n in a.only]
    with tempfile.TemporaryDirectory(prefix="kiln-layouts-") as tmp:
        data = Data(Path(tmp))
        refs = {fam: train(data.job(Path(tmp) / f"one-{fam}", fam, {}), 1) for fam in FAMILIES}
        rows, results = [], {}
        for name in names:
            family, nproc, fields = LAYOUTS[name]
            t0 = time.perf_counter()
            res = results[name] = train(data.job(Path(tmp) / name, family, fields), nproc)
            again_dir = Path(tmp) / f"{name}-again"
            cut_back(res, again_dir)
            again = train(data.job(again_dir, family, fields), nproc)
            same = again["rank_param_digests"] == res["rank_param_digests"] and again["curve"] == res["curve"]
            ref = refs[family]
            rows.append({"layout": name, "family": family, "processes": nproc,
                         "max_loss_diff": differences(res, ref),
                         "tokens_per_s": res["tokens_per_s"], "one_process_tokens_per_s": ref["tokens_per_s"],
                         "vs_one_process": res["tokens_per_s"] / ref["tokens_per_s"],
                         "restart_from_step_20": "bit-identical" if same else "DIFFERS",
                         "wall_s": round(time.perf_counter() - t0, 1)})
            r = rows[-1]
            print(f"{name:45s} {nproc} procs  max|dloss| {r['max_loss_diff']:.1e}  {r['tokens_per_s']:8,.0f} tok/s "
                  f"(x{r['vs_one_process']:.2f} of one process)  restart: {r['restart_from_step_20']}", flush=True)
        reshards = []
        for saved, resumed in RESHARDS:
            if saved not in results or resumed is not None and resumed not in LAYOUTS:
                continue
            family = LAYOUTS[saved][0]
            dest = Path(tmp) / f"{saved} -> {resumed}"
            cut_back(results[saved], dest)
            family2, nproc, fields = LAYOUTS[resumed] if resumed else (family, 1, {})
            res = train(data.job(dest, family2, fields), nproc)
            ok = res["resumed_from"].endswith(f"step_{RESUME_AT:07d}")
            reshards.append({"saved_under": saved, "resumed_under": resumed or "one process", "resumed": ok,
                             "max_loss_diff": differences(res, refs[family])})
            print(f"{saved} -> {resumed or 'one process'}: resumed from step {RESUME_AT}: {ok}, max|dloss| vs one "
                  f"process {reshards[-1]['max_loss_diff']:.1e}", flush=True)
    write(a.out, rows, reshards)


def write(out: Path, rows: list[dict], reshards: list[dict]) -> None:
    """OUT.json and OUT.md: the layouts against one process, then the resharding matrix."""
    out.with_suffix(".json").write_text(json.dumps({**header(), "layouts": rows, "reshards": reshards}, indent=1)
                                        + "\n")
    lines = ["# Every layout of the training job against one process, on CPU processes (gloo)", "", *header_md(),
             "The tiny job of the tests: 30 steps of 2 micro-batches of 4 sequences, width 48. On two cores tokens/s "
             "shows communication and process overhead, not what a layout gains on GPUs.", "",
             "| layout | processes | max abs loss difference | tokens/s (x one process) | restart from step 20 |",
             "|---|---:|---:|---|---|"]
    lines += [f"| {r['layout']} | {r['processes']} | {r['max_loss_diff']:.1e} | {r['tokens_per_s']:,.0f} "
              f"(x{r['vs_one_process']:.2f}) | {r['restart_from_step_20']} |" for r in rows]
    lines += ["", "Resharding: a step-20 checkpoint saved under one layout, resumed under another; the largest "
              "difference of the whole curve from one process.", "",
              "| saved under | resumed under | resumed from step 20 | max abs loss difference |", "|---|---|---|---:|"]
    lines += [f"| {r['saved_under']} | {r['resumed_under']} | {'yes' if r['resumed'] else 'NO'} | "
              f"{r['max_loss_diff']:.1e} |" for r in reshards]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')}", flush=True)


if __name__ == "__main__":
    main()
