"""Capture library verbose lines from file descriptor 1, forwarding everything else.

oneDNN and oneMKL print their verbose lines with C ``printf`` on fd 1, below Python's
``sys.stdout``. ``FdTap`` puts a pipe in place of fd 1 for a while; a reader cuts out every
run of bytes from a verbose prefix to the next newline (stamped with the session clock when it
arrives) and writes every other byte to the original fd 1, unchanged and in order, so the
user's output comes out as in a plain run:

- stdio buffers are flushed around every switch of fd 1; a prefix is recognised mid-line too
  (a program line that itself contains ``MKL_VERBOSE `` loses its rest to the capture);
- a partial line is forwarded as soon as it cannot become a verbose line (``hold_s``);
- where fd 1 is a terminal, the pipe is a pseudo-terminal with the terminal's settings and
  size (``_terminal_like``), so the program still sees a terminal (isatty, its size, Python's
  line buffering, colours);
- ``stop()`` keeps another thread's output in order (``_restore_in_order``), and fd 2 goes
  through the same pipe where it goes where fd 1 goes (``merge_fd``);
- children inherit the pipe; one that outlives ``stop()`` keeps a detached reader.

The reader is a thread running ``_tapread``'s C loop without the GIL where the helper is built,
else the Python loop (``MLTRACE_FDTAP_READER=python``), or a child process (``reader``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import select
import stat
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from itertools import repeat
from typing import Any, NamedTuple

from mltrace.formats.verbose_logs import VERBOSE_PREFIXES
from mltrace.native import c_helper
from mltrace.settings import FDTAP_READER
from mltrace.tracer.helper_env import wait_for_exit

_F_SETPIPE_SZ = 1031  # Linux's F_SETPIPE_SZ, for Pythons whose fcntl module lacks the name
_F_GETPIPE_SZ = 1032  # and F_GETPIPE_SZ
_READ_SIZE = 1 << 16
_MAX_LINE = 1 << 16  # longest verbose line (bytes) waited for; real ones are under 2 KiB
_PTY_CAPACITY = 16 << 10  # what a Linux pseudo-terminal holds before its writer waits (bytes, about)
_LEFT_OVER_READS = 256  # reads of what is left in the pipe at stop (as _tapread.c's restore)


def batch_sleep_s(batch_s: float, read_bytes: int, elapsed_s: float, pipe_capacity: int) -> float:
    """How long the reader sleeps after a read that emptied the pipe (the C reader's rule too).

    ``batch_s``, or less where ``read_bytes`` read since the pipe was last emptied, over
    ``elapsed_s``, say that at this rate a quarter of the pipe fills sooner: a full pipe
    would block the program's writes until the reader wakes. Never under 1 ms.
    """
    sleep = batch_s
    if read_bytes > 0 and elapsed_s > 0:
        sleep = min(sleep, elapsed_s * (pipe_capacity / 4) / read_bytes)
    return max(sleep, 0.001)


def _pipe_capacity(fd: int) -> int:
    """The pipe's capacity in bytes (64 KiB where it cannot be asked)."""
    try:
        return fcntl.fcntl(fd, getattr(fcntl, "F_GETPIPE_SZ", _F_GETPIPE_SZ))
    except OSError:
        return 1 << 16


def _terminal_like(tty_fd: int) -> tuple[int, int] | None:
    """A pseudo-terminal (master, slave) that looks to a program as the terminal ``tty_fd``
    does, or None where ``tty_fd`` is no terminal or the pseudo-terminal cannot be made so.

    The slave gets the terminal's settings and window size, so ``isatty``,
    ``os.get_terminal_size`` and Python's line buffering are as on the terminal, except that
    output processing (``OPOST``: newline to CR-LF and the like) is off: the terminal does it
    once when the reader forwards the bytes, which reach it unchanged.
    """
    if not os.isatty(tty_fd):
        return None
    try:
        master, slave = os.openpty()  # not inheritable; fd 1's copy of the slave is
    except OSError:
        return None
    try:
        attrs = termios.tcgetattr(tty_fd)
        attrs[1] &= ~termios.OPOST
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        fcntl.ioctl(slave, termios.TIOCSWINSZ, fcntl.ioctl(tty_fd, termios.TIOCGWINSZ, b"\0" * 8))
    except (OSError, termios.error):
        os.close(master)
        os.close(slave)
        return None
    return master, slave


def _pty_ended(exc: OSError, pty: bool) -> bool:
    """Whether a read error is a pseudo-terminal's end: its master reads EIO once every
    slave descriptor is closed, where a pipe's read end reads 0 bytes."""
    return pty and exc.errno == errno.EIO


class TappedLine(NamedTuple):
    """A captured line.

    Attributes:
        receive_ns: session-clock time (``time.monotonic_ns()``, ns) at which
            the reader received the bytes that completed the line.
        text: the line without its line ending, decoded as UTF-8 (invalid
            bytes replaced).
    """

    receive_ns: int
    text: str


#: Set by ``exiting_without_flush``: the process is leaving through ``os._exit``.
_NO_FLUSH = False


def exiting_without_flush() -> None:
    """Says that the process leaves through ``os._exit``, which discards what waits in
    Python's and C's stdio buffers: from now on no tap flushes them (``_flush_stdio``), so
    that output a plain run loses is not printed under mltrace. What already reached a tap's
    pipe is still forwarded; verbose lines left in C's buffer are lost to the trace."""
    global _NO_FLUSH
    _NO_FLUSH = True


def _flush_stdio() -> None:
    """Flushes Python's and C's stdout and stderr buffers, ignoring closed or broken streams;
    nothing after ``exiting_without_flush``."""
    if _NO_FLUSH:
        return
    for stream in (sys.stdout, sys.__stdout__, sys.stderr, sys.__stderr__):
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.flush()
    with contextlib.suppress(Exception):
        _libc().fflush(None)  # every C FILE*: stdout written by printf in a library


_LIBC: ctypes.CDLL | None = None


_PYLIBC: ctypes.PyDLL | None = None


def _pylibc() -> ctypes.PyDLL | None:
    """libc through ``ctypes.PyDLL``, whose calls keep the GIL: no other Python thread runs
    while one is in ``read``, ``write`` or ``dup2`` this way. None where it cannot be loaded."""
    global _PYLIBC
    if _PYLIBC is None:
        try:
            lib = ctypes.PyDLL(None, use_errno=True)
            lib.read.argtypes = lib.write.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
            lib.read.restype = lib.write.restype = ctypes.c_ssize_t
            lib.dup2.argtypes = [ctypes.c_int, ctypes.c_int]
            lib.dup2.restype = ctypes.c_int
        except (OSError, AttributeError):
            return None
        _PYLIBC = lib
    return _PYLIBC


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None)
    return _LIBC


