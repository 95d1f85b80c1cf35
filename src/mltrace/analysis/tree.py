"""The nesting of a run's span table as numpy columns: each row's parent and depth, nearest
ancestors (``Tree``, built once per table by ``tree_of``), and call/duration sums per pair of
rows (``pair_sums``). Shared by the analysis passes; numpy is imported when they first run."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from mltrace.run.table import SpanTable

_MAX_DEPTH = 100_000  # deeper than this only through a cyclic parent chain


class Tree:
    """Parent rows, depths and the rows of each depth (roots first) of a table."""

    def __init__(self, table: SpanTable) -> None:
        import numpy as np

        parent = table.parent_row().copy()
        depth = _depths(parent)
        self.detached = np.zeros(len(parent), dtype=bool)  # rows cut off a cyclic parent chain
        if depth is None:  # a cyclic parent chain: cut it where the walk gave up
            self.detached = parent != table.parent_row()
            depth = _depths(parent)
            assert depth is not None
        self.parent = parent
        self.depth = depth
        small = len(depth) == 0 or int(depth.max()) < np.iinfo(np.int16).max
        order = np.argsort(depth.astype(np.int16) if small else depth, kind="stable")  # 16-bit keys: a radix sort
        bounds = np.searchsorted(depth[order], np.arange(int(depth.max()) + 2 if len(depth) else 1))
        self.by_depth = [order[bounds[d] : bounds[d + 1]] for d in range(len(bounds) - 1)]

    def nearest(self, cond: np.ndarray) -> np.ndarray:
        """For each row, its nearest strict ancestor where ``cond`` holds (-1: none)."""
        import numpy as np

        parent = self.parent
        near = np.full(len(parent), -1, dtype=np.int64)
        for rows in self.by_depth[1:]:
            p = parent[rows]
            near[rows] = np.where(cond[p], p, near[p])
        return near

    def ancestor_or(self, flags: np.ndarray) -> np.ndarray:
        """For each row, the OR of ``flags`` over its strict ancestors."""
        import numpy as np

        parent = self.parent
        out = np.zeros(len(parent), dtype=flags.dtype)
        for rows in self.by_depth[1:]:
            p = parent[rows]
            out[rows] = out[p] | flags[p]
        return out


def tree_of(table: SpanTable) -> Tree:
    """The table's tree, built once per table."""
    got = table.cache.get("tree")
    if got is None:
        got = table.cache["tree"] = Tree(table)
    return got


def _depths(parent: np.ndarray) -> np.ndarray | None:
    """Number of ancestors of each row; on a cycle, detaches the rows caught in it and returns None."""
    import numpy as np

    n = len(parent)
    depth = np.zeros(n, dtype=np.int64)
    active = np.nonzero(parent >= 0)[0]
    anc = parent[active]
    steps = 0
    while active.size:
        depth[active] += 1
        anc = parent[anc]
        keep = anc >= 0
        active, anc = active[keep], anc[keep]
        steps += 1
        if steps > min(n, _MAX_DEPTH):
            parent[active] = -1  # every row still walking is in or under a cycle: make it a root
            return None
    return depth


def pair_sums(left: np.ndarray, right: np.ndarray, dur: np.ndarray) -> dict[int, dict[int, list[int]]]:
    """``left → {right: [calls, summed dur]}`` from parallel integer arrays (largest dur first per left)."""
    import numpy as np

    out: dict[int, dict[int, list[int]]] = {}
    if not len(left):
        return out
    width = int(right.max()) + 1
    key = left.astype(np.int64) * width + right
    uniq, inv = np.unique(key, return_inverse=True)
    calls = np.bincount(inv)
    ns = np.rint(np.bincount(inv, weights=dur)).astype(np.int64)
    order = np.lexsort((-ns, uniq // width))
    for k in order.tolist():
        out.setdefault(int(uniq[k] // width), {})[int(uniq[k] % width)] = [int(calls[k]), int(ns[k])]
    return out
