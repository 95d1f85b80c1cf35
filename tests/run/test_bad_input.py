"""Each malformed input the hard-stops issue (28) measured, as a user meets it through the CLI:
a result that is right, or one ``mltrace: error:`` line naming the file, exit 2."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mltrace import cli
from mltrace.run.store import RunError, load_run
from mltrace.run.table import TABLE_FILE

KINETO = Path(__file__).resolve().parent.parent / "data" / "kineto"


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mltrace.importers import import_kineto

    out = tmp_path_factory.mktemp("bad") / "clean"
    import_kineto(KINETO / "cpu_modules_torch.json.gz", out)
    return out


@pytest.fixture
def run_copy(clean_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(clean_run, out)
    return out


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(list(args))
    return status, out.getvalue(), err.getvalue()


def _refused(run_dir: Path, file: str, words: str) -> None:
    status, _, err = _cli("report", str(run_dir))
    assert status == 2, err
    assert err.count("\n") == 1 and err.startswith("mltrace: error: ") and file in err and words in err, err


def test_a_flipped_span_table_is_rebuilt_not_believed(clean_run: Path, run_copy: Path) -> None:
    """One span's end moved by 20 s in spans.bin (events.jsonl untouched): the CRC-32 no longer
    matches, the table is ignored, and the spans are events.jsonl's."""
    before = load_run(clean_run)
    header_len = int.from_bytes((run_copy / TABLE_FILE).read_bytes()[14:22], "little")
    header = json.loads((run_copy / TABLE_FILE).read_bytes()[22 : 22 + header_len])
    base = -(-(22 + header_len) // 64) * 64
    _, offset, count = header["arrays"]["end"]
    assert count == before.span_count
    ends = np.memmap(run_copy / TABLE_FILE, dtype="<i8", mode="r+", offset=base + offset, shape=(count,))
    ends[0] += 20_000_000_000
    ends.flush()
    del ends
    after = load_run(run_copy)
    assert [(s.id, s.start_ns, s.end_ns) for s in after.spans] == [(s.id, s.start_ns, s.end_ns) for s in before.spans]


def test_truncated_events_of_a_complete_run_say_so(run_copy: Path) -> None:
    events = run_copy / "events.jsonl"
    lines = events.read_bytes().split(b"\n")
    events.write_bytes(b"\n".join(lines[:1]) + b"\n")  # cut at a line's end: no torn line to see
    _refused(run_copy, "events.jsonl", "truncated")


@pytest.mark.parametrize(
    ("value", "words"),
    [(None, "the start of span"), (2**70, "the start of span"), (-5, "ends (")],
)
def test_a_bad_number_in_events_is_one_line(run_copy: Path, value: object, words: str) -> None:
    events = run_copy / "events.jsonl"
    lines = events.read_text().split("\n")
    for i, line in enumerate(lines):
        obj = json.loads(line) if line else {}
        if obj.get("spans"):
            row = obj["spans"][0]
            if words == "ends (":
                row[5] = row[4] + value  # type: ignore[operator]
            else:
                row[4] = value
            lines[i] = json.dumps(obj)
            break
    events.write_text("\n".join(lines))
    meta = json.loads((run_copy / "run.json").read_text())
    meta["events_bytes"] = events.stat().st_size
    (run_copy / "run.json").write_text(json.dumps(meta))
    (run_copy / TABLE_FILE).unlink()
    _refused(run_copy, f"events.jsonl:{i + 1}", words)


def test_deeply_nested_run_json_is_one_line(run_copy: Path) -> None:
    meta = (run_copy / "run.json").read_text()
    (run_copy / "run.json").write_text(meta.replace('"limitations": []', '"limitations": ' + "[" * 100_000 + "]" * 100_000))
    _refused(run_copy, "run.json", "nested too deeply")


@pytest.mark.parametrize(("key", "value"), [("clock", 5), ("levels", None), ("complete", "yes"), ("duration_ns", 2**70)])
def test_a_run_json_field_of_another_type_is_one_line(run_copy: Path, key: str, value: object) -> None:
    meta = json.loads((run_copy / "run.json").read_text())
    meta[key] = value
    (run_copy / "run.json").write_text(json.dumps(meta))
    _refused(run_copy, "run.json", repr(key))


def _kineto(tmp_path: Path, change: dict[str, object]) -> Path:
    trace = json.loads(gzip.decompress((KINETO / "cpu_modules_torch.json.gz").read_bytes()))
    trace.update(change)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace).replace('"@@NESTED@@"', "[" * 1000 + "1" + "]" * 1000))
    return path


NESTED = "@@NESTED@@"  # a list 1,000 deep (written as text: json.dumps cannot)


@pytest.mark.parametrize(
    "change",
    [
        {"deviceProperties": 5},
        {"deviceProperties": [{"id": 0, "name": "GPU", "totalGlobalMem": NESTED}]},
        {"deviceProperties": [{"id": [1], "name": {"a": 1}, "computeMajor": 9, "computeMinor": None}]},
    ],
)
def test_kineto_device_properties_of_any_shape_import(tmp_path: Path, change: dict[str, object]) -> None:
    out = tmp_path / "run"
    status, _, err = _cli("import", str(_kineto(tmp_path, change)), "-o", str(out))
    assert status == 0, err
    assert _cli("report", str(out))[0] == 0
    assert load_run(out).complete


def test_a_kineto_pid_beyond_32_bits_still_exports(tmp_path: Path) -> None:
    trace = json.loads(gzip.decompress((KINETO / "cpu_modules_torch.json.gz").read_bytes()))
    for event in trace["traceEvents"]:
        if isinstance(event, dict) and "pid" in event and isinstance(event["pid"], int):
            event["pid"] = 2**32 + event["pid"]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    out = tmp_path / "run"
    status, _, err = _cli("import", str(path), "-o", str(out))
    assert status == 0, err
    for fmt in ("perfetto", "chrome-json", "jaeger-json"):
        status, _, err = _cli("export", str(out), "--format", fmt, "-o", str(tmp_path / f"out.{fmt}"))
        assert status == 0, f"{fmt}: {err}"


def test_a_refused_import_leaves_no_directory(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text('{"traceEvents": 5}')
    out = tmp_path / "run"
    status, _, err = _cli("import", str(path), "-o", str(out))
    assert status == 2 and err.startswith("mltrace: error:"), err
    assert not out.exists()


def test_load_run_raises_run_error_not_internal_errors(run_copy: Path) -> None:
    (run_copy / "events.jsonl").write_bytes(b'{"spans": [[1, null, 1, "x", 0, 1, 1, {}]]}\n{"spans": 5}\n{}\n')
    meta = json.loads((run_copy / "run.json").read_text())
    meta["complete"] = False
    (run_copy / "run.json").write_text(json.dumps(meta))
    (run_copy / TABLE_FILE).unlink()
    with pytest.raises(RunError, match=r"events.jsonl:2: corrupt event line \('spans' is 5, not a list\)"):
        load_run(run_copy)


def test_a_span_table_with_a_huge_header_length_is_rebuilt(clean_run: Path, run_copy: Path) -> None:
    """A flipped high byte in the header's length: reading it would ask for exabytes."""
    data = bytearray((run_copy / TABLE_FILE).read_bytes())
    data[21] ^= 0x40  # the length's top byte (little-endian, bytes 14..21)
    (run_copy / TABLE_FILE).write_bytes(bytes(data))
    assert _cli("report", str(run_copy))[0] == 0
    assert load_run(run_copy).span_count == load_run(clean_run).span_count
