"""The full CPU trace against torch.profiler alone, measured in paired blocks.

``overhead.py`` compares whole sessions, each started and stopped around its
block; a library-level session takes seconds to stop, so its blocks and the
torch.profiler blocks they are compared with run seconds apart, and ten rounds
leave a ratio that moves by a few points from run to run. This script splits
the same comparison in two parts that can each alternate blocks of a few
inferences a few hundred milliseconds apart:

A. **What mltrace adds to its own profiler.** One real session at the library
   level (every source: the op level's torch.profiler, model and layer spans,
   oneDNN/MKL verbose output read from fd 1). Inside it, between blocks, the
   ``Module.__call__`` wrapper is swapped for torch's own and oneDNN's and MKL's
   verbose output is switched off and on at run time, so four kinds of block
   alternate (rotating order): ``op`` (the profiler alone), ``op+layer`` (model
   and layer spans), ``op+library`` (verbose output, read by the tap) and
   ``full`` (all of it). The spans' drain and write is timed in a flush after
   every ``--flush-every`` rounds and added to the kinds that record spans. The
   reader thread's work is in the blocks (it runs while the program does).

B. **mltrace's profiler against torch.profiler as users run it.** Blocks of
   plain inferences, inferences under ``torch.profiler(record_shapes=True)``
   and under the profiler as the op level configures it (also every thread:
   ``profile_all_threads``), each profiler started before its block and
   stopped after it.

Each round gives ratios of block medians; the report is the median ratio with a
bootstrap 95 % interval. The full trace against torch.profiler alone is the
product of ``full / op`` (A) and ``mltrace's profiler / torch.profiler`` (B),
with an interval from resampling both. Also printed: the same as a ratio of
overheads, (full − plain) / (torch.profiler − plain).

    python benchmarks/cross_stack_paired.py [--model cnn|encoder] [--pairs 60] [--block 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch  # noqa: E402
from models import encoder, resnet_small  # noqa: E402
from overhead_parts import bootstrap_median, loadavg, timed_block  # noqa: E402

from mltrace.config import ProfileOptions  # noqa: E402
from mltrace.run.levels import Level  # noqa: E402
from mltrace.tracer.session import Session  # noqa: E402
from mltrace.tracer.sources.cpu_library import CpuLibrarySource  # noqa: E402
from mltrace.tracer.sources.torch_modules import TorchModuleSource  # noqa: E402
from mltrace.tracer.sources.torch_ops import _all_threads_config  # noqa: E402

NO_FLUSH_S = 60.0  # the session's own flusher stays idle: flushes are timed by the script
IN_SESSION = ("op", "op+layer", "op+library", "full")  # phase A: (wrapper on, verbose on)
SWITCHES = {"op": (False, False), "op+layer": (True, False), "op+library": (False, True), "full": (True, True)}
PROFILERS = ("plain", "torch.profiler", "mltrace's profiler")  # phase B


def _order(kinds: tuple[str, ...], i: int) -> list[str]:
    """Round ``i``'s order: every kind takes every position in turn, forwards and backwards."""
    order = list(kinds[i % len(kinds) :] + kinds[: i % len(kinds)])
    return order if i % 2 == 0 else order[::-1]


def _set_verbose(on: bool) -> None:
    verbose = torch._C._verbose
    if torch.backends.mkldnn.is_available():
        verbose.mkldnn_set_verbose(1 if on else 0)
    if torch.backends.mkl.is_available():
        verbose.mkl_set_verbose(1 if on else 0)


def in_session(fn: Callable[[], Any], pairs: int, block: int, flush_every: int) -> dict[str, Any]:
    """Phase A: block medians per kind and round, inside one library-level session."""
    medians: dict[str, list[float]] = {k: [] for k in IN_SESSION}
    flush_ns = spans_inferences = 0
    with tempfile.TemporaryDirectory() as tmp:
        options = ProfileOptions(
            output=Path(tmp) / "run", summary=False, level=Level.LIBRARY, flush_interval_s=NO_FLUSH_S, op_memory_gib=16, max_spans=0
        )
        session = Session(options).start()
        try:
            modules = next(s for s in session.started if isinstance(s, TorchModuleSource))
            library = next(s for s in session.started if isinstance(s, CpuLibrarySource))
            assert modules._wrapped is not None, "the torch module source did not wrap Module.__call__"
            assert library._tap is not None, "the library level's fd tap did not start"
            module_cls, original, wrapper = modules._wrapped
            fn()
            session.flush()  # the first flush has one-off costs: not counted
            lines_before = len(library._tap.lines())
            verbose_inferences = 0
            for i in range(pairs):
                for kind in _order(IN_SESSION, i):
                    wrapped, verbose = SWITCHES[kind]
                    module_cls.__call__ = wrapper if wrapped else original
                    _set_verbose(verbose)
                    try:
                        medians[kind].append(statistics.median(timed_block(fn, block)))
                    finally:
                        module_cls.__call__ = wrapper
                        _set_verbose(True)
                    spans_inferences += (block + 1) * wrapped
                    verbose_inferences += (block + 1) * verbose
                if (i + 1) % flush_every == 0 or i == pairs - 1:
                    t0 = time.perf_counter_ns()
                    session.flush()
                    flush_ns += time.perf_counter_ns() - t0
                if (i + 1) % 10 == 0:
                    print(f"in-session round {i + 1}/{pairs}", file=sys.stderr, flush=True)
            time.sleep(0.05)  # the reader's last batch
            lines = (len(library._tap.lines()) - lines_before) / max(verbose_inferences, 1)
        finally:
            module_cls.__call__ = wrapper
            print("stopping the session (converting the trace) ...", file=sys.stderr, flush=True)
            session.stop()
    drain = flush_ns / max(spans_inferences, 1)  # ns an inference that recorded spans
    ratios = {k: [(m + drain * SWITCHES[k][0]) / o for m, o in zip(medians[k], medians["op"])] for k in IN_SESSION[1:]}
    return {"medians": medians, "ratios": ratios, "drain_ns": drain, "lines_per_inference": lines}


