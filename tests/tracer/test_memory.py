"""Memory per layer and op (``--memory``): Kineto's memory events, the attribution pass,
and real torch models traced in a session."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

from mltrace.config import ProfileOptions
from mltrace.errors import UsageError
from mltrace.run.events import Instant, Span, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run, load_run
from mltrace.tracer.passes.memory import SpanMemory, attribute_memory, span_memory
from mltrace.tracer.session import Session
from mltrace.tracer.sources.kineto import MEMORY_EVENT, kineto_to_events, memory_counter_name
from mltrace.tracer.sources.torch_modules import TorchModuleSource
from mltrace.tracer.sources.torch_ops import TorchOpSource
from mltrace.tracer.tracks import TrackRegistry
from support.pftrace import parse_pftrace

D_MODEL, HEADS, FF, SIDE = 64, 4, 256, 64  # tokens: (SIDE / 4)² = 256


class ConvEncoder(nn.Module):
    """A conv stem (4×4 patches) and a two-layer TransformerEncoder."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, D_MODEL, 4, stride=4)
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D_MODEL, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.stem(x).flatten(2).transpose(1, 2)
        return self.head(self.encoder(f).mean(1))


def mem(ts: int, size: int, total: int, track: int = 1, device: str = "cpu") -> Instant:
    attrs = {"ml.memory.bytes": size, "ml.memory.total_allocated": total, "ml.memory.device": device}
    return Instant(MEMORY_EVENT, ts, track, Level.OP, attrs)


# -- the attribution, from a table -------------------------------------------------------


def test_span_memory_counts_each_event_for_the_spans_around_it() -> None:
    layer = Span(1, None, Level.LAYER, "block", 0, 100, 1)
    op_a = Span(2, 1, Level.OP, "aten::a", 10, 40, 1)
    op_b = Span(3, 1, Level.OP, "aten::b", 50, 90, 1)
    other_thread = Span(4, None, Level.OP, "aten::c", 0, 100, 2)
    events = [
        mem(15, 1000, 1000),  # op a: +1000
        mem(20, 500, 1500),  # op a: +500 → net 1500, its peak
        mem(30, -1000, 500),  # op a frees 1000
        mem(55, 4000, 4500),  # op b: +4000 → the layer's net is 4500
        mem(60, -4000, 500),
        mem(95, -500, 0),  # the layer itself frees the rest
    ]
    got = span_memory([layer, op_a, op_b, other_thread], events)
    assert got[2] == SpanMemory("cpu", 1500, 1000, 1500, 1500)
    assert got[3] == SpanMemory("cpu", 4000, 4000, 4000, 4500)
    assert got[1] == SpanMemory("cpu", 5500, 5500, 4500, 4500)
    assert 4 not in got  # no event on its thread


def test_span_memory_peak_is_measured_from_the_spans_start() -> None:
    # The thread holds 10 kB already; the span frees 3 kB, then allocates 2 kB: it never
    # rises above its start, so its peak is 0, while the device's total peaks at 10 kB.
    span = Span(1, None, Level.OP, "aten::x", 100, 200, 1)
    events = [mem(50, 10_000, 10_000), mem(120, -3000, 7000), mem(150, 2000, 9000)]
    got = span_memory([span], events)[1]
    assert (got.alloc_bytes, got.freed_bytes, got.peak_bytes, got.peak_total_bytes) == (2000, 3000, 0, 9000)


def test_span_memory_takes_the_device_it_allocated_most_on() -> None:
    span = Span(1, None, Level.LAYER, "l", 0, 100, 1)
    events = [mem(10, 64, 64), mem(20, 1 << 20, 1 << 20, device="cuda:0"), mem(30, 128, 192)]
    got = span_memory([span], events)[1]
    assert got.device == "cuda:0" and got.alloc_bytes == 1 << 20 and got.peak_total_bytes == 1 << 20


def test_attribute_memory_sets_attributes_and_drops_the_instants(tmp_path: Path) -> None:
    spans = [Span(1, None, Level.LAYER, "l", 0, 100, 1), Span(2, 1, Level.KERNEL, "k", 10, 20, 1)]
    keep = Instant("other", 5, 1)
    run = Run(tmp_path, {}, spans=spans, instants=[mem(10, 256, 256), keep, mem(20, -256, 0)])
    out = attribute_memory(run)
    assert out.instants == [keep]
    assert out.spans[0].attrs["ml.memory.alloc_bytes"] == 256 and out.spans[0].attrs["ml.memory.peak_bytes"] == 256
    assert "ml.memory.alloc_bytes" not in out.spans[1].attrs  # kernels are not given memory numbers
    assert out.meta["correlation"]["attribute_memory"]["memory_events"] == 2


