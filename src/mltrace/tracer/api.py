"""The user API: ``trace`` (decorator), ``span`` (context manager), ``profile``.

Outside a session (or once its trace is full, ``Session.full``) ``span`` returns
a shared no-op object and a ``trace``d function calls straight through after one
global check, so instrumented code costs well under a microsecond when nobody is
profiling.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, TypeVar, overload

from mltrace.config import ProfileOptions
from mltrace.run.events import Span
from mltrace.run.levels import Level
from mltrace.tracer import session as _session_mod
from mltrace.tracer.callsite import CodeKeyed, code_attrs, defined_attrs

F = TypeVar("F", bound=Callable[..., Any])


class _NoSpan:
    """Returned by ``span()`` outside a session: does nothing, cheaply."""

    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set(self, key: str, value: Any) -> None:
        """Ignored outside a session."""


_NO_SPAN = _NoSpan()


class _LiveSpan:
    __slots__ = ("_session", "_name", "_level", "_attrs", "span")

    def __init__(self, session: _session_mod.Session, name: str, level: Level, attrs: dict[str, Any]) -> None:
        self._session = session
        self._name = name
        self._level = level
        self._attrs = attrs
        self.span: Span | None = None

    def __enter__(self) -> _LiveSpan:
        self.span = span = self._session.recorder.begin(self._name, self._level, self._attrs)
        if span.parent_id is None and "opentelemetry.trace" in sys.modules:
            _under_otel_span(span)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.span is not None:
            if exc_type is not None:
                self.span.attrs["error.type"] = exc_type.__name__
            self._session.recorder.end(self.span)

    def set(self, key: str, value: Any) -> None:
        """Sets an attribute on the open span (a key that is not text is made text)."""
        if self.span is not None:
            self.span.attrs[key if isinstance(key, str) else str(key)] = value


def _under_otel_span(span: Span) -> None:
    """Makes the program's current OpenTelemetry span the parent of ``span`` (a span with no
    mltrace parent), so the export puts it, and what runs inside it, in that span's trace."""
    from mltrace.tracer.otel_context import OTEL_PARENT_ATTR, capture_otel_parent

    otel = capture_otel_parent()
    if otel is not None:
        span.attrs = {**span.attrs, OTEL_PARENT_ATTR: f"{otel[0]:032x}-{otel[1]:016x}"}


def span(name: str, *, level: Level | str = Level.USER, **attrs: Any) -> _LiveSpan | _NoSpan:
    """Marks a region of code as a span::

        with mltrace.span("preprocess", batch=8):
            x = prepare(images)

    Args:
        name: the span's name.
        level: the level it is recorded at (default ``user``).
        **attrs: attributes (str, int, float, bool, or lists of them).

    Returns:
        A context manager; a no-op when no session is running.
    """
    session = _session_mod._active
    if session is None or session.full:
        return _NO_SPAN
    lv = Level.parse(level) if isinstance(level, str) else level
    return _LiveSpan(session, name, lv, _with_call_site(attrs, sys._getframe(1)))


#: This module's file and ``mltrace.profile``'s (``profiling.py``), which a region's call site is not.
_OWN_FILES = frozenset({__file__, str(Path(__file__).resolve().parents[1] / "profiling.py")})

#: Call sites seen (code object, line) → their ``code.*`` attributes, built once each.
_sites: CodeKeyed[dict[str, Any]] = CodeKeyed()


def _with_call_site(attrs: dict[str, Any], caller: FrameType) -> dict[str, Any]:
    """``attrs`` with the ``code.*`` attributes of the caller's line (the call site), unless given."""
    code = caller.f_code
    line = caller.f_lineno or code.co_firstlineno
    site = _sites.get(code, line)
    if site is None:
        site = _sites.put(code, line, code_attrs(code, line))
    return {**site, **attrs} if attrs else dict(site)


@overload
def trace(func: F) -> F: ...


