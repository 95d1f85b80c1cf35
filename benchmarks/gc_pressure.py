"""How tracing changes the program's own garbage collections: how many collections of each
generation run during an inference loop, and how long they take, plain and traced.

Each condition runs a fresh child process: a program that counts its collections with a
``gc.callbacks`` probe (generation, duration, thread), runs a few warm-up calls, then the
measured loop, and prints what the probe saw during the loop. Conditions are interleaved
round by round (``harness.rotation``); each figure is the median over rounds.

Workloads: ``keras`` (keras.applications MobileNetV2 with random weights, eager
``model(x)`` calls), ``cnn`` (the example ResNet-18-style CNN) and ``gpt2`` (GPT-2 small
built from its config, ``generate()`` of 32 tokens, greedy) and ``mlp`` (a small MLP, 64 wide at
batch 1, called 20,000 times: a model call every few tens of microseconds). Conditions: ``plain``,
``layer`` (``mltrace python --level layer``) and ``default`` (``mltrace python``, every
level). ``--compare-src DIR`` also runs the traced conditions with mltrace imported from
another checkout's ``src`` (a before/after comparison in one interleaved run);
``--compare-env KEY=VALUE`` runs them again with that variable set (``@env``), such as a
switch to one of mltrace's Python fallbacks.

    python benchmarks/gc_pressure.py --workload keras --rounds 4          # a few minutes on 2 cores
    python benchmarks/gc_pressure.py --workload keras --conditions plain layer --compare-src /tmp/old/src
    python benchmarks/gc_pressure.py --workload mlp --compare-env MLTRACE_SPAN_UNTRACK=python
    python benchmarks/gc_pressure.py --quick                               # smoke run
    python benchmarks/gc_pressure.py --callback-cost                       # the session's gc callback alone

``--callback-cost`` times what mltrace's own ``gc.callbacks`` entry (``sources/gc_pauses.py``)
adds to a collection: blocks of young collections (``gc.collect(0)``) without and with it,
interleaved, in this process.

``--start-objects`` counts the objects the collector tracks (``len(gc.get_objects())`` after
``gc.collect()``) at the program's first statement and after it imports a framework (none,
torch, onnxruntime), plain and under ``mltrace python`` at each level: what mltrace's modules
and its session's start leave for the program's every full collection to scan. The counts do
not vary from run to run; one run each.

    python benchmarks/gc_pressure.py --start-objects

The children run with one intra-op thread (``OMP_NUM_THREADS=1``, TensorFlow's too).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import harness

PROBE = r"""
import gc, json, os, sys, threading, time
_stats, _began, _on = {}, [0], [False]
def _probe(phase, info):
    if phase == "start":
        _began[0] = time.perf_counter_ns()
        return
    if not _on[0]:
        return
    took = (time.perf_counter_ns() - _began[0]) / 1e6
    s = _stats.setdefault(str(info["generation"]), {"n": 0, "ms": 0.0, "max_ms": 0.0, "other_threads": 0})
    s["n"] += 1
    s["ms"] += took
    s["max_ms"] = max(s["max_ms"], took)
    s["other_threads"] += threading.current_thread() is not threading.main_thread()
gc.callbacks.append(_probe)
"""

WORKLOADS = {
    "keras": r"""
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras, numpy as np
keras.utils.set_random_seed(0)
model = keras.applications.MobileNetV2(weights=None, input_shape=(SIZE, SIZE, 3))
x = np.random.default_rng(0).standard_normal((1, SIZE, SIZE, 3)).astype(np.float32)
def call():
    return np.asarray(model(x, training=False))
""",
    "cnn": r"""
import torch
sys.path.insert(0, EXAMPLES)
from models import resnet_small
torch.manual_seed(0)
torch.set_grad_enabled(False)
model = resnet_small().eval()
x = torch.randn(1, 3, SIZE, SIZE)
def call():
    return model(x)
""",
    "mlp": r"""
import torch
torch.manual_seed(0)
torch.set_grad_enabled(False)
nn = torch.nn
model = nn.Sequential(nn.Linear(SIZE, SIZE), nn.ReLU(), nn.Linear(SIZE, SIZE), nn.ReLU(), nn.Linear(SIZE, 10)).eval()
x = torch.randn(1, SIZE)
def call():
    return model(x)
""",
    "gpt2": r"""
import torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
torch.set_grad_enabled(False)
model = GPT2LMHeadModel(GPT2Config()).eval()
ids = torch.randint(0, 50257, (1, 16))
def call():
    return model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=0)
