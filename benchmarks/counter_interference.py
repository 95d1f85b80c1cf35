"""Does reading a hardware counter slow a GPU inference loop?

A ResNet-50 (torchvision, random weights, fp16, channels_last, batch 1) runs
synchronised calls in blocks, while a background thread reads one NVML counter
(or /proc/stat) at 100 Hz, all of them at 10 Hz (as mltrace's sampler does), or
all of them at 10 Hz from a separate process. Variants rotate by round; the
table gives each variant's median and p90 per call and its median over the
loop alone's. Also prints each read's latency, idle and with the GPU busy.

    python benchmarks/counter_interference.py [--rounds 3] [--calls 160]

Needs a CUDA GPU, torchvision and nvidia-ml-py.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

SUBPROCESS_READER = (
    "import threading, pynvml as nv\n"
    "nv.nvmlInit(); h = nv.nvmlDeviceGetHandleByIndex(0); e = threading.Event()\n"
    "while not e.wait(0.1):\n"
    "    nv.nvmlDeviceGetUtilizationRates(h); nv.nvmlDeviceGetMemoryInfo(h); nv.nvmlDeviceGetPowerUsage(h)\n"
    "    nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM); nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)\n"
)


def counter_reads(nv: Any) -> dict[str, Callable[[], object]]:
    """One reader per counter mltrace samples, and one for all of them in turn."""
    h = nv.nvmlDeviceGetHandleByIndex(0)

    def temperature() -> object:
        try:
            return nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)
        except nv.NVMLError:
            return nv.nvmlDeviceGetTemperatureV(h, nv.NVML_TEMPERATURE_GPU)

    def proc_stat() -> object:
        with open("/proc/stat") as f:
            return f.read()

    reads: dict[str, Callable[[], object]] = {
        "util": lambda: nv.nvmlDeviceGetUtilizationRates(h),
        "meminfo": lambda: nv.nvmlDeviceGetMemoryInfo(h),
        "power": lambda: nv.nvmlDeviceGetPowerUsage(h),
        "clock_sm": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
        "clock_mem": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
        "temp": temperature,
        "procstat": proc_stat,
    }
    singles = list(reads.values())
    reads["all"] = lambda: [f() for f in singles]
    return reads


def _timed(fn: Callable[[], object], into: list[int]) -> None:
    t0 = time.perf_counter_ns()
    fn()
    into.append(time.perf_counter_ns() - t0)


def _summary(latencies: dict[str, list[int]]) -> dict[str, tuple[int, int]]:
    return {k: (round(statistics.median(v) / 1e3), round(max(v) / 1e3)) for k, v in latencies.items() if v}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=160, help="synchronised calls per block")
    args = parser.parse_args()
    try:
        import pynvml as nv
        import torch
        import torchvision
    except ImportError as exc:
        print(f"counter_interference.py: needs torch, torchvision and nvidia-ml-py ({exc})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("counter_interference.py: torch sees no CUDA device", file=sys.stderr)
        return 2
    nv.nvmlInit()
    reads = counter_reads(nv)
    idle: dict[str, list[int]] = {k: [] for k in reads}
    for name, fn in reads.items():
        for _ in range(20):
            _timed(fn, idle[name])
    dev = torch.device("cuda")
    model = torchvision.models.resnet50(weights=None).to(dev, torch.float16, memory_format=torch.channels_last).eval()
    x = torch.randn(1, 3, 224, 224, device=dev, dtype=torch.float16).to(memory_format=torch.channels_last)

    def infer() -> None:
        model(x)
        torch.cuda.synchronize()

    busy: dict[str, list[int]] = {k: [] for k in reads}

    def reader(name: str, hz: float, stop: threading.Event) -> None:
        while not stop.wait(1 / hz):
            _timed(reads[name], busy[name])

    variants = ["none", *(f"{k}@100Hz" for k in reads if k != "all"), "all@10Hz", "all@10Hz-subprocess"]
    samples: dict[str, list[int]] = {v: [] for v in variants}
    with torch.inference_mode():
        for _ in range(30):
            infer()
        for r in range(args.rounds):
            for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
                stop = threading.Event()
                thread = proc = None
                if v == "all@10Hz-subprocess":
                    proc = subprocess.Popen([sys.executable, "-c", SUBPROCESS_READER])
                    time.sleep(1.0)  # its import and nvmlInit outside the block
                elif v != "none":
                    name, rate = v.split("@")
                    thread = threading.Thread(target=reader, args=(name, float(rate[:-2]), stop), daemon=True)
                    thread.start()
                for _ in range(args.calls):
                    _timed(infer, samples[v])
                stop.set()
                if thread is not None:
                    thread.join()
                if proc is not None:
                    proc.kill()
                    proc.wait()
    print("idle latency µs (median / max):", _summary(idle))
    print("busy latency µs (median / max):", _summary(busy))
    base = statistics.median(samples["none"])
    print(f"\n{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"{'variant':22} {'median ms':>9} {'p90 ms':>8} {'÷ none':>8}")
    for v, s in samples.items():
        p90 = statistics.quantiles(s, n=10)[-1]
        print(f"{v:22} {statistics.median(s) / 1e6:9.3f} {p90 / 1e6:8.3f} {statistics.median(s) / base:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
