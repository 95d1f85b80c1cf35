"""Example Keras inference: a keras.applications model with random weights.

``weights=None`` builds the architecture without downloading anything. The
script runs the model both ways Keras offers: ``model.predict`` (a compiled
graph function) and ``model(x)`` (eager). Run it plainly
(``python examples/keras_infer.py``) or traced, without changes:

    mltrace python examples/keras_infer.py --iters 3
    mltrace python examples/keras_infer.py --model ResNet50 --image-size 224

Traced, each ``predict`` and each eager call is a model span named by the
model (``mobilenetv2_1.00_224``); eager layer calls are layer spans named by
their Keras names (``Conv1``, ``block_1_expand``), and inside ``predict`` the
same layers come from the TensorFlow profiler's name scopes; TensorFlow ops
(``_MklNativeConv2D``) are op spans inside them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's start-up notices off the console

import keras  # noqa: E402
import numpy as np  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="MobileNetV2", help="a keras.applications class (MobileNetV2, ResNet50, EfficientNetB0, …)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--mode", choices=("predict", "eager", "both"), default="both")
    args = parser.parse_args()
    keras.utils.set_random_seed(0)
    build = getattr(keras.applications, args.model)
    model = build(weights=None, input_shape=(args.image_size, args.image_size, 3))
    images = np.random.default_rng(0).standard_normal((args.batch, args.image_size, args.image_size, 3)).astype(np.float32)
    if args.mode in ("predict", "both"):
        for i in range(args.iters):
            t0 = time.perf_counter()
            probs = model.predict(images, batch_size=args.batch, verbose=0)
            print(f"predict iter {i}: top class {int(probs.argmax(1)[0])}, {1e3 * (time.perf_counter() - t0):.1f} ms")
    if args.mode in ("eager", "both"):
        for i in range(args.iters):
            t0 = time.perf_counter()
            probs = np.asarray(model(images, training=False))
            print(f"eager iter {i}: top class {int(probs.argmax(1)[0])}, {1e3 * (time.perf_counter() - t0):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
