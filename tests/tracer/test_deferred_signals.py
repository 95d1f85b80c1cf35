"""SIGINT and SIGTERM held back while the op level switches cycles (a signal between the
profiler's stop and its hand-over to the converter lost every later op)."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from mltrace.tracer.deferred_signals import signals_held
from mltrace.tracer.sources.torch_ops import TorchOpSource


class _Interrupted(Exception):
    pass


def _raise(signum: int, frame: Any) -> None:
    raise _Interrupted(signum)


@pytest.fixture
def raising_sigterm() -> Any:
    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_in_the_block_is_raised_after_it(raising_sigterm: None) -> None:
    steps: list[str] = []
    with pytest.raises(_Interrupted), signals_held():
        os.kill(os.getpid(), signal.SIGTERM)
        steps.append("after the signal")  # the handler has not run: the block goes on
    assert steps == ["after the signal"]
    assert signal.getsignal(signal.SIGTERM) is _raise  # the program's handler is back


def test_nothing_is_raised_without_a_signal(raising_sigterm: None) -> None:
    with signals_held():
        pass
    assert signal.getsignal(signal.SIGTERM) is _raise


class _StopSignalled:
    """A profiler whose stop is interrupted by SIGTERM, as a signal during Kineto's stop is."""

    stopped = False

    def stop(self) -> None:
        self.stopped = True
        os.kill(os.getpid(), signal.SIGTERM)

    def export_chrome_trace(self, path: str) -> None:
        Path(path).write_text("{}")


class _Cycles:
    def __init__(self) -> None:
        self.paths: list[tuple[Path, int]] = []

    @property
    def handed(self) -> int:
        return len(self.paths)

    def hand(self, path: Path, calls: int, stopped_ns: int, spans: int) -> None:
        self.paths.append((path, calls))


def test_a_signal_during_a_cycle_switch_comes_after_the_stopped_profiler_is_handed_on(raising_sigterm: None) -> None:
    source = TorchOpSource()
    prof, cycles = _StopSignalled(), _Cycles()
    source._prof, source._cycles, source._cycle_calls = prof, cycles, 7  # type: ignore[assignment]
    with pytest.raises(_Interrupted):
        source._next_cycle(restart=False)
    assert prof.stopped and source._prof is None
    assert [(path.name, path.read_text(), calls) for path, calls in cycles.paths] == [("torch-profiler-1.json", "{}", 7)]
    shutil.rmtree(cycles.paths[0][0].parent)  # the source's temporary directory (no run directory)
