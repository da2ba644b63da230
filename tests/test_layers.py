"""Guard tests for the layer boundaries: kiln/ never imports dagster; the torchrun worker never loads it."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDER = {"kiln": 0, "resources": 1, "assets": 2, "jobs": 3}


def imported_modules(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            mods.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module.split(".")[0])
    return mods


def test_core_never_imports_dagster():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "kiln").rglob("*.py")
                 if any(m == "dagster" or m.startswith("dagster_") for m in imported_modules(p))]
    assert offenders == [], f"kiln/ must stay Dagster-free: {offenders}"


def test_imports_flow_one_way():
    bad = []
    for layer, rank in ORDER.items():
        for p in (ROOT / layer).rglob("*.py"):
            for m in imported_modules(p):
                if m in ORDER and ORDER[m] > rank:
                    bad.append(f"{p.relative_to(ROOT)} imports {m}")
    assert bad == []


def test_torchrun_worker_does_not_load_dagster():
    code = ("import sys, resources.pipes_worker, kiln.train.loop, kiln.loader, kiln.posttrain.sft; "
            "bad = [m for m in sys.modules if m == 'dagster' or m.startswith('dagster.')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
