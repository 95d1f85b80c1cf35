"""mltrace's Perfetto traces, loaded by the real Perfetto trace processor (WASM, headless Chromium).

Two real runs: a PyTorch model traced in-process (model, layer, op and library
slices, plus a counter track from ``MetricLogger``), and a real A100
torch.profiler trace imported with ``mltrace import`` (GPU stream tracks and
launch → kernel flows). For each, SQL checks that the trace processor reports
no import errors and holds exactly the run's slices per level, its nesting,
its flows and its counters.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import mltrace
from mltrace.importers.kineto import import_kineto
from mltrace.run.events import TrackKind
from mltrace.run.store import TRACE_FILE, Run
from support.perfetto_tp import query_trace, require_trace_processor

KINETO = Path(__file__).resolve().parents[1] / "data" / "kineto"

QUERIES = {
    "errors": "select name, idx, severity, source, value from stats where severity in ('error', 'data_loss') and value > 0",
    "info_problems": """
        select name, value from stats where severity = 'info' and value > 0
          and (name glob '*error*' or name glob '*skipped*' or name glob '*invalid*' or name glob '*dropped*' or name glob '*mismatch*')""",
    "per_category": "select category, count(*) as n from slice group by category order by category",
    "parents": """
        select s.name, s.ts, s.dur, p.name as parent, p.ts as parent_ts
        from slice s left join slice p on s.parent_id = p.id""",
    "flows": """
        select so.name as source, so.ts as source_ts, si.name as target, si.ts as target_ts
        from flow f join slice so on f.slice_out = so.id join slice si on f.slice_in = si.id""",
    "counters": """
        select t.name as track, c.ts, c.value from counter c join counter_track t on c.track_id = t.id order by c.ts""",
    "thread_tracks": """
        select distinct t.name as thread from slice s join thread_track tt on s.track_id = tt.id join thread t using (utid)""",
    "gpu_tracks": """
        select distinct tr.name as track from slice s join track tr on s.track_id = tr.id where tr.name glob 'stream *'""",
}


def expected_categories(run: Run) -> list[dict[str, Any]]:
    counts = Counter(s.level.label for s in run.spans) + Counter(i.level.label for i in run.instants)
    return [{"category": c, "n": n} for c, n in sorted(counts.items())]


def boundary_cases(run: Run) -> set[tuple[str, int]]:
    """Zero-length spans that start exactly where their same-track parent ends.

    The correlator nests them in that parent (containment includes the end);
    the exporter writes the parent's END before their BEGIN, so Perfetto makes
    them siblings. Known disagreement (reported to the exporter's owner); the
    parent check skips these few.
    """
    by_id = run.span_by_id()
    out = set()
    for s in run.spans:
        p = by_id.get(s.parent_id) if s.parent_id is not None else None
        if p is not None and p.track_id == s.track_id and s.duration_ns == 0 and s.start_ns == p.end_ns:
            out.add((s.name, s.start_ns))
    return out


def expected_parents(run: Run, skip: set[tuple[str, int]]) -> Counter[tuple[Any, ...]]:
    """(name, ts, dur, parent name, parent ts) for every span; the parent only when on the same track."""
    by_id = run.span_by_id()
    out: Counter[tuple[Any, ...]] = Counter()
    for s in run.spans:
        if s.duration_ns == 0 and (s.name, s.start_ns) in skip:
            continue
        p = by_id.get(s.parent_id) if s.parent_id is not None else None
        if p is not None and p.track_id == s.track_id:
            out[(s.name, s.start_ns, s.duration_ns, p.name, p.start_ns)] += 1
        else:
            out[(s.name, s.start_ns, s.duration_ns, None, None)] += 1
    for i in run.instants:
        out[(i.name, i.ts_ns, 0, None, None)] += 1  # parents of instants are not recorded in the run
    return out


def got_parents(rows: list[dict[str, Any]], instants: set[tuple[str, int]], skip: set[tuple[str, int]]) -> Counter[tuple[Any, ...]]:
    out: Counter[tuple[Any, ...]] = Counter()
    for r in rows:
        if r["dur"] == 0 and (r["name"], r["ts"]) in skip and (r["name"], r["ts"]) not in instants:
            continue
        if (r["name"], r["ts"]) in instants and r["dur"] == 0:
            out[(r["name"], r["ts"], 0, None, None)] += 1
        else:
            out[(r["name"], r["ts"], r["dur"], r["parent"], r["parent_ts"])] += 1
    return out


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    torch = pytest.importorskip("torch")
    from mltrace.bench import MetricLogger

    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 10)).eval()
    base = tmp_path_factory.mktemp("pftrace")
    with torch.inference_mode(), mltrace.profile(output=base / "run", summary=False):
        log = MetricLogger(base / "metrics.jsonl")
        for step in range(3):
            model(torch.randn(2, 3, 16, 16))
            log.log(step=step, loss=1.0 / (step + 1))
    return mltrace.load_run(base / "run")


def test_real_torch_run_loads_cleanly(torch_run: Run) -> None:
    require_trace_processor()
    r = query_trace(torch_run.path / TRACE_FILE, QUERIES)
    assert r["errors"] == [] and r["info_problems"] == []
    assert r["per_category"] == expected_categories(torch_run)
    assert {row["category"] for row in r["per_category"]} >= {"model", "layer"}
    skip = boundary_cases(torch_run)
    assert len(skip) <= len(torch_run.spans) // 20
    assert got_parents(r["parents"], set(), skip) == expected_parents(torch_run, skip)

    # Every counter sample, on its track (the exporter names a track "name (unit)");
    # MetricLogger's track among them with its three samples.
    def track_name(track_id: int) -> str:
        t = torch_run.tracks[track_id]
        return t.name + (f" ({t.unit})" if t.unit else "")

    expected = Counter((track_name(c.track_id), c.ts_ns, c.value) for c in torch_run.counters)
    assert Counter((row["track"], row["ts"], row["value"]) for row in r["counters"]) == expected
    loss = sorted((ts, v) for name, ts, v in expected if name == "metric.loss")
    assert [v for _, v in loss] == [1.0, 0.5, 1 / 3]
    assert [row["thread"] for row in r["thread_tracks"]] == ["MainThread"]
    assert r["flows"] == []  # a CPU run launches nothing


def test_imported_gpu_trace_with_flows(tmp_path: Path) -> None:
    require_trace_processor()
    run = mltrace.load_run(import_kineto(KINETO / "a100_alexnet_train.json.gz", tmp_path / "alexnet"))
    assert run.flows, "the fixture has launches"
    r = query_trace(run.path / TRACE_FILE, QUERIES)
    assert r["errors"] == [] and r["info_problems"] == []
    assert r["per_category"] == expected_categories(run)
    instants = {(i.name, i.ts_ns) for i in run.instants}
    skip = boundary_cases(run)
    assert len(skip) <= len(run.spans) // 20  # 20 of 826 in this trace
    assert got_parents(r["parents"], instants, skip) == expected_parents(run, skip)
    by_id = run.span_by_id()
    expected_flows = Counter(
        (by_id[f.from_span].name, by_id[f.from_span].start_ns, by_id[f.to_span].name, by_id[f.to_span].start_ns) for f in run.flows
    )
    assert Counter((f["source"], f["source_ts"], f["target"], f["target_ts"]) for f in r["flows"]) == expected_flows
    streams = {f"stream {t.stream}" for t in run.tracks.values() if t.kind == TrackKind.GPU_STREAM}
    assert {row["track"] for row in r["gpu_tracks"]} == streams


def test_the_exporter_writes_the_same_packets_in_chunks(torch_run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    """export_perfetto hands packets to the file as they are made; chunked or joined at the end,
    the bytes are the same."""
    from mltrace.run import perfetto

    monkeypatch.setattr(perfetto, "_WRITE_CHUNK", 7)
    events = {
        "tracks": torch_run.tracks.values(),
        "spans": torch_run.spans,
        "instants": torch_run.instants,
        "counters": torch_run.counters,
        "flows": torch_run.flows,
    }
    chunks: list[bytes] = []
    streamed = perfetto.PerfettoEncoder(torch_run.meta)
    assert streamed.encode(**events, write=chunks.append) == b""
    whole = perfetto.PerfettoEncoder(torch_run.meta)
    assert b"".join(chunks) == whole.encode(**events)
    assert len(chunks) > 10 and streamed.packets == whole.packets


@pytest.mark.parametrize("which", ["torch", "imported"])
def test_the_c_encoder_writes_what_the_python_one_writes(
    torch_run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    """The span packets made in C (``_pftrace.c``: ends, and begins whose head and annotation
    block are cached) are byte for byte the Python encoder's, written whole or in chunks; a
    run with flows, instants, counters and GPU tracks sends the rest to the Python one."""
    pytest.importorskip("mltrace._pftrace", reason="the C encoder was not built")
    from mltrace.run import perfetto

    run = torch_run if which == "torch" else mltrace.load_run(import_kineto(KINETO / "a100_alexnet_train.json.gz", tmp_path / "r"))
    events = {"tracks": run.tracks.values(), "spans": run.spans, "instants": run.instants, "counters": run.counters, "flows": run.flows}

    def encode(encoder: str, chunk: int) -> tuple[bytes, int]:
        monkeypatch.setenv("MLTRACE_PERFETTO_ENCODER", encoder)
        monkeypatch.setattr(perfetto, "_WRITE_CHUNK", chunk)
        assert (perfetto._fast_encoder() is None) == (encoder == "python")
        enc = perfetto.PerfettoEncoder(run.meta)
        parts: list[bytes] = []
        assert enc.encode(**events, write=parts.append) == b""
        return b"".join(parts), enc.packets

    python = encode("python", 8192)
    assert encode("c", 8192) == python and encode("c", 5) == python
    assert python[1] > 2 * len(run.spans)  # descriptors too


def test_annotation_strings_are_interned_once_each(torch_run: Run) -> None:
    """String annotation values (shapes, file paths, configs as JSON) repeat from span to span:
    each distinct one is written once, in the interned data of the packet that first uses it,
    and referenced by id after that."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    trace = pb.Trace.FromString((torch_run.path / TRACE_FILE).read_bytes())
    interned: dict[int, bytes] = {}
    uses = 0
    for packet in trace.packet:
        for e in packet.interned_data.debug_annotation_string_values:
            assert e.iid not in interned and e.str not in interned.values()
            interned[e.iid] = e.str
        for da in packet.track_event.debug_annotations:
            assert da.WhichOneof("value") != "string_value"  # every string is interned here
            if da.WhichOneof("value") == "string_value_iid":
                assert da.string_value_iid in interned
                uses += 1
    layer_spans = [s for s in torch_run.spans if s.level.label == "layer"]
    assert uses > 2 * len(interned) and len(layer_spans) > 10
    assert b"[[2,8,14,14]]" in interned.values()  # the conv's output shape, as written for every call


def test_reused_annotation_blocks_encode_as_fresh_ones(torch_run: Run) -> None:
    """Layer spans sharing their attribute values, and other spans sharing their attribute map,
    get their annotations encoded once and reused; the trace must be byte for byte what encoding
    every span afresh (nothing shared) gives."""
    import copy

    from mltrace.run import perfetto
    from mltrace.run.events import Span

    def encode(spans: list[Span]) -> bytes:
        enc = perfetto.PerfettoEncoder(torch_run.meta)
        return enc.encode(tracks=torch_run.tracks.values(), spans=spans, instants=torch_run.instants, counters=torch_run.counters)

    layers = [s for s in torch_run.spans if s.level.label == "layer"]
    shared = {}
    for s in layers:  # the same value objects for every call of a layer, as a loaded template gives
        s.attrs = {k: shared.setdefault((s.name, k, repr(v)), v) for k, v in s.attrs.items()}
    fresh = [Span(s.id, s.parent_id, s.level, s.name, s.start_ns, s.end_ns, s.track_id, copy.deepcopy(s.attrs)) for s in torch_run.spans]
    assert len({id(s.attrs["ml.input.shapes"]) for s in layers}) < len(layers)
    ops = [s for s in torch_run.spans if s.level.label == "op" and s.attrs]
    assert len({id(s.attrs) for s in ops}) < len(ops) / 2  # a loaded run's ops share their templates' maps
    assert encode(torch_run.spans) == encode(fresh)


def test_varints_match_protobufs_own_encoding() -> None:
    """The hand encoder's varints, timestamps' cached high groups included (``_varint``)."""
    from google.protobuf.internal.encoder import _VarintBytes

    from mltrace.run.perfetto import _varint

    edges = [0, 1, 0x7F, 0x80, 0x3FFF, 0x4000, (1 << 28) - 1, 1 << 28, (1 << 28) + 1, (1 << 35) - 1, 1 << 35]
    stamps = [1_720_000_000_123_456_789 + k * 104_729 for k in range(200)]  # epoch-sized ns, one high group
    monotonic = [1_626_563_407_427 + k * 7_919_191 for k in range(200)]  # session clock ns, several
    for n in [*edges, *stamps, *monotonic, (1 << 64) - 1]:
        assert _varint(n) == _VarintBytes(n), n


def test_packets_nest_at_equal_timestamps_in_the_written_order() -> None:
    """Outer begins first and inner ends first at one timestamp; a zero-length span's end follows
    its own begin; an end comes before a begin at the same time; instants follow the begins."""
    from mltrace.run.events import CounterSample, Instant, Span
    from mltrace.run.levels import Level
    from mltrace.run.perfetto import _depths, _packet_order

    spans = [
        Span(3, 2, Level.OP, "inner", 100, 200, 1),  # listed before its parents on purpose
        Span(1, None, Level.MODEL, "outer", 100, 200, 1),
        Span(2, 1, Level.LAYER, "middle", 100, 200, 1),
        Span(4, 2, Level.OP, "zero", 150, 150, 1),
        Span(5, None, Level.MODEL, "next", 200, 300, 1),
    ]
    instants = [Instant("mark", 100, 1)]
    counters = [CounterSample(9, 100, 1.0)]
    assert _depths(spans).tolist() == [2, 0, 1, 2, 0]
    order = _packet_order(spans, instants, counters).tolist()
    begin = {s.name: 2 * i for i, s in enumerate(spans)}
    end = {s.name: 2 * i + 1 for i, s in enumerate(spans)}
    assert order == [
        begin["outer"],
        11,  # the counter (index 2n + 1): depth 0 as the outer begin, later in the list
        begin["middle"],
        begin["inner"],
        10,  # the instant (index 2n), after every begin at its time
        begin["zero"],
        end["zero"],
        end["inner"],
        end["middle"],
        end["outer"],
        begin["next"],
        end["next"],
    ]


def test_a_cyclic_parent_chain_does_not_hang_the_exporter() -> None:
    from mltrace.run.events import Span
    from mltrace.run.levels import Level
    from mltrace.run.perfetto import _depths

    spans = [Span(1, 2, Level.LAYER, "a", 0, 10, 1), Span(2, 1, Level.LAYER, "b", 0, 10, 1), Span(3, 99, Level.OP, "c", 1, 2, 1)]
    depth = _depths(spans).tolist()
    assert depth[2] == 0  # a parent outside the run counts as none
    assert min(depth[:2]) >= 1000  # cut off, not looped forever
