"""Following children end to end: a real program's fork, spawn, forkserver, subprocess,
DataLoader and pool children, torchrun's ranks, ``--no-follow``, and ``mltrace merge``."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from conftest import run_cli, run_plain
from mltrace.run.levels import Level
from mltrace.run.store import Run, load_run

HERE = Path(__file__).resolve().parent
CHILDREN = HERE / "children.py"


def _model_calls_by_role(run: Run) -> Counter[str]:
    roles = {p["pid"]: p["role"] for p in run.meta["processes"]}
    return Counter(roles[run.tracks[s.track_id].pid] for s in run.spans if s.level is Level.MODEL)


@pytest.fixture(scope="module")
def followed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("follow")
    plain = run_plain(CHILDREN, cwd=tmp, timeout=240)
    traced = run_cli("python", "-q", "-o", str(tmp / "run"), "--level", "layer", str(CHILDREN), cwd=tmp, timeout=240)
    return {"plain": plain, "traced": traced, "run": load_run(tmp / "run"), "dir": tmp / "run"}


def test_output_and_status_unchanged(followed: dict[str, Any]) -> None:
    plain, traced = followed["plain"], followed["traced"]
    assert plain.returncode == traced.returncode == 3, traced.stderr.decode()
    # Processes print to one pipe: unbuffered (PYTHONUNBUFFERED), a print's text and newline are
    # two writes, so two processes' lines may interleave, plain as traced. Compare what each printed.
    printed = re.compile(rb"[a-z]+ [0-9.]+")
    assert sorted(printed.findall(traced.stdout)) == sorted(printed.findall(plain.stdout))


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_multiprocessing_child_model_calls(followed: dict[str, Any], method: str) -> None:
    run = followed["run"]
    roles = _model_calls_by_role(run)
    starts = {p["role"]: p.get("start") for p in run.meta["processes"]}
    # The three multiprocessing children, in start order; each made one model call.
    name = {"fork": "ForkProcess-1", "spawn": "SpawnProcess-2", "forkserver": "ForkServerProcess-3"}[method]
    assert roles[name] == 1, roles
    assert starts[name] == ("fork" if method in ("fork", "forkserver") else "exec")


def test_subprocess_python_child(followed: dict[str, Any]) -> None:
    run = followed["run"]
    subprocess_children = [p for p in run.meta["processes"] if p.get("role", "").startswith("pid ") and p.get("spans")]
    assert len(subprocess_children) == 1
    assert _model_calls_by_role(run)[subprocess_children[0]["role"]] == 1


def test_dataloader_workers_and_pool(followed: dict[str, Any]) -> None:
    run = followed["run"]
    roles = Counter(p["role"] for p in run.meta["processes"])
    assert roles["DataLoader worker 0"] == roles["DataLoader worker 1"] == 1
    pool = [p for p in run.meta["processes"] if p.get("mp_name", "").startswith("SpawnPoolWorker")]
    assert len(pool) == 2
    calls = _model_calls_by_role(run)
    assert all(calls[p["role"]] == 1 for p in pool)
    assert calls["main"] == 1


def test_one_trace_a_track_per_process(followed: dict[str, Any]) -> None:
    run = followed["run"]
    pids = {p["pid"] for p in run.meta["processes"]}
    assert len(pids) == len(run.meta["processes"]) == 9  # main, 3 mp, subprocess, 2 DataLoader, 2 pool
    assert {t.pid for t in run.tracks.values()} == pids
    assert run.complete and not run.meta.get("unfollowed")
    assert not (followed["dir"] / "procs").exists()  # the children's folders and notes, merged, are removed
    ids = [s.id for s in run.spans]
    assert len(ids) == len(set(ids))
    by_id = {s.id: s for s in run.spans}
    for s in run.spans:  # a parent is on the child's own process
        if s.parent_id is not None:
            assert run.tracks[by_id[s.parent_id].track_id].pid == run.tracks[s.track_id].pid


def test_report_lists_each_process_with_its_model_calls(followed: dict[str, Any]) -> None:
    """The report's processes section: one row per process, the program's first, with the
    model calls its tracks hold; the text report shows it."""
    run = followed["run"]
    res = run_cli("report", str(followed["dir"]), "--format", "json")
    assert res.returncode == 0, res.stderr.decode()
    processes = json.loads(res.stdout)["processes"]
    assert [p["pid"] for p in processes] == [p["pid"] for p in run.meta["processes"]] and processes[0]["role"] == "main"
    calls = _model_calls_by_role(run)
    assert {p["role"]: p["model_calls"] for p in processes if p["model_calls"]} == {r: n for r, n in calls.items() if n}
    assert all(p["parent"] is None if p["role"] == "main" else p["parent"] for p in processes)
    text = run_cli("report", str(followed["dir"])).stdout.decode()
    assert f"Processes: {len(processes)} processes, {sum(1 for p in processes if p['model_calls'])} with model calls" in text


def test_no_follow(tmp_path: Path) -> None:
    res = run_cli("python", "-q", "--no-follow", "-o", str(tmp_path / "run"), "--level", "model", str(CHILDREN), cwd=tmp_path, timeout=240)
    assert res.returncode == 3, res.stderr.decode()
    run = load_run(tmp_path / "run")
    assert "processes" not in run.meta
    assert {t.pid for t in run.tracks.values()} == {run.meta["pid"]}
    assert sum(1 for s in run.spans if s.level is Level.MODEL) == 1


def test_unfollowable_child_is_named(tmp_path: Path) -> None:
    """A child whose interpreter cannot import mltrace (here a broken ``mltrace`` package ahead
    of the real one: the program gives the child its own ``PYTHONPATH``, the bootstrap goes
    before it) runs as it would, and the run names it with the reason."""
    broken = tmp_path / "broken" / "mltrace"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('not this one')\n")
    script = tmp_path / "parent.py"
    script.write_text(
        "import os, subprocess, sys\n"
        f"env = dict(os.environ, PYTHONPATH={str(broken.parent)!r})\n"
        "sys.exit(subprocess.run([sys.executable, '-c', 'import torch; print(\"child ran\")'], env=env).returncode)\n"
    )
    res = run_cli("python", "-q", "-o", str(tmp_path / "run"), "--level", "model", str(script), cwd=tmp_path, timeout=120)
    assert res.returncode == 0 and res.stdout == b"child ran\n", res.stderr.decode()
    run = load_run(tmp_path / "run")
    (note,) = run.meta["unfollowed"]
    assert "not this one" in note["reason"] and note["argv"][-1] == 'import torch; print("child ran")'
    assert any(f"process {note['pid']}" in line for line in run.meta["limitations"])
    for fmt in ("text", "md"):  # the report names it, on one line
        report = run_cli("report", str(tmp_path / "run"), "--format", fmt)
        assert report.returncode == 0, report.stderr.decode()
        lines = [ln for ln in report.stdout.decode().splitlines() if f"process {note['pid']} " in ln]
        assert len(lines) == 1 and "was not followed" in lines[0] and "not this one" in lines[0]


def test_torchrun_ranks(tmp_path: Path) -> None:
    args = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(HERE / "ddp.py"))
    res = run_cli("python", "-q", "-o", str(tmp_path / "run"), "--level", "op", *args, cwd=tmp_path, timeout=240)
    assert res.returncode == 0, res.stderr.decode()
    # Both ranks print to one pipe; unbuffered, a print's text and its newline are two writes,
    # so the two lines may interleave: each rank's words are looked for anywhere in the output.
    printed = dict(re.findall(rb"rank (\d): ([0-9.]+)", res.stdout))
    assert sorted(printed) == [b"0", b"1"] and printed[b"0"] == printed[b"1"], res.stdout  # all_reduce ran
    run = load_run(tmp_path / "run")
    ranks = {p["distributed"]["rank"]: p for p in run.meta["processes"] if "distributed" in p}
    assert sorted(ranks) == [0, 1]
    assert all(p["role"] == f"rank {r}" and p["distributed"]["backend"] == "gloo" for r, p in ranks.items())
    pid_rank = {p["pid"]: r for r, p in ranks.items()}
    calls = Counter(pid_rank.get(run.tracks[s.track_id].pid) for s in run.spans if s.level is Level.MODEL)
    reduces = Counter(pid_rank.get(run.tracks[s.track_id].pid) for s in run.spans if s.level is Level.OP and "allreduce" in s.name)
    assert calls == {0: 1, 1: 1} and reduces == {0: 1, 1: 1}
    report = run_cli("report", str(tmp_path / "run"), "--format", "json")
    assert report.returncode == 0, report.stderr.decode()
    got = json.loads(report.stdout)["ranks"]
    assert (got["world_size"], got["backend"]) == (2, "gloo") and [r["rank"] for r in got["ranks"]] == [0, 1]
    waits = {r["rank"]: r["collective_ns"] - r["setup_ns"] for r in got["ranks"]}  # past the set-up
    assert all(r["model_calls"] == 1 and r["model_ns"] > 0 for r in got["ranks"]) and all(waits.values())
    assert got["straggler"] == min(waits, key=lambda k: waits[k])  # the rank that waits least
    text = run_cli("report", str(tmp_path / "run")).stdout.decode()
    assert f"Straggler: rank {got['straggler']} waits least in collectives" in text


def test_merge_two_runs(tmp_path: Path, followed: dict[str, Any]) -> None:
    other = tmp_path / "other"
    res = run_cli("python", "-q", "--no-follow", "-o", str(other), "--level", "model", str(CHILDREN), cwd=tmp_path, timeout=240)
    assert res.returncode == 3, res.stderr.decode()
    out = tmp_path / "merged"
    res = run_cli("merge", str(followed["dir"]), str(other), "-o", str(out))
    assert res.returncode == 0, res.stderr.decode()
    merged, first, second = load_run(out), followed["run"], load_run(other)
    assert merged.complete and merged.span_count == first.span_count + second.span_count
    assert len(merged.meta["processes"]) == len(first.meta["processes"]) + 1
    assert [m["clock_shift_ns"] for m in merged.meta["merged_from"]] == [0, 0]  # one host, one boot
    assert {(s.name, s.start_ns) for s in merged.spans} == {(s.name, s.start_ns) for s in [*first.spans, *second.spans]}
    assert json.loads((out / "run.json").read_text())["complete"] is True


def test_merge_refuses_one_run(tmp_path: Path) -> None:
    res = run_cli("merge", str(tmp_path), "-o", str(tmp_path / "out"))
    assert res.returncode == 2 and res.stderr.count(b"\n") == 1 and b"two run directories" in res.stderr


@pytest.mark.parametrize(("context", "worker_level"), [("fork", None), ("fork", "op"), ("spawn", None), ("forkserver", None)])
def test_dataloader_workers_record_no_deeper_than_the_worker_level(tmp_path: Path, context: str, worker_level: str | None) -> None:
    """A DataLoader's workers run no model call: by default they record down to the layer level
    (torch.profiler never starts in a forked worker, and ends as a spawned or forkserver worker
    starts its loop: its one cycle would be converted as the worker exits, while the DataLoader
    waits); ``MLTRACE_WORKER_LEVEL=op`` records their ops. Another forked child and the
    program's own process keep the run's level."""
    env = {"MLTRACE_WORKER_LEVEL": worker_level} if worker_level else {}
    script = str(HERE / "worker_ops.py")
    res = run_cli("python", "-q", "-o", str(tmp_path / "run"), script, context, cwd=tmp_path, timeout=240, env=env)
    assert res.returncode == 0, res.stderr.decode()
    run = load_run(tmp_path / "run")
    by_pid = {p["pid"]: p for p in run.meta["processes"]}
    ops: Counter[str] = Counter(by_pid[run.tracks[s.track_id].pid]["role"] for s in run.spans if s.level is Level.OP)
    workers = [p for p in by_pid.values() if p["role"].startswith("DataLoader worker")]
    assert len(workers) == 2
    for w in workers:
        assert w["level"].startswith(f"{worker_level or 'layer'}: a DataLoader worker records no deeper than MLTRACE_WORKER_LEVEL")
        assert (ops[w["role"]] > 0) == (worker_level == "op")
    (forked,) = [p for p in by_pid.values() if p.get("mp_name") == "ForkProcess-3"]  # numbered after the 2 workers
    assert ops["main"] > 0 and ops[forked["role"]] > 0 and "level" not in forked


def test_children_of_a_rank_are_not_ranks(tmp_path: Path) -> None:
    """Children inherit torchrun's environment (RANK…) from the rank that starts them: a forked
    or spawned multiprocessing child, a DataLoader worker and a Python subprocess are named as
    what they are, not as a second process of that rank, and the report has one rank."""
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    res = run_cli("python", "-q", "-o", str(tmp_path / "run"), "--level", "model", str(HERE / "inherited_rank.py"), cwd=tmp_path, env=env)
    assert res.returncode == 0 and res.stdout == b"6\n", res.stderr.decode()
    run = load_run(tmp_path / "run")
    roles = [p["role"] for p in run.meta["processes"]]
    subprocesses = [r for r in roles if r.startswith("pid ")]
    assert len(subprocesses) == 1, roles
    assert sorted(set(roles) - set(subprocesses)) == ["DataLoader worker 0", "ForkProcess-1", "SpawnProcess-2", "rank 1"], roles
    (ranked,) = [p for p in run.meta["processes"] if "distributed" in p]
    assert ranked["pid"] == run.meta["pid"] and ranked["distributed"]["rank"] == 1
    assert sum(_model_calls_by_role(run).values()) == 4  # the main process, the two multiprocessing children, the subprocess
    report = json.loads(run_cli("report", str(tmp_path / "run"), "--format", "json").stdout)
    assert [r["rank"] for r in report["ranks"]["ranks"]] == [1]


def test_a_child_that_traces_itself_keeps_its_own_run(tmp_path: Path) -> None:
    """A child that runs mltrace itself, ``mltrace python -o DIR`` or its own ``mltrace.profile()``
    opened before it imports torch, is traced into its own run, as without the parent's mltrace;
    the parent's run names it. (Its session's start looked for torch, which opened the follow
    bootstrap's gate: the child then ran two sessions and died of SIGSEGV.)"""
    (tmp_path / "model.py").write_text("import torch\nwith torch.no_grad():\n    torch.nn.Linear(2, 2)(torch.ones(1, 2))\n")
    (tmp_path / "own_profile.py").write_text(
        "import sys\nimport mltrace\nwith mltrace.profile(output=sys.argv[1], summary=False):\n    import model\n"
    )
    (tmp_path / "parent.py").write_text(
        "import subprocess, sys\n"
        "cli = subprocess.run([sys.executable, '-m', 'mltrace', 'python', '-q', '-o', 'cli', 'model.py'])\n"
        "api = subprocess.run([sys.executable, 'own_profile.py', 'api'])\n"
        "print(cli.returncode, api.returncode)\n"
    )
    res = run_cli("python", "-q", "-o", str(tmp_path / "run"), str(tmp_path / "parent.py"), cwd=tmp_path)
    assert res.returncode == 0 and res.stdout == b"0 0\n", (res.stdout, res.stderr.decode())
    for own in ("cli", "api"):
        assert sum(1 for s in load_run(tmp_path / own).spans if s.level is Level.MODEL) == 1, own
    run = load_run(tmp_path / "run")
    children = [p for p in run.meta["processes"] if p["role"] != "main"]
    assert sorted(p["note"] for p in children) == [f"traced by its own mltrace session, into {tmp_path / own}" for own in ("api", "cli")], (
        children
    )
    assert not [s for s in run.spans if run.tracks[s.track_id].pid != run.meta["pid"]]


