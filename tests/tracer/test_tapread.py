"""mltrace._tapread.Reader, the fd tap's C loop, driven directly on a pipe (FdTap's own tests
run it through fd 1)."""

from __future__ import annotations

import errno
import importlib.util
import os
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mltrace._tapread") is None, reason="the C helper is not built")

PREFIXES = (b"onednn_verbose,", b"MKL_VERBOSE ")


def _reader(read_fd: int, saved_fd: int, **kw: object):  # type: ignore[no-untyped-def]
    from mltrace._tapread import Reader

    args = {"prefixes": PREFIXES, "urgent": (), "hold_s": 0.05, "batch_s": 0.0, "max_line": 1 << 16, **kw}
    return Reader(read_fd, saved_fd, args["prefixes"], args["urgent"], args["hold_s"], args["batch_s"], args["max_line"])


def test_reads_to_the_end_capturing_lines_and_forwarding_the_rest(tmp_path: Path) -> None:
    out = tmp_path / "forwarded"
    saved = os.open(out, os.O_WRONLY | os.O_CREAT)
    r, w = os.pipe()
    try:
        reader = _reader(r, saved)
        thread = threading.Thread(target=reader.run)
        thread.start()
        os.write(w, b"user 1\nonednn_verbose,a,b\r\nhalf ")
        os.write(w, b"MKL_VERBOSE SGEMM(N) 1.00us\nof a line\nonednn_verb")
        os.write(w, b"ose,split across writes\ntail without newline")
        os.close(w)
        thread.join(10)
        assert not thread.is_alive()  # returned at the pipe's end
        blocks = reader.take()
        assert reader.take() == []  # taken once
    finally:
        os.close(r)
        os.close(saved)
    lines = [line for _, block in blocks for line in block.split(b"\n")[:-1]]
    assert lines == [b"onednn_verbose,a,b\r", b"MKL_VERBOSE SGEMM(N) 1.00us", b"onednn_verbose,split across writes"]
    assert [ns for ns, _ in blocks] == sorted(ns for ns, _ in blocks)
    assert out.read_bytes() == b"user 1\nhalf of a line\ntail without newline"
    assert reader.forwarded_bytes == len(out.read_bytes()) and reader.forward_errors == 0


def test_a_read_error_ends_run_with_oserror() -> None:
    r, w = os.pipe()
    os.close(w)
    os.close(r)  # a descriptor that is no longer open
    reader = _reader(r, 2)
    with pytest.raises(OSError) as info:
        reader.run()
    assert info.value.errno in (errno.EBADF, errno.EINVAL)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        _reader(0, 1, prefixes=())
    with pytest.raises(ValueError):
        _reader(0, 1, prefixes=(b"",))
    with pytest.raises(ValueError):
        _reader(0, 1, prefixes=tuple(b"p%d" % i for i in range(9)))
    with pytest.raises(TypeError):
        _reader(0, 1, prefixes=("text",))
