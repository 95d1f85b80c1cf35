"""Time-to-accuracy (TTA) and average time to multiple thresholds (ATTMT).

A training log is a sequence of (time, metric) points. For thresholds
θ_1 < θ_2 < … < θ_K:

- ``TTA(θ_k)`` is the earliest time at which the metric reaches θ_k
  (``value >= θ_k``; ``value <= θ_k`` for a lower-is-better metric such as
  loss), in the log's own time unit.
- ``ATTMT(θ_k)`` is the mean of ``TTA(θ_1) … TTA(θ_k)``. It is undefined
  (None) from the first threshold that is never reached on, because a mean
  over a missing time would understate it.

Logs are CSV (with a header row) or JSON Lines (one object per line; lines
without the metric are skipped, so loss and accuracy records can share a
file). A run directory stands for its ``metrics.jsonl``, which
``mltrace.bench.MetricLogger`` writes while a session runs.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

#: Column names tried, in order, when the log's time column is not named.
TIME_COLUMNS = ("time", "time_s", "elapsed", "elapsed_s", "seconds", "wall_time", "timestamp", "t")

#: The file a run directory keeps its logged metrics in.
RUN_METRICS_FILE = "metrics.jsonl"

#: Most thresholds one request may ask for (a typo such as 0:100:0.0001 would
#: otherwise build a million-row table).
MAX_THRESHOLDS = 10_000


class MetricLogError(ValueError):
    """A log or a threshold specification that cannot be used (message for the user)."""


@dataclass(frozen=True)
class MetricLog:
    """The points of one metric read from a training log.

    Attributes:
        source: the file read.
        metric: the metric's column name.
        time_column: the time column's name.
        points: (time, value) pairs in file order; time in the log's unit.
    """

    source: str
    metric: str
    time_column: str
    points: list[tuple[float, float]]


@dataclass(frozen=True)
class TtaRow:
    """One threshold of the TTA/ATTMT table.

    Attributes:
        threshold: θ_k, in the metric's unit.
        tta: first time the metric reaches θ_k (log's time unit); None if never.
        attmt: mean of TTA(θ_1 … θ_k); None if any of them is None.
    """

    threshold: float
    tta: float | None
    attmt: float | None


def parse_thresholds(spec: str) -> list[float]:
    """Parses ``START:STOP:STEP`` into the thresholds START, START+STEP, … ≤ STOP.

    Decimal arithmetic keeps ``0.5:0.8:0.1`` exact (0.8 is included). A single
    number or a comma list (``70,72.5,75``) is also accepted.

    Raises:
        MetricLogError: for a malformed spec, a non-positive step, STOP < START,
            or more than ``MAX_THRESHOLDS`` thresholds.
    """
    text = spec.strip()
    try:
        if ":" not in text:
            values = [Decimal(p.strip()) for p in text.split(",") if p.strip()]
            if not values:
                raise MetricLogError("no thresholds given")
            return [float(v) for v in values]
        parts = text.split(":")
        if len(parts) != 3:
            raise MetricLogError(f"thresholds must be START:STOP:STEP, not {spec!r}")
        start, stop, step = (Decimal(p.strip()) for p in parts)
    except InvalidOperation:
        raise MetricLogError(f"thresholds must be numbers (START:STOP:STEP), not {spec!r}") from None
    if not all(v.is_finite() for v in (start, stop, step)):
        raise MetricLogError(f"thresholds must be finite numbers, not {spec!r}")
    if step <= 0:
        raise MetricLogError(f"threshold STEP must be positive, not {step}")
    if stop < start:
        raise MetricLogError(f"threshold STOP ({stop}) is below START ({start})")
    count = int((stop - start) / step) + 1
    if count > MAX_THRESHOLDS:
        raise MetricLogError(f"{count} thresholds requested; at most {MAX_THRESHOLDS}")
    return [float(start + i * step) for i in range(count)]


def _number(raw: object, what: str, where: str) -> float | None:
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    if isinstance(raw, bool):
        raise MetricLogError(f"{where}: {what} is a boolean, not a number")
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise MetricLogError(f"{where}: {what} {raw!r} is not a number") from None
    if math.isnan(value):
        return None
    return value


def _pick_time_column(columns: list[str], wanted: str | None, source: str) -> str:
    if wanted is not None:
        if wanted not in columns:
            raise MetricLogError(f"{source}: no time column {wanted!r} (columns: {', '.join(columns) or 'none'})")
        return wanted
    for name in TIME_COLUMNS:
        if name in columns:
            return name
    raise MetricLogError(
        f"{source}: no time column (looked for {', '.join(TIME_COLUMNS)}; columns: {', '.join(columns) or 'none'}); "
        "name it with --time-column"
    )


def _read_csv(path: Path, metric: str, time_column: str | None) -> MetricLog:
    with open(path, newline="", encoding="utf-8") as f:
        header = f.readline()
        f.seek(0)
        # The header decides the delimiter: data rows may have blank cells that fool csv.Sniffer.
        delimiter = max((",", ";", "\t"), key=header.count)
        reader = csv.DictReader(f, delimiter=delimiter)
        columns = [c.strip() for c in (reader.fieldnames or [])]
        reader.fieldnames = columns
        tcol = _pick_time_column(columns, time_column, str(path))
        if metric not in columns:
            raise MetricLogError(f"{path}: no metric column {metric!r} (columns: {', '.join(columns)}); name it with --metric")
        points: list[tuple[float, float]] = []
        for row in reader:
            where = f"{path}:{reader.line_num}"
            t = _number(row.get(tcol), f"time {tcol!r}", where)
            v = _number(row.get(metric), f"metric {metric!r}", where)
            if t is not None and v is not None:
                points.append((t, v))
    return MetricLog(str(path), metric, tcol, points)


def _read_jsonl(path: Path, metric: str, time_column: str | None) -> MetricLog:
    records: list[tuple[int, dict[str, object]]] = []
    columns: list[str] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise MetricLogError(f"{path}:{number}: not a JSON object ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise MetricLogError(f"{path}:{number}: not a JSON object")
            for k in obj:
                if k not in columns:
                    columns.append(k)
            records.append((number, obj))
    tcol = _pick_time_column(columns, time_column, str(path))
    if metric not in columns:
        raise MetricLogError(f"{path}: no record has metric {metric!r} (keys: {', '.join(columns) or 'none'}); name it with --metric")
    points: list[tuple[float, float]] = []
    for number, obj in records:
        if metric not in obj:
            continue
        where = f"{path}:{number}"
        t = _number(obj.get(tcol), f"time {tcol!r}", where)
        v = _number(obj.get(metric), f"metric {metric!r}", where)
        if t is not None and v is not None:
            points.append((t, v))
    return MetricLog(str(path), metric, tcol, points)


def read_metric_log(path: str | Path, metric: str = "accuracy", time_column: str | None = None) -> MetricLog:
    """Reads one metric's (time, value) points from a CSV or JSONL log.

    Args:
        path: a ``.csv``/``.tsv`` file, a ``.jsonl``/``.json``/``.ndjson``
            file, any file whose first character tells (``{`` means JSONL), or
            a run directory holding ``metrics.jsonl``.
        metric: the metric's column (CSV) or key (JSONL).
        time_column: the time column; default: the first of ``TIME_COLUMNS``.

    Raises:
        MetricLogError: a missing file or column, or a non-numeric value.
    """
    p = Path(path)
    if p.is_dir():
        inner = p / RUN_METRICS_FILE
        if not inner.exists():
            raise MetricLogError(f"{p}: a directory without {RUN_METRICS_FILE} (log metrics with mltrace.bench.MetricLogger)")
        p = inner
    if not p.exists():
        raise MetricLogError(f"{p}: no such log file")
    suffix = p.suffix.lower()
    try:
        if suffix in (".jsonl", ".json", ".ndjson"):
            return _read_jsonl(p, metric, time_column)
        if suffix in (".csv", ".tsv"):
            return _read_csv(p, metric, time_column)
        with open(p, encoding="utf-8") as f:
            head = f.read(256).lstrip()
        return _read_jsonl(p, metric, time_column) if head.startswith("{") else _read_csv(p, metric, time_column)
    except UnicodeDecodeError:
        raise MetricLogError(f"{p}: not a text log") from None
    except OSError as exc:
        raise MetricLogError(f"{p}: {exc.strerror or exc}") from None


def time_to_threshold(points: list[tuple[float, float]], threshold: float, higher_is_better: bool = True) -> float | None:
    """The earliest time (log unit) at which the metric reaches ``threshold``; None if never."""
    best: float | None = None
    for t, v in points:
        reached = v >= threshold if higher_is_better else v <= threshold
        if reached and (best is None or t < best):
            best = t
    return best


def tta_table(points: list[tuple[float, float]], thresholds: list[float], higher_is_better: bool = True) -> list[TtaRow]:
    """TTA and ATTMT for each threshold, in the order given.

    ATTMT(θ_k) averages TTA over the first k thresholds as given, so pass them
    in the order the metric improves (ascending for accuracy, descending for
    loss) to get the seed's definition.
    """
    rows: list[TtaRow] = []
    total = 0.0
    defined = True
    for k, theta in enumerate(thresholds, 1):
        tta = time_to_threshold(points, theta, higher_is_better)
        if tta is None:
            defined = False
        else:
            total += tta
        rows.append(TtaRow(theta, tta, total / k if defined else None))
    return rows
