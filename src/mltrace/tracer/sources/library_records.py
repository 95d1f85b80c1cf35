"""Library calls (oneDNN and MKL verbose lines) as compact records, turned into spans by the flusher.

The library level turns every verbose line into a span on the flusher thread: a GPT-2
``generate()`` prints some twenty thousand, about a thousand a second. A ``Span`` and its
attribute dict per line, kept until the flush wrote them, were objects the cyclic garbage
collector tracks: they brought the program's young collections, promoted survivors, and a
full collection (about 200 ms) into the traced run, nearly all on the flusher thread while it
held the GIL.

Here a call is kept as ``FIELDS`` integers in one ``array`` (``LibraryRecords.add``): span id,
start, end, track, the id of its *template* (name, leading attributes and FLOPs that every
call of one primitive and problem, or of one MKL function with the same arguments, shares;
``LibrarySpanMaker._template``), its duration, seq number, MKL thread fields and, for a call
without a timestamp, its receive time. The array holds no object per call at all. The flusher
writes the records as events.jsonl rows that refer to their templates (each template written
once, as JSON text), or as ``Span`` objects where it needs those (the streamed Perfetto
trace): the same spans, with the same attributes in the same order, either way.
"""

from __future__ import annotations

import itertools
import threading
from array import array
from typing import Any

from mltrace.run.events import Span
from mltrace.run.jsoncodec import dumps, trimmed
from mltrace.run.levels import Level

#: The first id of these templates: torch's layer templates count from 1, the op converter's
#: from 1 << 40 and TensorFlow's layers' from 1 << 41, and a run's templates share one numbering.
TEMPLATE_BASE = 1 << 42
#: Integers per record: span id, start, end, track, template id, exec ns, seq, MKL ``TID``,
#: MKL ``NThr``, receive ns (``ABSENT`` where a field is not there).
FIELDS = 10
#: The value of a record's field that the call does not have (a thread field, the receive
#: time of a timed call).
ABSENT = -(1 << 63)


class LibraryTemplate:
    """What the calls of one template share: the span name, the leading attributes (the dict
    the maker copies per span), the FLOPs, and the same as JSON text for rows."""

    __slots__ = ("id", "name", "head", "flops", "head_json", "flops_json", "written")

    def __init__(self, template_id: int, name: str, head: dict[str, Any], flops: int | None) -> None:
        self.id = template_id
        self.name = name
        self.head = head
        self.flops = flops
        self.head_json = trimmed(dumps(head))
        self.flops_json = b"" if flops is None else b',"ml.flops":' + dumps(flops)
        #: Whether a row batch (``LibraryRecords.encode``) has written the template.
        self.written = False


_new_template_ids = itertools.count(TEMPLATE_BASE)


def new_template(name: str, head: dict[str, Any], flops: int | None) -> LibraryTemplate:
    """A template with a fresh id (unique within the process, so across a run's sessions too)."""
    return LibraryTemplate(next(_new_template_ids), name, head, flops)


def span_attrs(template: LibraryTemplate, exec_ns: int, seq: int, tid: int, nthr: int, receive_ns: int) -> dict[str, Any]:
    """A call's attributes, in the order the library level has always written them: the
    template's, the MKL thread fields, duration, seq, FLOPs, and the untimed call's receipt."""
    attrs = template.head.copy()
    if tid != ABSENT:
        attrs["ml.library.mkl_tid"] = tid
    if nthr != ABSENT:
        attrs["ml.library.nthr"] = nthr
    attrs["ml.library.exec_ns"] = exec_ns
    attrs["ml.library.seq"] = seq
    if template.flops is not None:
        attrs["ml.flops"] = template.flops
    if receive_ns != ABSENT:
        attrs["ml.library.untimed"] = True
        attrs["ml.library.receive_ns"] = receive_ns
    return attrs


class LibraryRecords:
    """The library calls parsed since the last drain, and the templates they use.

    ``add`` runs in the source's ``drain_events`` on the flusher thread; ``spans`` and
    ``encode`` in the recorder's drain (the flusher, or the thread that stops the session).
    A lock keeps the records and their templates together across a drain.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records = array("q")
        #: Template id → template, for every template a waiting record uses.
        self._templates: dict[int, LibraryTemplate] = {}

    def __len__(self) -> int:
        """Calls recorded and not drained yet."""
        return len(self._records) // FIELDS

    def add(self, records: array[int], templates: dict[int, LibraryTemplate]) -> None:
        """Appends ``records`` (``FIELDS`` integers each) and the templates they use."""
        with self._lock:
            self._records.extend(records)
            self._templates.update(templates)

    def _take(self) -> tuple[array[int], dict[int, LibraryTemplate]]:
        """The waiting records and the templates they use; none wait after."""
        with self._lock:
            records, self._records = self._records, array("q")
            templates, self._templates = self._templates, {}
        return records, templates

    def spans(self) -> list[Span]:
        """The waiting records as LIBRARY spans (each with its own attribute dict)."""
        records, templates = self._take()
        spans = []
        level = Level.LIBRARY
        for i in range(0, len(records), FIELDS):
            span_id, start, end, track, template_id, exec_ns, seq, tid, nthr, receive_ns = records[i : i + FIELDS]
            template = templates[template_id]
            attrs = span_attrs(template, exec_ns, seq, tid, nthr, receive_ns)
            spans.append(Span(span_id, None, level, template.name, start, end, track, attrs))
        return spans

    def encode(self) -> tuple[bytes, bytes, int]:
        """The waiting records as events.jsonl span rows: the templates first written in this
        batch, the rows, and how many spans they are (``Recorder.add_producer``)."""
        records, templates = self._take()
        new = [t for t in templates.values() if not t.written]
        encoded_templates = b",".join(b"[%d,%s,%s]" % (t.id, dumps(t.name), t.head_json) for t in new)
        level = int(Level.LIBRARY)
        rows: list[bytes] = []
        for i in range(0, len(records), FIELDS):
            span_id, start, end, track, template_id, exec_ns, seq, tid, nthr, receive_ns = records[i : i + FIELDS]
            threads = b""
            if tid != ABSENT:
                threads = b'"ml.library.mkl_tid":%d,' % tid
            if nthr != ABSENT:
                threads += b'"ml.library.nthr":%d,' % nthr
            untimed = b"" if receive_ns == ABSENT else b',"ml.library.untimed":true,"ml.library.receive_ns":%d' % receive_ns
            rows.append(
                b'[%d,null,%d,null,%d,%d,%d,{%s"ml.library.exec_ns":%d,"ml.library.seq":%d%s%s},%d]'
                % (span_id, level, start, end, track, threads, exec_ns, seq, templates[template_id].flops_json, untimed, template_id)
            )
        for t in new:  # once the batch is encoded: no row may refer to a template never written
            t.written = True
        return encoded_templates, b",".join(rows), len(records) // FIELDS