def test_a_child_that_outlives_the_program_keeps_writing_its_own_folder(tmp_path: Path) -> None:
    """A child still running when the program's trace is finished (a background ``subprocess``,
    workers left running by a Ctrl-C of the program alone) is merged with what it streamed, and
    its folder stays in ``procs/``, where it finishes its own trace: its op-level cycles and its
    finish found the folder removed and wrote errors to the program's stderr."""
    (tmp_path / "parent.py").write_text(
        "import os, subprocess, sys, time\n"
        "child = 'import time, torch\\nm = torch.nn.Linear(2, 2)\\nm(torch.ones(1, 2))\\nopen(\\'ready\\', \\'w\\').close()\\n"
        "end = time.monotonic() + 6\\nwhile time.monotonic() < end:\\n    m(torch.ones(1, 2)); time.sleep(0.01)\\n'\n"
        "subprocess.Popen([sys.executable, '-c', child], stdout=subprocess.DEVNULL, stderr=open('child.err', 'wb'))\n"
        "while not os.path.exists('ready'):\n    time.sleep(0.05)\n"
    )
    res = run_cli("python", "-q", "-o", str(tmp_path / "run"), str(tmp_path / "parent.py"), cwd=tmp_path, timeout=120)
    assert (res.returncode, res.stdout, res.stderr) == (0, b"", b""), res.stderr.decode()
    run = load_run(tmp_path / "run")
    (child,) = [p for p in run.meta["processes"] if p["role"] != "main"]
    assert not child["finished"] and child["spans"] > 0, child
    assert any(f"process {child['pid']} " in line and "still running" in line for line in run.meta["limitations"])
    folder = tmp_path / "run" / "procs" / str(child["pid"])
    deadline = time.monotonic() + 60
    while not (folder / "run.json").exists() or not json.loads((folder / "run.json").read_text()).get("follow"):
        assert time.monotonic() < deadline and folder.is_dir(), "the child's folder was removed or never finished"
        time.sleep(0.2)
    assert (tmp_path / "child.err").read_bytes() == b""  # nothing written to its stderr


