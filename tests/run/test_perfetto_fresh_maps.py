"""The C Perfetto encoder on attribute maps it has not seen before (``_pftrace.c``: ``fresh_block``).

A live run's op and library spans each carry their own map (Kineto ids, times, sequence numbers),
so no cached annotation block applies. The C encoder writes such a span's begin packet itself
when every name and string value in it is interned already, and leaves the rest (a first use, a
lone surrogate, a float or int subclass, an int beyond 64 bits the first time) to the Python
encoder, which interns them. Either way the trace must be byte for byte the Python encoder's.
"""

from __future__ import annotations

import copy
import enum
from pathlib import Path
from typing import Any

import pytest

import mltrace
from mltrace.run.events import Span
from mltrace.run.store import Run
from support.perfetto_tp import query_trace, require_trace_processor


class Mode(enum.IntEnum):
    EAGER = 1


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    base = tmp_path_factory.mktemp("fresh")
    with torch.inference_mode(), mltrace.profile(output=base / "run", summary=False):
        for _ in range(20):
            model(torch.randn(2, 8))
    return mltrace.load_run(base / "run")


def per_span_values(i: int) -> dict[str, Any]:
    """Attributes unique to span ``i``, of every kind the encoder writes."""
    import numpy as np

    return {
        "test.seq": i,
        "test.negative": -i - 1,
        "test.ratio": i / 3,
        "test.flag": i % 2 == 0,
        "test.missing": None,
        "test.parity": "even" if i % 2 == 0 else "odd",
        "test.shape": [[i % 3, 4]],
        "test.pair": (1, "a"),
        "test.config": {"k": i % 4},
        "test.huge": (1 << 70) + i % 2 if i % 7 == 0 else i,  # JSON text beyond 64 bits
        "test.label": f"span {i}" if i % 10 == 0 else "common",  # a new string value every 10th span
        "test.text": "bad \udc80" if i % 11 == 0 else "good ü",  # a lone surrogate is replaced
        "test.odd": np.float64(i) if i % 13 == 0 else Mode.EAGER if i % 13 == 1 else 0.5,
    }


def fresh_spans(run: Run) -> list[Span]:
    """The run's spans, each with a map of its own: its attributes copied, plus ``per_span_values``."""
    out = []
    for i, s in enumerate(run.spans):
        attrs = copy.deepcopy(s.attrs) | per_span_values(i)
        out.append(Span(s.id, s.parent_id, s.level, s.name, s.start_ns, s.end_ns, s.track_id, attrs))
    return out


def encode(run: Run, batches: list[list[Span]], encoder: str, chunk: int, monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, int]:
    """The trace of ``batches`` encoded by one encoder in turn, and how many begins went to Python."""
    from mltrace.run import perfetto

    monkeypatch.setenv("MLTRACE_PERFETTO_ENCODER", encoder)
    monkeypatch.setattr(perfetto, "_WRITE_CHUNK", chunk)
    enc = perfetto.PerfettoEncoder(run.meta)
    python_begins = 0
    slice_begin = enc._slice_begin

    def counted(*args: Any, **kwargs: Any) -> bytes:
        nonlocal python_begins
        python_begins += 1
        return slice_begin(*args, **kwargs)

    monkeypatch.setattr(enc, "_slice_begin", counted)
    parts: list[bytes] = []
    for n, spans in enumerate(batches):
        first = n == 0
        enc.encode(
            tracks=run.tracks.values() if first else (),
            spans=spans,
            instants=run.instants if first else (),
            counters=run.counters if first else (),
            write=parts.append,
        )
    return b"".join(parts), python_begins


@pytest.mark.parametrize("batches", [1, 3])
def test_c_begins_of_unseen_maps_are_the_python_encoders_bytes(torch_run: Run, monkeypatch: pytest.MonkeyPatch, batches: int) -> None:
    pytest.importorskip("mltrace._pftrace", reason="the C encoder was not built")
    spans = fresh_spans(torch_run)
    assert {s.level.label for s in spans} >= {"model", "layer", "op"}
    assert len({id(s.attrs) for s in spans}) == len(spans)
    step = -(-len(spans) // batches)
    parts = [spans[lo : lo + step] for lo in range(0, len(spans), step)]
    python, all_begins = encode(torch_run, parts, "python", 8192, monkeypatch)
    c, c_python_begins = encode(torch_run, parts, "c", 8192, monkeypatch)
    assert all_begins == len(spans)
    assert c == python
    assert encode(torch_run, parts, "c", 5, monkeypatch)[0] == python
    # The C path took most begins: all but first uses and the values only Python writes.
    assert 0 < c_python_begins < len(spans) // 2


def test_the_trace_processor_reads_the_c_encoders_annotations(torch_run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mltrace._pftrace", reason="the C encoder was not built")
    require_trace_processor()
    spans = fresh_spans(torch_run)
    trace, _ = encode(torch_run, [spans], "c", 8192, monkeypatch)
    path = tmp_path / "trace.pftrace"
    path.write_bytes(trace)
    r = query_trace(
        path,
        {
            "errors": "select name, value from stats where severity in ('error', 'data_loss') and value > 0",
            "args": """
                select s.ts, a.key, a.display_value from slice s join args a using (arg_set_id)
                where a.key in ('debug.test_seq', 'debug.test_parity', 'debug.test_shape', 'debug.test_text')""",
        },
    )
    assert r["errors"] == []
    got = {(row["ts"], row["key"].removeprefix("debug.test_"), row["display_value"]) for row in r["args"]}
    for i, s in enumerate(spans):  # the trace processor writes a name's dots as underscores
        assert (s.start_ns, "seq", str(i)) in got
        assert (s.start_ns, "parity", "even" if i % 2 == 0 else "odd") in got
        assert (s.start_ns, "shape", f"[[{i % 3},4]]") in got
        assert (s.start_ns, "text", "bad ?" if i % 11 == 0 else "good ü") in got
