"""The package's shape in numbers: modules at the top level, import cycles, largest files and functions.

    .venv/bin/python scripts/measure-layout.py [SRC]        (default: src/ of this checkout)

For a before/after comparison, run it on a worktree of the older commit:
    git worktree add /tmp/before 45fc6f2 && .venv/bin/python scripts/measure-layout.py /tmp/before/src

Cycles are strongly connected components of the module import graph (grimp, which import-linter
brings), counted over in-package imports at any level (function-level ones included).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, src: Path, known: set[str]) -> set[str]:
    """The in-package modules ``path`` imports (relative imports resolved; ``from pkg import mod`` as pkg.mod)."""
    this = module_name(path, src)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                root = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(root + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != this}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> None:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "src").resolve()
    files = sorted((src / "vsnap").rglob("*.py"))
    known = {module_name(p, src) for p in files}
    graph = {module_name(p, src): imports_of(p, src, known) for p in files}
    top_modules = [p.name for p in (src / "vsnap").glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    packages = [p.name for p in (src / "vsnap").iterdir() if (p / "__init__.py").exists()]
    face = [m for m, deps in graph.items() if "vsnap" in deps and m != "vsnap" and not m.startswith("vsnap.cli")]
    sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(src))) for p in files), reverse=True)
    functions = sorted(((n.end_lineno - n.lineno + 1, f"{p.relative_to(src)}:{n.name}") for p in files
                        for n in ast.walk(ast.parse(p.read_text()))
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), reverse=True)
    print(json.dumps({
        "top_level_modules": len(top_modules), "top_level_packages": sorted(packages),
        "modules": len(files), "lines": sum(s for s, _ in sizes),
        "import_cycles": cycles(graph),
        "imports_of_the_package_face": sorted(face),
        "largest_files": sizes[:4], "largest_functions": functions[:4],
        "functions_over_80_lines": sum(1 for n, _ in functions if n > 80),
    }, indent=1))


if __name__ == "__main__":
    main()
