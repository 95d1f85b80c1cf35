"""Carries mltrace's current span into the functions an asyncio loop runs in an executor.

``loop.run_in_executor(executor, func, *args)`` runs ``func`` in a worker thread without the
awaiting task's context variables (``asyncio.to_thread`` copies them), so a model call there
would not see the request span open in the task. While the session runs,
``asyncio.BaseEventLoop.run_in_executor`` is wrapped: ``func`` goes to the executor with
mltrace's own current span (``recorder.current_span``) and the OpenTelemetry span current in
the task (``otel_context.carried_otel_parent``), set around the call in the worker thread and
reset after it. The program's own context variables are not carried: ``func`` sees what it
would. A coroutine or coroutine function (which ``run_in_executor`` refuses), or a call made
with no span open, goes to the original as it is, so a debug-mode loop refuses what it
refuses without mltrace. Loops of another class (uvloop's) are not
wrapped. asyncio is never imported here: the wrapper goes in once the program imports it.
"""

from __future__ import annotations

from contextvars import ContextVar
from types import ModuleType
from typing import TYPE_CHECKING, Any

from mltrace.native import c_helper
from mltrace.settings import EXECUTOR_CARRY
from mltrace.tracer.otel_context import capture_otel_parent, carried_otel_parent
from mltrace.tracer.recorder import current_span
from mltrace.tracer.sources._imports import PostImportHook
from mltrace.tracer.sources.base import Source

if TYPE_CHECKING:
    from collections.abc import Callable

    from mltrace.run.events import Event
    from mltrace.run.levels import Level
    from mltrace.tracer.sources.base import SessionView

#: The module whose import puts the wrapper in place.
LOOP_MODULE = "asyncio.base_events"


class CarriedCall:
    """``func`` called with each ``(ContextVar, value)`` of ``pairs`` set around the call and
    reset after it; its result and its exception are the function's own. ``_carry.c`` does the
    same without a Python frame of its own (none in the function's tracebacks); this runs where
    it is not built."""

    __slots__ = ("func", "pairs")

    def __init__(self, func: Callable[..., Any], pairs: tuple[tuple[ContextVar[Any], Any], ...]) -> None:
        self.func = func
        self.pairs = pairs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tokens = [var.set(value) for var, value in self.pairs]
        try:
            return self.func(*args, **kwargs)
        finally:
            for (var, _), token in zip(reversed(self.pairs), reversed(tokens)):
                var.reset(token)


def carried_call_class() -> Callable[..., Callable[..., Any]]:
    """The C ``CarriedCall`` where built (and not switched off), else the Python one."""
    helper = c_helper("_carry", EXECUTOR_CARRY)
    return helper.CarriedCall if helper is not None else CarriedCall  # type: ignore[no-any-return]


def carrying(original: Callable[..., Any], is_coroutine: Callable[[Any], bool]) -> Callable[..., Any]:
    """``run_in_executor`` that hands ``original`` the function as a ``CarriedCall`` of the
    calling context's span and OpenTelemetry parent where it has either, else as it is; as it
    is too where it is no callable or ``is_coroutine`` says it is a coroutine (the original
    refuses those in debug mode)."""
    carried = carried_call_class()

    def run_in_executor(loop: Any, executor: Any, func: Any, *args: Any) -> Any:
        span = current_span.get()
        otel = capture_otel_parent()
        if (span is None and otel is None) or not callable(func) or is_coroutine(func):
            return original(loop, executor, func, *args)
        return original(loop, executor, carried(func, ((current_span, span), (carried_otel_parent, otel))), *args)

    run_in_executor.__wrapped__ = original  # type: ignore[attr-defined]
    return run_in_executor


class AsyncioExecutorSource(Source):
    """Puts the ``run_in_executor`` wrapper in place while the session runs (see the module
    docstring); records nothing itself."""

    name = "asyncio.executor"
    #: No level of its own: a source with none is always started.
    levels: tuple[Level, ...] = ()

    def __init__(self) -> None:
        self._hook: PostImportHook | None = None
        self._patched: tuple[type, Any] | None = None

    def available(self) -> str | None:
        """Always available: nothing happens unless the program imports asyncio."""
        return None

    def start(self, session: SessionView) -> None:
        """Waits for the program's asyncio import (or wraps now where it is imported)."""
        self._hook = PostImportHook(LOOP_MODULE, self._attach)

    def stop(self) -> list[Event]:
        """Puts ``BaseEventLoop.run_in_executor`` back."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._patched is not None:
            cls, original = self._patched
            cls.run_in_executor = original  # type: ignore[attr-defined]
            self._patched = None
        return []

    def _attach(self, base_events: ModuleType) -> None:
        cls = base_events.BaseEventLoop
        original = cls.__dict__["run_in_executor"]
        coroutines = base_events.coroutines  # imported by base_events itself

        def is_coroutine(func: Any) -> bool:  # what BaseEventLoop._check_callback refuses
            return bool(coroutines.iscoroutine(func) or coroutines.iscoroutinefunction(func))

        cls.run_in_executor = carrying(original, is_coroutine)
        self._patched = (cls, original)
