"""Tracing overhead for ONNX Runtime and Keras/TensorFlow, measured side by side in one process.

For each model: median latency plain and traced at the model level (wrappers
only) and at the op level (wrappers plus ONNX Runtime's profiler or the
TensorFlow profiler), in interleaved rounds (plain block, model block, op
block, plain block, …) so that machine noise hits all alike. Each traced
block runs inside a fresh in-process session with mltrace's default sources
plus the ONNX Runtime and TensorFlow sources.

    python benchmarks/overhead_frameworks.py            # about a minute on 2 cores
    python benchmarks/overhead_frameworks.py --quick    # smoke run

Prints a table; ``--json FILE`` writes the figures.

Notes: ONNX Runtime profiles a session from its creation, so the op-level
block creates its InferenceSession inside the traced session (and the plain
block uses one created outside). Keras's ``predict`` runs a graph function;
``model(x)`` runs eagerly, one TensorFlow op at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import numpy as np  # noqa: E402

from mltrace.config import ProfileOptions  # noqa: E402
from mltrace.run.levels import Level  # noqa: E402
from mltrace.tracer.session import Session  # noqa: E402

CONDITIONS = {"model": Level.MODEL, "op": Level.OP}


def _sources() -> list[Any]:
    from mltrace.tracer.sources import default_sources
    from mltrace.tracer.sources.onnxruntime import OrtSource
    from mltrace.tracer.sources.tensorflow import TensorFlowSource

    sources = default_sources()
    names = {s.name for s in sources}
    return sources + [s for s in (OrtSource(), TensorFlowSource()) if s.name not in names]


@contextmanager
def traced(level: Level, out: Path) -> Iterator[None]:
    session = Session(ProfileOptions(output=out, summary=False, level=level), sources=_sources()).start()
    try:
        yield
    finally:
        session.stop()


def _time_block(fn: Callable[[], Any], iters: int) -> list[int]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    return out


def measure(name: str, make: Callable[[], Callable[[], Any]], rounds: int, iters: int, warmup: int = 3) -> dict[str, Any]:
    """Median ns per call plain and per condition; ``make()`` builds the callable (inside a traced session for those)."""
    samples: dict[str, list[int]] = {"plain": [], **{c: [] for c in CONDITIONS}}

    def block(key: str) -> None:
        fn = make()  # every block builds its callable alike (a fresh ORT session each time)
        for _ in range(warmup):
            fn()  # first calls: arena growth, weight prepacking, a new tracing session; not measured
        samples[key] += _time_block(fn, iters)

    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            block("plain")
            for c, level in CONDITIONS.items():
                with traced(level, Path(tmp) / f"{c}-{r}"):
                    block(c)
    plain = statistics.median(samples["plain"])
    res: dict[str, Any] = {"model": name, "plain_ms": plain / 1e6, "samples": len(samples["plain"])}
    for c in CONDITIONS:
        med = statistics.median(samples[c])
        res[f"{c}_ms"] = med / 1e6
        res[f"{c}_overhead_pct"] = 100.0 * (med - plain) / plain
    return res


def ort_cases(size: int) -> list[tuple[str, Callable[[], Callable[[], Any]]]]:
    import onnxruntime as ort
    from ort_infer import export

    path = os.path.join(tempfile.gettempdir(), "mltrace-examples", f"resnet_small_dynamo_{size}.onnx")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        export(path + ".tmp", "dynamo", size)
        os.replace(path + ".tmp", path)
    images = np.random.default_rng(0).standard_normal((1, 3, size, size), dtype=np.float32)

    def make(level: Any) -> Callable[[], Callable[[], Any]]:
        def build() -> Callable[[], Any]:
            options = ort.SessionOptions()
            options.graph_optimization_level = level
            sess = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            name = sess.get_inputs()[0].name
            return lambda: sess.run(None, {name: images})

        return build

    def tiny() -> Callable[[], Any]:
        # One Neg node: what is left is the cost per run() call of ORT and of tracing it.
        from onnx import TensorProto, helper

        graph = helper.make_graph(
            [helper.make_node("Neg", ["x"], ["y"], name="neg")],
            "tiny",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        x = np.ones(4, np.float32)
        return lambda: sess.run(None, {"x": x})

    return [
        (f"ORT ResNet-18-style, {size}x{size}, optimisations on", make(ort.GraphOptimizationLevel.ORT_ENABLE_ALL)),
        (f"ORT ResNet-18-style, {size}x{size}, optimisations off", make(ort.GraphOptimizationLevel.ORT_DISABLE_ALL)),
        ("ORT one-node model (cost per run call)", tiny),
    ]


def keras_cases(size: int) -> list[tuple[str, Callable[[], Callable[[], Any]]]]:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(weights=None, input_shape=(size, size, 3))
    images = np.random.default_rng(0).standard_normal((1, size, size, 3)).astype(np.float32)
    model.predict(images, verbose=0)
    dense = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="fc")], name="tiny")
    row = np.ones((1, 4), np.float32)
    dense(row)
    return [
        (f"Keras MobileNetV2 predict(), {size}x{size}", lambda: lambda: model.predict(images, verbose=0)),
        (f"Keras MobileNetV2 eager model(x), {size}x{size}", lambda: lambda: model(images, training=False)),
        ("Keras one-Dense model eager (cost per call)", lambda: lambda: dense(row)),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few rounds, small inputs (smoke run)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--frameworks", default="onnxruntime,keras")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()
    rounds, iters = (2, 2) if args.quick else (args.rounds, args.iters)
    ort_size, keras_size = (64, 64) if args.quick else (112, 96)
    cases: list[tuple[str, Callable[[], Callable[[], Any]]]] = []
    wanted = set(args.frameworks.split(","))
    if "onnxruntime" in wanted:
        cases += ort_cases(ort_size)
    if "keras" in wanted:
        cases += keras_cases(keras_size)
    results = []
    for name, make in cases:
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        per_call = "cost per" in name  # microseconds per call: many calls per block
        results.append(measure(name, make, rounds, iters * 50 if per_call else iters))
    versions = []
    for mod in ("onnxruntime", "tensorflow", "keras"):
        if mod in sys.modules:
            versions.append(f"{mod} {sys.modules[mod].__version__}")
    print(f"\n{', '.join(versions)}; cpu count {os.cpu_count()}; {rounds} rounds x {iters} calls per condition")
    header = f"{'model':48} {'plain ms':>9}" + "".join(f" {c + ' ms':>10} {c + ' %':>9}" for c in CONDITIONS)
    print(header)
    for r in results:
        line = f"{r['model']:48} {r['plain_ms']:9.3f}"
        for c in CONDITIONS:
            line += f" {r[f'{c}_ms']:10.3f} {r[f'{c}_overhead_pct']:+8.1f}%"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