class FdTap:
    """Diverts lines with given prefixes from a file descriptor (fd 1 by default).

    Usage::

        with FdTap() as tap:
            run_model()
        for line in tap.lines():
            ...

    Args:
        fd: the file descriptor to tap (1: standard output).
        prefixes: the bytes from one of these to the next newline are
            captured, not forwarded.
        hold_s: longest time (s) to hold back a partial line that might still
            become a captured line, before forwarding it.
        pipe_size: requested pipe capacity (bytes); the kernel may cap it.
        batch_s: after a read that emptied the pipe, how long (s) the reader
            sleeps so that the next read takes many lines at once (less where
            a quarter of the pipe would fill sooner at the rate just read:
            ``batch_sleep_s``; after a read that filled its buffer it reads
            again at once). Where the program's threads fill every core, each
            wake-up of the reader displaces one of them: waking once per
            verbose line (80 a ResNet-18 inference) cost ≈ 6 %, every 10 ms
            still 1–2 %. Lines keep the time they were read, so a line's
            receipt time, and the program's own output, can be this much
            later than its write. ``stop()`` cuts the thread reader's sleep short
            (the reader process finishes its own).
        urgent: prefixes of lines whose receipt time should stay close to
            their write: after a read that contained one, the reader does not
            sleep, since more tend to follow. The library source reads every
            line in batches (MKL placement no longer leans on receipt time);
            ``benchmarks/library_tap.py`` compares both.
        merge_fd: a descriptor (2: standard error) tapped through the same pipe where it
            refers to the same open file or terminal as ``fd`` (``_same_destination``; a terminal
            only where ``fd``'s is tapped through a pseudo-terminal), so that the
            order of their writes is kept; its bytes are forwarded to ``fd``'s original,
            its verbose lines captured as ``fd``'s. None: never.
        reader: ``"thread"`` (in this process) or ``"process"``: a small
            child process (``python -m mltrace.tracer.fdtap``) reads the pipe,
            so reading never takes the GIL from the program and a writer that
            holds the GIL cannot block on a full pipe. Falls back to the
            thread when the child cannot start.
        echo: prefixes (some of ``prefixes``) of captured lines that are forwarded as well, in
            place, as a plain run prints them: verbose output the program's user asked for. The
            thread reader is then the Python loop (the C one forwards no captured line), as
            where the descriptor is tapped through a pseudo-terminal (``pty``; the C loop
            sizes its batching to a pipe's capacity, 4 times what a pseudo-terminal holds).

    Attributes:
        forwarded_bytes: bytes written to the original descriptor.
        forward_errors: writes to the original descriptor that failed (the
            bytes were dropped: its reader is gone).
        detached: True when ``stop()`` returned before the pipe's end (a child
            process still held it) and the reader went on in the background.
        held_by_helpers: True when ``stop()`` did not wait for the pipe's end because only
            multiprocessing's lifelong helpers (its resource tracker, its forkserver) held it.
    """

    def __init__(
        self,
        fd: int = 1,
        prefixes: tuple[bytes, ...] = VERBOSE_PREFIXES,
        hold_s: float = 0.05,
        pipe_size: int = 1 << 20,
        batch_s: float = 0.0,
        urgent: tuple[bytes, ...] = (),
        reader: str = "thread",
        merge_fd: int | None = 2,
        echo: tuple[bytes, ...] = (),
    ) -> None:
        self.fd = fd
        self.merge_fd = merge_fd if merge_fd != fd else None
        self._merge_saved = -1  # the original of merge_fd while it points at the pipe
        self.prefixes = prefixes
        self.echo = echo
        # Whole captured lines one after the other (a library's output, the common case):
        # matched in one pass instead of a Python step per line.
        self._line_run = re.compile(b"(?:(?:" + b"|".join(map(re.escape, prefixes)) + b")[^\n]*\n)+")
        self.hold_s = hold_s
        self.batch_s = batch_s
        self.urgent = urgent
        if reader not in ("thread", "process"):
            raise ValueError(f"reader must be 'thread' or 'process', not {reader!r}")
        self.reader = reader
        self._process: subprocess.Popen[bytes] | None = None
        self._out_path = ""  # process reader: the file it appends captured lines to
        self._out_offset = 0
        self.pipe_size = pipe_size
        self.forwarded_bytes = 0
        self.forward_errors = 0
        self.detached = False
        self.held_by_helpers = False
        self._lines: list[TappedLine] = []
        self._captured_lines = 0  # the thread reader's in Python: lines captured since the start
        self._raw: list[tuple[int, list[bytes]]] = []  # captured, not decoded yet (``_lines_of``)
        self._lock = threading.Lock()
        self._saved_fd = -1
        self._read_fd = -1
        #: What the saved and read descriptors were made as (``_fd_ident``): a program may close
        #: them (``os.closerange``) and reuse their numbers, which mltrace must then leave alone.
        self._saved_ident: tuple[int, int] | None = None
        self._read_ident: tuple[int, int] | None = None
        #: What the descriptor points at while tapped: (device, inode), and its /proc link text.
        self._write_ident: tuple[int, int] | None = None
        self._write_path = ""
        #: Whether the descriptor is tapped through a pseudo-terminal (it was a terminal).
        self.pty = False
        self._thread: threading.Thread | None = None
        self._collecting = True
        self._active = False
        self._reader_done = False
        # The thread reader's state, for stop(): waiting for the pipe with nothing read and not
        # forwarded (idle); draining: no batching sleeps; the restore's writes keep the GIL.
        self._idle = False
        self._draining = threading.Event()  # setting it also ends a batching sleep
        self._gil_writes = False
        self._libc = _pylibc() if reader == "thread" else None
        self._buf = ctypes.create_string_buffer(_READ_SIZE) if self._libc is not None else None
        self._native_type = _native_reader() if reader == "thread" and not echo else None
        self._native: Any = None  # the C reader (``_tapread.Reader``) of this start, if any
        self._pid = os.getpid()  # the process whose reader thread this is (see _reader_here)
        self.reader_error: OSError | None = None  # what ended the reader thread early, if anything

    # -- public ------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Whether the descriptor is currently diverted."""
        return self._active

    def start(self) -> FdTap:
        """Replaces the descriptor with a pipe and starts the reader thread.

        Raises:
            RuntimeError: if this tap is already active.
            OSError: if the descriptor is closed or no pipe can be made.
        """
        if self._active:
            raise RuntimeError("FdTap already started")
        _flush_stdio()
        saved = os.dup(self.fd)
        try:
            read_fd, write_fd = self._channel(saved)
        except OSError:
            os.close(saved)
            raise
        try:
            os.dup2(write_fd, self.fd)  # inheritable, so children write to the pipe too
        except OSError:
            for f in (saved, read_fd, write_fd):
                os.close(f)
            raise
        self._write_ident = _fd_ident(write_fd)
        self._write_path = os.ttyname(write_fd) if self.pty else f"pipe:[{self._write_ident[1] if self._write_ident else -1}]"
        os.close(write_fd)  # fd 1 is now the process's only write end
        self._saved_fd, self._read_fd = saved, read_fd
        self._saved_ident, self._read_ident = _fd_ident(saved), _fd_ident(read_fd)
        self._collecting = True
        self.detached = False
        self._reader_done = False
        self._idle = False
        self._draining.clear()
        if self.reader == "process" and self._start_process():
            self._merge()
            self._active = True
            atexit.register(self.stop)
            return self
        target = self._run
        self._native = None
        self._pid = os.getpid()
        if self._native_type is not None and not self.pty:  # the C loop knows only pipes (``_run``)
            os.set_blocking(read_fd, False)  # restore() empties the pipe without waiting
            self._native = self._native_type(read_fd, saved, self.prefixes, self.urgent, self.hold_s, self.batch_s, _MAX_LINE)
            target = self._run_native
        self._thread = threading.Thread(target=target, name="mltrace-fdtap", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            os.dup2(saved, self.fd)  # nobody would read the pipe: writers would block
            os.close(saved)
            os.close(read_fd)
            self._thread = None
            raise
        self._merge()
        self._active = True
        atexit.register(self.stop)  # a program that exits without stop() still gets its output
        return self

    def _channel(self, saved: int) -> tuple[int, int]:
        """The read and write ends that stand in for the descriptor while tapped: a
        pseudo-terminal where ``saved`` is a terminal (``_terminal_like``), else a pipe."""
        pty = _terminal_like(saved)
        self.pty = pty is not None
        if pty is not None:
            return pty
        read_fd, write_fd = os.pipe()
        try:
            # 1 MiB: the Python reader needs the GIL, so a writer that holds it while it fills the
            # pipe would wait forever; that now takes over a thousand verbose lines in one call.
            fcntl.fcntl(write_fd, getattr(fcntl, "F_SETPIPE_SZ", _F_SETPIPE_SZ), self.pipe_size)
        except OSError:
            pass  # a smaller pipe only means more, smaller reads
        return read_fd, write_fd

    def stop(self, timeout_s: float = 5.0) -> list[TappedLine]:
        """Restores the descriptor, drains the pipe and returns the captured lines.

        Safe to call twice. The descriptor is restored even if draining fails.

        Args:
            timeout_s: how long (s) to wait for the pipe's end, which comes
                when every process holding it (children included) closed it.

        Returns:
            Every captured line, in arrival order.
        """
        if not self._active:
            return self.lines()
        self._active = False
        atexit.unregister(self.stop)
        restored = False
        try:
            _flush_stdio()
            restored = self.reader_error is None and self._restore_in_order()
        finally:
            if not restored and self._saved_is_ours():
                os.dup2(self._saved_fd, self.fd)  # closes this process's write end of the pipe
            self._unmerge()
        if self._process is not None:
            return self._stop_process(timeout_s)
        if self._thread is not None:
            self._thread.join(min(timeout_s, _FIRST_WAIT_S))
            self.held_by_helpers = self._thread.is_alive() and _only_lifelong_helpers_write(self._write_path)
            if not self.held_by_helpers:
                self._thread.join(max(0.0, timeout_s - _FIRST_WAIT_S))
        with self._lock:
            if self._reader_done:
                self._close_saved()
            else:
                # A child still holds the pipe: the reader goes on forwarding
                # its output and closes the descriptors when the pipe ends.
                self.detached = True
                self._collecting = False
        self._thread = None
        lines = self.lines()
        native = self._reader_here()
        if native is not None:
            native.collecting = False  # after the lines above: a detached reader's are not returned
            self.forwarded_bytes, self.forward_errors = native.forwarded_bytes, native.forward_errors
        return lines

    def release_in_forked_child(self) -> None:
        """In a child forked while the tap runs: points this process's fd 1 back at the
        original, where the parent's reader does not see it. The parent's tap goes on."""
        if not self._active:
            return
        self._active = False
        atexit.unregister(self.stop)
        _flush_stdio()
        os.dup2(self._saved_fd, self.fd)
        self._unmerge()

    def _merge(self) -> None:
        """Points ``merge_fd`` at the pipe where it goes where ``fd`` went (``_same_destination``)."""
        other = self.merge_fd
        if other is None or (os.isatty(other) and not self.pty) or not _same_destination(self._saved_fd, other):
            return
        _flush_stdio()
        try:
            saved = os.dup(other)
        except OSError:
            return
        try:
            os.dup2(self.fd, other)
        except OSError:
            os.close(saved)
            return
        self._merge_saved = saved

    def _unmerge(self) -> None:
        """Points ``merge_fd`` back at its original (where ``_restore_in_order`` has not) and closes the copy."""
        with self._lock:  # stop() and a failing reader thread
            saved, self._merge_saved = self._merge_saved, -1
        if saved < 0 or self.merge_fd is None:
            return
        with contextlib.suppress(OSError):
            if _fd_ident(self.merge_fd) == self._write_ident:
                os.dup2(saved, self.merge_fd)
            os.close(saved)

    def _restore_in_order(self, timeout_s: float = 1.0) -> bool:
        """Restores the descriptor so that another thread's output stays in order; False where
        it could not (the caller restores it plainly).

        Another thread of the program may be writing meanwhile. Bytes of it still in the pipe
        when the descriptor is restored would be forwarded after its next write, which goes
        straight to the original descriptor, and come out after it. So this waits until the
        reader has forwarded everything it read and waits for more (``_idle``), then, without
        letting any other Python thread run, restores the descriptor, reads what is left in
        the pipe and forwards it: the other thread's next write comes after all of it.
        """
        if self._native is not None:
            native = self._reader_here()
            if native is None:
                return False  # a forked child: the reader thread is its parent's (restored plainly)
            # The C reader handles each read under a mutex, which restore() takes: it sees all
            # of a read or none, and keeps the GIL while it forwards what is left.
            native.draining = True
            if self._merge_saved >= 0 and self.merge_fd is not None:
                return bool(native.restore(self.fd, self.merge_fd, self._merge_saved))
            return bool(native.restore(self.fd))
        libc, thread = self._libc, self._thread
        if libc is None or thread is None:
            return False
        self._draining.set()
        deadline = time.monotonic() + timeout_s
        # A thread that waits for the GIL longer than the switch interval makes the holder
        # give it up at its next bytecode boundary: for the few microseconds below, that must
        # not happen, so threads that begin to wait from now on wait longer first.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(max(interval, 1.0))
        try:
            # Waiting with the pipe empty: the reader may have marked itself idle just before a
            # select that returns at once, and forwarding a full pipe here, with the GIL, could
            # block on a stdout that a Python thread of this program drains.
            while not (self._idle and _unread_bytes(self._read_fd) == 0):
                if time.monotonic() > deadline or not thread.is_alive():
                    return False
                time.sleep(0.0002)  # lets the reader (and any thread waiting for the GIL) run
            # From here on, only calls that keep the GIL.
            if libc.dup2(self._saved_fd, self.fd) < 0:
                return False
            if self._merge_saved >= 0 and self.merge_fd is not None:
                libc.dup2(self._merge_saved, self.merge_fd)
            self._forward_left_over()
        finally:
            sys.setswitchinterval(interval)
        return True

    def _forward_left_over(self) -> None:
        """What is left in the pipe, split and forwarded keeping the GIL (``_restore_in_order``)."""
        self._gil_writes = True
        try:
            left = b""
            # At most _LEFT_OVER_READS reads: a child that goes on writing to the pipe must not
            # keep the GIL here; what it writes later, the reader forwards.
            for _ in range(_LEFT_OVER_READS):
                chunk = self._read_now(self._read_fd)
                if not chunk:
                    break
                left += chunk
            if left:
                try:
                    rest = self._split(left, time.monotonic_ns())
                except Exception:  # a bug here must not cost the user's output
                    rest = left
                if rest.startswith(self.prefixes):
                    self._capture(rest, time.monotonic_ns())
                else:
                    self._forward(rest)
        finally:
            self._gil_writes = False

    def _read_now(self, fd: int) -> bytes | None:
        """What the pipe holds (up to a read's worth), read keeping the GIL; None when it is
        empty, b"" at its end."""
        assert self._libc is not None and self._buf is not None
        n = self._libc.read(fd, self._buf, _READ_SIZE)
        if n < 0:
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                return None
            if err == errno.EIO and self.pty:
                return b""  # a pseudo-terminal's end (``_pty_ended``)
            raise OSError(err, os.strerror(err))
        return ctypes.string_at(self._buf, n)

    @property
    def captured_count(self) -> int:
        """Lines captured so far by the thread reader (the reader process's are not counted)."""
        native = self._native
        if native is not None:
            return int(native.captured_lines)
        return self._captured_lines

    def lines(self) -> list[TappedLine]:
        """A copy of the lines captured so far (after ``take_lines()``: those not taken)."""
        with self._lock:
            self._decode_raw()
            return list(self._lines)

    def take_lines(self) -> list[TappedLine]:
        """The lines captured since the last take (or the start), in arrival order, which the
        tap then forgets: ``lines()`` and ``stop()`` return only the lines not taken. It costs
        the new lines, not the run's: the library level hands them over while the program runs."""
        with self._lock:
            self._decode_raw()
            taken, self._lines = self._lines, []
            return taken

    def pipe_empty(self) -> bool:
        """Whether no byte waits in the pipe for this process's reader thread (False where that
        cannot be told: not active, a reader process, the read end closed by the program).

        With the C reader a read and the capture of its lines happen under one mutex, which
        ``take_lines`` takes too: after True, a take returns every line written to the pipe
        before this call began, except one still being written (held as a started line). The
        Python reader may be between a read and its capture for a moment."""
        if not self._active or self._process is not None or _fd_ident(self._read_fd) != self._read_ident:
            return False
        return _unread_bytes(self._read_fd) == 0

    def _decode_raw(self) -> None:
        """Moves what the reader captured since the last call into ``_lines``, decoded (holding
        ``_lock``)."""
        if self._out_path:
            self._read_process_output()
        native = self._reader_here()
        if native is not None:
            self._raw.extend((ns, [block]) for ns, block in native.take())
        for receive_ns, raw in self._raw:
            for block in raw:
                self._lines.extend(_tapped_lines(receive_ns, block))
        self._raw.clear()

    def __enter__(self) -> FdTap:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- process reader ------------------------------------------------------

    def _start_process(self) -> bool:
        """Starts the child that reads the pipe; False (nothing changed) if it cannot start."""
        try:
            out_fd, out_path = tempfile.mkstemp(prefix="mltrace-fdtap-", suffix=".lines")
        except OSError:
            return False
        config = {
            "read_fd": self._read_fd,
            "saved_fd": self._saved_fd,
            "out_fd": out_fd,
            "prefixes": [p.hex() for p in self.prefixes],
            "urgent": [p.hex() for p in self.urgent],
            "hold_s": self.hold_s,
            "batch_s": self.batch_s,
            "pty": self.pty,
            "echo": [p.hex() for p in self.echo],
        }
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "mltrace.tracer.fdtap", json.dumps(config)],
                pass_fds=(self._read_fd, self._saved_fd, out_fd),
                stdin=subprocess.DEVNULL,
                stdout=self._saved_fd,  # never the pipe: the child must not hold a write end
                close_fds=True,
            )
        except OSError:
            os.close(out_fd)
            os.unlink(out_path)
            return False
        finally:
            if self._process is not None:
                os.close(out_fd)
        # The child has its own copies of both ends it needs.
        os.close(self._read_fd)
        self._out_path, self._out_offset = out_path, 0
        self._lines = []
        return True

    def _read_process_output(self) -> None:
        """Appends the lines the child wrote since the last call (holding ``_lock``)."""
        try:
            with open(self._out_path, "rb") as f:
                f.seek(self._out_offset)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        self._out_offset += end
        got: list[TappedLine] = []
        for row in data[:end].split(b"\n")[:-1]:
            if row.startswith(b"#"):  # the child's closing counts
                forwarded, errors = row[1:].split()
                self.forwarded_bytes, self.forward_errors = int(forwarded), int(errors)
                continue
            ns, _, text = row.partition(b" ")
            got.append(TappedLine(int(ns), text.decode("utf-8", "replace")))
        if self._collecting:
            self._lines.extend(got)

    def _stop_process(self, timeout_s: float) -> list[TappedLine]:
        process, self._process = self._process, None
        assert process is not None
        os.close(self._saved_fd)  # the child holds its own copy
        if wait_for_exit(process, timeout_s):
            process.wait()
        else:
            # A child of the program still holds the pipe: the reader goes on
            # forwarding its output in the background and exits at the pipe's end.
            self.detached = True
        with self._lock:
            self._read_process_output()
            self._collecting = False
            lines = list(self._lines)
        with contextlib.suppress(OSError):
            os.unlink(self._out_path)
        self._out_path = ""
        return lines

    # -- reader ------------------------------------------------------------

    def _forward(self, data: bytes) -> None:
        if not data:
            return
        if self._gil_writes and self._libc is not None:  # stop()'s restore: keep the GIL
            view = memoryview(data)
            while view:
                n = self._libc.write(self._saved_fd, bytes(view), len(view))
                if n < 0:
                    if ctypes.get_errno() == errno.EINTR:
                        continue
                    self.forward_errors += 1
                    return
                self.forwarded_bytes += n
                view = view[n:]
            return
        view = memoryview(data)
        while view:
            try:
                n = os.write(self._saved_fd, view)
            except InterruptedError:
                continue
            except OSError:
                self.forward_errors += 1
                return  # the reader of the original fd is gone; keep draining
            self.forwarded_bytes += n
            view = view[n:]

    def _capture(self, line: bytes, receive_ns: int) -> None:
        """Captures a line that the pipe's end cut short (no newline)."""
        self._echo(line)
        self._capture_all([line], receive_ns)

    def _echo(self, block: bytes) -> None:
        """Forwards the lines of a captured block (each ended by a newline, but maybe the last)
        that start with an ``echo`` prefix."""
        if not self.echo:
            return
        if block.startswith(self.echo) and all(p in self.echo for p in self.prefixes):
            self._forward(block)
            return
        lines = block.split(b"\n")
        kept = [line + b"\n" for line in lines[:-1] if line.startswith(self.echo)]
        if lines[-1].startswith(self.echo):
            kept.append(lines[-1])
        self._forward(b"".join(kept))

    def _capture_all(self, lines: list[bytes], receive_ns: int) -> None:
        # Kept as bytes: ``lines()`` decodes them, so the reader holds the GIL for less. An
        # item may be a block of several lines, each ended by a newline (``_split``).
        with self._lock:
            if self._collecting:
                self._raw.append((receive_ns, lines))
                self._captured_lines += sum(max(1, item.count(b"\n")) for item in lines)

    def _reader_here(self) -> Any:
        """The C reader, where this process runs its thread: a child forked meanwhile has a copy
        of the reader's state but not its thread, and its mutex may have been copied locked."""
        return self._native if self._native is not None and os.getpid() == self._pid else None

    def _run_native(self) -> None:
        """The thread reader's loop in C (``_tapread``), which releases the GIL until the pipe ends."""
        fd = self._read_fd
        try:
            self._native.run()
        except OSError as exc:  # a broken pipe read: the tap ends, the program goes on
            if not _pty_ended(exc, self.pty):
                self._reader_failed(exc)
        finally:
            self._reader_finished(fd)

    def _reader_failed(self, exc: OSError) -> None:
        """The reader could not go on (the program closed the pipe's read end, say, with
        ``os.closerange``): the program's output must not go into a pipe nobody reads (its
        writes would fail with EPIPE). The descriptor goes back to the original where that
        is still the one saved, else to /dev/null, with one warning."""
        try:
            if not self._active:
                return  # stop() restores it
            self._unmerge()
            if self._saved_is_ours():
                with contextlib.suppress(OSError):
                    os.dup2(self._saved_fd, self.fd)
                    return
            with contextlib.suppress(OSError):
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, self.fd)
                os.close(null)
            _warn(f"the tap on descriptor {self.fd} lost its pipe ({exc}); the program's output there is discarded from now on")
        finally:
            self.reader_error = exc  # once the descriptor is safe to write to

    def _reader_finished(self, fd: int) -> None:
        """Closes the pipe's read end, and the saved descriptor too where stop() left the reader
        running in the background (``detached``); a descriptor that is no longer the one made
        (the program closed it and may have reused its number) is left alone."""
        if _fd_ident(fd) == self._read_ident:
            os.close(fd)
        with self._lock:
            self._reader_done = True
            if self.detached:
                self._close_saved()

    def _saved_is_ours(self) -> bool:
        """Whether the saved descriptor still refers to the original it was made as."""
        return _fd_ident(self._saved_fd) == self._saved_ident

    def _close_saved(self) -> None:
        if self._saved_is_ours():
            os.close(self._saved_fd)

    def _run(self) -> None:
        fd = self._read_fd
        pending = b""  # a segment (no newline) held back: it may become a captured line
        held_since = 0.0
        # A pseudo-terminal's master reads at most a few KiB at a time and holds about 16 KiB:
        # read on while bytes wait, and size the batching sleep to what it holds, or a program
        # that prints fast waits on the full pseudo-terminal for most of each sleep.
        capacity = _PTY_CAPACITY if self.pty else _pipe_capacity(fd)
        emptied, since_emptied = time.monotonic(), 0  # when a read last emptied the pipe; bytes since
        if self._libc is not None:
            # Reads keep the GIL (``_read_now``): while this thread waits in select, the pipe's
            # bytes are either still in it or forwarded, which ``_restore_in_order`` relies on.
            os.set_blocking(fd, False)
        try:
            while True:
                if pending:
                    wait = self.hold_s - (time.monotonic() - held_since)
                    ready = wait > 0 and select.select([fd], [], [], wait)[0]
                    if not ready:
                        if not pending.startswith(self.prefixes):
                            self._forward(pending)  # still only a prefix of a prefix: user output
                            pending = b""
                            continue
                        held_since = time.monotonic()  # a started verbose line: wait for its end
                        continue
                elif self._libc is not None:
                    self._idle = True
                    try:
                        select.select([fd], [], [])
                    finally:
                        self._idle = False
                try:
                    got = self._read_now(fd) if self._libc is not None else os.read(fd, _READ_SIZE)
                except InterruptedError:
                    continue
                except OSError as exc:
                    if not _pty_ended(exc, self.pty):
                        raise
                    got = b""
                if got is None:
                    continue  # emptied meanwhile (by stop()), or a spurious wake-up
                chunk = got
                receive_ns = time.monotonic_ns()
                if not chunk:
                    break
                try:
                    pending = self._split(pending + chunk, receive_ns)
                except Exception:  # a bug here must not cost the user's output
                    self._forward(pending + chunk)
                    pending = b""
                if pending:
                    held_since = time.monotonic()
                since_emptied += len(chunk)
                more = len(chunk) == _READ_SIZE or (self.pty and _unread_bytes(fd) > 0)
                if more or self.batch_s <= 0 or any(p in chunk for p in self.urgent):
                    continue  # more may be waiting, or no batching
                now = time.monotonic()
                sleep = batch_sleep_s(self.batch_s, since_emptied, now - emptied, capacity)
                emptied, since_emptied = now, 0
                self._draining.wait(sleep)  # returns at once when draining
            if pending:  # the pipe ended inside a line
                if pending.startswith(self.prefixes):
                    self._capture(pending, time.monotonic_ns())
                else:
                    self._forward(pending)
        except OSError as exc:  # as the C reader's: the tap ends, the program goes on
            self._reader_failed(exc)
        finally:
            self._reader_finished(fd)

    def _split(self, data: bytes, receive_ns: int) -> bytes:
        """Captures every prefixed line of ``data``, forwards the rest in order.

        A captured line runs from a prefix to the next newline, which it
        consumes. The prefix may start mid-line: a library printing while the
        program's own line is unfinished (``print("running…", end="")``)
        yields that line's bytes on both sides of the captured one, exactly as
        a run without verbose output would show them.

        Returns:
            The bytes to hold back: a started captured line without its
            newline yet, or a tail that may still grow into a prefix.
        """
        pos = 0
        captured: list[bytes] = []
        # The common case first: whole lines of a library's output, one after the other,
        # kept as one block (lines() splits it; a chunk that is all such lines is not copied).
        run = self._line_run.match(data)
        if run is not None:
            pos = run.end()
            captured.append(data if pos == len(data) else data[:pos])
            self._echo(captured[-1])
        # Next position of each prefix at or after pos (-1: none left). Searched
        # again only once passed, so a chunk of many lines is one scan, not one
        # per line and prefix.
        found = {p: data.find(p, pos) for p in self.prefixes}
        try:
            while True:
                begin = -1
                for p, i in found.items():
                    if 0 <= i < pos:
                        i = found[p] = data.find(p, pos)
                    if i >= 0 and (begin < 0 or i < begin):
                        begin = i
                if begin < 0:
                    break
                nl = data.find(b"\n", begin)
                if begin > pos:
                    self._forward(data[pos:begin])
                if nl < 0:
                    if len(data) - begin <= _MAX_LINE:
                        return data[begin:]
                    # No library prints such a line: it is the program's (binary) data.
                    self._forward(data[begin:])
                    return b""
                captured.append(data[begin:nl])
                self._echo(data[begin : nl + 1])
                pos = nl + 1
        finally:
            if captured:
                self._capture_all(captured, receive_ns)
        keep = self._prefix_tail(data, pos)
        self._forward(data[pos : len(data) - keep])
        return data[len(data) - keep :]

    def _prefix_tail(self, data: bytes, pos: int) -> int:
        """Length of the longest tail of ``data[pos:]`` that is a proper start of a prefix."""
        longest = max(len(p) for p in self.prefixes) - 1
        for k in range(min(longest, len(data) - pos), 0, -1):
            tail = data[len(data) - k :]
            if any(p.startswith(tail) for p in self.prefixes):
                return k
        return 0


