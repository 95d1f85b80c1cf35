"""The parts of the Kineto conversion (``mltrace.formats.kineto``), one table each: what a
single complete event becomes, why one is skipped, which times and ids are read, and that the
module and the converter process (formats/kineto_serve.py) import nothing of the tracer."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path
from typing import Any

import pytest

from mltrace.formats import kineto
from mltrace.formats.kineto import kineto_to_events
from mltrace.run.levels import Level
from mltrace.tracer.tracks import TrackRegistry

SRC = Path(kineto.__file__).resolve().parents[2]


def convert_one(event: dict[str, Any], **top: Any) -> kineto.KinetoEvents:
    """Converts a trace of one event (pid 1, tid 2 unless given), ``baseTimeNanoseconds`` 0."""
    base = {"ph": "X", "pid": 1, "tid": 2, "ts": 10, "dur": 5}
    trace = {"traceEvents": [{**base, **event}], "baseTimeNanoseconds": 0, **top}
    ids = itertools.count(1)
    return kineto_to_events(trace, TrackRegistry(pid=1), ids.__next__, lambda ns: ns, external_ids=True)


@pytest.mark.parametrize(
    ("event", "level", "name", "attrs"),
    [
        (
            {
                "cat": "cpu_op",
                "name": "aten::mm",
                "args": {"Input Dims": [[2, 3], [3, 4]], "Input type": ["float", "float"], "External id": 7},
            },
            Level.OP,
            "aten::mm",
            {
                "ml.framework": "pytorch",
                "ml.op.name": "aten::mm",
                "ml.input.shapes": [[2, 3], [3, 4]],
                "ml.input.dtypes": ["float", "float"],
                "ml.flops": 48,
                "kineto.external_id": 7,
            },
        ),
        (
            {"cat": "cpu_op", "name": "aten::relu", "args": {"flops": 9}},
            Level.OP,
            "aten::relu",
            {"ml.framework": "pytorch", "ml.op.name": "aten::relu", "ml.flops": 9},
        ),
        ({"cat": "user_annotation", "name": "step", "args": {"correlation": 3}}, Level.USER, "step", {}),
        (
            {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "args": {"cbid": 211, "correlation": 5}},
            Level.KERNEL,
            "cudaLaunchKernel",
            {"cuda.api.name": "cudaLaunchKernel", "cuda.api.kind": "runtime", "cuda.api.cbid": 211, "gpu.correlation_id": 5},
        ),
        (
            {"cat": "gpu_memset", "name": "Memset (Device)", "args": {"device": 0, "stream": 7, "bytes": 64, "correlation": 5}},
            Level.KERNEL,
            "Memset (Device)",
            {"gpu.device": 0, "gpu.stream": 7, "gpu.activity": "gpu_memset", "gpu.bytes": 64, "gpu.correlation_id": 5},
        ),
    ],
)
def test_one_complete_event_becomes_one_span(event: dict[str, Any], level: Level, name: str, attrs: dict[str, Any]) -> None:
    out = convert_one(event)
    assert [(s.level, s.name, s.attrs, s.start_ns, s.end_ns) for s in out.spans] == [(level, name, attrs, 10_000, 15_000)]
    assert out.stats.spans_by_category == {event["cat"]: 1}
    assert out.stats.skipped == {}


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        ({"cat": "python_function", "name": "torch/nn/functional.py(1): relu"}, "python_function (not a module)"),
        ({"cat": "python_function", "name": "nn.Module: Linear_0", "args": {}}, "python_function (no Python id)"),
        ({"cat": "fwdbwd", "name": "x"}, "fwdbwd"),
        ({"cat": "", "name": "x"}, "(no category)"),
        ({"cat": "cpu_op", "name": "x", "ts": "10"}, "bad ts/dur"),
        ({"cat": "cpu_op", "name": "x", "dur": -1}, "bad ts/dur"),
        ({"cat": "cpu_op", "name": "x", "ts": float("nan")}, "bad ts/dur"),
        ({"cat": "cuda_sync", "name": "Context Sync", "args": {"stream": -1}}, "cuda_sync (context-wide)"),
        ({"cat": "cpu_op", "name": "x", "tid": "main"}, "no pid/tid"),
        ({"cat": 3, "name": "x"}, "malformed (a name, category, phase or args of another type)"),
        ({"ph": "i", "name": "[memory]", "args": {"Bytes": "many"}}, "[memory] (bad ts, bytes or pid/tid)"),
        ({"ph": "f", "name": "ac2g"}, "ph=f"),
    ],
)
def test_an_event_not_converted_is_counted_with_its_reason(event: dict[str, Any], reason: str) -> None:
    out = convert_one(event)
    assert out.spans == [] and out.instants == []
    assert out.stats.skipped == {reason: 1}


@pytest.mark.parametrize(
    ("ts", "dur", "expected"),
    [(1, 2, (1, 2)), (1.5, 0, (1.5, 0)), (True, 1, None), (1, None, None), (-1, 1, None), (1 << 53, 1, None), (float("inf"), 1, None)],
)
def test_checked_times(ts: Any, dur: Any, expected: tuple[float, float] | None) -> None:
    assert kineto._checked_times(ts, dur) == expected


@pytest.mark.parametrize(
    ("cat", "name", "reason"),
    [
        ("cpu_op", "aten::add", None),
        ("python_function", "nn.Module: Net_0", None),
        ("python_function", "f.py(3): g", "python_function (not a module)"),
        ("Trace", "x", "Trace"),
        ("", "x", "(no category)"),
    ],
)
def test_rejected_by_category(cat: str, name: str, reason: str | None) -> None:
    assert kineto._rejected(cat, name) == reason


def test_gpu_side_waits_and_memory_events() -> None:
    sync = convert_one({"cat": "cuda_sync", "name": "Stream Sync", "args": {"stream": 7, "device": 0, "correlation": 4}})
    assert [(i.name, i.level, i.attrs) for i in sync.instants] == [
        ("Stream Sync", Level.KERNEL, {"cuda.sync.kind": "Stream Sync", "cuda.sync.duration_ns": 5000, "gpu.correlation_id": 4})
    ]
    memory = convert_one({"ph": "i", "name": "[memory]", "args": {"Bytes": 64, "Total Allocated": 128, "Device Type": 1, "Device Id": 0}})
    assert [(i.ts_ns, i.attrs) for i in memory.instants] == [
        (10_000, {"ml.memory.bytes": 64, "ml.memory.device": "cuda:0", "ml.memory.total_allocated": 128})
    ]
    assert [c.value for c in memory.counters] == [128.0]
    assert {t.name for t in memory.tracks} == {"thread 2", "gpu0.memory.allocated"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mltrace"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("mltrace"))
    return found


def test_the_conversion_imports_only_formats_and_run() -> None:
    """Everything ``formats/kineto.py`` reaches (lazily too) lies in ``formats/`` or ``run/``."""
    seen: set[str] = set()
    todo = ["mltrace.formats.kineto", "mltrace.formats.kineto_serve"]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = SRC / (module.replace(".", "/") + ".py")
        if not path.exists():
            path = SRC / module.replace(".", "/") / "__init__.py"
        todo.extend(_imports(path))
    assert {m.split(".")[1] for m in seen} <= {"formats", "run", "settings", "errors", "_version", "config", "native"}, sorted(seen)


#: sha256 (first 16 hex digits) of ``store.encode_batch`` (its line, less the newline) of each fixture's conversion (tracks,
#: spans, instants, counters, flows; pid 4242, ids from 1, session ns = epoch ns, external ids
#: kept) and of its stats (``json.dumps(as_dict(), sort_keys=True)``), as the single
#: ``kineto_to_events`` of before the split (f1d74a5) gave them: the split changed no byte. Since
#: then torch's own ranges carry ``torch.range`` (0bcc6e4): the two fixtures with such ranges
#: (ProfilerStep, Optimizer.step, DistributedDataParallel.forward) give the digests below, and
#: their lines without that attribute the ones before it (c3c2d6f133359384, 48425dabc4128320).
#: And torch's ranges that torch records as ops are user spans (5d2a671): the one fixture with
#: such (Torch-Compiled Region, TorchDynamo Cache Lookup) gives the digest below, and gave
#: 1c540e49e4d6a783 before.
BEFORE_SPLIT = {
    "a100_alexnet_train.json.gz": ("7ca0443bb8f8603e", "f4942fb430b81c2e"),
    # its 10 nccl: ranges are torch.range "collectives" (d3fc33c); its sigmoid, tanh, layer_norm
    # and softmax ops carry FLOPs (c6b5366, 8aef0d2); its model is a TorchScript model, and the 36
    # ops its interpreter called with values of its stack recorded ahead of their arguments (20
    # linear, 14 matmul, 2 mul) keep their own shapes and FLOPs (59d27fd764c4b076 before), nothing
    # else differs
    "a100_sampled_rank0.json.gz": ("a701b3b8d1204bd9", "3266521c39dd293e"),
    "a100_triton_kernel.json.gz": ("79fa66ba82a76672", "23b2c11577c3226b"),
    "cpu_modules_torch.json.gz": ("87c6bee7a31e1dd9", "740cae3c6a0bd998"),  # its relu's FLOPs (c6b5366)
    "h100_cuda_models.json.gz": ("8e4a4b2f7ecbfa26", "32194b0716160d0e"),  # its relu, batch_norm and layer_norm ops' FLOPs
}


@pytest.mark.parametrize("name", sorted(BEFORE_SPLIT))
def test_conversion_is_byte_identical_to_before_the_split(name: str) -> None:
    import hashlib
    import json

    from mltrace.run.store import encode_batch

    trace = kineto.load_kineto_json(SRC.parent / "tests" / "data" / "kineto" / name)
    ids = itertools.count(1)
    out = kineto_to_events(trace, TrackRegistry(pid=4242), ids.__next__, lambda ns: ns, external_ids=True)
    line = encode_batch(tracks=out.tracks, spans=out.spans, instants=out.instants, counters=out.counters, flows=out.flows)
    stats = json.dumps(out.stats.as_dict(), sort_keys=True).encode()
    digests = (hashlib.sha256(line.rstrip(b"\n")).hexdigest()[:16], hashlib.sha256(stats).hexdigest()[:16])
    assert digests == BEFORE_SPLIT[name]


class _SessionSide:
    """The traced process's side of the converter process's questions (``kineto_serve``)."""

    def __init__(self) -> None:
        self.tracks = TrackRegistry(pid=4242)
        self.ids = itertools.count(1)

    def ask(self, question: dict[str, Any]) -> dict[str, Any]:
        from mltrace.run.store import track_row

        if "ids" in question:
            return {"ids": [next(self.ids) for _ in range(question["ids"])]}
        kind, a, b, c = question["track"]
        if kind == "thread":
            track = self.tracks.thread(a, b, pid=c)
        elif kind == "gpu_stream":
            track = self.tracks.gpu_stream(a, b, pid=c)
        else:
            track = self.tracks.counter(a, b, c)
        return {"row": track_row(track)}


@pytest.mark.parametrize("name", ["cpu_modules_torch.json.gz", "h100_cuda_models.json.gz"])
def test_the_converter_process_writes_what_the_conversion_makes(tmp_path: Path, name: str) -> None:
    """The converter process's line in events.jsonl loads as the same events as converting in
    the traced process (ids, tracks, times, attributes); the trace file is removed."""
    import gzip
    import shutil

    from mltrace.formats.kineto_serve import Server
    from mltrace.run.store import Run, decode_batch

    source = SRC.parent / "tests" / "data" / "kineto" / name
    path = tmp_path / "torch-profiler-2.json"
    with gzip.open(source) as f, open(path, "wb") as out:
        shutil.copyfileobj(f, out)
    events = tmp_path / "events.jsonl"
    events.touch()
    side = _SessionSide()
    answer = Server(side).convert({"path": str(path), "events": str(events), "epoch_ns": 5_000, "monotonic_ns": 2_000})  # type: ignore[arg-type]
    assert not path.exists()
    run = Run(tmp_path, meta={})
    decode_batch(run, events.read_bytes(), {})
    ids = itertools.count(1)
    direct = kineto_to_events(
        kineto.load_kineto_json(source), TrackRegistry(pid=4242), ids.__next__, lambda ns: ns - 3_000, external_ids=False
    )
    assert answer["done"]["spans"] == len(direct.spans) == len(run.spans)
    assert answer["done"]["stats"] == direct.stats.as_dict()
    fields = ("id", "parent_id", "level", "name", "start_ns", "end_ns", "track_id", "attrs")
    assert [[getattr(s, k) for k in fields] for s in run.spans] == [[getattr(s, k) for k in fields] for s in direct.spans]
    assert run.instants == direct.instants and run.counters == direct.counters and run.flows == direct.flows
    assert sorted(run.tracks.values(), key=lambda t: t.id) == direct.tracks
