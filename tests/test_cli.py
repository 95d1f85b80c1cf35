"""End-to-end: `mltrace python` as a user runs it, in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mltrace
from conftest import SCRIPTS, mltrace_cmd, run_cli, run_plain
from mltrace.run.levels import Level
from support.pftrace import parse_pftrace

ECHO = SCRIPTS / "echo_env.py"
MODELS = SCRIPTS / "tiny_models.py"


def _single_run(base: Path) -> Path:
    runs = sorted((base / "mltrace-runs").iterdir())
    assert len(runs) == 1, runs
    return runs[0]


def test_script_sees_what_plain_python_gives(tmp_path: Path) -> None:
    plain = run_plain(ECHO, "a", "--flag", "-m", "x", cwd=tmp_path)
    traced = run_cli("python", str(ECHO), "a", "--flag", "-m", "x", cwd=tmp_path)
    assert traced.returncode == plain.returncode == 0, traced.stderr.decode()
    assert traced.stdout == plain.stdout  # byte-identical, argv, __name__, sys.path[0]
    assert b"name __main__" in traced.stdout
    assert f"path0 {SCRIPTS}".encode() in traced.stdout
    run = mltrace.load_run(_single_run(tmp_path))
    assert run.complete and run.meta["exit_status"] == 0
    assert run.meta["command"][:3] == ["mltrace", "python", str(ECHO)]


EXIT_CASES = [
    ("exit=0", 0, "SystemExit(0)", ""),
    ("exit=3", 3, "SystemExit(3)", "The program exited with status 3 (SystemExit(3))"),
    ("raise", 1, "uncaught ValueError", "The program exited with status 1 (uncaught ValueError)"),
    ("sigint", -2, "KeyboardInterrupt", "The program was ended by SIGINT (KeyboardInterrupt)"),
    ("sigterm", -15, "SIGTERM", "The program was ended by SIGTERM: "),
]


@pytest.mark.parametrize(("arg", "status", "cause", "said"), EXIT_CASES)
def test_exit_status_and_trace_always_written(tmp_path: Path, arg: str, status: int, cause: str, said: str) -> None:
    """The process ends as plain Python's would, with the same output: by SIGINT after the
    atexit handlers (an uncaught KeyboardInterrupt), killed by SIGTERM before them."""
    traced = run_cli("python", "-q", "-o", str(tmp_path / "run"), str(ECHO), arg, cwd=tmp_path)
    plain = run_plain(ECHO, arg, cwd=tmp_path)
    assert traced.returncode == plain.returncode == status, traced.stderr.decode()
    assert traced.stdout == plain.stdout
    assert traced.stdout.endswith(b"atexit\n") is (arg != "sigterm")
    err = traced.stderr.decode()
    if arg == "raise":
        assert "Traceback (most recent call last):" in err
        assert 'echo_env.py", line' in err and "ValueError: boom from the script" in err
        assert "mltrace/runner.py" not in err  # the user's traceback, not ours
    if arg == "sigint":
        assert "KeyboardInterrupt" in err
    run = mltrace.load_run(tmp_path / "run")
    assert run.complete
    assert run.meta["exit_status"] == status
    assert run.meta["exit_cause"] == cause
    report = run_cli("report", str(tmp_path / "run"), "--format", "json", cwd=tmp_path)
    assert report.returncode == 0, report.stderr.decode()
    ended = json.loads(report.stdout)["run"]["exit"]
    assert ended["status"] == status and ended["cause"] == (cause if status else None)
    assert ended["text"].startswith(said) and bool(ended["text"]) is bool(said)
    text = run_cli("report", str(tmp_path / "run"), cwd=tmp_path).stdout.decode()
    assert (said in " ".join(text.split())) if said else "The program" not in text


def test_module_mode(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tool.py").write_text("import sys\nprint(__name__, sys.argv[1:])\nsys.exit(4)\n")
    traced = run_cli("python", "-q", "-m", "mypkg.tool", "x", "-y", cwd=tmp_path)
    assert traced.returncode == 4, traced.stderr.decode()
    assert traced.stdout == b"__main__ ['x', '-y']\n"
    assert _single_run(tmp_path).name.startswith("tool-")


def test_models_end_to_end(tmp_path: Path) -> None:
    plain = run_plain(MODELS, "2", cwd=tmp_path)
    traced = run_cli("python", "--level", "layer", "-o", str(tmp_path / "run"), str(MODELS), "2", cwd=tmp_path)
    assert traced.returncode == 0, traced.stderr.decode()
    assert traced.stdout == plain.stdout
    assert b"trace:" in traced.stderr and b"Top layers by self time" in traced.stderr
    run = mltrace.load_run(tmp_path / "run")
    by_id = run.span_by_id()
    models = [s for s in run.spans if s.level == Level.MODEL]
    assert sorted(s.name for s in models) == ["Cnn", "Cnn", "TransformerEncoder", "TransformerEncoder"]
    names = {s.name for s in run.spans if s.level == Level.LAYER}
    for expected in ("stem.0", "blocks.1.conv", "blocks.1.bn", "fc", "layers.0", "layers.1.self_attn", "layers.1.linear2"):
        assert expected in names
    for s in run.spans:
        assert s.end_ns >= s.start_ns
        if s.level == Level.LAYER:
            parent = by_id[s.parent_id]
            assert parent.track_id == s.track_id
            assert parent.start_ns <= s.start_ns and s.end_ns <= parent.end_ns
            if parent.level == Level.LAYER:
                assert s.name.startswith(parent.name + ".")
    conv = next(s for s in run.spans if s.name == "stem.0")
    assert conv.attrs["ml.layer.type"] == "Conv2d"
    assert conv.attrs["ml.input.shapes"] == [[2, 3, 16, 16]]
    assert conv.attrs["ml.output.shapes"] == [[2, 8, 8, 8]]
    assert conv.attrs["ml.input.dtypes"] == ["float32"]
    assert conv.attrs["ml.layer.params"] == 3 * 8 * 9 + 8
    assert conv.attrs["code.file.path"] == str(MODELS)  # the call site: the model's own line
    assert conv.attrs["ml.defined.file.path"].endswith("torch/nn/modules/conv.py")
    cnn = next(s for s in models if s.name == "Cnn")
    assert cnn.attrs["ml.call.file.path"] == str(MODELS)
    assert run.meta["levels"]["layer"]["recorded"] is True
    assert run.meta["levels"]["op"]["requested"] is False
    assert run.meta["correlation"]["check_containment"]["outside_parent"] == 0
    # The Perfetto file holds the same slices, nested the same way.
    trace = parse_pftrace(tmp_path / "run" / "trace.pftrace")
    assert len(trace.slices) == len(run.spans)
    assert sorted((s.name, s.category) for s in trace.slices) == sorted((s.name, s.level.label) for s in run.spans)
    assert all(s.end >= s.start for s in trace.slices)
    depth_of = {}
    for s in run.spans:
        d, p = 0, s.parent_id
        while p is not None:
            d, p = d + 1, by_id[p].parent_id
        depth_of[(s.name, s.start_ns)] = d
    for sl in trace.slices:
        assert depth_of[(sl.name, sl.start)] == sl.depth
    assert {sl.args.get("ml.layer.type") for sl in trace.slices} >= {"Conv2d", "MultiheadAttention", "Linear"}


def test_level_model_records_only_models(tmp_path: Path) -> None:
    traced = run_cli("python", "-q", "--level", "model", "-o", str(tmp_path / "run"), str(MODELS), "1", cwd=tmp_path)
    assert traced.returncode == 0, traced.stderr.decode()
    run = mltrace.load_run(tmp_path / "run")
    assert {s.level for s in run.spans} == {Level.MODEL}
    assert len(run.spans) == 2
    assert run.meta["levels"]["layer"]["requested"] is False


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["python", "--bogus", "x.py"], "unrecognized arguments: --bogus"),
        (["python"], "no script given"),
        (["python", "missing_script.py"], "can't open file"),
        (["python", "-m", "no_such_module_xyz"], "no module named"),
        (["python", "-m", "no_such_package_xyz.mod"], "no module named 'no_such_package_xyz'"),
        (["python", "-m", ".x"], "cannot import module '.x'"),
        (["python", "--level", "deep", "x.py"], "unknown level"),
        (["report", "does-not-exist"], "no such run directory"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_usage_errors_are_one_line_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "x.py").write_text("print('ran')\n")
    res = run_cli(*args, cwd=tmp_path)
    err = res.stderr.decode()
    assert res.returncode == 2, err
    assert err.count("\n") == 1 and err.startswith("mltrace: error:"), err
    assert message in err
    assert b"ran" not in res.stdout
    assert "Traceback" not in err


def test_non_empty_output_is_refused_and_untouched(tmp_path: Path) -> None:
    out = tmp_path / "precious"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = run_cli("python", "-o", str(out), str(ECHO), cwd=tmp_path)
    assert res.returncode == 2
    assert b"not empty" in res.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert res.stdout == b""  # the script never ran


def _at_once(n: int, *args: str, cwd: Path) -> list[tuple[int, bytes, bytes]]:
    """Runs ``mltrace ARGS`` in ``n`` processes started together: (status, stdout, stderr) each."""
    env = {k: v for k, v in os.environ.items() if k != "MLTRACE_OUTPUT"}
    procs = [
        subprocess.Popen(mltrace_cmd(*args), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(n)
    ]
    return [(p.returncode, *p.communicate(timeout=120)) for p in procs if p.wait(timeout=120) is not None]


def test_one_output_directory_given_to_processes_at_once(tmp_path: Path) -> None:
    """Processes given the same ``-o`` at once (the ranks of ``torchrun --no-python … mltrace
    python -o DIR``): one records into it, each other one is refused with one line and exit 2
    before its program runs, never two runs written into one directory."""
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(1)\nprint('ran')\n")
    out = tmp_path / "run"
    results = _at_once(3, "python", "-q", "--level", "model", "-o", str(out), "slow.py", cwd=tmp_path)
    assert sorted(status for status, _, _ in results) == [0, 2, 2], results
    for status, stdout, stderr in results:
        if status == 2:
            assert stdout == b"" and stderr.count(b"\n") == 1 and stderr.startswith(b"mltrace: error: output directory"), stderr
        else:
            assert stdout == b"ran\n"
    assert json.loads((out / "run.json").read_text())["complete"] is True
    assert sorted(p.name for p in out.iterdir()) == ["events.jsonl", "run.json", "spans.bin", "trace.pftrace"]


def test_default_output_directories_of_processes_started_at_once(tmp_path: Path) -> None:
    """Processes started in the same second without ``-o`` each get a run directory of their own."""
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(1)\n")
    results = _at_once(3, "python", "-q", "--level", "model", "slow.py", cwd=tmp_path)
    assert [status for status, _, _ in results] == [0, 0, 0], results
    runs = sorted((tmp_path / "mltrace-runs").iterdir())
    assert len(runs) == 3, runs
    pids = {json.loads((run / "run.json").read_text())["pid"] for run in runs}
    assert len(pids) == 3  # one process's run in each


def test_report_rejects_torn_and_foreign_files(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "run.json").write_text('{"hello": 1}')
    res = run_cli("report", str(foreign))
    assert res.returncode == 2 and b"not mltrace run metadata" in res.stderr
    run_cli("python", "-q", "-o", str(tmp_path / "ok"), str(ECHO))
    events = tmp_path / "ok" / "events.jsonl"
    lines = events.read_bytes().split(b"\n")
    events.write_bytes(lines[0] + b"\n" + b"{garbage\n" + b"\n".join(lines[1:]))
    res = run_cli("report", str(tmp_path / "ok"))
    assert res.returncode == 2 and b"corrupt event line" in res.stderr and b"Traceback" not in res.stderr


LOOP = """
import sys, time, torch
from torch import nn
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
x = torch.randn(4, 64)
n = 0
while True:
    model(x)
    n += 1
    if n == 200:
        print("ready", flush=True)
    time.sleep(0.001)