def _same_destination(a: int, b: int) -> bool:
    """Whether descriptors ``a`` and ``b`` write to the same place: the same file, pipe or
    terminal, and for a regular file at the same offset (``2>&1`` shares one open file)."""
    try:
        sa, sb = os.fstat(a), os.fstat(b)
        if (sa.st_dev, sa.st_ino) != (sb.st_dev, sb.st_ino):
            return False
        if stat.S_ISREG(sa.st_mode):
            return os.lseek(a, 0, os.SEEK_CUR) == os.lseek(b, 0, os.SEEK_CUR)
    except OSError:
        return False
    return True


#: How long ``stop()`` waits for the pipe's end before it asks who still holds the pipe (s).
_FIRST_WAIT_S = 0.25
#: multiprocessing's own helper processes: they live as long as the program, so a pipe they
#: hold (their inherited fd 1 and 2) ends only when the program exits.
_LIFELONG_HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver", b"multiprocessing.semaphore_tracker")


def _only_lifelong_helpers_write(target: str) -> bool:
    """Whether the processes that hold a write end of the tap's pipe or pseudo-terminal
    (``target``: its /proc link text, ``pipe:[inode]`` or ``/dev/pts/N``), this one's
    descendants, are all multiprocessing's lifelong helpers (then waiting for the pipe's end
    would only time out). False where none is found or /proc cannot tell."""
    if not target:
        return False
    writers = [pid for pid in _descendants(os.getpid()) if _writes_to(pid, target)]
    return bool(writers) and all(_is_lifelong_helper(pid) for pid in writers)


