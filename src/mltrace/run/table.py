"""A run's spans as columns: what analysis reads, in arrays instead of objects.

A report over a million spans cannot afford a million Python objects, nor decoding a million
attribute maps it mostly never looks at. ``SpanTable`` holds the structural fields of every
span as numpy arrays and the attributes as *attribute sets*: identical maps stored once, each
decoded only when asked for.

``spans.bin``, a cache beside events.jsonl, is ignored and rebuilt when the events.jsonl size
and mtime it names differ or its CRC-32 does not match (a flipped byte would otherwise give
wrong times silently). Layout: the line ``MLTRACE-SPANS``, the header's length (8 bytes,
little-endian), a JSON header (format version, the events.jsonl stamp, dtype, offset and
count of each array, ``checksum``: the CRC-32 of the header's other fields as JSON and of
every byte after the header's padding), then the arrays, little-endian, each at a 64-byte
aligned offset (memory-mapped on read):

- ``id``, ``parent_id`` (-1: none), ``start``, ``end``, ``track``: int64; ``level``: int16;
  ``name``: int32 index into ``names``; ``attr``: int32 index into the attribute sets;
- ``flops``: float64, the span's ``ml.flops`` (NaN when absent or not a number);
  ``has_flops`` (bool): whether it is set at all;
- uint8: ``names`` (a JSON list of strings), ``attr_blob`` (the attribute sets, each one
  JSON object, at ``attr_offsets``: int64, n+1), ``others`` (one events.jsonl batch line
  with the tracks, instants, counters and flows).
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from mltrace.run.events import Span
from mltrace.run.jsoncodec import dumps, trimmed
from mltrace.run.jsoncodec import loads as _loads
from mltrace.run.levels import Level

if TYPE_CHECKING:
    import numpy as np

TABLE_FILE = "spans.bin"
TABLE_VERSION = 2  # 2: the header names a CRC-32 of itself and the data

_LEVELS = {int(lv): lv for lv in Level}


def _flops_of(attrs: dict[str, Any]) -> tuple[bool, float]:
    """Whether ``ml.flops`` is set, and its value (NaN when it is not a number)."""
    f = attrs.get("ml.flops")
    if f is None:
        return False, math.nan
    return True, float(f) if isinstance(f, (int, float)) else math.nan


def parent_rows(ids: np.ndarray, parent_ids: np.ndarray) -> np.ndarray:
    """Row of each span's parent among ``ids`` (-1: no parent, given as -1, or one not among them;
    where an id is on several rows, the first)."""
    import numpy as np

    direct = _parent_rows_by_lookup(ids, parent_ids)
    if direct is not None:
        return direct
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    pos = np.searchsorted(sorted_ids, parent_ids)
    pos = np.minimum(pos, max(len(sorted_ids) - 1, 0))
    found = (parent_ids >= 0) & (sorted_ids[pos] == parent_ids) if len(sorted_ids) else parent_ids < -1
    return np.where(found, order[pos] if len(order) else -1, -1).astype(np.int64)


def _parent_rows_by_lookup(ids: np.ndarray, parent_ids: np.ndarray) -> np.ndarray | None:
    """``parent_rows`` through an array indexed by id, without sorting, where the ids are unique
    and no larger than a few times their number (a recorded run's: the session counts them
    from 1); None otherwise."""
    import numpy as np

    n = len(ids)
    if n == 0 or int(ids.min()) < 0 or int(ids.max()) > 4 * n + 1024:
        return None
    row_of = np.full(int(ids.max()) + 1, -1, dtype=np.int64)
    rows = np.arange(n, dtype=np.int64)
    row_of[ids] = rows
    if not np.array_equal(row_of[ids], rows):  # an id on several rows
        return None
    inside = (parent_ids >= 0) & (parent_ids < len(row_of))
    return np.where(inside, row_of[np.where(inside, parent_ids, 0)], -1)


class SpanTable:
    """Every span of a run as columns (see the module docstring).

    Attributes:
        id, parent_id, level, name, start, end, track, attr, flops, has_flops:
            one entry per span, in file order.
        names: the span names ``name`` indexes.
    """

    def __init__(
        self,
        columns: dict[str, np.ndarray],
        names: list[str],
        attr_sets: Sequence[dict[str, Any]] | None = None,
        attr_offsets: np.ndarray | None = None,
        attr_blob: Any = None,
    ) -> None:
        self.id = columns["id"]
        self.parent_id = columns["parent_id"]
        self.level = columns["level"]
        self.name = columns["name"]
        self.start = columns["start"]
        self.end = columns["end"]
        self.track = columns["track"]
        self.attr = columns["attr"]
        self.flops = columns["flops"]
        self.has_flops = columns["has_flops"]
        self.names = names
        self._sets: list[dict[str, Any] | None]
        if attr_sets is not None:
            self._sets = list(attr_sets)
        else:
            assert attr_offsets is not None and attr_blob is not None
            self._sets = [None] * (len(attr_offsets) - 1)
        self._offsets = attr_offsets
        self._blob = attr_blob
        self._parent_row: np.ndarray | None = None
        self.cache: dict[str, Any] = {}  # derived structure (e.g. the span tree), computed once

    def __len__(self) -> int:
        return len(self.id)

    # -- attributes ------------------------------------------------------------

    def attr_set(self, k: int) -> dict[str, Any]:
        """Attribute set ``k``, decoded on first use (shared: do not modify)."""
        got = self._sets[k]
        if got is None:
            assert self._offsets is not None and self._blob is not None
            got = self._sets[k] = _loads(bytes(self._blob[int(self._offsets[k]) : int(self._offsets[k + 1])]))
        return got

    def attrs(self, row: int) -> dict[str, Any]:
        """The attributes of the span in ``row`` (shared: do not modify)."""
        return self.attr_set(int(self.attr[row]))

    @property
    def attr_set_count(self) -> int:
        return len(self._sets)

    # -- structure --------------------------------------------------------------

    def parent_row(self) -> np.ndarray:
        """Row of each span's parent (-1: a root, or a parent not in the run)."""
        if self._parent_row is None:
            self._parent_row = parent_rows(self.id, self.parent_id)
        return self._parent_row

    def renamed(self, name: np.ndarray, names: list[str]) -> SpanTable:
        """This table with another name column and name list; every other column, the
        attribute sets and the parent rows are shared."""
        columns = {c: getattr(self, c) for c in ("id", "parent_id", "level", "start", "end", "track", "attr", "flops", "has_flops")}
        columns["name"] = name
        table = SpanTable(columns, names, attr_sets=[], attr_offsets=self._offsets, attr_blob=self._blob)
        table._sets = self._sets  # decoded once for both
        table._parent_row = self._parent_row
        return table

    # -- conversions ------------------------------------------------------------

    @classmethod
    def from_spans(cls, spans: Sequence[Span]) -> SpanTable:
        """Columns of in-memory spans (each span's own attribute map is its set)."""
        import numpy as np

        n = len(spans)
        names: dict[str, int] = {}
        name_idx = [names.setdefault(s.name, len(names)) for s in spans]
        has_flops = np.zeros(n, dtype=bool)
        flops = np.full(n, np.nan, dtype=np.float64)
        for i, s in enumerate(spans):
            if "ml.flops" in s.attrs:
                has_flops[i], flops[i] = _flops_of(s.attrs)
        columns: dict[str, np.ndarray] = {
            "id": np.fromiter((s.id for s in spans), dtype=np.int64, count=n),
            "parent_id": np.fromiter((-1 if s.parent_id is None else s.parent_id for s in spans), dtype=np.int64, count=n),
            "level": np.fromiter((int(s.level) for s in spans), dtype=np.int16, count=n),
            "name": np.asarray(name_idx, dtype=np.int32),
            "start": np.fromiter((s.start_ns for s in spans), dtype=np.int64, count=n),
            "end": np.fromiter((s.end_ns for s in spans), dtype=np.int64, count=n),
            "track": np.fromiter((s.track_id for s in spans), dtype=np.int64, count=n),
            "attr": np.arange(n, dtype=np.int32),
            "flops": flops,
            "has_flops": has_flops,
        }
        return cls(columns, list(names), attr_sets=[s.attrs for s in spans])

    def to_spans(self) -> list[Span]:
        """The spans as objects; spans with the same attributes share one dict (see ``Span``)."""
        levels = _LEVELS
        names = self.names
        sets = [self.attr_set(k) for k in range(self.attr_set_count)]
        out = []
        for sid, pid, lv, nm, st, en, tr, at in zip(
            self.id.tolist(),
            self.parent_id.tolist(),
            self.level.tolist(),
            self.name.tolist(),
            self.start.tolist(),
            self.end.tolist(),
            self.track.tolist(),
            self.attr.tolist(),
        ):
            out.append(Span(sid, None if pid < 0 else pid, levels[lv], names[nm], st, en, tr, sets[at]))
        return out


