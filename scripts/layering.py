"""Lists mltrace's imports that point up the layers, and its import cycles (lazy imports included).

    python scripts/layering.py            # a summary and every violation
    python scripts/layering.py --counts   # the two counts only

Every ``import``/``from … import`` of an ``mltrace`` module anywhere in a module's source
(top level or inside a function) is an edge. A module's layer is its package's rank below;
an edge to a higher rank is an upward import. Cycles are the strongly connected components
of more than one module. Exit status: 0 when there is neither, 1 otherwise (so the layering
issue's "Done when" can become a test once it holds).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

#: Rank of each package (or top-level module) of mltrace: imports may only point to a lower or
#: equal rank. The ground (the data model and the run directory) is 0; commands and the CLI the top.
RANKS = {
    "_version": 0,
    "_layercall": 0,
    "_pftrace": 0,
    "_sweep": 0,
    "_mkltimer": 0,
    "_tapread": 0,
    "errors": 0,
    "native": 0,
    "config": 0,
    "run": 0,
    "tracer": 1,
    "importers": 2,
    "exporters": 2,
    "analysis": 3,
    "viewers": 4,
    "follow": 4,
    "bench": 5,
    "brickbench": 5,
    "runner": 5,
    "commands": 5,
    "cli": 5,
    "__main__": 6,
    "__init__": 6,
}


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def rank(module: str) -> int:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    return RANKS.get(key, 3)


def imports_of(path: Path, module: str) -> set[str]:
    """Every mltrace module ``path`` imports, anywhere in it."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("mltrace"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base == "mltrace":  # `from mltrace import _mkltimer`: the modules named
                out.update(f"mltrace.{a.name}" for a in node.names)
            elif base.startswith("mltrace"):
                out.add(base)
    return out


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in SRC.joinpath("mltrace").rglob("*.py")}
    for stub in SRC.joinpath("mltrace").rglob("*.pyi"):  # the C helpers: leaves, known by their stubs
        modules.setdefault(module_name(stub), stub)
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for target in imports_of(path, name):
            while target not in modules and "." in target:  # `from mltrace.x import y` where y is a name
                target = target.rpartition(".")[0]
            if target in modules and target != name:
                targets.add(target)
        edges[name] = targets
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out, key=len, reverse=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", action="store_true", help="print the two counts only")
    args = parser.parse_args()
    edges = graph()
    upward = sorted((a, b) for a, targets in edges.items() for b in targets if rank(b) > rank(a))
    loops = cycles(edges)
    print(f"{len(edges)} modules, {sum(len(t) for t in edges.values())} imports: {len(upward)} upward, {len(loops)} cycles")
    if not args.counts:
        for a, b in upward:
            print(f"  up    {a} -> {b}")
        for loop in loops:
            print(f"  cycle ({len(loop)}) " + ", ".join(loop))
    return 1 if upward or loops else 0


if __name__ == "__main__":
    sys.exit(main())
