"""Example inference script: a ResNet-style CNN and a Transformer encoder.

Run it plainly (``python examples/infer.py``) or traced, without changes:
``mltrace python examples/infer.py --batch 2 --iters 3``. It also follows the sweep
protocol of ``mltrace bench`` (``MLTRACE_BATCH``, ``MLTRACE_PRECISION``,
``MLTRACE_THREADS``, ``MLTRACE_ITERS`` as defaults), without importing mltrace.
``--device cuda`` runs both models on the GPU (each timed call waits for it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from models import encoder, resnet_small  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    env = os.environ
    parser.add_argument("--batch", type=int, default=int(env.get("MLTRACE_BATCH") or 1))
    parser.add_argument("--iters", type=int, default=int(env.get("MLTRACE_ITERS") or 3))
    parser.add_argument("--precision", choices=("fp32", "bf16"), default=env.get("MLTRACE_PRECISION") or "fp32")
    parser.add_argument("--threads", type=int, default=int(env.get("MLTRACE_THREADS") or 0), help="0: torch's default")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--model", choices=("cnn", "transformer", "both"), default="both")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("infer.py: --device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    device = torch.device(args.device)

    def wait() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    torch.manual_seed(0)
    with torch.inference_mode():
        if args.model in ("cnn", "both"):
            cnn = resnet_small().to(device, dtype)
            images = torch.randn(args.batch, 3, args.image_size, args.image_size, dtype=dtype).to(device)
            for i in range(args.iters):
                t0 = time.perf_counter()
                logits = cnn(images)
                wait()
                print(f"cnn iter {i}: top class {int(logits.argmax(1)[0])}, {1e3 * (time.perf_counter() - t0):.1f} ms")
        if args.model in ("transformer", "both"):
            enc = encoder().to(device, dtype)
            tokens = torch.randint(0, 30522, (args.batch, args.seq_len)).to(device)
            for i in range(args.iters):
                t0 = time.perf_counter()
                out = enc(tokens)
                wait()
                print(f"encoder iter {i}: {tuple(out.shape)}, {1e3 * (time.perf_counter() - t0):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