""",
}

LOOP = r"""
for _ in range(WARM):
    call()
objects = len(gc.get_objects())
_on[0] = True
t0 = time.perf_counter()
for _ in range(ITERS):
    call()
loop_s = time.perf_counter() - t0
_on[0] = False
print("RESULT " + json.dumps({"gc": _stats, "loop_s": loop_s, "objects": objects}), flush=True)
"""

#: Default loop length and input size per workload.
SETTINGS = {"keras": (60, 128), "cnn": (40, 112), "mlp": (20_000, 64), "gpt2": (4, 0)}


def program(workload: str, iters: int, size: int) -> str:
    """The child's source."""
    body = WORKLOADS[workload].replace("SIZE", str(size)).replace("EXAMPLES", repr(str(harness.EXAMPLES)))
    return PROBE + body + LOOP.replace("WARM", "2").replace("ITERS", str(iters))


def command(condition: str, script: Path, out: Path) -> list[str]:
    """The child's command line for a condition (``plain``, ``default``, or a level's name)."""
    if condition == "plain":
        return [sys.executable, str(script)]
    level = [] if condition == "default" else ["--level", condition]
    return [sys.executable, "-m", "mltrace", "python", "-q", *level, "-o", str(out), str(script)]


def run_once(kind: str, script: Path, scratch: Path, compare: dict[str, str], r: int) -> dict[str, Any]:
    """One child run of a condition (``layer``; ``layer@old`` with the other checkout, ``layer@env``
    with the other environment variable): ``compare`` holds what those two change."""
    condition, _, which = kind.partition("@")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
    if which == "old":
        env["PYTHONPATH"] = compare["src"]
    elif which == "env":
        key, _, value = compare["env"].partition("=")
        env[key] = value
    out = scratch / f"run-{kind.replace('@', '-')}-{r}"
    child = harness.run_child(command(condition, script, out), env=env)
    result: dict[str, Any] = json.loads(" ".join(child.result_line()))
    return result


def summary_row(kind: str, results: list[dict[str, Any]]) -> str:
    """One table row: medians over rounds of each generation's collections, total and longest."""
    cells = [f"{kind:14}"]
    for g in "012":
        per = [r["gc"].get(g, {}) for r in results]
        n = statistics.median(p.get("n", 0) for p in per)
        ms = statistics.median(p.get("ms", 0.0) for p in per)
        longest = statistics.median(p.get("max_ms", 0.0) for p in per)
        cells.append(f"{n:5.0f} {ms:7.1f} {longest:6.1f}")
    cells.append(f"{statistics.median(r['loop_s'] for r in results):7.2f}")
    cells.append(f"{statistics.median(r['objects'] for r in results):9.0f}")
    return "  ".join(cells)


def callback_cost(rounds: int, block: int = 20_000) -> None:
    """Prints the median time of a young collection without and with the session's callback."""
    import gc
    import itertools
    import time

    from mltrace.tracer.recorder import Recorder
    from mltrace.tracer.sources.gc_pauses import GcPauseSource
    from mltrace.tracer.tracks import TrackRegistry

    class View:
        def __init__(self) -> None:
            self.meta: dict[str, Any] = {}
            self.tracks = TrackRegistry()
            self.recorder = Recorder(self.tracks, itertools.count(1))

    def collections(kind: str, _round: int) -> list[float]:
        source = GcPauseSource()
        if kind == "callback":
            source.start(View())  # type: ignore[arg-type]
        try:
            t0 = time.perf_counter_ns()
            for _ in range(block):
                gc.collect(0)
            return [(time.perf_counter_ns() - t0) / block]
        finally:
            if kind == "callback":
                source.stop()

    got = harness.interleave(["plain", "callback"], rounds, collections)
    plain, with_callback = got.median("plain"), got.median("callback")
    print(f"# young collection (gc.collect(0)), median of {rounds} blocks of {block}; load {harness.loadavg()}")
    print(f"plain     {plain / 1e3:7.2f} µs")
    print(f"callback  {with_callback / 1e3:7.2f} µs  (+{(with_callback - plain) / 1e3:.2f} µs a collection)")


START_OBJECTS = r"""
import gc, json, sys
gc.collect()
first = len(gc.get_objects())
FRAMEWORK
gc.collect()
own = sum(1 for name in sys.modules if name == "mltrace" or name.startswith("mltrace."))
print("RESULT " + json.dumps({"first": first, "after": len(gc.get_objects()), "mltrace_modules": own}), flush=True)
"""