def test_a_run_without_memory_events_is_left_as_it_is(tmp_path: Path) -> None:
    run = Run(tmp_path, {}, spans=[Span(1, None, Level.LAYER, "l", 0, 100, 1)])
    assert attribute_memory(run) is run and "correlation" not in run.meta


# -- Kineto's memory events --------------------------------------------------------------


def _kineto_memory_event(ts: float, size: int, total: int, device_type: int = 0, device_id: int = -1) -> dict[str, object]:
    """A ``[memory]`` instant as Kineto writes it (PyTorch 2.13)."""
    args = {"Total Reserved": 0, "Total Allocated": total, "Bytes": size, "Device Id": device_id, "Device Type": device_type}
    return {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 7, "tid": 8, "ts": ts, "args": args | {"Addr": 1}}


def test_kineto_memory_events_become_instants_and_counter_samples() -> None:
    trace = {
        "baseTimeNanoseconds": 0,
        "traceEvents": [
            {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": 7, "tid": 8, "ts": 1.0, "dur": 2.0, "args": {}},
            _kineto_memory_event(1.5, 4096, 4096),
            _kineto_memory_event(2.0, 1 << 20, 1 << 21, device_type=1, device_id=0),
            _kineto_memory_event(2.5, -4096, 0),
            {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 7, "tid": 8, "ts": 3.0, "args": {}},
        ],
    }
    ids = itertools.count(1)
    result = kineto_to_events(trace, TrackRegistry(pid=7), lambda: next(ids), lambda ns: ns)
    memory = [i for i in result.instants if i.name == MEMORY_EVENT]
    assert [(i.ts_ns, i.attrs["ml.memory.bytes"], i.attrs["ml.memory.device"]) for i in memory] == [
        (1500, 4096, "cpu"),
        (2000, 1 << 20, "cuda:0"),
        (2500, -4096, "cpu"),
    ]
    op = result.spans[0]
    assert all(i.track_id == op.track_id for i in memory)  # on the thread that allocated
    counters = {t.id: t for t in result.tracks if t.kind == TrackKind.COUNTER}
    assert sorted((t.name, t.unit, t.device) for t in counters.values()) == [
        ("cpu.memory.allocated", "bytes", -1),
        ("gpu0.memory.allocated", "bytes", 0),
    ]
    assert [(counters[c.track_id].name, c.value) for c in result.counters] == [
        ("cpu.memory.allocated", 4096.0),
        ("gpu0.memory.allocated", float(1 << 21)),
        ("cpu.memory.allocated", 0.0),
    ]
    assert result.stats.memory_events == 3
    assert result.stats.skipped["[memory] (bad ts, bytes or pid/tid)"] == 1
    assert "ph=i" not in result.stats.skipped


def test_memory_counter_names() -> None:
    assert memory_counter_name("cpu") == "cpu.memory.allocated"
    assert memory_counter_name("cuda:1") == "gpu1.memory.allocated"


# -- options -----------------------------------------------------------------------------


def test_memory_option_needs_the_op_level(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match="--memory needs the op level"):
        ProfileOptions.build(memory=True, level="layer")
    assert ProfileOptions.build(memory=True, level="op").memory
    assert not ProfileOptions.build().memory
    monkeypatch.setenv("MLTRACE_MEMORY", "1")
    assert ProfileOptions.build().memory
    assert not ProfileOptions.build(memory=False).memory  # an explicit argument wins


# -- real models -------------------------------------------------------------------------


def trace_model(tmp_path: Path, batch: int, memory: bool = True, calls: int = 2) -> Run:
    torch.manual_seed(0)
    model = ConvEncoder().eval()
    x = torch.randn(batch, 3, SIDE, SIDE)
    out = tmp_path / f"run-{batch}-{memory}"
    session = Session(ProfileOptions(output=out, summary=False, memory=memory), sources=[TorchModuleSource(), TorchOpSource()])
    session.start()
    try:
        with torch.no_grad():
            for _ in range(calls):
                model(x)
    finally:
        session.stop()
    return load_run(out)


def layer_calls(run: Run, name: str) -> list[Span]:
    return [s for s in run.spans if s.level is Level.LAYER and s.name == name]


def test_encoder_layer_peak_is_of_its_activations_size(tmp_path: Path) -> None:
    batch = 4
    run = trace_model(tmp_path, batch)
    tokens = (SIDE // 4) ** 2
    activation = batch * tokens * D_MODEL * 4  # one float32 [batch, tokens, d_model] tensor
    scores = batch * HEADS * tokens * tokens * 4  # the attention weights, [batch, heads, tokens, tokens]
    hidden = batch * tokens * FF * 4  # the feed-forward's hidden activations
    calls = layer_calls(run, "encoder.layers.0")
    assert len(calls) == 2
    for span in calls:
        peak = span.attrs["ml.memory.peak_bytes"]
        # Its output is allocated inside it and alive at its end; at most, everything the
        # layer makes is alive at once.
        assert activation <= peak <= scores + hidden + 8 * activation, peak
        assert span.attrs["ml.memory.alloc_bytes"] >= peak
        assert span.attrs["ml.memory.device"] == "cpu"
    ops = [s for s in run.spans if s.level is Level.OP and "ml.memory.alloc_bytes" in s.attrs]
    assert ops, "ops get memory numbers too"
    assert run.meta["correlation"]["attribute_memory"]["devices"] == ["cpu"]
    assert not [i for i in run.instants if i.name == MEMORY_EVENT]


def test_memory_counter_track_follows_every_layer(tmp_path: Path) -> None:
    run = trace_model(tmp_path, 4)
    track = next(t for t in run.tracks.values() if t.kind == TrackKind.COUNTER and t.name == "cpu.memory.allocated")
    assert track.unit == "bytes"
    samples = [c for c in run.counters if c.track_id == track.id]
    assert len(samples) == run.meta["correlation"]["attribute_memory"]["memory_events"]
    layers = [s for s in run.spans if s.level is Level.LAYER]
    # Each layer call's rise and fall shows: samples inside every layer call, many per call
    # for the encoder layers.
    for layer in layers:
        inside = [c for c in samples if layer.start_ns <= c.ts_ns <= layer.end_ns]
        assert inside, layer.name
    for layer in layer_calls(run, "encoder.layers.0"):
        inside = [c.value for c in samples if layer.start_ns <= c.ts_ns <= layer.end_ns]
        assert len(inside) >= 10 and max(inside) - min(inside) >= layer.attrs["ml.memory.peak_bytes"] // 2
    # The Perfetto trace draws it as a counter track with every sample.
    parsed = parse_pftrace(run.path / "trace.pftrace")
    (uuid,) = [u for u, t in parsed.tracks.items() if t.name == "cpu.memory.allocated (bytes)"]
    assert parsed.tracks[uuid].HasField("counter")
    assert sorted(v for _, v in parsed.counters[uuid]) == sorted(c.value for c in samples)


def test_peak_grows_with_the_batch(tmp_path: Path) -> None:
    small = max(s.attrs["ml.memory.peak_bytes"] for s in layer_calls(trace_model(tmp_path, 4), "encoder.layers.0"))
    large = max(s.attrs["ml.memory.peak_bytes"] for s in layer_calls(trace_model(tmp_path, 8), "encoder.layers.0"))
    assert 1.6 <= large / small <= 2.4, (small, large)


def test_without_the_option_nothing_is_recorded(tmp_path: Path) -> None:
    run = trace_model(tmp_path, 2, memory=False, calls=1)
    assert not any(k.startswith("ml.memory.") for s in run.spans for k in s.attrs)
    assert not any(t.name.endswith(".memory.allocated") for t in run.tracks.values())
    assert "attribute_memory" not in run.meta.get("correlation", {})


def test_profile_api_takes_the_memory_option(tmp_path: Path) -> None:
    import mltrace

    torch.manual_seed(0)
    model = ConvEncoder().eval()
    with mltrace.profile(memory=True, output=tmp_path / "api", summary=False), torch.no_grad():
        model(torch.randn(2, 3, SIDE, SIDE))
    run = load_run(tmp_path / "api")
    (layer,) = layer_calls(run, "encoder.layers.0")
    assert layer.attrs["ml.memory.peak_bytes"] >= 2 * (SIDE // 4) ** 2 * D_MODEL * 4


def test_an_imported_profile_memory_trace_keeps_its_memory(tmp_path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    from mltrace.importers import import_kineto

    torch.manual_seed(0)
    model = ConvEncoder().eval()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(torch.randn(2, 3, SIDE, SIDE))
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    run = load_run(import_kineto(tmp_path / "trace.json", tmp_path / "imported"))
    events = run.meta["correlation"]["attribute_memory"]["memory_events"]
    assert events > 10
    (track,) = [t for t in run.tracks.values() if t.name == "cpu.memory.allocated"]
    assert len([c for c in run.counters if c.track_id == track.id]) == events
    ops = [s for s in run.spans if s.level is Level.OP and s.name == "aten::_transformer_encoder_layer_fwd"]
    assert len(ops) == 2 and all(s.attrs["ml.memory.peak_bytes"] >= 2 * (SIDE // 4) ** 2 * D_MODEL * 4 for s in ops)