def test_a_forked_childs_start_reuses_its_parents_work(tmp_path: Path) -> None:
    """A child forked from a traced program starts its session with what the program's start
    already did that the fork copied: MKL's timer slots found without walking the loaded
    libraries again, and no op-level converter process at its start (its model call comes
    first), nor for the cycle of its first model call (a fork-per-request service's child makes
    one): the process starts for a later call's. It records what it did before: its three model
    calls with their layers and ops."""
    res = run_cli("python", "-q", "-o", str(tmp_path / "run"), str(HERE / "fork_start.py"), cwd=tmp_path, timeout=240)
    assert res.returncode == 0, res.stderr.decode()
    state = json.loads(res.stdout)
    assert state["own_session"] and state["cycles"] and not state["converter_at_start"]
    assert not state["converter_after_one_call"] and state["converter_after_three_calls"]
    parent_walks, child_walks = state["walks"]
    if parent_walks:  # this torch's MKL imports the timer: the child redirected it with no walk of its own
        assert state["mkl_slots"] > 0 and child_walks == parent_walks
    run = load_run(tmp_path / "run")
    (child,) = [p for p in run.meta["processes"] if p.get("start") == "fork"]
    levels = Counter(s.level for s in run.spans if run.tracks[s.track_id].pid == child["pid"])
    assert levels[Level.MODEL] == 3 and levels[Level.LAYER] == 9 and levels[Level.OP] > 0
    assert not run.meta.get("errors")
