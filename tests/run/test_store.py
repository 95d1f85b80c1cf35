"""events.jsonl lines: spans given as objects and as rows a producer encoded itself decode alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mltrace.run.events import CounterSample, Flow, Instant, Span, Track, TrackKind
from mltrace.run.jsoncodec import dumps
from mltrace.run.levels import Level
from mltrace.run.metadata import base_metadata
from mltrace.run.store import EVENTS_FILE, Run, encode_batch, load_run, span_row, write_meta

TRACK = Track(1, TrackKind.THREAD, "MainThread", 10, 10)
SPANS = [
    Span(1, None, Level.MODEL, "Net", 0, 100, 1, {"ml.layer.type": "Net"}),
    Span(2, 1, Level.LAYER, "stem.0", 10, 40, 1, {"ml.input.shapes": [[1, 3, 8, 8]], "ml.input.dtypes": ["float32"]}),
    Span(3, 1, Level.LAYER, "blocks.1 — ü", 50, 90, 1, {}),
]


def _encoded(spans: list[Span]) -> bytes:
    return b",".join(dumps(span_row(s)) for s in spans)


def _load(tmp_path: Path, *lines: bytes) -> tuple[list[tuple[object, ...]], Run]:
    tmp_path.mkdir(exist_ok=True)
    write_meta(tmp_path, {**base_metadata(["python", "x.py"], "t"), "complete": True})
    (tmp_path / EVENTS_FILE).write_bytes(b"".join(lines))
    run = load_run(tmp_path)
    return sorted((s.id, s.parent_id, s.level, s.name, s.start_ns, s.end_ns, s.track_id, s.attrs) for s in run.spans), run


def test_encoded_span_rows_decode_like_span_objects(tmp_path: Path) -> None:
    instant = Instant("mark", 20, 1, Level.USER, {"k": 1})
    flow = Flow(7, 1, 2, "test")
    plain = encode_batch(tracks=[TRACK], spans=SPANS, instants=[instant], flows=[flow])
    mixed = encode_batch(tracks=[TRACK], spans=SPANS[:1], span_rows=[_encoded(SPANS[1:]), b""], instants=[instant], flows=[flow])
    assert json.loads(mixed)["spans"] == json.loads(plain)["spans"]
    (a, run_a), (b, run_b) = _load(tmp_path / "a", plain), _load(tmp_path / "b", mixed)
    assert a == b and len(a) == 3
    assert run_a.instants == run_b.instants and run_a.flows == run_b.flows


def test_a_line_of_encoded_span_rows_alone(tmp_path: Path) -> None:
    line = encode_batch(span_rows=[_encoded(SPANS[:2]), _encoded(SPANS[2:])])
    assert line.endswith(b"}\n") and line.count(b"\n") == 1
    spans, _ = _load(tmp_path, encode_batch(tracks=[TRACK]), line)
    assert [s[0] for s in spans] == [1, 2, 3]
    assert encode_batch(span_rows=[b"", b""]) == b"{}\n"


def test_encoded_runs_are_spliced_in_as_the_lines_first_keys() -> None:
    """Templates and rows of several producers, each run a comma-separated list, joined by commas
    under their keys, before the line's other keys; a line of templates alone is valid too."""
    both = encode_batch(span_templates=[b"[1]", b"[2],[3]"], span_rows=[b"[4]", b"[5]"], counters=[CounterSample(1, 5, 2.0)])
    assert both == b'{"templates":[[1],[2],[3]],"spans":[[4],[5]],"counters":[[1,5,2.0]]}\n'
    assert encode_batch(span_templates=[b"[1]"]) == b'{"templates":[[1]]}\n'
    assert json.loads(encode_batch(span_rows=[b"[4]"], span_templates=[b"", b"[1]"])) == {"templates": [[1]], "spans": [[4]]}


