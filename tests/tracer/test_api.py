"""The user API: span, trace, profile — inside and outside a session."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

import mltrace
from mltrace.errors import UsageError
from mltrace.run.levels import Level


def test_outside_a_session_everything_is_a_no_op() -> None:
    calls = []

    @mltrace.trace
    def f(x: int) -> int:
        calls.append(x)
        return x + 1

    with mltrace.span("nothing", a=1) as s:
        s.set("b", 2)
        assert f(1) == 2
    assert calls == [1]


def test_spans_nest_with_attributes_and_errors(tmp_path: Path) -> None:
    @mltrace.trace(name="step", stage=2)
    def step() -> None:
        with mltrace.span("inner", level="layer", batch=8) as s:
            s.set("extra", "yes")

    with mltrace.profile(output=tmp_path / "r", summary=False):
        with mltrace.span("outer"):
            step()
            with pytest.raises(KeyError), mltrace.span("failing"):
                raise KeyError("x")
    run = mltrace.load_run(tmp_path / "r")
    by_name = {s.name: s for s in run.spans}
    assert set(by_name) == {"outer", "step", "inner", "failing"}
    assert by_name["step"].parent_id == by_name["outer"].id
    assert by_name["inner"].parent_id == by_name["step"].id
    assert by_name["inner"].level == Level.LAYER and by_name["step"].level == Level.USER
    inner = by_name["inner"].attrs
    assert {k: v for k, v in inner.items() if not k.startswith("code.")} == {"batch": 8, "extra": "yes"}
    # Call sites: the line of each `with` and of the decorated function's call, here.
    lines = {name: by_name[name].attrs["code.line.number"] for name in by_name}
    assert all(by_name[n].attrs["code.file.path"] == __file__ for n in by_name)
    assert inner["code.function.name"].endswith("step")  # the with-statement is inside step()
    assert lines["step"] == lines["outer"] + 1 and lines["failing"] == lines["outer"] + 2
    step = by_name["step"].attrs
    assert step["stage"] == 2
    # Where the traced function is defined, apart from where it was called.
    assert step["ml.defined.file.path"] == __file__ and step["ml.defined.line.number"] < lines["inner"]
    assert step["ml.defined.function.name"] == "step"
    assert by_name["failing"].attrs["error.type"] == "KeyError"


def test_async_functions_and_tasks_get_their_own_parents(tmp_path: Path) -> None:
    @mltrace.trace
    async def work(n: int) -> int:
        await asyncio.sleep(0.01 * n)
        return n

    async def main() -> list[int]:
        with mltrace.span("gather"):
            return list(await asyncio.gather(work(1), work(2), work(3)))

    with mltrace.profile(output=tmp_path / "r", summary=False):
        assert asyncio.run(main()) == [1, 2, 3]
    run = mltrace.load_run(tmp_path / "r")
    gather = next(s for s in run.spans if s.name == "gather")
    works = [s for s in run.spans if s.name.endswith("work")]
    assert len(works) == 3
    assert all(w.parent_id == gather.id for w in works)
    # Interleaved coroutines overlap on one thread: moved to extra tracks so Perfetto keeps them.
    assert run.meta["correlation"]["separate_overlaps"]["moved"] >= 1
    assert run.meta["correlation"]["check_containment"]["outside_parent"] == 0


def test_threads_have_their_own_tracks_and_stacks(tmp_path: Path) -> None:
    def worker(i: int) -> None:
        with mltrace.span(f"thread-{i}"):
            with mltrace.span("child"):
                pass

    with mltrace.profile(output=tmp_path / "r", summary=False):
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    run = mltrace.load_run(tmp_path / "r")
    tops = [s for s in run.spans if s.name.startswith("thread-")]
    assert len({s.track_id for s in tops}) == 3
    assert all(s.parent_id is None for s in tops)
    for child in (s for s in run.spans if s.name == "child"):
        parent = run.span_by_id()[child.parent_id]
        assert parent.name.startswith("thread-") and parent.track_id == child.track_id


def test_profile_as_decorator_and_start_stop(tmp_path: Path) -> None:
    @mltrace.profile(output=tmp_path / "dec", summary=False)
    def job() -> int:
        with mltrace.span("in-job"):
            return 7

    assert job() == 7
    assert [s.name for s in mltrace.load_run(tmp_path / "dec").spans] == ["in-job"]
    p = mltrace.profile(output=tmp_path / "ss", summary=False).start()
    with mltrace.span("between"):
        pass
    assert p.stop() == tmp_path / "ss"
    assert p.stop() is None  # stopping twice is harmless
    assert mltrace.load_run(tmp_path / "ss").complete


def test_profile_rejects_bad_options(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="unknown option"):
        mltrace.profile(colour="red").start()
    with pytest.raises(UsageError, match="unknown level"):
        mltrace.profile(level="everything").start()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    with pytest.raises(UsageError, match="not empty"):
        mltrace.profile(output=tmp_path / "full").start()
    assert (tmp_path / "full" / "x").read_text() == "keep"


def test_a_second_session_is_refused(tmp_path: Path) -> None:
    with mltrace.profile(output=tmp_path / "a", summary=False):
        with pytest.raises(UsageError, match="already running"):
            mltrace.profile(output=tmp_path / "b").start()


@pytest.mark.parametrize("summary", [True, False])
def test_a_slow_stop_says_the_trace_is_being_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], summary: bool
) -> None:
    """Finishing a large run takes seconds: past FINISHING_NOTICE_S the user is told why,
    once, and then each step as it begins; a quiet session (summary=False) prints nothing."""
    import time

    from mltrace import finish
    from mltrace.tracer import session

    original = finish.finalize_run

    def slow_finalize(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.5)
        return original(*args, **kwargs)

    monkeypatch.setattr(session, "FINISHING_NOTICE_S", 0.05)
    monkeypatch.setattr(finish, "finalize_run", slow_finalize)
    with mltrace.profile(output=tmp_path / "run", summary=summary, level="model"), mltrace.span("work"):
        pass
    err = capsys.readouterr().err
    notice = f"mltrace: writing the trace to {tmp_path / 'run'}: stopping "
    assert err.count(notice) == (1 if summary else 0)
    steps = [line.removeprefix("mltrace: … ") for line in err.splitlines() if line.startswith("mltrace: … ")]
    if summary:
        assert steps == [
            "loading the recorded events",
            "correlating 1 span",  # the user span
            "rewriting events.jsonl",
            "writing the span table",
            "writing trace.pftrace (1 span)",
            "summarizing",
        ]
    else:
        assert steps == []
    assert mltrace.load_run(tmp_path / "run").complete


def test_the_programs_own_profile_inside_mltrace_python_is_a_span_of_the_run(tmp_path: Path) -> None:
    """A program that calls ``mltrace.profile()`` itself, run by ``mltrace python``: the region
    is recorded into the whole program's session, as a user span at the program's line (named by
    the ``name`` option), and the program runs as without mltrace (it failed with 'an mltrace
    session is already running'). A second session of the program's own is still refused."""
    import subprocess
    import sys

    from conftest import mltrace_cmd

    script = tmp_path / "regions.py"
    script.write_text(
        "import mltrace, torch\n"
        "m = torch.nn.Linear(4, 4)\n"
        "with mltrace.profile(name='warm', level='op') as p:\n"
        "    m(torch.ones(1, 4))\n"
        "print('region run dir given:', p.run_dir is not None)\n"
        "@mltrace.profile()\n"
        "def step():\n"
        "    return m(torch.ones(1, 4))\n"
        "step()\n"
        "print('done')\n"
    )
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    cmd = mltrace_cmd("python", "-q", "-o", str(tmp_path / "run"), str(script))
    traced = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert plain.returncode == traced.returncode == 0, traced.stderr
    assert traced.stdout == "region run dir given: True\ndone\n"
    run = mltrace.load_run(tmp_path / "run")
    regions = sorted((s.name, s.attrs.get("code.line.number")) for s in run.spans if s.level is Level.USER)
    assert regions == [("mltrace.profile", 9), ("warm", 3)]
    assert any("the program's own mltrace.profile() ran inside this session" in t for t in run.meta["limitations"])
    assert [s.name for s in run.spans if s.level is Level.MODEL] == ["Linear", "Linear"]
