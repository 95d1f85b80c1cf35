"""What the benchmarks share: timing blocks of calls, interleaving conditions round by round,
medians, p90s and bootstrap intervals, the machine's load, the example models, child
processes with their peak memory, and the common command-line flags.

A benchmark script runs as ``python benchmarks/NAME.py``, so this directory is first on
``sys.path`` and ``import harness`` finds this module.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

#: The steady glibc allocator settings several figures in docs/PERFORMANCE.md were measured with.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "1073741824"}


def use_examples() -> None:
    """Makes ``examples/`` importable (``models``, ``mobilenet``, ``ort_infer``)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))


# --- timing -------------------------------------------------------------------------------


def time_calls(fn: Callable[[], object], n: int, *, warm: int = 0, clock: Callable[[], int] = time.perf_counter_ns) -> list[int]:
    """Durations (``clock`` units, ns by default) of ``n`` calls of ``fn``, after ``warm`` calls not timed."""
    for _ in range(warm):
        fn()
    out = []
    for _ in range(n):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def p90(values: Sequence[float]) -> float:
    """The 90th percentile (inclusive method); the value itself for a single sample."""
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]


def rotation(kinds: Sequence[str], i: int, *, mirror: bool = False) -> list[str]:
    """Round ``i``'s order: every kind takes every position in turn; ``mirror`` also reverses odd rounds."""
    order = list(kinds[i % len(kinds) :]) + list(kinds[: i % len(kinds)])
    return order[::-1] if mirror and i % 2 else order


@dataclass
class Rounds:
    """Samples of interleaved rounds: every sample of each kind pooled, and each round's block median."""

    samples: dict[str, list[float]] = field(default_factory=dict)
    medians: dict[str, list[float]] = field(default_factory=dict)

    def add(self, kind: str, block: Sequence[float]) -> None:
        self.samples.setdefault(kind, []).extend(block)
        self.medians.setdefault(kind, []).append(statistics.median(block))

    def median(self, kind: str) -> float:
        return statistics.median(self.samples[kind])

    def p90(self, kind: str) -> float:
        return p90(self.samples[kind])

    def overhead_pct(self, kind: str, base: str = "plain") -> float:
        """Pooled median of ``kind`` against pooled median of ``base``, in percent."""
        return 100.0 * (self.median(kind) / self.median(base) - 1)

    def ratios(self, kind: str, base: str = "plain") -> list[float]:
        """Each round's block median of ``kind`` over that round's block median of ``base``."""
        return [a / b for a, b in zip(self.medians[kind], self.medians[base])]

    def paired_ratio(self, kind: str, base: str = "plain") -> float:
        """The median of the per-round ratios (drift between rounds cancels)."""
        return statistics.median(self.ratios(kind, base))


def interleave(
    kinds: Sequence[str],
    rounds: int,
    block: Callable[[str, int], Sequence[float]],
    *,
    order: Callable[[Sequence[str], int], list[str]] = rotation,
    progress: str | None = None,
) -> Rounds:
    """Runs ``block(kind, round)`` for every kind in every round, in ``order(kinds, round)``."""
    out = Rounds()
    for r in range(rounds):
        for kind in order(kinds, r):
            out.add(kind, block(kind, r))
        if progress and (r + 1) % 10 == 0:
            print(f"{progress} round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    return out


# --- statistics ---------------------------------------------------------------------------


def bootstrap_median(values: Sequence[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95 % percentile-bootstrap interval for the median of ``values``."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def bootstrap_product(a: Sequence[float], b: Sequence[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95 % percentile-bootstrap interval for median(a) × median(b), a and b resampled independently."""
    rng = random.Random(seed)
    prods = sorted(statistics.median(rng.choices(a, k=len(a))) * statistics.median(rng.choices(b, k=len(b))) for _ in range(n))
    return prods[int(0.025 * n)], prods[int(0.975 * n) - 1]


def ratio_row(name: str, ratios: Sequence[float], width: int = 22, *, extremes: bool = False) -> str:
    """``name``: the median of ``ratios`` as a percentage over 1, its bootstrap 95 % interval and IQR
    (``extremes``: also min and max)."""
    pct = sorted(100 * (r - 1) for r in ratios)
    lo, hi = bootstrap_median(pct)
    q1, q3 = pct[len(pct) // 4], pct[(3 * len(pct)) // 4]
    row = f"  {name:{width}} {statistics.median(pct):+6.2f} %  95% CI [{lo:+.2f}, {hi:+.2f}]  IQR [{q1:+.2f}, {q3:+.2f}]"
    return row + (f"  min/max [{pct[0]:+.2f}, {pct[-1]:+.2f}]" if extremes else "")


# --- the machine --------------------------------------------------------------------------


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg gives them ("n/a" where it does not)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """Sets environment variables for the block and restores them after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --- the example models -------------------------------------------------------------------


@dataclass
class Workload:
    """A model, its input and a label for tables."""

    label: str
    model: Any
    x: Any

    def __call__(self) -> Any:
        return self.model(self.x)


def example_model(kind: str, *, batch: int = 1, size: int = 224, seq: int = 128, layers: int = 12) -> Workload:
    """The example CNN (``cnn``: ResNet-18-style) or Transformer encoder (``encoder``) of examples/models.py,
    in eval mode, with a seeded random input."""
    import torch

    use_examples()
    from models import encoder, resnet_small

    torch.manual_seed(0)
    if kind == "cnn":
        return Workload(f"ResNet-18-style CNN, batch {batch}, {size}x{size}", resnet_small().eval(), torch.randn(batch, 3, size, size))
    if kind == "encoder":
        label = f"Transformer encoder ({layers}x768), batch {batch}, seq {seq}"
        return Workload(label, encoder(layers=layers).eval(), torch.randint(0, 30522, (batch, seq)))
    raise ValueError(f"unknown model {kind!r} (cnn or encoder)")


# --- child processes ----------------------------------------------------------------------


@dataclass
class Child:
    """A finished child process: its standard output, peak resident memory, wall time and when it
    was seen to exit (``time.time()``)."""

    stdout: str
    peak_mb: float
    wall_s: float
    exited_at: float

    def result_line(self, tag: str = "RESULT") -> list[str]:
        """The words after ``tag`` on the child's line that starts with it."""
        line = next((ln for ln in self.stdout.splitlines() if ln.startswith(tag)), None)
        if line is None:
            raise SystemExit(f"the child printed no {tag} line")
        return line.split()[1:]


def run_child(cmd: Sequence[str], *, env: dict[str, str] | None = None) -> Child:
    """Runs ``cmd`` to its end (stderr discarded); exits with one line if it fails.

    Peak RSS is the child's whole life, its end included (``wait4``'s ``ru_maxrss``).
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    text = proc.stdout.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    exited_at = time.time()
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"child {' '.join(cmd)} failed with status {proc.returncode}")
    return Child(text, usage.ru_maxrss / 1024, wall, exited_at)


# --- the command line ---------------------------------------------------------------------


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser whose help is the script's docstring, laid out as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_quick(p: argparse.ArgumentParser, what: str = "few rounds, small inputs (smoke run)") -> None:
    p.add_argument("--quick", action="store_true", help=what)


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")


def write_json(path: str | None, data: Any) -> None:
    """Writes ``data`` as indented JSON to ``path`` (nothing when ``path`` is None)."""
    if path:
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