"""


def _start_loop(tmp_path: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], Path]:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    out = tmp_path / "run"
    proc = subprocess.Popen(
        mltrace_cmd("python", "-q", "--flush-interval", "0.2", "-o", str(out), str(script)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line == b"ready\n", proc.stderr.read() if proc.stderr else b""
    time.sleep(1.0)  # more than the flush interval
    return proc, out


@pytest.mark.parametrize("stream_perfetto", [False, True])
def test_sigkill_leaves_readable_trace(tmp_path: Path, stream_perfetto: bool) -> None:
    proc, out = _start_loop(tmp_path, {"MLTRACE_STREAM_PERFETTO": "1"} if stream_perfetto else {})
    proc.kill()
    proc.wait(timeout=30)
    run = mltrace.load_run(out)
    assert not run.complete
    models = [s for s in run.spans if s.level == Level.MODEL]
    assert len(models) >= 200
    assert sum(1 for s in run.spans if s.level == Level.LAYER) >= 3 * 200
    if stream_perfetto:  # the streamed Perfetto file parses too, up to its last flush
        trace = parse_pftrace(out / "trace.pftrace")
    else:  # rebuilt from the streamed events
        assert not (out / "trace.pftrace").exists()
        res = run_cli("export", str(out), "--format", "perfetto", "-o", str(tmp_path / "rebuilt.pftrace"))
        assert res.returncode == 0, res.stderr.decode()
        trace = parse_pftrace(tmp_path / "rebuilt.pftrace")
    assert sum(1 for s in trace.slices if s.category == "model") >= 200
    report = run_cli("report", str(out))
    assert report.returncode == 0 and b"did not finish normally" in report.stdout


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, -15), (signal.SIGINT, -2)])
def test_sigterm_sigint_finish_the_trace(tmp_path: Path, sig: int, status: int) -> None:
    proc, out = _start_loop(tmp_path)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == status
    run = mltrace.load_run(out)
    assert run.complete and run.meta["exit_status"] == status
    assert len([s for s in run.spans if s.level == Level.MODEL]) >= 200


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("follow", [True, False], ids=["followed", "no-follow"])
def test_a_terminated_worker_dies_by_sigterm_as_without_mltrace(tmp_path: Path, follow: bool) -> None:
    """A multiprocessing worker forked from the program and terminated (SIGTERM) dies by the
    signal, exit code -15 as without mltrace (not the runner's 143); followed, it finishes its
    trace first."""
    script = SCRIPTS / "terminate_child.py"
    plain = run_plain(script, cwd=tmp_path)
    flags = [] if follow else ["--no-follow"]
    traced = run_cli("python", "-q", *flags, "-o", str(tmp_path / "run"), str(script), cwd=tmp_path)
    assert traced.returncode == plain.returncode == 0, traced.stderr.decode()
    assert traced.stdout == plain.stdout == b"worker exit code -15\n" * 2
    run = mltrace.load_run(tmp_path / "run")
    assert run.complete
    if follow:
        workers = [p for p in run.meta["processes"] if p.get("role") != "main"]
        assert len(workers) == 2 and all(p["finished"] for p in workers)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("start", ["fork", "exec"])
def test_a_child_killed_before_its_finish_is_listed_with_its_start_facts(tmp_path: Path, start: str) -> None:
    """A followed worker killed by SIGKILL never wrote its finish's facts (its role): the run is
    still finished, the worker listed by its pid with what it wrote as it started (its parent,
    how it started, its command line) and as having ended before it finished its trace, which
    the processes section of the report says, with the command line of a child started by exec
    (a forked child's is its parent's)."""
    pytest.importorskip("torch")
    script = SCRIPTS / "killed_child.py"
    args = [] if start == "fork" else ["exec"]
    traced = run_cli("python", "-q", "-o", str(tmp_path / "run"), str(script), *args, cwd=tmp_path)
    assert traced.returncode == 0 and traced.stdout == b"worker exit code -9\n", traced.stderr.decode()
    assert b"could not finalize" not in traced.stderr
    run = mltrace.load_run(tmp_path / "run")
    assert run.complete
    main, worker = run.meta["processes"]
    assert main["role"] == "main" and worker["finished"] is False and worker["running"] is False
    assert isinstance(worker["pid"], int) and worker["pid"] not in (0, main["pid"]) and worker["role"] == f"pid {worker['pid']}"
    assert worker["ppid"] == main["pid"] and worker["start"] == start
    assert any(f"process {worker['pid']} " in line and "had not finished its trace" in line for line in run.meta["limitations"])
    report = run_cli("report", str(tmp_path / "run"), "--format", "json", cwd=tmp_path)
    assert report.returncode == 0, report.stderr.decode()
    row = json.loads(report.stdout)["processes"][1]
    assert (row["pid"], row["parent"], row["start"]) == (worker["pid"], "main", start)
    assert 0 < row["model_calls"] <= 20  # what it streamed
    command = f"; command: {sys.executable} {script} worker" if start == "exec" else ""
    assert row["note"] == "ended before it finished its trace (killed): what it streamed" + command


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_is_followed_into_the_run(tmp_path: Path) -> None:
    """Following children (the default): a child the script forks starts its own session (the
    layer wrapper put back in for it), streams into procs/<pid>/, prints no summary, and the
    parent's finish merges its call into the run as a second process; procs/ is then gone.
    (Layer level: see the --no-follow test below.)"""
    traced = run_cli("python", "-o", str(tmp_path / "run"), "--level", "layer", str(SCRIPTS / "fork_child.py"), cwd=tmp_path)
    assert traced.returncode == 0, traced.stderr.decode()
    out = traced.stdout.decode()
    assert "child done, Module.__call__ is a LayerCall" in out  # the child's own session's wrapper
    assert "parent done, child status 0" in out
    assert traced.stderr.decode().count("model calls, model time") == 1  # one summary: the parent's
    assert not (tmp_path / "run" / "procs").exists()
    run = mltrace.load_run(tmp_path / "run")
    assert run.complete and run.meta["pid"] != 0
    main, child = run.meta["processes"]
    assert (main["pid"], main["role"]) == (run.meta["pid"], "main")
    assert (child["ppid"], child["start"], child["finished"]) == (run.meta["pid"], "fork", True)
    assert child["pid"] != main["pid"] and not run.meta.get("unfollowed")
    models = [s for s in run.spans if s.level == Level.MODEL]
    by_pid: dict[int, list[int]] = {}
    for m in models:
        by_pid.setdefault(run.tracks[m.track_id].pid, []).append(m.attrs["ml.model.invocation"])
    assert by_pid == {main["pid"]: [1, 2], child["pid"]: [1]}  # the parent's two calls, the child's one
    main_track = {m.track_id for m in models if run.tracks[m.track_id].pid == main["pid"]}
    child_track = {m.track_id for m in models if run.tracks[m.track_id].pid == child["pid"]}
    assert len(main_track) == len(child_track) == 1  # one thread each
    assert {s.track_id for s in run.spans} == main_track | child_track


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_leaves_the_run_to_its_parent_with_no_follow(tmp_path: Path) -> None:
    """With --no-follow a child the script forks has the session's copy but not its threads: it
    records nothing more, takes the layer wrapper out, writes nothing and prints no summary; the
    parent's run is whole. (At the op level a forked child that exits normally hangs in Kineto's
    exit handlers, as it does under torch.profiler alone, so this runs at the layer level.)"""
    run_dir = tmp_path / "run"
    traced = run_cli("python", "--no-follow", "-o", str(run_dir), "--level", "layer", str(SCRIPTS / "fork_child.py"), cwd=tmp_path)
    assert traced.returncode == 0, traced.stderr.decode()
    out = traced.stdout.decode()
    assert "child done, Module.__call__ is a function" in out  # torch's own, not the C wrapper
    assert "parent done, child status 0" in out
    assert traced.stderr.decode().count("model calls, model time") == 1  # one summary: the parent's
    assert not (run_dir / "procs").exists()
    run = mltrace.load_run(run_dir)
    assert run.complete and run.meta["pid"] != 0 and "processes" not in run.meta
    models = [s for s in run.spans if s.level == Level.MODEL]
    assert [m.attrs["ml.model.invocation"] for m in models] == [1, 2]  # the parent's two calls
    assert {s.track_id for s in run.spans} == {models[0].track_id}  # one process, one thread


def test_import_mltrace_imports_no_framework() -> None:
    code = (
        "import sys, mltrace, mltrace.cli, mltrace.tracer.session; "
        "heavy = [m for m in ('torch','tensorflow','onnxruntime','grpc','pandas','opentelemetry','matplotlib') if m in sys.modules]; "
        "print(heavy)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert res.stdout.strip() == b"[]", res.stderr


def test_python_dash_m_mltrace_version() -> None:
    res = run_cli("--version")
    assert res.returncode == 0 and res.stdout.startswith(b"mltrace ")


def test_chrome_json_export(tmp_path: Path) -> None:
    from mltrace.exporters.chrome_json import export_chrome_json

    run_cli("python", "-q", "--level", "layer", "-o", str(tmp_path / "run"), str(MODELS), "1")
    run = mltrace.load_run(tmp_path / "run")
    dest = export_chrome_json(run, tmp_path / "trace.json")
    doc = json.loads(dest.read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(run.spans)
    assert {e["cat"] for e in xs} == {"model", "layer"}
    assert all(e["dur"] >= 0 for e in xs)
    assert os.path.getsize(dest) > 0


def test_an_internal_error_is_one_line_unless_debugging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bug of mltrace's own in a command (here: the analysis failing) is one line on stderr
    and status 1; MLTRACE_DEBUG=1 shows the traceback instead."""
    import mltrace.analysis.bottleneck as bottleneck
    from mltrace.cli import main
    from mltrace.settings import DEBUG

    run_dir = tmp_path / "run"
    with mltrace.profile(output=run_dir, summary=False, level="model"):
        with mltrace.span("work"):
            pass

    def broken(*_: object, **__: object) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(bottleneck, "analyze", broken)
    monkeypatch.delenv(DEBUG.name, raising=False)
    assert main(["report", str(run_dir)]) == 1
    err = capsys.readouterr().err
    last = err.splitlines()[-1]  # after the peaks measurement's notice, where this machine had none cached
    assert last.startswith("mltrace: internal error in 'report': ValueError: a bug") and "Traceback" not in err
    monkeypatch.setenv(DEBUG.name, "1")
    with pytest.raises(ValueError, match="a bug"):
        main(["report", str(run_dir)])


