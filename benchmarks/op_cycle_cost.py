"""What one cycle of the op level costs, step by step: torch.profiler's stop, the export of its
Chrome trace, the load and the conversion, per op, with the process's resident memory after
each step, and whether the stop lets another Python thread run.

Records ``--steps`` sampling steps of the 2-layer LSTM word model of ``long_run.py`` under
the CPU profiler as the op level runs it (``_CpuProfile``: every thread, shapes recorded),
``--rounds`` times. While the profiler stops, a second Python thread counts in a loop; its
count during the stop, against its count in as long a time right after, says how much of the
stop held the GIL (a stop that released it would leave the count's rate unchanged). The same
trace then goes through the op level's converter process (``formats/kineto_serve.py``): its
wall time, and the CPU time of the thread that waits for it (what that thread holds the GIL
for), per op.

    python benchmarks/op_cycle_cost.py                 # 3 rounds of 160 steps
    python benchmarks/op_cycle_cost.py --steps 400 --rounds 5
    python benchmarks/op_cycle_cost.py --trace-only both   # each round with and without Kineto's trace_only
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "99")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import ProfilerActivity  # noqa: E402

from mltrace.formats.kineto import kineto_to_events, load_kineto_json  # noqa: E402
from mltrace.run.gcpause import gc_paused  # noqa: E402
from mltrace.tracer.clock import ClockAnchor  # noqa: E402
from mltrace.tracer.memwatch import release_free_memory  # noqa: E402
from mltrace.tracer.sources.torch_ops import _all_threads_config, _ConverterProcess, _CpuProfile, _release  # noqa: E402
from mltrace.tracer.tracks import TrackRegistry  # noqa: E402


class WordModel(nn.Module):
    """pytorch/examples' word_language_model at its defaults (as ``long_run.py``)."""

    def __init__(self, ntoken: int = 10000, ninp: int = 200, nhid: int = 200, nlayers: int = 2) -> None:
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers)
        self.decoder = nn.Linear(nhid, ntoken)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, h: Any) -> tuple[torch.Tensor, Any]:
        out, h = self.rnn(self.drop(self.encoder(x)), h)
        return self.decoder(self.drop(out)), h


def rss_mb() -> int:
    """The process's resident memory (MB)."""
    text = Path("/proc/self/status").read_text()
    found = re.search(r"VmRSS:\s+(\d+)", text)
    return int(found[1]) // 1024 if found else 0