@overload
def trace(func: None = None, *, name: str | None = None, level: Level | str = Level.USER, **attrs: Any) -> Callable[[F], F]: ...


def trace(func: F | None = None, *, name: str | None = None, level: Level | str = Level.USER, **attrs: Any) -> F | Callable[[F], F]:
    """Decorator: each call of the function becomes a span.

    Works on plain and ``async`` functions, with or without arguments::

        @mltrace.trace
        def preprocess(x): ...

        @mltrace.trace(name="decode", level="layer", stage=2)
        async def decode(x): ...

    Args:
        func: the function (when used without parentheses).
        name: span name (default: the function's qualified name).
        level: level to record at (default ``user``).
        **attrs: attributes added to every span.
    """
    lv = Level.parse(level) if isinstance(level, str) else level

    def decorate(fn: F) -> F:
        span_name: str = name or str(getattr(fn, "__qualname__", getattr(fn, "__name__", "function")))
        fixed = {**defined_attrs(fn, span_name), **attrs}

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                session = _session_mod._active
                if session is None or session.full:
                    return await fn(*args, **kwargs)
                with _LiveSpan(session, span_name, lv, _with_call_site(fixed, sys._getframe(1))):
                    return await fn(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            session = _session_mod._active
            if session is None or session.full:
                return fn(*args, **kwargs)
            with _LiveSpan(session, span_name, lv, _with_call_site(fixed, sys._getframe(1))):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    if func is not None:
        return decorate(func)
    return decorate


class profile:  # noqa: N801 - reads as a verb, like contextlib's helpers
    """Profiles a region of a program: context manager, decorator, or start()/stop().

    Takes the same options as the CLI (see ``ProfileOptions``)::

        with mltrace.profile(level="layer", output="runs/r1") as p:
            model(x)
        print(p.run_dir)

    Attributes:
        run_dir: the run directory, once started.
    """

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._session: _session_mod.Session | None = None
        self._joined: _LiveSpan | _NoSpan | None = None
        self.run_dir: Path | None = None

    def start(self) -> profile:
        """Starts a session. Inside one that traces the whole program (``mltrace python``, a
        followed child), records its region there instead, as a user span named after the
        ``name`` option (``mltrace.profile``); its other options do not apply.

        Raises:
            mltrace.errors.UsageError: for invalid options or a second session.
        """
        opts = ProfileOptions.build(**self._options)
        running = _session_mod.active_session()
        if running is not None and running.whole_program:
            self._join(running, opts.name or "mltrace.profile")
            return self
        self._session = _session_mod.Session(opts).start()
        self.run_dir = self._session.run_dir
        return self

    def _join(self, running: _session_mod.Session, name: str) -> None:
        """Records this region into ``running`` as a user span (``start()``)."""
        running.note_limitation(
            "the program's own mltrace.profile() ran inside this session, which traces the whole program: "
            "its regions are user spans of this run, its options not applied"
        )
        caller = sys._getframe(1)
        while caller.f_back is not None and caller.f_code.co_filename in _OWN_FILES:  # the program's line
            caller = caller.f_back
        self._joined = _LiveSpan(running, name, Level.USER, _with_call_site({}, caller)) if not running.full else _NO_SPAN
        self._joined.__enter__()
        self.run_dir = running.run_dir

    def stop(self) -> Path | None:
        """Stops the session, writes the run, and prints the summary if asked (a region
        recorded into a running session ends its span; that session goes on)."""
        if self._joined is not None:
            joined, self._joined = self._joined, None
            joined.__exit__(None, None, None)
            return self.run_dir
        if self._session is None:
            return None
        session, self._session = self._session, None
        run_dir = session.stop()
        if session.options.summary and not session.forked_copy:
            _session_mod.finish_in_use().print_summary(run_dir)
        return run_dir

    def __enter__(self) -> profile:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with type(self)(**self._options):  # a subclass's own start and stop (mltrace/profiling.py)
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]
