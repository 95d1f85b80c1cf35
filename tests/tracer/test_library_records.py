"""Library calls as compact records (``library_records.LibraryRecords``): what the flusher
writes of them, as rows with templates or as spans, is what the library level made before,
and a drain leaves no object the garbage collector tracks per call."""

from __future__ import annotations

import gc
import itertools
import json
from pathlib import Path

from mltrace.run.events import Span
from mltrace.run.store import Run, decode_batch, encode_batch
from mltrace.tracer.fdtap import TappedLine
from mltrace.tracer.sources.cpu_library import LibrarySpanMaker, _parse_in_chunks, library_spans
from mltrace.tracer.sources.library_records import TEMPLATE_BASE, LibraryRecords

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
OFFSET = 1_795_000_000_000_000_000


def _logged_lines() -> list[TappedLine]:
    """oneDNN (timed, untimed, creation) and MKL lines from real logs, twice over, 1 µs apart."""
    texts = []
    for log in ("onednn/torch_profile_exec.log", "onednn/torch_toggle_create.log", "mkl/torch_mkl_verbose.log"):
        texts += [ln for ln in (DATA / log).read_text(encoding="utf-8").splitlines() if not ln.startswith("== ")]
    return [TappedLine(1_795_322_166_140_000_000 - OFFSET + 1_000 * i, text) for i, text in enumerate(texts * 2)]


def _maker() -> LibrarySpanMaker:
    return LibrarySpanMaker(lambda ns: ns - OFFSET, 7, itertools.count(1).__next__)


def _decoded(lines: list[bytes]) -> list[Span]:
    run = Run(path=Path("x"), meta={})
    templates: dict[int, tuple[str, dict[str, object]]] = {}
    for line in lines:
        decode_batch(run, line, templates)
    return run.spans


def _fields(spans: list[Span]) -> list[tuple[object, ...]]:
    """Everything of each span, the order of its attributes included."""
    return [(s.id, s.parent_id, s.level, s.name, s.start_ns, s.end_ns, s.track_id, list(s.attrs.items())) for s in spans]


def test_rows_decode_to_the_spans_and_each_template_is_written_once() -> None:
    lines = _logged_lines()
    whole, _ = library_spans(lines, lambda ns: ns - OFFSET, 7, itertools.count(1).__next__)
    maker, records = _maker(), LibraryRecords()
    written: list[bytes] = []
    half = len(lines) // 2  # the second half repeats the first's calls
    for batch in (lines[:half], lines[half:]):
        maker.add_records(batch, records)
        templates, rows, count = records.encode()
        assert count > 0 and len(records) == 0
        written.append(encode_batch(span_rows=[rows], span_templates=[templates]))
    assert b'"templates"' in written[0] and b'"templates"' not in written[1]
    decoded = _decoded(written)
    assert _fields(decoded) == _fields(whole)
    assert {s.attrs.get("ml.library.untimed") for s in decoded} == {None, True}
    assert any("ml.library.mkl_tid" in s.attrs for s in decoded) and any("ml.flops" in s.attrs for s in decoded)
    template_ids = [t[0] for t in json.loads(written[0])["templates"]]
    assert template_ids and all(TEMPLATE_BASE <= t < 2 * TEMPLATE_BASE for t in template_ids)  # the library's own ids


def test_records_handed_over_as_spans_are_those_of_the_maker() -> None:
    """The streamed Perfetto trace takes Spans (``LibraryRecords.spans``): the same as rows."""
    lines = _logged_lines()
    whole, _ = library_spans(lines, lambda ns: ns - OFFSET, 7, itertools.count(1).__next__)
    records = LibraryRecords()
    _parse_in_chunks(_maker(), lines, records)
    spans = records.spans()
    assert _fields(spans) == _fields(whole) and len(records) == 0
    assert len({id(s.attrs) for s in spans}) == len(spans)  # each its own dict


def test_a_drain_leaves_no_tracked_object_per_call() -> None:
    """The calls wait for the flush in an array of integers: after a drain of a thousand
    lines the collector tracks no more objects than before (a Span and a dict each, before)."""
    gemm = "MKL_VERBOSE SGEMM(N,N,64,1,34,0x7f00,0x7f10,64,0x7f20,34,0x7f30,0x7f40,64) 4.78us CNR:OFF Dyn:1 FastMM:1 TID:0  NThr:1"
    lines = [TappedLine(1_000 * (i + 1), gemm) for i in range(1000)]
    maker, records = _maker(), LibraryRecords()
    _parse_in_chunks(maker, lines[:10], records)  # the template, made once
    gc.collect()
    before = len(gc.get_objects())
    _parse_in_chunks(maker, lines, records)
    gc.collect()
    assert len(records) == 1010
    assert len(gc.get_objects()) - before < 20
