"""Lists mltrace's imports that point up the layers, and its import cycles (lazy imports included).

    python scripts/layering.py            # a summary and every violation
    python scripts/layering.py --counts   # the counts only

Every ``import``/``from … import`` of an ``mltrace`` module anywhere in a module's source
(top level, inside a function, under ``TYPE_CHECKING``) is an edge. A module's layer is its
package's rank below; an edge to a higher rank is an upward import, and a package missing from
the ranks is unranked. Cycles are the strongly connected components of more than one module.
Exit status: 0 when there is none of these, 1 otherwise. ``tests/test_layering.py`` checks the
same.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

#: Rank of each package (or top-level module) of mltrace: imports may only point to a lower or
#: equal rank. The ground (the data model and the run directory) is 0; the tracer records; the
#: exporters, the analysis and the viewers read finished runs; the finish (and what makes or
#: merges runs through it) ends a run; the CLI and its commands are the top.
RANKS = {
    "_version": 0,
    "_layercall": 0,
    "_pftrace": 0,
    "_sweep": 0,
    "_mkltimer": 0,
    "_tapread": 0,
    "_mklscan": 0,
    "_untrack": 0,
    "_carry": 0,
    "errors": 0,
    "native": 0,
    "config": 0,
    "settings": 0,
    "run": 0,
    "tracer": 1,
    "formats": 1,
    "exporters": 2,
    "analysis": 3,
    "viewers": 4,
    "finish": 5,
    "finish_stream": 5,
    "finish_serve": 5,
    "profiling": 5,
    "importers": 5,
    "follow": 5,
    "bench": 6,
    "brickbench": 6,
    "runner": 6,
    "commands": 6,
    "cli": 6,
    "__main__": 7,
    "__init__": 7,
}


def module_name(path: Path, src: Path = SRC) -> str:
    rel = path.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def rank(module: str) -> int | None:
    """The layer of ``module`` (None: its package has no rank)."""
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    return RANKS.get(key)


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
            if base.startswith("mltrace"):  # `from mltrace.tracer import session`: the module named
                out.update(f"{base}.{a.name}" for a in node.names)  # (a name that is no module: ``graph`` strips it)
    return out


def graph(src: Path = SRC) -> dict[str, set[str]]:
    """Each module of the ``mltrace`` package under ``src`` → the mltrace modules it imports."""
    modules = {module_name(p, src): p for p in src.joinpath("mltrace").rglob("*.py")}
    for stub in src.joinpath("mltrace").rglob("*.pyi"):  # the C helpers: leaves, known by their stubs
        modules.setdefault(module_name(stub, src), stub)
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


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports of a module from a higher layer than its own."""
    out = []
    for a, targets in edges.items():
        for b in targets:
            ra, rb = rank(a), rank(b)
            if ra is not None and rb is not None and rb > ra:
                out.append((a, b))
    return sorted(out)


def unranked(edges: dict[str, set[str]]) -> list[str]:
    """The modules whose package has no rank in ``RANKS``."""
    return sorted(m for m in edges if rank(m) is None)


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
    up, loops, loose = upward(edges), cycles(edges), unranked(edges)
    imports = sum(len(t) for t in edges.values())
    print(f"{len(edges)} modules, {imports} imports: {len(up)} upward, {len(loops)} cycles, {len(loose)} unranked")
    if not args.counts:
        for a, b in up:
            print(f"  up    {a} -> {b}")
        for loop in loops:
            print(f"  cycle ({len(loop)}) " + ", ".join(loop))
        for module in loose:
            print(f"  unranked {module}")
    return 1 if up or loops or loose else 0


if __name__ == "__main__":
    sys.exit(main())