def test_templated_span_rows_take_name_and_attributes_from_their_template(tmp_path: Path) -> None:
    """A template is written once, in the line of its first use; rows after it refer to it by id,
    and a row's own name and attributes take precedence."""
    first = encode_batch(
        tracks=[TRACK],
        span_templates=[b'[7,"stem.0",{"ml.layer.type":"Conv2d","k":1}]'],
        span_rows=[b"[1,null,2,null,0,10,1,{},7]"],
    )
    later = encode_batch(span_rows=[b'[2,null,2,null,20,30,1,{},7],[3,null,2,"own",40,50,1,{"k":2},7]'])
    spans, run = _load(tmp_path, first, later)
    assert spans == [
        (1, None, Level.LAYER, "stem.0", 0, 10, 1, {"ml.layer.type": "Conv2d", "k": 1}),
        (2, None, Level.LAYER, "stem.0", 20, 30, 1, {"ml.layer.type": "Conv2d", "k": 1}),
        (3, None, Level.LAYER, "own", 40, 50, 1, {"ml.layer.type": "Conv2d", "k": 2}),
    ]
    # The calls of a template share its dict (one per layer, not one per call, at the end of a run);
    # a row with attributes of its own gets a dict of its own.
    assert run.spans[0].attrs is run.spans[1].attrs and run.spans[2].attrs is not run.spans[1].attrs


def test_a_row_naming_a_template_never_written_is_a_corrupt_line(tmp_path: Path) -> None:
    from mltrace.run.store import RunError

    bad = encode_batch(span_rows=[b"[1,null,2,null,0,10,1,{},7]"])
    with pytest.raises(RunError, match="corrupt event line"):
        _load(tmp_path, encode_batch(tracks=[TRACK]), bad, encode_batch(tracks=[TRACK]))


@pytest.mark.parametrize("cap", [None, 6])
def test_a_run_written_at_the_end_keeps_every_span_and_their_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cap: int | None
) -> None:
    """write_events_atomically writes repeated layer and op spans (same name and attributes) as a
    template and rows; spans seen once and spans of other levels in full; all load back as they
    were, in order, also when the template table starts over (``cap``)."""
    from mltrace.run import store

    if cap is not None:
        monkeypatch.setattr(store, "_TEMPLATES_MAX", cap)
    shapes = {"ml.layer.type": "Conv2d", "ml.input.shapes": [[1, 3, 8, 8]], "ml.layer.config": {"k": [3, 3]}}
    spans = [Span(1, None, Level.MODEL, "Net", 0, 10_000, 1, {"ml.model.invocation": 1})]
    for i in range(40):
        name = ("stem.0", "stem.1", "head")[i % 3]
        attrs = {**shapes, "ml.layer.path": name} if name != "head" else {"ml.layer.path": name, "i": i}
        spans.append(Span(10 + i, 1, Level.LAYER, name, 100 * i, 100 * i + 50, 1, attrs))
        spans.append(Span(100 + i, 10 + i, Level.OP, "aten::conv2d", 100 * i + 1, 100 * i + 40, 1, {"ml.flops": i % 2}))
    run = Run(path=tmp_path, meta={**base_metadata(["python", "x.py"], "t"), "complete": True}, tracks={1: TRACK}, spans=spans)
    write_meta(tmp_path, run.meta)
    store.write_events_atomically(tmp_path / EVENTS_FILE, run, batch_size=16)
    text = (tmp_path / EVENTS_FILE).read_bytes()
    written = [t for line in text.splitlines() for t in json.loads(line).get("templates", [])]
    if cap is None:  # each stem layer and op in full once, then once as a template: 4 of 27 layer spans' configs
        assert text.count(b"ml.layer.config") == 4 and text.count(b"ml.flops") == 4
        expected = [("aten::conv2d", 0), ("stem.0", None), ("aten::conv2d", 1), ("stem.1", None)]
        assert [(t[1], t[2].get("ml.flops")) for t in written] == expected
    else:  # forgotten and written again under new ids
        assert {t[1] for t in written} <= {"stem.0", "stem.1", "aten::conv2d"} and len({t[0] for t in written}) == len(written) > 4
    back = load_run(tmp_path)
    assert [(s.id, s.parent_id, s.level, s.name, s.start_ns, s.end_ns, s.track_id, s.attrs) for s in back.spans] == [
        (s.id, s.parent_id, s.level, s.name, s.start_ns, s.end_ns, s.track_id, s.attrs) for s in spans
    ]
