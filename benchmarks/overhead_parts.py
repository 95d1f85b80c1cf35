"""Where layer-level overhead comes from on the example CNN, measured side by side.

Interleaved rounds in one process: plain; the default layer-level session; the
torch module source alone with the flusher streaming; the torch source plus the
NVML/CPU counter sampler without streaming; the torch source alone without
streaming. Each session starts and stops outside the measured calls.

    python benchmarks/overhead_parts.py [--rounds 12] [--iters 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch  # noqa: E402
from models import resnet_small  # noqa: E402

from mltrace.config import ProfileOptions  # noqa: E402
from mltrace.tracer.levels import Level  # noqa: E402
from mltrace.tracer.session import Session  # noqa: E402
from mltrace.tracer.sources.nvml import NvmlSampler  # noqa: E402
from mltrace.tracer.sources.torch_modules import TorchModuleSource  # noqa: E402

NO_FLUSH_S = 60.0  # longer than the measurement: nothing is streamed while timing

CONDITIONS: dict[str, Callable[[Path], Session]] = {
    "layer, default session": lambda d: Session(ProfileOptions(output=d, summary=False, level=Level.LAYER)),
    "torch source + streaming": lambda d: Session(
        ProfileOptions(output=d, summary=False, level=Level.LAYER), sources=[TorchModuleSource()]
    ),
    "torch source + counters": lambda d: Session(
        ProfileOptions(output=d, summary=False, level=Level.LAYER, flush_interval_s=NO_FLUSH_S),
        sources=[TorchModuleSource(), NvmlSampler()],
    ),
    "torch source only": lambda d: Session(
        ProfileOptions(output=d, summary=False, level=Level.LAYER, flush_interval_s=NO_FLUSH_S), sources=[TorchModuleSource()]
    ),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    cnn = resnet_small()
    x = torch.randn(1, 3, 224, 224)

    def block() -> list[int]:
        out = []
        for _ in range(args.iters):
            t0 = time.perf_counter_ns()
            cnn(x)
            out.append(time.perf_counter_ns() - t0)
        return out

    samples: dict[str, list[int]] = {"plain": [], **{k: [] for k in CONDITIONS}}
    with torch.inference_mode():
        for _ in range(3):
            cnn(x)
        for r in range(args.rounds):
            samples["plain"] += block()
            for name, make in CONDITIONS.items():
                with tempfile.TemporaryDirectory() as tmp:
                    session = make(Path(tmp) / "run").start()
                    try:
                        cnn(x)  # first call under the session: not measured
                        samples[name] += block()
                    finally:
                        session.stop()
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    plain = statistics.median(samples["plain"])
    print(f"ResNet-18-style CNN, batch 1, 224x224; torch threads {torch.get_num_threads()}")
    for name, values in samples.items():
        med = statistics.median(values)
        print(f"  {name:28} {med / 1e6:7.2f} ms  {100 * (med - plain) / plain:+6.2f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
