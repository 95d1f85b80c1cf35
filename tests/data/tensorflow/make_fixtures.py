"""Regenerates the TensorFlow profiler fixtures in this folder (run from the repo root).

    .venv/bin/python tests/data/tensorflow/make_fixtures.py

For each model, runs it under ``tf.profiler.experimental`` (host tracer level
2, as mltrace does) and keeps the ``xplane.pb`` TensorFlow wrote, plus
``<name>.calls.json``: what the live wrappers would have recorded around each
call (start and end in ns since the Unix epoch, the method, the thread's
``std::hash<std::thread::id>`` and OS id) and the model's layers by path.

- ``keras_nested``: a functional model ``net`` (``conv``, ``gap``) around a
  Sequential ``head`` (``fc1``, ``fc2``), called with ``predict``, inside a
  user ``tf.function``, and eagerly.
- ``mobilenetv2``: ``keras.applications.MobileNetV2(weights=None, alpha=0.35)``
  on 32x32 images, with ``predict`` and an eager call.
"""

from __future__ import annotations

import glob
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "src"))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from mltrace.formats.xspace import std_thread_hash  # noqa: E402
from mltrace.tracer.sources.tensorflow import keras_layer_paths  # noqa: E402


def record(name: str, model: keras.Model, calls: list[tuple[str, Any]]) -> None:
    for _, fn in calls:
        fn()  # warm up: build, trace the tf.functions
    logdir = tempfile.mkdtemp()
    spans = []
    try:
        options = tf.profiler.experimental.ProfilerOptions(host_tracer_level=2, python_tracer_level=0, device_tracer_level=1)
        tf.profiler.experimental.start(logdir, options=options)
        for method, fn in calls:
            start = time.time_ns()
            fn()
            spans.append({"method": method, "start_ns": start, "end_ns": time.time_ns()})
        tf.profiler.experimental.stop()
        (path,) = glob.glob(f"{logdir}/plugins/profile/*/*.xplane.pb")
        shutil.copy(path, HERE / f"{name}.xplane.pb")
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    thread = {"hash": std_thread_hash(threading.get_ident()), "tid": threading.get_native_id(), "name": threading.current_thread().name}
    meta = {"model": model.name, "layers": keras_layer_paths(model), "thread": thread, "calls": spans}
    (HERE / f"{name}.calls.json").write_text(json.dumps(meta, indent=1) + "\n")


def main() -> None:
    keras.utils.set_random_seed(0)
    head = keras.Sequential([keras.layers.Dense(8, activation="relu", name="fc1"), keras.layers.Dense(4, name="fc2")], name="head")
    inp = keras.Input((6, 6, 3))
    x = keras.layers.Conv2D(4, 3, name="conv")(inp)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    net = keras.Model(inp, head(x), name="net")
    small = np.ones((2, 6, 6, 3), np.float32)

    @tf.function
    def user_function(t: Any) -> Any:
        return net(t)

    calls = [
        ("predict", lambda: net.predict(small, verbose=0)),
        ("tf.function", lambda: user_function(small)),
        ("__call__", lambda: net(small)),
    ]
    record("keras_nested", net, calls)
    mobilenet = keras.applications.MobileNetV2(weights=None, alpha=0.35, input_shape=(32, 32, 3), classes=10)
    images = np.random.default_rng(0).standard_normal((2, 32, 32, 3)).astype(np.float32)
    record("mobilenetv2", mobilenet, [("predict", lambda: mobilenet.predict(images, verbose=0)), ("__call__", lambda: mobilenet(images))])


if __name__ == "__main__":
    main()
