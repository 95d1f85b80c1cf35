"""Eager Keras layer calls as compact records (``tf_layer_records.LayerRecords``): what the
flusher writes of them, as rows with templates or as spans, is the same."""

from __future__ import annotations

import gc
from pathlib import Path

from mltrace.run.events import Span
from mltrace.run.levels import Level
from mltrace.run.store import Run, decode_batch, encode_batch
from mltrace.tracer.sources import tf_layer_records
from mltrace.tracer.sources.tf_layer_records import TEMPLATE_BASE, LayerRecords

ATTRS = {"ml.layer.path": "conv", "ml.input.shapes": [[1, 8, 8, 3]], "ml.flops": 12.0}


def record(records: LayerRecords, span_id: int, key: object, name: str = "conv") -> None:
    if not records.add(span_id, 1, 10 * span_id, 10 * span_id + 5, 3, key):
        records.add_new(span_id, 1, 10 * span_id, 10 * span_id + 5, 3, key, name, {**ATTRS, "ml.layer.path": name})


def decoded(lines: list[bytes]) -> list[Span]:
    run = Run(path=Path("x"), meta={})
    templates: dict[int, tuple[str, dict[str, object]]] = {}
    for line in lines:
        decode_batch(run, line, templates)
    return run.spans


def test_rows_and_spans_agree_and_each_template_is_written_once() -> None:
    as_rows, as_spans = LayerRecords(), LayerRecords()
    lines: list[bytes] = []
    spans: list[Span] = []
    for batch in ([(2, "a"), (3, "a"), (4, "b")], [(5, "a"), (6, "b")]):
        for span_id, key in batch:
            for records in (as_rows, as_spans):
                record(records, span_id, key, name=f"layer_{key}")
        assert len(as_rows) == len(batch)
        templates, rows, count = as_rows.encode()
        assert count == len(batch) and len(as_rows) == 0
        lines.append(encode_batch(span_rows=[rows], span_templates=[templates]))
        spans += as_spans.spans()
    assert lines[1].count(b'"ml.flops"') == 0  # the second batch refers to the first's templates
    expected = [(s.id, s.parent_id, s.level, s.name, s.start_ns, s.end_ns, s.track_id, s.attrs) for s in spans]
    got = [(s.id, s.parent_id, s.level, s.name, s.start_ns, s.end_ns, s.track_id, s.attrs) for s in decoded(lines)]
    assert got == expected
    assert [s.name for s in spans] == ["layer_a", "layer_a", "layer_b", "layer_a", "layer_b"]
    assert all(s.level is Level.LAYER and s.attrs["ml.flops"] == 12.0 for s in spans)


def test_the_templates_start_over_beyond_their_bound(monkeypatch: object) -> None:
    monkeypatch.setattr(tf_layer_records, "TEMPLATES_KEPT", 2)  # type: ignore[attr-defined]
    records = LayerRecords()
    lines = []
    for span_id, key in ((2, "a"), (3, "b"), (4, "a")):
        record(records, span_id, key)
        templates, rows, _ = records.encode()
        lines.append(encode_batch(span_rows=[rows], span_templates=[templates]))
    assert b"[%d," % TEMPLATE_BASE in lines[0] and b"[%d," % (TEMPLATE_BASE + 2) in lines[2]  # a new id once over
    assert [s.id for s in decoded(lines)] == [2, 3, 4]


def test_a_waiting_record_is_not_tracked_by_the_collector() -> None:
    records = LayerRecords()
    record(records, 2, "a")
    record(records, 3, "a")
    gc.collect()
    assert not any(gc.is_tracked(r) for r in records._records)
