"""Example ONNX Runtime inference: the example ResNet exported from PyTorch.

The model is ``models.resnet_small()`` (random weights), exported once with
``torch.onnx.export`` and cached under ``--cache``; then an
``onnxruntime.InferenceSession`` runs it. Run it plainly
(``python examples/ort_infer.py``) or traced, without changes:

    mltrace python examples/ort_infer.py --iters 3
    mltrace python examples/ort_infer.py --opt off --exporter legacy

Traced, each ``run`` is a model span named ``ResNet``, each ONNX node a
layer span carrying the PyTorch module it came from
(``ml.torch.module_path = "layer1.0.conv1"``), and each node kernel an op span.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

OPT_LEVELS = {
    "off": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def export(path: str, exporter: str, image_size: int) -> None:
    """Exports ``resnet_small()`` to ``path`` (ONNX)."""
    import torch
    from models import resnet_small

    torch.manual_seed(0)
    model = resnet_small()
    example = torch.randn(1, 3, image_size, image_size)
    if exporter == "dynamo":
        torch.onnx.export(model, (example,), path, dynamo=True, external_data=False, dynamic_shapes=({0: "batch"},))
    else:
        torch.onnx.export(model, (example,), path, dynamo=False, input_names=["x"], dynamic_axes={"x": {0: "batch"}})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--exporter", choices=("dynamo", "legacy"), default="dynamo")
    parser.add_argument("--opt", choices=tuple(OPT_LEVELS), default="all", help="ONNX Runtime graph optimisation level")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: ORT's default)")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "mltrace-examples"))
    args = parser.parse_args()
    os.makedirs(args.cache, exist_ok=True)
    path = os.path.join(args.cache, f"resnet_small_{args.exporter}_{args.image_size}.onnx")
    if not os.path.exists(path):
        t0 = time.perf_counter()
        export(path + ".tmp", args.exporter, args.image_size)
        os.replace(path + ".tmp", path)
        print(f"exported {path} in {time.perf_counter() - t0:.1f} s")
    options = ort.SessionOptions()
    options.graph_optimization_level = OPT_LEVELS[args.opt]
    if args.threads:
        options.intra_op_num_threads = args.threads
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    images = np.random.default_rng(0).standard_normal((args.batch, 3, args.image_size, args.image_size), dtype=np.float32)
    for i in range(args.iters):
        t0 = time.perf_counter()
        (logits,) = session.run(None, {name: images})
        print(f"ort iter {i}: top class {int(logits.argmax(1)[0])}, {1e3 * (time.perf_counter() - t0):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