#: ``--start-objects``' conditions: plain, then ``mltrace python`` at each level and at the default.
START_CONDITIONS = ("plain", "model", "layer", "op", "library", "default")


def start_objects(frameworks: list[str]) -> dict[str, dict[str, Any]]:
    """Prints, per framework and condition, the tracked objects at the program's start and after
    its framework import, and the traced conditions' excess over plain."""
    results: dict[str, dict[str, Any]] = {}
    print(f"# tracked objects (gc.get_objects() after gc.collect()); load {harness.loadavg()}")
    print(f"{'framework':12} {'condition':10} {'at start':>9} {'+mltrace':>8} {'after import':>12} {'+mltrace':>8}  mltrace modules")
    with tempfile.TemporaryDirectory(prefix="mltrace-gc-") as tmp:
        scratch = Path(tmp)
        for framework in frameworks:
            script = scratch / f"start_{framework}.py"
            script.write_text(START_OBJECTS.replace("FRAMEWORK", f"import {framework}" if framework != "none" else ""))
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            for condition in START_CONDITIONS:
                out = scratch / f"run-{framework}-{condition}"
                child = harness.run_child(command(condition, script, out), env=env)
                got: dict[str, Any] = json.loads(" ".join(child.result_line()))
                results[f"{framework}/{condition}"] = got
                plain = results[f"{framework}/plain"]
                print(
                    f"{framework:12} {condition:10} {got['first']:9,} {got['first'] - plain['first']:+8,} "
                    f"{got['after']:12,} {got['after'] - plain['after']:+8,}  {got['mltrace_modules']}"
                )
    return results


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="keras")
    p.add_argument("--conditions", nargs="+", choices=("plain", "layer", "default"), default=["plain", "layer", "default"])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--iters", type=int, help="calls in the measured loop (default per workload)")
    p.add_argument("--size", type=int, help="image size (keras, cnn)")
    p.add_argument("--compare-src", metavar="DIR", help="also run the traced conditions with mltrace from DIR (a checkout's src)")
    p.add_argument("--compare-env", metavar="KEY=VALUE", help="also run the traced conditions with this variable set")
    p.add_argument("--callback-cost", action="store_true", help="time the session's gc callback alone (see above)")
    p.add_argument("--start-objects", action="store_true", help="count the tracked objects at the program's start (see above)")
    p.add_argument("--frameworks", nargs="+", default=["none", "torch", "onnxruntime"], help="--start-objects: what the program imports")
    harness.add_quick(p)
    harness.add_json(p)
    args = p.parse_args()
    if args.callback_cost:
        callback_cost(3 if args.quick else 15)
        return
    if args.start_objects:
        harness.write_json(args.json, {"start_objects": start_objects(args.frameworks)})
        return
    iters, size = SETTINGS[args.workload]
    iters = args.iters or (max(2, iters // 10) if args.quick else iters)
    size = args.size or size
    rounds = 1 if args.quick else args.rounds
    kinds = list(args.conditions)
    compare: dict[str, str] = {}
    if args.compare_src:
        kinds += [f"{c}@old" for c in args.conditions if c != "plain"]
        compare["src"] = args.compare_src
    if args.compare_env:
        if "=" not in args.compare_env:
            p.error("--compare-env takes KEY=VALUE")
        kinds += [f"{c}@env" for c in args.conditions if c != "plain"]
        compare["env"] = args.compare_env
    print(f"# gc_pressure: {args.workload}, {iters} calls a loop, size {size}, {rounds} rounds; load {harness.loadavg()}")
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="mltrace-gc-") as tmp:
        scratch = Path(tmp)
        script = scratch / f"gc_{args.workload}.py"
        script.write_text(program(args.workload, iters, size))
        for r in range(rounds):
            for kind in harness.rotation(kinds, r):
                results[kind].append(run_once(kind, script, scratch, compare, r))
    print(f"# load after: {harness.loadavg()}")
    print("# medians over rounds of the collections during the loop: count, total ms, longest ms per generation")
    print(f"{'condition':14}  {'gen0 n   total  max':20}  {'gen1 n   total  max':20}  {'gen2 n   total  max':20}  loop s   objects")
    for kind in kinds:
        print(summary_row(kind, results[kind]))
    harness.write_json(args.json, {"workload": args.workload, "iters": iters, "size": size, "results": results})


if __name__ == "__main__":
    main()
