"""Guard tests for the layer boundaries: kiln/ never imports dagster, imports flow one way, no import cycle in kiln/.

Run: python -m pytest tests/test_layers.py -q
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDER = {"kiln": 0, "resources": 1, "assets": 2, "jobs": 3}

# The import statements of each file, read by a fresh interpreter: CPython 3.11 keeps the AST builder's recursion
# counter per interpreter, so an ast.parse racing one on another thread of this test process (Ray, Dagster and
# MLflow leave threads behind) fails with "AST constructor recursion depth mismatch" (cpython gh-106905).
_READ_IMPORTS = """
import ast, json, sys
out = {}
for path in json.load(sys.stdin):
    rows = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), filename=path)):
        if isinstance(node, ast.Import):
            rows.append([None, 0, [a.name for a in node.names]])
        elif isinstance(node, ast.ImportFrom):
            rows.append([node.module, node.level, [a.name for a in node.names]])
    out[path] = rows
json.dump(out, sys.stdout)
"""


def import_statements(paths: list[Path]) -> dict[Path, list[tuple[str | None, int, list[str]]]]:
    """{file: [(module of a ``from`` import or None for ``import``, relative level, names)]}."""
    proc = subprocess.run([sys.executable, "-c", _READ_IMPORTS], input=json.dumps([str(p) for p in paths]),
                          capture_output=True, text=True, check=True)
    return {Path(p): [tuple(r) for r in rows] for p, rows in json.loads(proc.stdout).items()}


def imported_modules(paths: list[Path]) -> dict[Path, set[str]]:
    """{file: top-level packages it imports absolutely}."""
    out = {}
    for path, rows in import_statements(paths).items():
        mods = set()
        for module, level, names in rows:
            if module is None:
                mods.update(n.split(".")[0] for n in names)
            elif level == 0:
                mods.add(module.split(".")[0])
        out[path] = mods
    return out


def test_core_never_imports_dagster():
    mods = imported_modules(sorted((ROOT / "kiln").rglob("*.py")))
    offenders = [str(p.relative_to(ROOT)) for p, ms in mods.items()
                 if any(m == "dagster" or m.startswith("dagster_") for m in ms)]
    assert offenders == [], f"kiln/ must stay Dagster-free: {offenders}"


def test_imports_flow_one_way():
    bad = []
    for layer, rank in ORDER.items():
        for p, ms in imported_modules(sorted((ROOT / layer).rglob("*.py"))).items():
            for m in ms:
                if m in ORDER and ORDER[m] > rank:
                    bad.append(f"{p.relative_to(ROOT)} imports {m}")
    assert bad == []


def test_torchrun_worker_does_not_load_dagster():
    code = ("import sys, resources.pipes_worker, kiln.train.loop, kiln.tokens.loader, kiln.posttrain.sft; "
            "bad = [m for m in sys.modules if m == 'dagster' or m.startswith('dagster.')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def kiln_modules(root: Path = ROOT) -> dict[str, Path]:
    """{dotted module name: file} of every module and package under root/kiln/."""
    mods = {}
    for p in sorted((root / "kiln").rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """{module: kiln modules it imports}, module-level and function-level imports alike; relative imports are
    resolved, ``from pkg import name`` counts pkg and, where it is a module, pkg.name."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    statements = import_statements(list(mods.values()))
    for m, p in mods.items():
        package = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for module, level, imported in statements[p]:
            if module is None and not level:
                names = imported
            else:
                base = module or ""
                if level:
                    up = package.split(".")[: len(package.split(".")) - level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a}" for a in imported]
            for name in names:
                while name and name not in mods:  # kiln.x.y.func -> kiln.x.y; outside kiln/ -> ""
                    name = name.rpartition(".")[0]
                if name and name != m:
                    graph[m].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        comp.append(stack.pop())
                        if comp[-1] == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in stack:
                low[v] = min(low[v], index[w])
    return out


def test_cycle_finder_sees_function_level_and_relative_imports(tmp_path):
    files = {"kiln/__init__.py": "", "kiln/a.py": "def f():\n    from .sub import b\n",
             "kiln/sub/__init__.py": "", "kiln/sub/b.py": "import os\nfrom ..c import thing\n",
             "kiln/c.py": "import kiln.a as a\n", "kiln/d.py": "from kiln import c\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(kiln_modules(tmp_path))
    assert graph["kiln.a"] == {"kiln.sub", "kiln.sub.b"} and graph["kiln.sub.b"] == {"kiln.c"}
    assert graph["kiln.d"] == {"kiln", "kiln.c"}
    assert cycles(graph) == [["kiln.a", "kiln.c", "kiln.sub.b"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_kiln():
    found = cycles(import_graph(kiln_modules()))
    assert found == [], "import cycles in kiln/ (move the shared part into a module both import): " + "; ".join(
        " <-> ".join(c) for c in found)