@pytest.mark.parametrize(
    ("argv", "options", "script", "script_args"),
    [
        (["--otlp", "http://localhost:4317", "infer.py"], ["--otlp", "http://localhost:4317"], "infer.py", []),
        (["--otlp=http://localhost:4317", "infer.py"], ["--otlp=http://localhost:4317"], "infer.py", []),
        (["--otlp", "jaeger:4317", "-q", "infer.py"], ["--otlp", "jaeger:4317", "-q"], "infer.py", []),
        (["--otlp", "https://[::1]:4318/v1/traces", "x.py"], ["--otlp", "https://[::1]:4318/v1/traces"], "x.py", []),
        (["--otlp", "infer.py", "--otlp", "a:1"], ["--otlp"], "infer.py", ["--otlp", "a:1"]),
        (["-q", "--otlp", "--", "infer.py", "-q"], ["-q", "--otlp"], "infer.py", ["-q"]),
    ],
)
def test_otlp_takes_a_url_after_it_and_nothing_else(argv: list[str], options: list[str], script: str, script_args: list[str]) -> None:
    from mltrace.cli import split_trace_argv

    assert split_trace_argv(argv) == (options, script, None, script_args)


def test_otlp_value_looks_like_an_endpoint() -> None:
    from mltrace.cli import looks_like_endpoint

    for word in ("http://localhost:4317", "grpc://h", "localhost:4317", "10.0.0.1:4318/v1/traces", "[::1]:4317"):
        assert looks_like_endpoint(word), word
    for word in ("infer.py", "dir/infer.py", "C:\\infer.py", "-q", "host:port", "a:b:1"):
        assert not looks_like_endpoint(word), word
