"""Property-based fuzzing of the readers: mutated run directories and Kineto traces.

Each example copies a small real run (imported from a Kineto fixture, so no framework runs),
mutates one of its files — a JSON value replaced by null, a huge or negative number, text,
a list, an object or a deep nesting; the file truncated; a byte flipped; bytes that are not
UTF-8 inserted — and runs the readers on it in this process: ``mltrace report``, ``mltrace
export --format chrome-json``, ``mltrace diff`` (the CLI's ``main``), ``load_run``, and
``mltrace import`` on a mutated Kineto trace. Every reader must give a result (exit 0), or one
``mltrace: error:`` line and exit 2; never an internal error (exit 1), an exception or a hang.
The examples are drawn from a fixed seed and bounded in number and time, so the test runs in CI.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mltrace import cli  # noqa: E402
from mltrace.run.store import RunError, load_run  # noqa: E402

#: Draws one value from a strategy (``st.composite``'s ``draw``, ``DataObject.draw``).
Draw = Callable[[Any], Any]
KINETO = Path(__file__).resolve().parent.parent / "data" / "kineto" / "cpu_modules_torch.json.gz"

#: Values a mutation puts in place of a JSON value.
VALUES: list[Any] = [None, 2**70, -1, -(2**63), 2**64, 1e308, -1e-300, "x", "", [], {}, True, 0, [1, [2]], {"a": None}]
FUZZ = settings(
    max_examples=60,
    deadline=None,  # each example runs a whole report; the pytest timeout bounds a hang
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete run with model, layer and op spans, its span table and Perfetto trace."""
    from mltrace.importers import import_kineto

    out = tmp_path_factory.mktemp("fuzz") / "base"
    import_kineto(KINETO, out)
    load_run(out, cache_table=True)
    assert {"run.json", "events.jsonl", "spans.bin"} <= {p.name for p in out.iterdir()}
    return out


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _replaced(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    cur = obj
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    return obj


def _nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def _mutate_json(data: bytes, draw: Draw) -> bytes:
    """One JSON value of one line (or of the whole document) replaced."""
    whole = data.startswith(b"{\n")  # run.json is indented: one document
    lines = [data] if whole else data.split(b"\n")
    i = draw(st.sampled_from([k for k, line in enumerate(lines) if line.strip()]))
    obj = json.loads(lines[i])
    path = draw(st.sampled_from(list(_paths(obj))))
    depth = draw(st.sampled_from([0, 0, 0, 60, 5000, 200_000]))
    if depth:
        text = json.dumps(_replaced(obj, path, "@@DEEP@@")).replace('"@@DEEP@@"', _nested(depth))
    else:
        text = json.dumps(_replaced(obj, path, draw(st.sampled_from(VALUES))))
    lines[i] = text.encode()
    return b"\n".join(lines)


def _mutate_bytes(data: bytes, draw: Draw) -> bytes:
    """The file truncated, a bit flipped, non-UTF-8 bytes inserted, or 8 bytes overwritten."""
    if not data:
        return b"\xff"
    pos = draw(st.integers(0, len(data) - 1))
    kind = draw(st.sampled_from(["truncate", "flip", "non-utf8", "overwrite"]))
    if kind == "truncate":
        return data[:pos]
    if kind == "flip":
        return data[:pos] + bytes([data[pos] ^ (1 << draw(st.integers(0, 7)))]) + data[pos + 1 :]
    if kind == "non-utf8":
        return data[:pos] + b"\xff\xfe\xc3" + data[pos:]
    return data[:pos] + draw(st.binary(min_size=8, max_size=8)) + data[pos + 8 :]


@st.composite
def mutated_run(draw: st.DrawFn, base: Path, dest: Path) -> str:
    """Copies ``base`` to ``dest`` with one file mutated; returns what was done (for the report)."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(base, dest)
    name = draw(st.sampled_from(["run.json", "events.jsonl", "events.jsonl", "spans.bin"]))
    path = dest / name
    data = path.read_bytes()
    as_json = name != "spans.bin" and draw(st.booleans())
    path.write_bytes(_mutate_json(data, draw) if as_json else _mutate_bytes(data, draw))
    stamp = (base / "events.jsonl").stat()
    os.utime(dest / "events.jsonl", ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # the span table still looks current
    if name == "events.jsonl" and draw(st.booleans()):
        # As if the run had written these events: the size check passes, the lines are read.
        meta = json.loads((dest / "run.json").read_text())
        meta["events_bytes"] = path.stat().st_size
        (dest / "run.json").write_text(json.dumps(meta))
    return f"{name} {'json' if as_json else 'bytes'}"


def _cli(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        status = cli.main(list(args))
    return status, err.getvalue()


def _clean(status: int, err: str, what: str) -> None:
    assert status in (0, 2), f"{what}: exit {status}: {err}"
    assert "internal error" not in err and "Traceback" not in err, f"{what}: {err}"
    if status == 2:
        errors = [line for line in err.splitlines() if line.startswith("mltrace: error:")]
        assert len(errors) == 1, f"{what}: {err}"


@seed(28)
@FUZZ
@given(data=st.data())
def test_readers_never_fail_inside_on_a_mutated_run(base_run: Path, tmp_path: Path, data: st.DataObject) -> None:
    run_dir = tmp_path / "run"
    what = data.draw(mutated_run(base_run, run_dir))
    try:
        run = load_run(run_dir)
        assert run.span_count >= 0
    except RunError as exc:
        assert str(exc), what
    for args in (("report", str(run_dir)), ("export", str(run_dir), "--format", "chrome-json", "-o", str(tmp_path / "c.json"))):
        _clean(*_cli(*args), f"{what}: {args[0]}")
    _clean(*_cli("diff", str(base_run), str(run_dir)), f"{what}: diff")


@seed(2828)
@FUZZ
@given(data=st.data())
def test_kineto_import_never_fails_inside_on_a_mutated_trace(tmp_path: Path, data: st.DataObject) -> None:
    """A mutated Kineto trace imports, or is refused with one line; a refused import leaves no
    output directory behind."""
    raw = gzip.decompress(KINETO.read_bytes())
    trace = tmp_path / "trace.json"
    if data.draw(st.booleans()):
        trace.write_bytes(_mutate_json(raw, data.draw))
    else:
        trace.write_bytes(_mutate_bytes(raw, data.draw))
    out = tmp_path / "imported"
    shutil.rmtree(out, ignore_errors=True)
    status, err = _cli("import", str(trace), "-o", str(out))
    _clean(status, err, "import")
    if status == 2:
        assert not out.exists() or not any(out.iterdir()), "a refused import left files behind"
    else:
        _clean(*_cli("report", str(out)), "report of the import")
        _clean(*_cli("export", str(out), "--format", "chrome-json", "-o", str(tmp_path / "c.json")), "export of the import")
