"""The shape of the code a newcomer reads: lines per area, the longest functions and modules, import cycles, and how
many core modules have tests at the mirrored path; at one or more commits, side by side.

Run: ``python bench/code_shape.py [--at REV ...] [--out bench/results/code_shape]``; each REV is read from git
(``git archive``, nothing checked out), the working tree's HEAD when none is given. Writes OUT.md and OUT.json with the
command, commit, date and machine line.

Counts: physical lines of ``*.py`` per top-level folder (kiln, assets, resources, jobs); a function's length is its
``def`` line to its last line (decorators and docstring included, nested functions inside their parent); an import
cycle is a strongly connected set of two or more of the project's modules, counting imports anywhere in a module
(inside functions too), a package's ``__init__`` included.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from provenance import header, header_md, machine_line  # noqa: E402

AREAS = ("kiln", "assets", "resources", "jobs")


def sources(rev: str) -> dict[str, str]:
    """{path: text} of every .py file under AREAS and tests at ``rev``."""
    blob = subprocess.run(["git", "archive", "--format=tar", rev, *AREAS, "tests"], cwd=ROOT, capture_output=True,
                          check=True).stdout
    out = {}
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        for m in tar.getmembers():
            if m.isfile() and m.name.endswith(".py"):
                out[m.name] = tar.extractfile(m).read().decode("utf-8")
    return out


def module_name(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def imports(path: str, tree: ast.AST, known: set[str]) -> set[str]:
    """The project modules ``path`` imports, anywhere in it (``from a import b`` counts a.b when that is a module)."""
    here = module_name(path)
    out = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != here and not here.startswith(n + "."):  # a package's own parents are not its imports
                out.add(n)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more modules (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def shape(rev: str) -> dict:
    files = sources(rev)
    code = {p: t for p, t in files.items() if p.split("/")[0] in AREAS}
    lines = {a: sum(t.count("\n") for p, t in code.items() if p.startswith(a + "/")) for a in AREAS}
    trees = {p: ast.parse(t) for p, t in code.items()}
    funcs = []
    for p, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((node.end_lineno - node.lineno + 1, f"{p}:{node.lineno} {node.name}"))
    funcs.sort(reverse=True)
    modules = sorted(((t.count("\n"), p) for p, t in code.items()), reverse=True)
    known = {module_name(p) for p in code}
    graph = {module_name(p): imports(p, tree, known) for p, tree in trees.items()}
    core = [p for p in code if p.startswith("kiln/") and not p.endswith(("__init__.py", "__main__.py"))]
    mirrored = [p for p in core if f"tests/{Path(p).parent}/test_{Path(p).stem}.py" in files]
    commit = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    return {"rev": rev, "commit": commit, "lines": lines, "total_lines": sum(lines.values()),
            "longest_functions": [{"lines": n, "where": w} for n, w in funcs[:10]],
            "functions_over_50_lines": sum(1 for n, _ in funcs if n > 50),
            "longest_modules": [{"lines": n, "path": p} for n, p in modules[:5]],
            "modules": len(code), "import_cycles": cycles(graph),
            "core_modules": len(core), "core_modules_with_mirrored_tests": len(mirrored)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--at", action="append", default=None, help="a git revision (repeatable; default HEAD)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "code_shape"))
    args = ap.parse_args(argv)
    print(f"machine: {machine_line()}", flush=True)
    got = [shape(rev) for rev in args.at or ["HEAD"]]
    argv = sys.argv if argv is None else ["bench/code_shape.py", *argv]
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({**header(argv), "revisions": got}, indent=2) + "\n")
    md = ["# Code shape", "", *header_md(argv),
          "| | " + " | ".join(f"{g['rev']} ({g['commit'][:10]})" for g in got) + " |",
          "|---|" + "---|" * len(got)]
    rows = [(f"lines in {a}/", [f"{g['lines'][a]:,}" for g in got]) for a in AREAS]
    rows += [("lines in all four", [f"{g['total_lines']:,}" for g in got]),
             ("modules", [str(g["modules"]) for g in got]),
             ("longest function", [f"{g['longest_functions'][0]['lines']} ({g['longest_functions'][0]['where']})"
                                   for g in got]),
             ("functions over 50 lines", [str(g["functions_over_50_lines"]) for g in got]),
             ("longest module", [f"{g['longest_modules'][0]['lines']:,} ({g['longest_modules'][0]['path']})" for g in got]),
             ("import cycles", [("; ".join(" <-> ".join(c) for c in g["import_cycles"]) or "none") for g in got]),
             ("core modules with a test at the mirrored path",
              [f"{g['core_modules_with_mirrored_tests']} of {g['core_modules']}" for g in got])]
    md += [f"| {name} | " + " | ".join(vals) + " |" for name, vals in rows]
    for g in got:
        md += ["", f"Longest functions at {g['rev']}:", ""]
        md += [f"- {f['lines']} lines: {f['where']}" for f in g["longest_functions"]]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return {"revisions": got}


if __name__ == "__main__":
    main()
