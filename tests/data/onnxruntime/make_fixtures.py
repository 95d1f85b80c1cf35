"""Regenerates the ONNX Runtime fixtures in this folder (run from the repo root).

    .venv/bin/python tests/data/onnxruntime/make_fixtures.py

Writes small real models exported from the example PyTorch models (narrow
widths so that the weights stay small) and the profiles ONNX Runtime writes
for them:

- ``resnet_tiny_dynamo.onnx``: ``torch.onnx.export(dynamo=True)``, with the
  exporter's per-node metadata (``pkg.torch.onnx.name_scopes``, …).
- ``resnet_tiny_legacy.onnx``: the TorchScript exporter (``dynamo=False``):
  scoped node names, no metadata.
- ``encoder_tiny_dynamo.onnx``: a one-layer Transformer encoder (ORT fuses
  MatMul+Add, Gather+Slice, Add+LayerNorm on it).
- ``<model>.<level>.profile.json``: ORT's profile of two runs with graph
  optimisations off (``off``) and at ``ORT_ENABLE_ALL`` (``all``), with
  ``<model>.<level>.start_ns`` holding ``get_profiling_start_time_ns()``.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "examples"))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
from models import ResNet, TextEncoder  # noqa: E402


def export() -> None:
    torch.manual_seed(0)
    resnet = ResNet(widths=(4, 8, 16, 32), num_classes=10).eval()
    image = torch.randn(1, 3, 32, 32)
    torch.onnx.export(resnet, (image,), str(HERE / "resnet_tiny_dynamo.onnx"), dynamo=True, external_data=False)
    torch.onnx.export(resnet, (image,), str(HERE / "resnet_tiny_legacy.onnx"), dynamo=False)
    enc = TextEncoder(vocab=100, d_model=16, heads=2, layers=1, ff=32).eval()
    tokens = torch.randint(0, 100, (1, 8))
    torch.onnx.export(enc, (tokens,), str(HERE / "encoder_tiny_dynamo.onnx"), dynamo=True, external_data=False)


def profile(model: str, level: str, feed: dict[str, np.ndarray]) -> None:
    tmp = tempfile.mkdtemp()
    try:
        so = ort.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tmp, "p")
        so.graph_optimization_level = {"off": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[
            level
        ]
        so.intra_op_num_threads = 2
        sess = ort.InferenceSession(str(HERE / f"{model}.onnx"), so, providers=["CPUExecutionProvider"])
        for _ in range(2):
            sess.run(None, feed)
        path = sess.end_profiling()
        shutil.copy(path, HERE / f"{model}.{level}.profile.json")
        (HERE / f"{model}.{level}.start_ns").write_text(f"{sess.get_profiling_start_time_ns()}\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    export()
    image = {"x": np.random.default_rng(0).standard_normal((1, 3, 32, 32), dtype=np.float32)}
    for level in ("off", "all"):
        profile("resnet_tiny_dynamo", level, image)
    legacy = ort.InferenceSession(str(HERE / "resnet_tiny_legacy.onnx"), providers=["CPUExecutionProvider"])
    profile("resnet_tiny_legacy", "all", {legacy.get_inputs()[0].name: image["x"]})
    profile("encoder_tiny_dynamo", "all", {"tokens": np.arange(8, dtype=np.int64).reshape(1, 8)})
    for leftover in glob.glob(str(HERE / "*.onnx.data")):
        os.remove(leftover)


if __name__ == "__main__":
    main()