def profilers(fn: Callable[[], Any], pairs: int, block: int) -> dict[str, Any]:
    """Phase B: plain, torch.profiler(record_shapes=True) and the op level's profiler configuration."""
    from torch.profiler import ProfilerActivity, profile

    config = _all_threads_config()

    def make(kind: str) -> Any:
        if kind == "plain":
            return None
        kwargs: dict[str, Any] = {"activities": [ProfilerActivity.CPU], "record_shapes": True}
        if kind != "torch.profiler" and config is not None:
            kwargs["experimental_config"] = config
        return profile(**kwargs)

    medians: dict[str, list[float]] = {k: [] for k in PROFILERS}
    for i in range(pairs):
        for kind in _order(PROFILERS, i):
            prof = make(kind)
            if prof is not None:
                prof.start()
            try:
                medians[kind].append(statistics.median(timed_block(fn, block)))
            finally:
                if prof is not None:
                    prof.stop()
        if (i + 1) % 10 == 0:
            print(f"profiler round {i + 1}/{pairs}", file=sys.stderr, flush=True)
    ratios = {
        "torch.profiler / plain": [t / p for t, p in zip(medians["torch.profiler"], medians["plain"])],
        "mltrace's profiler / torch.profiler": [m / t for m, t in zip(medians["mltrace's profiler"], medians["torch.profiler"])],
    }
    return {"medians": medians, "ratios": ratios, "all_threads": config is not None}


def bootstrap_product(a: list[float], b: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95 % percentile-bootstrap interval for median(a) × median(b), a and b resampled independently."""
    rng = random.Random(seed)
    prods = sorted(
        statistics.median(rng.choices(a, k=len(a))) * statistics.median(rng.choices(b, k=len(b))) for _ in range(n)
    )
    return prods[int(0.025 * n)], prods[int(0.975 * n) - 1]


def _row(name: str, ratios: list[float]) -> str:
    pct = sorted(100 * (r - 1) for r in ratios)
    lo, hi = bootstrap_median(pct)
    q1, q3 = pct[len(pct) // 4], pct[(3 * len(pct)) // 4]
    return f"  {name:38} {statistics.median(pct):+6.2f} %  95% CI [{lo:+.2f}, {hi:+.2f}]  IQR [{q1:+.2f}, {q3:+.2f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("cnn", "encoder"), default="cnn")
    parser.add_argument("--pairs", type=int, default=60, help="rounds of each phase (default 60)")
    parser.add_argument("--block", type=int, default=3, help="timed inferences per block (default 3)")
    parser.add_argument("--flush-every", type=int, default=2, help="phase A: rounds per timed flush (default 2)")
    args = parser.parse_args()
    if args.pairs < 2 or args.block < 1 or args.flush_every < 1:
        parser.error("--pairs must be at least 2, --block and --flush-every at least 1")
    torch.manual_seed(0)
    if args.model == "cnn":
        model: torch.nn.Module = resnet_small()
        x = torch.randn(1, 3, 224, 224)
        label = "ResNet-18-style CNN, batch 1, 224x224"
    else:
        model = encoder(layers=12)
        x = torch.randint(0, 30522, (1, 128))
        label = "Transformer encoder (12x768), batch 1, seq 128"

    def fn() -> Any:
        return model(x)

    load_before = loadavg()
    with torch.inference_mode():
        for _ in range(3):
            fn()
        a = in_session(fn, args.pairs, args.block, args.flush_every)
        b = profilers(fn, args.pairs, args.block)
    print(f"{label}; torch {torch.__version__}, threads {torch.get_num_threads()}")
    plain_ms = statistics.median(b["medians"]["plain"]) / 1e6
    print(f"plain inference: median {plain_ms:.2f} ms; load average before {load_before}, after {loadavg()}")
    print(
        f"A. inside one library-level session, {args.pairs} rounds of {len(IN_SESSION)} blocks of {args.block}: "
        f"{a['lines_per_inference']:.0f} verbose lines an inference, drain+write {a['drain_ns'] / 1e3:.0f} µs an inference"
    )
    for kind, ratios in a["ratios"].items():
        print(_row(f"{kind} / op", ratios))
    config = "every thread" if b["all_threads"] else "the starting thread only (no profile_all_threads here)"
    print(f"B. {args.pairs} rounds of {len(PROFILERS)} blocks of {args.block}, profilers started and stopped around each block")
    for name, ratios in b["ratios"].items():
        print(_row(name + (f" ({config})" if name.startswith("mltrace") else ""), ratios))
    full = a["ratios"]["full"]
    config_ratio = b["ratios"]["mltrace's profiler / torch.profiler"]
    estimate = statistics.median(full) * statistics.median(config_ratio)
    lo, hi = bootstrap_product(full, config_ratio)
    print(f"full CPU trace / torch.profiler alone = {estimate:.3f}x  95% CI [{lo:.3f}, {hi:.3f}]  (A full/op x B)")
    profiler_cost = statistics.median(b["ratios"]["torch.profiler / plain"])
    full_cost = estimate * profiler_cost
    if profiler_cost > 1:
        print(
            f"as overheads: torch.profiler +{100 * (profiler_cost - 1):.2f} %, full CPU trace +{100 * (full_cost - 1):.2f} % "
            f"({(full_cost - 1) / (profiler_cost - 1):.2f}x torch.profiler's overhead)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
