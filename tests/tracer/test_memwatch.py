"""The memory watch of op-level sessions (tracer/memwatch.py) and the op level's early end
(tracer/windows.py) it triggers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mltrace.config import ProfileOptions
from mltrace.run.events import Event
from mltrace.run.levels import Level
from mltrace.tracer import memwatch
from mltrace.tracer.memwatch import GROWTH_BYTES, MemoryWatch, read_meminfo
from mltrace.tracer.session import Session
from mltrace.tracer.sources.base import Source

GIB = 1 << 30


def test_meminfo_is_read_from_the_kernel_format(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24576000 kB\nMemFree:         1000000 kB\nMemAvailable:    2048000 kB\n")
    assert read_meminfo(f) == (2048000 * 1024, 24576000 * 1024)
    f.write_text("MemTotal:       24576000 kB\n")  # an old kernel without MemAvailable
    assert read_meminfo(f) is None
    assert read_meminfo(tmp_path / "absent") is None
    assert read_meminfo() is not None  # this machine's own


def test_warns_once_when_memory_is_low_and_the_process_grew() -> None:
    rss = [1 * GIB]
    info: list[tuple[int, int] | None] = [(20 * GIB, 24 * GIB)]
    watch = MemoryWatch("the op level (torch.ops)", rss=lambda: rss[0], meminfo=lambda: info[0])
    assert watch.check() is None  # plenty available
    rss[0] = 7 * GIB
    assert watch.check() is None  # grew, but the machine still has room
    info[0] = (1 * GIB, 24 * GIB)
    message = watch.check()
    assert message is not None and "1.0 of 24.0 GiB available" in message and "grew by 6.0 GiB" in message
    assert "the op level (torch.ops)" in message
    assert watch.check() is None  # once


def test_an_armed_watch_fires_past_its_budget_counted_from_when_it_was_armed() -> None:
    rss = [3 * GIB]  # torch imported: not the profiler's
    plenty = (20 * GIB, 24 * GIB)
    watch = MemoryWatch("the op level (torch.profiler)", rss=lambda: rss[0], meminfo=lambda: plenty)
    rss[0] = 5 * GIB
    assert watch.check() is None  # no budget before it is armed, and memory is plentiful
    watch.arm(GIB)
    rss[0] = 5 * GIB + GIB - 1
    assert watch.check() is None
    rss[0] = 6 * GIB
    message = watch.check()
    assert message is not None and "grew by 1.0 GiB" in message and "budget of 1.0 GiB" in message
    assert watch.check() is None  # once


def test_what_the_stop_would_add_counts_against_the_budget() -> None:
    """torch.profiler's stop materialises what it holds (about 3 KB an op, where recording took
    a fifth of that): a cycle held over many calls passes the budget at its stop, not before."""
    rss = [GIB]
    watch = MemoryWatch("the op level (torch.profiler)", rss=lambda: rss[0], meminfo=lambda: (20 * GIB, 24 * GIB))
    watch.arm(GIB)
    rss[0] = GIB + GIB // 4
    assert watch.check(stop_bytes=GIB // 2) is None
    message = watch.check(stop_bytes=GIB - GIB // 4)
    assert message is not None and "grew by 0.2 GiB while traced (its stop would add about 0.8 GiB more)" in message


def test_growth_counts_only_where_a_profiler_holds_every_event() -> None:
    """torch.profiler in cycles holds only its running cycle: the process's growth is then the
    program's own (neither past the budget nor with memory low does it fire), and only what
    the running cycle's stop would take counts."""
    rss = [GIB]
    low = (GIB, 24 * GIB)
    watch = MemoryWatch("the op level (torch.profiler)", rss=lambda: rss[0], meminfo=lambda: low)
    watch.arm(GIB)
    rss[0] = 4 * GIB  # the program's own 3 GiB, with little memory left
    assert watch.check(stop_bytes=GIB // 4, growth=False) is None
    message = watch.check(stop_bytes=GIB + GIB // 10, growth=False)
    assert message == (
        "stopping torch.profiler's running cycle would take about 1.1 GiB, "
        "past the op level's memory budget of 1.0 GiB (MLTRACE_OP_MEMORY_GIB)"
    )
    assert watch.check(growth=True) is None  # once


def test_the_default_budget_is_5_percent_of_what_is_available_and_at_least_one_gib() -> None:
    assert memwatch.default_budget(80 * GIB) == 4 * GIB
    assert memwatch.default_budget(2 * GIB) == GIB
    assert memwatch.default_budget(None) == GIB
    assert memwatch.default_budget(40 * GIB, gib=0.5) == GIB // 2


def test_no_warning_when_the_machine_is_short_but_the_process_did_not_grow() -> None:
    """Another program using the memory is not mltrace's to report."""
    watch = MemoryWatch("x", rss=lambda: GIB, meminfo=lambda: (GIB // 10, 24 * GIB))
    assert watch.check() is None
    grown = MemoryWatch("x", rss=iter([GIB, GIB + GROWTH_BYTES]).__next__, meminfo=lambda: (GIB // 10, 24 * GIB))
    assert grown.check() is not None
    unknown = MemoryWatch("x", rss=lambda: 0, meminfo=lambda: None)
    assert unknown.check() is None


class _HoldingOpsSource(Source):
    """An op-level source that holds its events until the end, as torch.profiler does."""

    name = "held.ops"
    levels = (Level.OP,)

    def available(self) -> str | None:
        return None

    def start(self, session: Session) -> None:
        pass

    def stop(self) -> list[Event]:
        return []


def test_a_session_recording_ops_warns_on_stderr_and_in_run_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(memwatch, "LOW_FRACTION", 2.0)  # any machine is "low"
    monkeypatch.setattr(memwatch, "GROWTH_BYTES", -(1 << 62))  # and any process has "grown"
    session = Session(ProfileOptions(output=tmp_path / "run", summary=False, flush_interval_s=60), sources=[_HoldingOpsSource()])
    session.start()
    try:
        session.flush()
        session.flush()
    finally:
        run_dir = session.stop()
    warnings = [line for line in capsys.readouterr().err.splitlines() if "memory is running low" in line]
    assert len(warnings) == 1 and warnings[0].startswith("mltrace: warning: ") and "the op level (held.ops)" in warnings[0]
    assert "--level layer" in warnings[0]  # it cannot end early: what to do instead
    limitations = json.loads((run_dir / "run.json").read_text())["limitations"]
    assert [x for x in limitations if "memory is running low" in x] == [warnings[0].removeprefix("mltrace: warning: ")]


def test_a_session_without_the_op_level_does_not_watch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memwatch, "LOW_FRACTION", 2.0)
    monkeypatch.setattr(memwatch, "GROWTH_BYTES", -(1 << 62))
    session = Session(ProfileOptions(output=tmp_path / "run", summary=False, level=Level.LAYER), sources=[_HoldingOpsSource()])
    session.start()
    try:
        session.flush()
    finally:
        run_dir = session.stop()
    assert not any("memory" in x for x in json.loads((run_dir / "run.json").read_text())["limitations"])


def test_what_the_stop_itself_takes_is_not_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Converting a profiler's events at the end grows the process; the flusher may check then."""
    source = _HoldingOpsSource()
    session = Session(ProfileOptions(output=tmp_path / "run", summary=False, flush_interval_s=60), sources=[source])

    def stop() -> list[Event]:
        monkeypatch.setattr(memwatch, "LOW_FRACTION", 2.0)  # the machine is now "low"
        monkeypatch.setattr(memwatch, "GROWTH_BYTES", -(1 << 62))  # and the process has "grown"
        session.flush()  # the flusher thread's turn while this source converts its events
        return []

    monkeypatch.setattr(source, "stop", stop)
    session.start()
    session.flush()
    run_dir = session.stop()
    assert "memory" not in capsys.readouterr().err
    assert not any("memory" in x for x in json.loads((run_dir / "run.json").read_text())["limitations"])