# -- the file -----------------------------------------------------------------------

_MAGIC = b"MLTRACE-SPANS\n"
_ALIGN = 64
_COLUMNS = ("id", "parent_id", "level", "name", "start", "end", "track", "attr", "flops", "has_flops", "attr_offsets")
_DTYPES = {
    "id": "<i8",
    "parent_id": "<i8",
    "level": "<i2",
    "name": "<i4",
    "start": "<i8",
    "end": "<i8",
    "track": "<i8",
    "attr": "<i4",
    "flops": "<f8",
    "has_flops": "|b1",
    "attr_offsets": "<i8",
    "attr_blob": "|u1",
    "names": "|u1",
    "others": "|u1",
}


def _stamp(events: Path) -> dict[str, int]:
    st = events.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_table(path: Path, spans: Sequence[Span], others: bytes, events: Path) -> SpanTable:
    """Writes ``spans`` (and the other events, as one batch line) to ``path`` atomically, and
    returns them as a table (``TableWriter.write``).

    Attribute maps that serialise identically are stored once (keys are not
    sorted first: a source writes its keys in one order, and sorting tripled
    the cost).
    """
    writer = TableWriter()
    writer.add(spans)
    return writer.write(path, others, events)


class TableWriter:
    """Builds ``spans.bin`` a part of the run at a time (``add``), then writes it (``write``):
    the columns of each part, and each attribute set encoded once, as ``write_table`` does
    for a whole run."""

    def __init__(self, spill: Path | None = None) -> None:
        self._parts: list[dict[str, np.ndarray]] = []
        self._names: dict[str, int] = {}
        self._index: dict[bytes, int] = {}
        self._blobs: list[bytes] = []
        self._blob_count = 0
        self._blob_end = 0
        #: With ``spill``, each array's parts go to a file of its own (``<spill>.<array>.streamed.tmp``)
        #: as they are added, and only the attribute sets' index stays in memory (at most
        #: ``_INDEX_MAX`` of them: a set seen again after that is stored again).
        self._spills: dict[str, _Spill] | None = None
        if spill is not None:
            self._spills = {key: _Spill(spill.with_name(f"{spill.name}.{key}.streamed.tmp"), key) for key in _SPILLED}
            self._spills["attr_offsets"].append(bytes(8))  # the first set's start: 0
        self.rows = 0

    def add(self, spans: Sequence[Span]) -> None:
        """Appends the rows of ``spans``."""
        import numpy as np

        n = len(spans)
        names, index = self._names, self._index
        attr = np.empty(n, dtype=np.int32)
        has_flops = np.zeros(n, dtype=bool)
        flops = np.full(n, np.nan, dtype=np.float64)
        by_dict: dict[int, int] = {}  # id of an attribute dict (shared by a layer's calls) → its set
        for i, s in enumerate(spans):
            a = s.attrs
            k = by_dict.get(id(a))  # the spans keep their dicts alive: ids stay theirs
            if k is None:
                b = dumps(a)
                k = index.get(b)
                if k is None:
                    k = self._new_set(trimmed(b))
                by_dict[id(a)] = k
            attr[i] = k
            if "ml.flops" in a:
                has_flops[i], flops[i] = _flops_of(a)
        part: dict[str, np.ndarray] = {
            "id": np.fromiter((s.id for s in spans), dtype=np.int64, count=n),
            "parent_id": np.fromiter((-1 if s.parent_id is None else s.parent_id for s in spans), dtype=np.int64, count=n),
            "level": np.fromiter((int(s.level) for s in spans), dtype=np.int16, count=n),
            "name": np.fromiter((names.setdefault(s.name, len(names)) for s in spans), dtype=np.int32, count=n),
            "start": np.fromiter((s.start_ns for s in spans), dtype=np.int64, count=n),
            "end": np.fromiter((s.end_ns for s in spans), dtype=np.int64, count=n),
            "track": np.fromiter((s.track_id for s in spans), dtype=np.int64, count=n),
            "attr": attr,
            "flops": flops,
            "has_flops": has_flops,
        }
        if self._spills is None:
            self._parts.append(part)
        else:
            for key, column in part.items():
                self._spills[key].append(np.ascontiguousarray(column, dtype=_DTYPES[key]).tobytes())
        self.rows += n

    def _new_set(self, blob: bytes) -> int:
        """Stores a new attribute set; its index."""
        k = self._blob_count
        self._blob_count += 1
        if self._spills is None:
            self._index[blob] = k
            self._blobs.append(blob)
            return k
        if len(self._index) >= _INDEX_MAX:
            self._index.clear()
        self._index[blob] = k
        self._blob_end += len(blob)
        self._spills["attr_blob"].append(blob)
        self._spills["attr_offsets"].append(self._blob_end.to_bytes(8, "little", signed=True))
        return k

    def write(self, path: Path, others: bytes, events: Path) -> SpanTable:
        """Writes the table of every part added (and ``others``, the run's other events as one
        batch line) to ``path`` atomically, and returns it memory-mapped, as ``read_table`` does
        (``events`` is the events.jsonl it stands for). The parts are written one after the
        other, never joined in memory."""
        import numpy as np

        pieces: dict[str, list[Any]]
        if self._spills is None:
            blobs = self._blobs
            offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
            if blobs:
                np.cumsum([len(b) for b in blobs], out=offsets[1:])
            pieces = {c: [p[c] for p in self._parts] for c in _COLUMNS if c != "attr_offsets"}
            pieces["attr_offsets"] = [offsets]
            pieces["attr_blob"] = blobs
        else:
            pieces = {key: [self._spills[key]] for key in _SPILLED}
        pieces["names"] = [json.dumps(list(self._names)).encode()]
        pieces["others"] = [others]
        try:
            base, placed = _write_arrays(path, pieces, events)
        finally:
            self.discard()
        arrays = _mapped(path, base, placed)
        columns = {c: arrays[c] for c in _COLUMNS if c != "attr_offsets"}
        return SpanTable(columns, list(self._names), attr_offsets=arrays["attr_offsets"], attr_blob=arrays["attr_blob"])

    def discard(self) -> None:
        """Removes the spilled parts' files (none without ``spill``)."""
        for spill in (self._spills or {}).values():
            spill.remove()


