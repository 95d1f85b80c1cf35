"""Regenerates cpu_modules_torch.json.gz: a small real torch.profiler trace on CPU.

It has what the A100 fixtures lack: ``python_function`` frames with
``nn.Module: <Type>_<n>`` module frames (``with_modules=True`` needs
``with_stack=True``), a ``record_function`` range, ``baseTimeNanoseconds``
and float timestamps with ns fractions (PyTorch 2.13). Run from the
repository root:

    PYTHONPATH=src .venv/bin/python tests/data/kineto/make_cpu_fixture.py
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.head = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 14 * 14, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x))


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net().eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        model(x)  # warm-up outside the trace
        with profile(
            activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True, with_modules=True
        ) as prof:
            with record_function("inference"):
                model(x)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        trace = json.loads(raw.read_text())
    # Host-specific values that tests do not need.
    trace.pop("host_name", None)
    out = Path(__file__).with_name("cpu_modules_torch.json.gz")
    with gzip.open(out, "wt", encoding="utf-8") as f:
        json.dump(trace, f)
    print(f"wrote {out} ({os.path.getsize(out)} bytes)")


if __name__ == "__main__":
    main()
