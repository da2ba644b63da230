"""What every results file under bench/results/ says about where its numbers came from: the command that wrote it,
the git commit when the bench started (and whether the tree had uncommitted changes then), the date, and the machine line (processor model, its
vector extensions, cores, memory).

``header(argv)`` returns those as a dict; ``header_md(argv)`` as the Markdown lines a results file starts with;
``machine_line()`` alone, e.g. ``Intel(R) Xeon(R) Processor | avx512f avx2 fma | 2 cores | 23.5 GiB``. Benches print
the machine line before their first timing, so a figure is never separated from the machine that gave it.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What holds torch's kernels, MKL and oneDNN below the CPU's instruction set (the AVX2 path measured on AVX-512)
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
FLAGS_SHOWN = ("avx512f", "avx512_bf16", "amx_tile", "avx2", "fma", "neon", "sve")  # the ones that move CPU kernels


def _cpuinfo() -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            out.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return out


def machine_line() -> str:
    """``model | flags that matter | N cores | memory`` of this machine."""
    info = _cpuinfo()
    model = info.get("model name") or platform.processor() or platform.machine()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    shown = " ".join(f for f in FLAGS_SHOWN if f in flags) or "no AVX2/AVX-512"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        memory = f"{mem:.1f} GiB"
    except (ValueError, OSError):
        memory = "memory unknown"
    gpu = gpu_line()
    held = " ".join(f"{k}={os.environ[k]}" for k in ISA_CAPS if os.environ.get(k))
    return (f"{model} | {shown} | {cores} cores | {memory}" + (f" | GPU: {gpu}" if gpu else "")
            + (f" | instruction set held down: {held}" if held else ""))


def gpu_line() -> str:
    """The GPUs nvidia-smi lists (name, memory, driver), ``""`` on a machine without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    gpus = [g.strip() for g in out.splitlines() if g.strip()]
    return f"{len(gpus)} x {gpus[0]}" if gpus else ""


def git_commit() -> str:
    """The commit of the working tree, ``+dirty`` when tracked files differ from it. A copy of the tree without its
    git folder (a remote machine's) takes it from KILN_COMMIT, which the command that copied it sets."""
    if not (ROOT / ".git").exists() and os.environ.get("KILN_COMMIT"):
        return os.environ["KILN_COMMIT"] + " (a copy of the tree, no git folder there)"
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD") or "unknown"
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


COMMIT_AT_START = git_commit()  # the code a bench ran is the tree when it started: commits made while it runs differ


def header(argv: list[str] | None = None) -> dict[str, str]:
    argv = sys.argv if argv is None else argv
    return {"command": "python " + shlex.join([str(Path(argv[0]).resolve().relative_to(ROOT))
                                               if Path(argv[0]).resolve().is_relative_to(ROOT) else argv[0], *argv[1:]]),
            "commit": COMMIT_AT_START,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_line()}


def header_md(argv: list[str] | None = None) -> list[str]:
    h = header(argv)
    return [f"- command: `{h['command']}`", f"- commit: {h['commit']}", f"- date: {h['date']}",
            f"- machine: {h['machine']}", ""]


def write_results(stem: str | Path, title: str, lines: list[str], data: dict, indent: int = 1) -> None:
    """STEM.md (``# title``, the header lines, then ``lines``) and STEM.json (the header's fields and ``data``; values
    JSON cannot hold written with str)."""
    import json

    stem = Path(stem)
    stem.with_suffix(".md").write_text("\n".join([f"# {title}", "", *header_md(), *lines, ""]))
    stem.with_suffix(".json").write_text(json.dumps({**header(), **data}, indent=indent, default=str))
