"""Benchmark: checkpoint save and load throughput against this disk's own write and read bandwidth, measured in the
same run; how long training is blocked by a background save versus a synchronous one; and (--goodput) the goodput
of a real training run under torchrun with three injected SIGKILLs (tests/faults.py).

Run: python bench/bench_checkpoint.py [--layers 8] [--width 512] [--repeat 3] [--goodput] [--dir /path/on/the/disk]
Reads are measured cold: each file is dropped from the page cache (posix_fadvise DONTNEED) before it is read.
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kiln.train.checkpoint import load_state, save_checkpoint  # noqa: E402
from kiln.train.checkpointer import Checkpointer  # noqa: E402
from kiln.model.config import ModelConfig  # noqa: E402
from kiln.model.config import padded_vocab  # noqa: E402
from kiln.model.families import build_model  # noqa: E402
from kiln.train.optim import OptimConfig, make_optimizer  # noqa: E402

CHUNK = 8 << 20


def drop_cache(folder: Path) -> None:
    """Evict the files under ``folder`` from the page cache so the next read comes from the disk."""
    for f in [folder] if folder.is_file() else sorted(p for p in folder.rglob("*") if p.is_file()):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_bandwidth(folder: Path, nbytes: int) -> tuple[float, float]:
    """(write, cold read) bytes/s of one file of ``nbytes`` written in 8 MiB blocks and fsynced, as a save is."""
    data = os.urandom(CHUNK)
    path = folder / "bandwidth.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // CHUNK):
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    write = (nbytes // CHUNK) * CHUNK / (time.perf_counter() - t0)
    drop_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(CHUNK):
            pass
    read = path.stat().st_size / (time.perf_counter() - t0)
    path.unlink()
    return write, read


def trained(layers: int, width: int, vocab: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=vocab, block_size=256, n_layer=layers, n_head=max(1, width // 64), n_embd=width))
    opt = make_optimizer(model, OptimConfig(), torch.device("cpu"))
    model(torch.randint(0, vocab, (2, 16)), torch.randint(0, vocab, (2, 16))).backward()
    opt.step()  # AdamW's moments exist: the state is weights + 2 moments, as in training
    opt.zero_grad(set_to_none=True)
    return model, opt


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def bench_io(work: Path, layers: int, width: int, vocab: int, repeat: int) -> dict:
    model, opt = trained(layers, width, vocab)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    state = {"model": msd, "optimizer": osd, "step": 1}
    saves, loads, size = [], [], 0
    for i in range(repeat):
        root = work / f"io{i}"
        t0 = time.perf_counter()
        path = save_checkpoint(root, 1, state, {"model": vars(model.config)})  # torch.save + checksum + fsync + rename
        saves.append(time.perf_counter() - t0)
        size = folder_bytes(path)
        drop_cache(path)
        t0 = time.perf_counter()
        load_state(path)  # verify every checksum, then load with weights_only
        loads.append(time.perf_counter() - t0)
        shutil.rmtree(root)
    write_bw, read_bw = zip(*[disk_bandwidth(work, size) for _ in range(repeat)])
    save_bw, load_bw = size / min(saves), size / min(loads)
    return {"checkpoint_mb": size / 1e6, "params_m": model.num_params(non_embedding=False) / 1e6,
            "disk_write_mb_s": max(write_bw) / 1e6, "disk_read_cold_mb_s": max(read_bw) / 1e6,
            "save_mb_s": save_bw / 1e6, "load_mb_s": load_bw / 1e6,
            "save_vs_disk_write": save_bw / max(write_bw), "load_vs_disk_read": load_bw / max(read_bw)}


def bench_blocking(work: Path, layers: int, width: int, vocab: int, repeat: int) -> dict:
    """Seconds Checkpointer.save() holds the training loop: background (copy to memory) vs synchronous (write)."""
    model, opt = trained(layers, width, vocab)
    out = {}
    for mode in ("async", "sync"):
        ck = Checkpointer(work / mode, 0, 1, sharded=False, async_save=mode == "async", keep_last=1, log=lambda m: None)
        blocked, committed = [], []
        for step in range(1, repeat + 1):
            t0 = time.perf_counter()
            blocked.append(ck.save(step, model, opt, {"step": step}, {}))
            ck.wait()
            committed.append(time.perf_counter() - t0)
        out[mode] = {"blocked_s": min(blocked), "until_committed_s": min(committed)}
        shutil.rmtree(work / mode)
    out["blocked_ratio_async_vs_sync"] = out["async"]["blocked_s"] / out["sync"]["blocked_s"]
    return out


def bench_goodput(work: Path, steps: int, kills: list[int]) -> dict:
    """A 3.4M-parameter model trained by torchrun (--max_restarts=3) while rank 0 SIGKILLs itself at ``kills``;
    checkpoints every 25 steps, so each kill loses the steps since the last one plus a restart."""
    from kiln.tokens.shards import shard_paths, write_shards
    from kiln.tokens.tokenizer import save_encoding, train_bpe
    from resources.torchrun import TorchrunResource

    texts = [p.read_text() for p in sorted((ROOT / "kiln").rglob("*.py"))] * 4  # Kiln's own source as a corpus
    docs = [(f"d{i}", t) for i, t in enumerate(texts)]
    enc = train_bpe((t for _, t in docs), 1024)
    save_encoding(enc, work / "tokenizer.json")
    write_shards(enc, docs, work / "shards", shard_tokens=1 << 20, val_permille=100, num_workers=1)
    job = {"task": "pretrain", "out_dir": str(work / "run"), "tokenizer": str(work / "tokenizer.json"),
           "model": {"vocab_size": padded_vocab(enc.n_vocab), "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 256},
           "optim": {"lr": 2e-3, "warmup_steps": 20}, "train_files": [str(p) for p in shard_paths(work / "shards", "train")],
           "val_files": [str(p) for p in shard_paths(work / "shards", "val")], "seq_len": 128, "micro_batch": 8,
           "max_steps": steps, "eval_interval": 50, "eval_batches": 4, "ckpt_interval": 25, "keep_last": 2,
           "log_interval": 50}
    (work / "job.json").write_text(json.dumps(job))
    from tests.faults import Faults

    faults = Faults(kill_at_steps=kills).write(work / "faults.json")
    cmd = TorchrunResource(max_restarts=len(kills)).command(1, work / "job.json", "cpu", worker="tests.faults")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(torch.get_num_threads()),
           "KILN_FAULTS": str(faults)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
    result = json.loads((work / "run" / "result.json").read_text())
    return {"steps": steps, "kills_at": kills, **result["goodput"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dir", default="", help="a folder on the disk to measure (default: a temporary one)")
    p.add_argument("--goodput", action="store_true", help="also train 200 steps under torchrun with three SIGKILLs")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(dir=a.dir or None) as tmp:
        work = Path(tmp)
        out = {"io": bench_io(work, a.layers, a.width, a.vocab, a.repeat),
               "blocking": bench_blocking(work, a.layers, a.width, a.vocab, a.repeat)}
        io, blk = out["io"], out["blocking"]
        print(f"checkpoint of {io['params_m']:.1f}M parameters (weights + AdamW moments): {io['checkpoint_mb']:.0f} MB")
        print(f"  disk: write {io['disk_write_mb_s']:.0f} MB/s (fsync), read {io['disk_read_cold_mb_s']:.0f} MB/s (cold)")
        print(f"  save {io['save_mb_s']:.0f} MB/s = {io['save_vs_disk_write']:.0%} of the disk's write bandwidth")
        print(f"  load {io['load_mb_s']:.0f} MB/s = {io['load_vs_disk_read']:.0%} of the disk's read bandwidth "
              "(checksums verified)")
        print(f"  training blocked per save: {blk['async']['blocked_s'] * 1e3:.0f} ms in the background "
              f"vs {blk['sync']['blocked_s'] * 1e3:.0f} ms synchronous ({blk['blocked_ratio_async_vs_sync']:.1%}); "
              f"the background save is on disk {blk['async']['until_committed_s']:.2f} s after it starts")
        if a.goodput:
            out["goodput"] = good = bench_goodput(work, 200, [45, 110, 170])
            print(f"  goodput with SIGKILLs at steps {good['kills_at']}: {good['goodput']:.1%} of {good['wall_s']:.0f} s "
                  f"(productive {good['productive_s']:.1f} s, redone {good['redone_steps_s']:.1f} s, restarting "
                  f"{good['restarting_s']:.1f} s, first start-up {good['startup_s']:.1f} s, saving {good['saving_s']:.1f} s, "
                  f"validation {good['validation_s']:.1f} s)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
