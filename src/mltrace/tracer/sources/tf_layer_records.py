"""Eager Keras layer calls as compact records, turned into spans by the flusher.

An eager Keras layer call used to leave a ``Span``, its attribute dict and the lists of its
shapes (eight objects the cyclic garbage collector tracks) until the next flush, half a
second later. A Keras program's own eager calls leave almost nothing tracked behind, so these
were most of what its young collections found alive: they were promoted to the oldest
generation by the thousand, and the program's full collections came more often (one in every
twenty MobileNetV2 calls or so, 150–300 ms each, inside whichever layer ran then).

Here a call ends as one tuple of integers (``LayerRecords.add``): span id, parent id, start,
end, track and the id of its *template* (the path, attributes and shapes every call of a
layer from one call site with the same shapes shares, built at the first such call). The
collector stops tracking such a tuple at its first look, so nothing is promoted. The flusher
writes the records as events.jsonl rows that refer to their templates, or as ``Span``
objects where it needs those (the streamed Perfetto trace).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Hashable
from typing import Any

from mltrace.run.events import Span
from mltrace.run.jsoncodec import dumps, loads, trimmed
from mltrace.run.levels import Level

#: The first id of these templates: torch's layer templates count from 1 and the op
#: converter's from 1 << 40, and a run's templates share one numbering.
TEMPLATE_BASE = 1 << 41
#: Templates kept for reuse at most; beyond, the next drain starts over (written ones stay valid).
TEMPLATES_KEPT = 4096

#: A layer call: span id, parent span id, start ns, end ns, track id, template id.
Record = tuple[int, "int | None", int, int, int, int]


class LayerRecords:
    """The eager layer calls recorded since the last drain, and their templates.

    ``add`` runs on the program's threads at each layer call's end; ``spans`` and ``encode``
    on the flusher. A lock keeps a record and its template together across a drain.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: deque[Record] = deque()
        #: Template key → template id, for reuse.
        self._ids: dict[Hashable, int] = {}
        #: Template id → (span name, attributes as JSON), for every id in ``_ids`` or in a waiting
        #: record: text, which the collector does not track, however many templates a run has.
        self._templates: dict[int, tuple[str, bytes]] = {}
        #: Template ids not yet written to events.jsonl.
        self._unwritten: list[int] = []
        self._next_id = itertools.count(TEMPLATE_BASE)

    def __len__(self) -> int:
        """Layer calls recorded and not drained yet."""
        return len(self._records)

    def add(self, span_id: int, parent_id: int | None, start_ns: int, end_ns: int, track_id: int, key: Hashable) -> bool:
        """Records a call whose template ``key`` names, if that template is known; returns
        whether it was (else call ``add_new`` with the template)."""
        with self._lock:
            template = self._ids.get(key)
            if template is None:
                return False
            self._records.append((span_id, parent_id, start_ns, end_ns, track_id, template))
            return True

    def add_new(
        self,
        span_id: int,
        parent_id: int | None,
        start_ns: int,
        end_ns: int,
        track_id: int,
        key: Hashable,
        name: str,
        attrs: dict[str, Any],
    ) -> None:
        """Records a call with a new template: its span's ``name`` and ``attrs``, which every
        later call with the same ``key`` shares."""
        encoded = trimmed(dumps(attrs))
        with self._lock:
            template = self._ids.get(key)
            if template is None:
                template = next(self._next_id)
                self._ids[key] = template
                self._templates[template] = (name, encoded)
                self._unwritten.append(template)
            self._records.append((span_id, parent_id, start_ns, end_ns, track_id, template))

    def _take(self) -> tuple[list[Record], list[tuple[int, str, bytes]], dict[int, tuple[str, bytes]]]:
        """The waiting records, the templates not written yet (as ``(id, name, attrs)``), and
        the templates the records use; starts the templates over where too many are kept."""
        with self._lock:
            records = [self._records.popleft() for _ in range(len(self._records))]
            new = [(t, *self._templates[t]) for t in self._unwritten]
            self._unwritten.clear()
            used = {r[5]: self._templates[r[5]] for r in records}
            if len(self._ids) >= TEMPLATES_KEPT:
                self._ids.clear()
                self._templates.clear()
        return records, new, used

    def spans(self) -> list[Span]:
        """The waiting records as layer spans (those of one template sharing its attributes)."""
        records, _, used = self._take()
        decoded = {template: (name, loads(attrs)) for template, (name, attrs) in used.items()}
        spans = []
        for span_id, parent_id, start, end, track, template in records:
            name, attrs = decoded[template]
            spans.append(Span(span_id, parent_id, Level.LAYER, name, start, end, track, attrs))
        return spans

    def encode(self) -> tuple[bytes, bytes, int]:
        """The waiting records as events.jsonl span rows: the templates first written in this
        batch, the rows, and how many spans they are (``Recorder.add_producer``)."""
        records, new, _ = self._take()
        templates = b",".join(b"[%d,%s,%s]" % (t, dumps(name), attrs) for t, name, attrs in new)
        level = int(Level.LAYER)
        rows = ",".join(
            f"[{span_id},{'null' if parent_id is None else parent_id},{level},null,{start},{end},{track},{{}},{template}]"
            for span_id, parent_id, start, end, track, template in records
        )
        return templates, rows.encode(), len(records)
