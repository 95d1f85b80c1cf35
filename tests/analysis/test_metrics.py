"""TTA and ATTMT from training logs, and the metric logger's counter track."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mltrace
from mltrace.analysis.metrics import MetricLogError, parse_thresholds, read_metric_log, time_to_threshold, tta_table
from mltrace.bench import MetricLogger
from mltrace.run.events import TrackKind

DATA = Path(__file__).resolve().parent.parent / "data" / "metrics"

#: The seed's table for one configuration (accuracy %: TTA → ATTMT).
SEED = [
    (70, 364, 364.0),
    (71, 364, 364.0),
    (72, 424, 384.0),
    (73, 424, 394.0),
    (74, 504, 416.0),
    (75, 664, 457.3),
    (76, 704, 492.6),
    (77, 804, 531.5),
]


@pytest.mark.parametrize("name", ["seed_tta.csv", "seed_tta.jsonl"])
def test_seed_reference_column_is_reproduced(name: str) -> None:
    log = read_metric_log(DATA / name)
    assert log.metric == "accuracy" and log.time_column == "time"
    assert len(log.points) == 16
    rows = tta_table(log.points, parse_thresholds("70:77:1"))
    assert [r.threshold for r in rows] == [t for t, _, _ in SEED]
    assert [r.tta for r in rows] == [float(tta) for _, tta, _ in SEED]
    for row, (_, _, attmt) in zip(rows, SEED):
        assert row.attmt == pytest.approx(attmt, abs=0.05)  # the seed prints one decimal


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("70:77:1", [70.0, 71.0, 72.0, 73.0, 74.0, 75.0, 76.0, 77.0]),
        ("0.5:0.8:0.1", [0.5, 0.6, 0.7, 0.8]),  # decimal steps include STOP exactly
        ("1:2:0.4", [1.0, 1.4, 1.8]),
        ("5:5:1", [5.0]),
        ("70, 72.5,75", [70.0, 72.5, 75.0]),
        ("80", [80.0]),
    ],
)
def test_parse_thresholds(spec: str, expected: list[float]) -> None:
    assert parse_thresholds(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("77:70:1", "below START"),
        ("70:77:0", "STEP must be positive"),
        ("70:77:-1", "STEP must be positive"),
        ("a:b:c", "must be numbers"),
        ("70:77", "START:STOP:STEP"),
        ("0:100:0.00001", "at most"),
        ("nan:1:1", "finite"),
        ("", "no thresholds"),
    ],
)
def test_bad_thresholds(spec: str, message: str) -> None:
    with pytest.raises(MetricLogError, match=message):
        parse_thresholds(spec)


def test_unreached_threshold_makes_attmt_undefined_from_there() -> None:
    points = [(10.0, 50.0), (20.0, 60.0), (30.0, 55.0)]
    rows = tta_table(points, [50.0, 60.0, 61.0, 62.0])
    assert [(r.tta, r.attmt) for r in rows] == [(10.0, 10.0), (20.0, 15.0), (None, None), (None, None)]


def test_first_time_not_first_row_and_unsorted_times() -> None:
    # The log is out of time order; the earliest time reaching θ wins.
    points = [(30.0, 0.9), (10.0, 0.2), (20.0, 0.95)]
    assert time_to_threshold(points, 0.9) == 20.0
    assert time_to_threshold(points, 0.96) is None


def test_lower_is_better_loss() -> None:
    log = read_metric_log(DATA / "seed_tta.csv", metric="loss")
    rows = tta_table(log.points, [1.0, 0.8, 0.7], higher_is_better=False)
    assert [r.tta for r in rows] == [304.0, 484.0, 744.0]
    assert rows[-1].attmt == pytest.approx((304 + 484 + 744) / 3)


def test_explicit_time_column_and_semicolon_csv(tmp_path: Path) -> None:
    log_file = tmp_path / "log.csv"
    log_file.write_text("epoch;minutes;top1\n1;5;40\n2;9;;\n3;14;71.5\n")
    log = read_metric_log(log_file, metric="top1", time_column="minutes")
    assert log.points == [(5.0, 40.0), (14.0, 71.5)]  # the blank value is skipped
    with pytest.raises(MetricLogError, match="no time column 'wall'"):
        read_metric_log(log_file, metric="top1", time_column="wall")


@pytest.mark.parametrize(
    ("content", "suffix", "message"),
    [
        ("step,accuracy\n1,50\n", ".csv", "no time column"),
        ("time,acc\n1,50\n", ".csv", "no metric column 'accuracy'"),
        ("time,accuracy\n1,fifty\n", ".csv", r"log\.csv:2: metric 'accuracy' 'fifty' is not a number"),
        ('{"time": 1, "accuracy": 50}\n[1, 2]\n', ".jsonl", r"log\.jsonl:2: not a JSON object"),
        ('{"time": 1, "loss": 2}\n', ".jsonl", "no record has metric 'accuracy'"),
        ('{"time": true, "accuracy": 3}\n', ".jsonl", "boolean"),
    ],
)
def test_log_errors_name_the_place(tmp_path: Path, content: str, suffix: str, message: str) -> None:
    path = tmp_path / f"log{suffix}"
    path.write_text(content)
    with pytest.raises(MetricLogError, match=message):
        read_metric_log(path)


def test_missing_log_and_sniffed_format(tmp_path: Path) -> None:
    with pytest.raises(MetricLogError, match="no such log file"):
        read_metric_log(tmp_path / "nope.csv")
    sniffed = tmp_path / "train.log"
    sniffed.write_text('{"elapsed": 3.5, "accuracy": 0.7}\n')
    assert read_metric_log(sniffed).points == [(3.5, 0.7)]
    with pytest.raises(MetricLogError, match="without metrics.jsonl"):
        read_metric_log(tmp_path)


def test_metric_logger_writes_counter_track_and_run_metrics(tmp_path: Path) -> None:
    out = tmp_path / "run"
    values = [41.5, 62.0, 71.2, 73.1]
    with mltrace.profile(output=out, summary=False, level="model"):
        logger = MetricLogger()
        for v in values:
            logger.log(accuracy=v, loss=100 - v)
    run = mltrace.load_run(out)
    tracks = {t.name: t for t in run.tracks.values() if t.kind == TrackKind.COUNTER and t.name.startswith("metric.")}
    assert set(tracks) == {"metric.accuracy", "metric.loss"}  # other counters (CPU, GPU) may be recorded too
    acc = [c.value for c in run.counters if c.track_id == tracks["metric.accuracy"].id]
    assert acc == values
    log = read_metric_log(out)  # the run directory stands for its metrics.jsonl
    assert [v for _, v in log.points] == values
    times = [t for t, _ in log.points]
    assert times == sorted(times) and times[0] >= 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    rows = tta_table(log.points, [70.0, 72.0])
    assert rows[0].tta == times[2] and rows[1].tta == times[3]


def test_metric_logger_outside_a_session(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    logger = MetricLogger(path)
    logger.log(step=7, accuracy=0.5)
    assert json.loads(path.read_text())["step"] == 7
    assert MetricLogger().path is None  # nowhere to write, and no error