def _descendants(root: int) -> list[int]:
    """The pids of ``root``'s descendants (from /proc; [] where it cannot be read)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rpartition(b")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _writes_to(pid: int, target: str) -> bool:
    """Whether process ``pid`` holds a write end of ``target`` (a /proc fd link text)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != target:
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}", "rb") as f:
                flags = next(int(line.split()[1], 8) for line in f if line.startswith(b"flags:"))
        except (OSError, StopIteration, ValueError, IndexError):
            continue
        if flags & (os.O_WRONLY | os.O_RDWR):
            return True
    return False


def _is_lifelong_helper(pid: int) -> bool:
    """Whether process ``pid`` is one of multiprocessing's lifelong helpers (its command line)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return any(helper in cmdline for helper in _LIFELONG_HELPERS)


def _fd_ident(fd: int) -> tuple[int, int] | None:
    """(device, inode) of what a descriptor refers to, or None where it is closed."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _warn(text: str) -> None:
    """One mltrace warning line on stderr (this module sits below the session's ``warn``)."""
    with contextlib.suppress(OSError):
        os.write(2, f"mltrace: warning: {text}\n".encode())


def _unread_bytes(fd: int) -> int:
    """Bytes waiting in the pipe ``fd`` (-1 where that cannot be told)."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])
    except OSError:
        return -1


def _native_reader() -> Any:
    """The C reader's type (``mltrace._tapread.Reader``), or None: not built, or
    ``MLTRACE_FDTAP_READER=python``."""
    helper = c_helper("_tapread", FDTAP_READER)
    return helper.Reader if helper is not None else None


def _lines_of(block: bytes) -> list[bytes]:
    """The captured lines of one captured item: a line, or a block of lines each ended by a
    newline (``FdTap._split``). Captured lines are never empty (each starts with a prefix)."""
    return block[:-1].split(b"\n") if block.endswith(b"\n") else block.split(b"\n")


_new_tuple = tuple.__new__


def _tapped_lines(receive_ns: int, block: bytes) -> map[TappedLine]:
    """The lines of one captured item (``_lines_of``) as ``TappedLine``s received at
    ``receive_ns``: each decoded as UTF-8 (invalid bytes replaced) without its trailing carriage
    returns. The block is decoded in one piece and the tuples are made without a Python call
    per line (the flusher does this for every verbose line, holding the GIL); a newline never
    belongs to a multi-byte character, so the lines are those of a decode line by line."""
    text = block.decode("utf-8", "replace")
    lines = text[:-1].split("\n") if text.endswith("\n") else text.split("\n")
    if "\r" in text:
        lines = [line.rstrip("\r") for line in lines]
    return map(_new_tuple, repeat(TappedLine), zip(repeat(receive_ns), lines))


def _reader_main(config_json: str) -> int:
    """The process reader (``python -m mltrace.tracer.fdtap CONFIG``): FdTap's reader loop,
    writing each captured line as ``<receive ns> <text>`` to the output file."""
    config = json.loads(config_json)
    tap = FdTap(
        prefixes=tuple(bytes.fromhex(p) for p in config["prefixes"]),
        hold_s=float(config["hold_s"]),
        batch_s=float(config["batch_s"]),
        urgent=tuple(bytes.fromhex(p) for p in config["urgent"]),
        echo=tuple(bytes.fromhex(p) for p in config["echo"]),
    )
    out_fd = int(config["out_fd"])
    tap._read_fd, tap._saved_fd = int(config["read_fd"]), int(config["saved_fd"])
    tap.pty = bool(config["pty"])

    def write_lines(lines: list[bytes], receive_ns: int) -> None:
        stamp = b"%d " % receive_ns
        data = b"".join(stamp + line.rstrip(b"\r") + b"\n" for block in lines for line in _lines_of(block))
        while data:
            data = data[os.write(out_fd, data) :]

    tap._capture_all = write_lines  # type: ignore[method-assign]
    tap._run()  # returns at the pipe's end (every writer closed it); closes both fds
    os.write(out_fd, b"#%d %d\n" % (tap.forwarded_bytes, tap.forward_errors))
    os.close(out_fd)
    return 0


if __name__ == "__main__":
    sys.exit(_reader_main(sys.argv[1]))