class Counter:
    """A Python thread that counts while it runs (``count``), to see when it gets the GIL."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            self.count += 1

    def close(self) -> None:
        self._stop = True
        self._thread.join()


def one_round(step: Any, steps: int, path: Path, ids: Any, converter: _ConverterProcess, trace_only: bool) -> dict[str, float]:
    """Records ``steps`` steps, then stops, exports, loads and converts; times per op (µs),
    the counter's share during the stop, and RSS (MB) after each step. ``trace_only``: Kineto's
    ``trace_only`` (as the op level sets it where torch has it)."""
    config = _all_threads_config(trace_only=trace_only)
    kwargs = {"activities": [ProfilerActivity.CPU], "record_shapes": True, "experimental_config": config}
    row: dict[str, float] = {"rss_start": rss_mb()}
    prof = _CpuProfile(kwargs)
    prof.start()
    for _ in range(steps):
        step()
    row["rss_recorded"] = rss_mb()
    counter = Counter()
    time.sleep(0.05)
    c0, t0 = counter.count, time.perf_counter()
    prof.stop()
    t1, c1 = time.perf_counter(), counter.count
    time.sleep(t1 - t0)
    c2 = counter.count
    counter.close()
    row["rss_stopped"] = rss_mb()
    with gc_paused():  # as the converter thread runs these
        t1e = time.perf_counter()
        prof.export_chrome_trace(str(path))
        t2 = time.perf_counter()
        _release(prof)  # Kineto's result freed, as the converter does before the load
        del prof
        t2f = time.perf_counter()
        shutil.copyfile(path, path.with_name("cycle-for-process.json"))
        trace = load_kineto_json(path)
        t3 = time.perf_counter()
        row["rss_loaded"] = rss_mb()
        result = kineto_to_events(trace, TrackRegistry(), lambda: next(ids), lambda ns: ns, external_ids=False)
        t4 = time.perf_counter()
    row["rss_converted"] = rss_mb()
    n = len(result.spans)
    del trace, result
    release_free_memory()
    row["rss_trimmed"] = rss_mb()
    # The same trace through the converter process: the calling thread's wall and CPU time (its
    # CPU time is what it holds the GIL for: answering the process's questions for ids and tracks).
    w0, c0t = time.perf_counter(), time.thread_time()
    written, _ = converter.convert(path.with_name("cycle-for-process.json"), path.with_name("events.jsonl"))
    w1, c1t = time.perf_counter(), time.thread_time()
    assert written == n, (written, n)
    row.update(process_wall_us=1e6 * (w1 - w0) / n, process_cpu_us=1e6 * (c1t - c0t) / n, process_peak_mb=converter.peak_rss_kb / 1024)
    row.update(
        ops=n,
        stop_us=1e6 * (t1 - t0) / n,
        counter_during_stop=(c1 - c0) / max(c2 - c1, 1),
        export_us=1e6 * (t2 - t1e) / n,
        free_us=1e6 * (t2f - t2) / n,
        load_us=1e6 * (t3 - t2f) / n,
        convert_us=1e6 * (t4 - t3) / n,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--trace-only", choices=("on", "off", "both"), default="on", help="Kineto's trace_only (both: alternate, in rotating order)"
    )
    args = parser.parse_args()
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.trace_only]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = WordModel().eval()
    state = {"h": (torch.zeros(2, 1, 200), torch.zeros(2, 1, 200))}
    x = torch.randint(10000, (1, 1))

    def step() -> None:
        with torch.no_grad():
            out, state["h"] = model(x, state["h"])
            x.fill_(torch.multinomial(out.squeeze().exp(), 1)[0])

    for _ in range(20):
        step()
    ids = itertools.count(1)
    print(f"load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "events.jsonl").touch()
        view = SimpleNamespace(anchor=ClockAnchor.take(), tracks=TrackRegistry(), new_id=lambda: next(ids), run_dir=Path(tmp))
        t0 = time.perf_counter()
        converter = _ConverterProcess(view)  # type: ignore[arg-type]
        print(f"converter process started in {1e3 * (time.perf_counter() - t0):.0f} ms (Popen only)")
        stops: dict[bool, list[float]] = {m: [] for m in modes}
        for r in range(args.rounds):
            for trace_only in modes[r % len(modes) :] + modes[: r % len(modes)]:
                row = one_round(step, args.steps, Path(tmp) / "cycle.json", ids, converter, trace_only)
                stops[trace_only].append(row["stop_us"])
                _print_round(row, f"trace_only {'on' if trace_only else 'off'}: ")
        converter.close()
    for trace_only, got in stops.items():
        print(f"trace_only {'on' if trace_only else 'off'}: median stop {statistics.median(got):.1f} µs/op over {len(got)} rounds")


def _print_round(row: dict[str, float], label: str) -> None:
    print(
        f"{label}{int(row['ops'])} ops: stop {row['stop_us']:.1f} µs/op (the counting thread ran at "
        f"{100 * row['counter_during_stop']:.0f} % of its rate meanwhile), export {row['export_us']:.1f}, "
        f"free {row['free_us']:.1f}, load {row['load_us']:.1f}, convert {row['convert_us']:.1f} µs/op; "
        f"RSS MB: start {row['rss_start']:.0f}, "
        f"recorded {row['rss_recorded']:.0f}, stopped {row['rss_stopped']:.0f}, loaded {row['rss_loaded']:.0f}, "
        f"converted {row['rss_converted']:.0f}, trimmed {row['rss_trimmed']:.0f}; "
        f"the converter process: {row['process_wall_us']:.1f} µs/op of wall, {row['process_cpu_us']:.2f} µs/op of "
        f"this thread's CPU, its peak RSS {row['process_peak_mb']:.0f} MB"
    )


if __name__ == "__main__":
    main()