#: The arrays a spilling ``TableWriter`` keeps in files until the end, in the file's order.
_SPILLED = (*(c for c in _COLUMNS if c != "attr_offsets"), "attr_offsets", "attr_blob")
#: Attribute sets a spilling ``TableWriter`` remembers, to store each once.
_INDEX_MAX = 65536


class _Spill:
    """One array's parts, appended to a file of their own until the table is written."""

    def __init__(self, path: Path, key: str) -> None:
        import numpy as np

        self.path = path
        self.itemsize = np.dtype(_DTYPES[key]).itemsize
        self._file: IO[bytes] | None = open(path, "wb")  # noqa: SIM115 - closed in remove()
        self.size = 0
        self.crc = 0  # of the bytes so far: the table's checksum takes it whole (crc32_combine)

    def append(self, raw: bytes) -> None:
        assert self._file is not None
        self._file.write(raw)
        self.size += len(raw)
        self.crc = zlib.crc32(raw, self.crc)

    def copy_to(self, out: IO[bytes]) -> None:
        """Appends its bytes to ``out`` (flushed first), copied by the kernel where it can."""
        if self._file is not None:
            self._file.flush()
        out.flush()
        with open(self.path, "rb") as f:
            done = 0
            try:
                while done < self.size:
                    n = os.copy_file_range(f.fileno(), out.fileno(), self.size - done)
                    if n <= 0:
                        break
                    done += n
            except (AttributeError, OSError):  # no copy_file_range here: the rest through memory
                pass
            f.seek(done)
            while chunk := f.read(1 << 22):
                out.write(chunk)

    def __len__(self) -> int:
        return self.size // self.itemsize

    def remove(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.path.unlink(missing_ok=True)


def _write_arrays(path: Path, pieces: dict[str, list[Any]], events: Path) -> tuple[int, dict[str, list[Any]]]:
    """Writes the file (atomically): magic, header length (8 bytes), JSON header (padded with
    spaces to the length it has with the widest checksum), then each array, from its pieces in
    order, at a 64-byte aligned offset the header names (dtype, offset, count). Returns where
    the data begins and the header's ``arrays``."""
    import numpy as np

    placed: dict[str, list[Any]] = {}
    offset = 0
    for key, parts in pieces.items():
        count = sum(len(p) for p in parts)
        placed[key] = [_DTYPES[key], offset, count]
        offset += -(-(count * np.dtype(_DTYPES[key]).itemsize) // _ALIGN) * _ALIGN
    fields: dict[str, Any] = {"format": "mltrace-spans", "version": TABLE_VERSION, "events": _stamp(events), "arrays": placed}
    widest = len(json.dumps({**fields, "checksum": 0xFFFFFFFF}).encode())
    base = -(-(len(_MAGIC) + 8 + widest) // _ALIGN) * _ALIGN
    checksum = zlib.crc32(json.dumps(fields).encode())
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.seek(base)
        for key, parts in pieces.items():  # the data region as the file holds it: each array, zero-padded to the next
            size = 0
            for part in parts:
                if isinstance(part, _Spill):
                    part.copy_to(f)
                    checksum = crc32_combine(checksum, part.crc, part.size)
                    size += part.size
                    continue
                raw = part if isinstance(part, bytes) else np.ascontiguousarray(part, dtype=_DTYPES[key]).tobytes()
                checksum = zlib.crc32(raw, checksum)
                f.write(raw)
                size += len(raw)
            pad = bytes(-size % _ALIGN)
            checksum = zlib.crc32(pad, checksum)
            f.write(pad)
        header = json.dumps({**fields, "checksum": checksum}).encode().ljust(widest)
        f.seek(0)
        f.write(_MAGIC + len(header).to_bytes(8, "little") + header)
    os.replace(tmp, path)
    return base, placed


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from A's (``crc1``), B's (``crc2``) and B's length, as zlib's
    ``crc32_combine`` computes it (which Python's zlib does not offer): ``crc1`` is carried
    through ``len2`` zero bytes by the GF(2) operators of 2^k zero bytes, then B's CRC is added."""
    k = 0
    while len2 > 0:
        if len2 & 1:
            crc1 = _gf2_times(_zero_bytes_operator(k), crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


_ZERO_OPERATORS: list[list[int]] = []


def _zero_bytes_operator(k: int) -> list[int]:
    """The operator that carries a CRC-32 through 2^k zero bytes (made once, by squaring)."""
    if not _ZERO_OPERATORS:
        op = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
        for _ in range(3):
            op = _gf2_square(op)
        _ZERO_OPERATORS.append(op)  # one zero byte
    while len(_ZERO_OPERATORS) <= k:
        _ZERO_OPERATORS.append(_gf2_square(_ZERO_OPERATORS[-1]))
    return _ZERO_OPERATORS[k]


def _gf2_times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, row) for row in matrix]


def _mapped(path: Path, base: int, placed: dict[str, Any]) -> dict[str, Any]:
    """The arrays of the file at ``path`` that ``placed`` (its header's ``arrays``) names,
    memory-mapped (ValueError: one that lies beyond the file's end)."""
    import numpy as np

    size = path.stat().st_size
    arrays: dict[str, Any] = {}
    for key, (dtype, offset, count) in placed.items():
        dt = np.dtype(dtype)
        if base + offset + count * dt.itemsize > size:
            raise ValueError(f"{key} lies beyond the end of {path.name}")
        arrays[key] = np.memmap(path, dtype=dt, mode="r", offset=base + offset, shape=(count,)) if count else np.zeros(0, dt)
    return arrays


def _checksum_matches(path: Path, header: dict[str, Any], base: int) -> bool:
    """Whether the CRC-32 the header names is that of the header's other fields and of every
    byte from ``base`` on (a flipped bit anywhere, or a truncated file, gives another)."""
    expected = header.pop("checksum", None)
    if not isinstance(expected, int):
        return False
    checksum = zlib.crc32(json.dumps(header).encode())
    with open(path, "rb") as f:
        f.seek(base)
        while chunk := f.read(1 << 22):
            checksum = zlib.crc32(chunk, checksum)
    return checksum == expected


def read_table(path: Path, events: Path, verify: bool = True) -> tuple[SpanTable, bytes] | None:
    """The table in ``path`` and its other-events line, or None when missing, foreign or stale
    (or, with ``verify``, damaged: its CRC-32 checked over the whole file).

    Columns are memory-mapped: pages are read when analysis touches them.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(len(_MAGIC) + 8)
            if head[: len(_MAGIC)] != _MAGIC:
                return None
            length = int.from_bytes(head[len(_MAGIC) :], "little")
            if length > os.fstat(f.fileno()).st_size:  # a damaged length: reading it would allocate it all
                return None
            header = json.loads(f.read(length))
        if header.get("format") != "mltrace-spans" or header.get("version") != TABLE_VERSION:
            return None
        if header.get("events") != _stamp(events):
            return None
        base = -(-(len(_MAGIC) + 8 + int.from_bytes(head[len(_MAGIC) :], "little")) // _ALIGN) * _ALIGN
        if verify and not _checksum_matches(path, header, base):
            return None
        arrays = _mapped(path, base, header["arrays"])
        columns = {k: arrays[k] for k in _COLUMNS if k != "attr_offsets"}
        names = json.loads(arrays["names"].tobytes())
        others = arrays["others"].tobytes()
        offsets = arrays["attr_offsets"]
        blob = arrays["attr_blob"]
    except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError, AttributeError):
        return None
    n = len(columns["id"])
    if any(len(c) != n for c in columns.values()) or len(offsets) < 1:
        return None
    if n and (int(columns["attr"].max()) >= len(offsets) - 1 or int(columns["name"].max()) >= len(names)):
        return None
    return SpanTable(columns, names, attr_offsets=offsets, attr_blob=blob), others
