"""The program's traceback under ``mltrace python``: mltrace's frames between the program's and,
for a Ctrl-C held through one of mltrace's steps and raised on leaving it, below them are cut;
the program's own calls into the standard library, and an error mltrace's API raises, keep
their frames."""

from __future__ import annotations

import contextlib
import json
import traceback
from collections.abc import Callable
from typing import Any

from mltrace import runner

OWN_FILE = runner._PACKAGE_DIR + "tracer/fake_step.py"  # a file name inside mltrace's package


HELD = """\
@contextlib.contextmanager
def _held():
    yield
    raise KeyboardInterrupt  # as a signal held through the block is delivered on leaving it
"""


def _own(source: str) -> Callable[..., Any]:
    """A function whose code says it is in mltrace's package, as the tracer's wrapper's."""
    namespace: dict[str, Any] = {"contextlib": contextlib}
    exec(compile(source, OWN_FILE, "exec"), namespace)  # noqa: S102 - the test's own source
    return namespace["step"]  # type: ignore[no-any-return]


def _files(exc: BaseException) -> list[str]:
    tb = runner._user_traceback(exc)
    return [frame.filename for frame in traceback.extract_tb(tb)]


def test_mltrace_frames_below_the_program_are_cut() -> None:
    step = _own(HELD + "def step():\n    with _held():\n        pass\n")
    try:
        step()  # the program's call into mltrace (a module call through the layer wrapper)
    except KeyboardInterrupt as exc:
        files = _files(exc)
    assert files == [__file__]


def test_an_error_mltraces_api_raises_keeps_its_frames() -> None:
    """As plain Python shows an error a library raises at its caller (a bad argument)."""
    step = _own("def step():\n    raise ValueError('bad level')\n")
    try:
        step()
    except ValueError as exc:
        files = _files(exc)
    assert files == [__file__, OWN_FILE]


def test_the_programs_own_standard_library_frames_are_kept() -> None:
    try:
        json.loads("{")
    except ValueError as exc:
        files = _files(exc)
    assert files[0] == __file__ and files[-1].endswith("json/decoder.py") and len(files) > 1


def test_mltrace_frames_between_the_programs_are_cut() -> None:
    """The wrapper of ``Module.__call__`` between the program's call and its ``forward``."""

    def forward() -> None:
        raise ValueError("the model's own error")

    step = _own("def step(forward):\n    return forward()\n")
    try:
        step(forward)
    except ValueError as exc:
        files = _files(exc)
    assert files == [__file__, __file__]
