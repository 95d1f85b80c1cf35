"""Whether a torch ``RecordFunction`` range may be open on the calling thread.

torch.profiler's stop frees the events of its ranges, and a range that was open then still
holds a pointer into them: when it ends while another profiler runs, torch writes its end
into freed memory and a later stop crashes the process (SIGSEGV in ``materialize``). The op
level's cycle switch (stop, then start at once) must therefore not happen inside a range.

Python-side ranges are counted on every thread: ``record_function`` (a ``with`` block, a
decorator, the DataLoader's ``__next__``) is wrapped while cycles run (``RecordFunctionDepth``).
Ranges torch opens in C++ around Python code are found on the calling thread's stack
(``range_frame_on_stack``): TorchDynamo's compiled frames ("Torch-Compiled Region"), a custom
autograd ``Function``'s ``apply``, the autograd engine's backward pass (each node it evaluates
is a range: a model called from there, as ``torch.utils.checkpoint`` recomputes one, returns
inside it), an op implemented in Python (``torch._ops``) and ``__torch_dispatch__``. The ranges
of ops that other threads run are not seen.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

#: The name prefixes of code that TorchDynamo writes: the calls of compiled graphs and the
#: functions that resume after a graph break.
_DYNAMO_CALL_PREFIX = "__compiled_fn"
_DYNAMO_RESUME_PREFIX = "torch_dynamo_resume_in_"


class RecordFunctionDepth:
    """Counts, per thread, the ``torch.autograd.profiler.record_function`` ranges entered and
    not yet exited, while installed. ``on_closed`` runs on a thread whose last such range just
    ended."""

    def __init__(self, on_closed: Callable[[], None]) -> None:
        self._on_closed = on_closed
        self._depths: dict[int, int] = {}  # by thread ident; each thread writes its own
        self._uninstall: Callable[[], None] | None = None

    def open_here(self) -> int:
        """The ranges open on the calling thread."""
        return self._depths.get(threading.get_ident(), 0)

    def open_elsewhere(self) -> bool:
        """Whether a range is open on another thread (a DataLoader's ``__next__`` on a thread
        that prefetches batches)."""
        here = threading.get_ident()
        return any(depth and ident != here for ident, depth in list(self._depths.items()))

    def seen_elsewhere(self, ident: int) -> bool:
        """Whether a thread other than ``ident`` has entered a range since ``install``."""
        return any(other != ident for other in list(self._depths))

    def install(self, torch: Any) -> None:
        """Wraps ``record_function.__enter__`` and ``__exit__`` (``uninstall`` puts them back)."""
        cls = getattr(getattr(getattr(torch, "autograd", None), "profiler", None), "record_function", None)
        if cls is None or self._uninstall is not None:
            return
        enter, exit_ = cls.__dict__.get("__enter__"), cls.__dict__.get("__exit__")
        if enter is None or exit_ is None:
            return
        depths, on_closed = self._depths, self._on_closed

        def counted_enter(rf: Any) -> Any:
            entered = enter(rf)
            ident = threading.get_ident()
            depths[ident] = depths.get(ident, 0) + 1
            return entered

        def counted_exit(rf: Any, *exc_info: Any) -> Any:
            try:
                return exit_(rf, *exc_info)
            finally:
                ident = threading.get_ident()
                depth = max(0, depths.get(ident, 0) - 1)
                if depth:
                    depths[ident] = depth
                else:
                    depths.pop(ident, None)
                    on_closed()

        cls.__enter__, cls.__exit__ = counted_enter, counted_exit

        def uninstall() -> None:
            if cls.__dict__.get("__enter__") is counted_enter:
                cls.__enter__ = enter
            if cls.__dict__.get("__exit__") is counted_exit:
                cls.__exit__ = exit_

        self._uninstall = uninstall

    def uninstall(self) -> None:
        """Puts torch's ``__enter__`` and ``__exit__`` back."""
        uninstall, self._uninstall = self._uninstall, None
        if uninstall is not None:
            uninstall()


def range_frame_on_stack(frame: FrameType | None = None) -> str | None:
    """What on the calling thread's Python stack (from ``frame``, by default the caller's) runs
    inside a range torch opened in C++, or None: "compiled code", "autograd Function", "autograd
    backward" or "op implemented in Python"."""
    codes = _range_codes()
    compiled = _dynamo_output_codes()
    f: FrameType | None = frame if frame is not None else sys._getframe(1)
    while f is not None:
        code = f.f_code
        why = codes.get(id(code))
        if why is not None:
            return why
        if code.co_name == "__torch_dispatch__":
            return "op implemented in Python"
        if _is_dynamo_code(code, compiled):
            return "compiled code"
        f = f.f_back
    return None


def _range_codes() -> dict[int, str]:
    """The code of torch's Python functions that call into a C++ range, by ``id``: a custom
    ``Function``'s ``apply``, the calls into the autograd engine and the calls of an op."""
    codes: dict[int, str] = {}
    function = sys.modules.get("torch.autograd.function")
    apply = getattr(getattr(function, "Function", None), "apply", None)
    code = getattr(getattr(apply, "__func__", apply), "__code__", None)
    if code is not None:
        codes[id(code)] = "autograd Function"
    # The backward pass: torch's entry into the C++ engine, and (where torch has no such entry)
    # the functions that call the engine themselves.
    graph = sys.modules.get("torch.autograd.graph")
    autograd = sys.modules.get("torch.autograd")
    for entry in (getattr(graph, "_engine_run_backward", None), getattr(autograd, "backward", None), getattr(autograd, "grad", None)):
        code = getattr(entry, "__code__", None)
        if code is not None:
            codes[id(code)] = "autograd backward"
    ops = sys.modules.get("torch._ops")
    for cls_name in ("OpOverload", "OpOverloadPacket"):
        cls = getattr(ops, cls_name, None)
        code = getattr(vars(cls).get("__call__") if cls is not None else None, "__code__", None)
        if code is not None:
            codes[id(code)] = "op implemented in Python"
    return codes


def _dynamo_output_codes() -> Any:
    """TorchDynamo's map of the code it wrote (``in`` tests one), or None where it is not loaded."""
    utils = sys.modules.get("torch._dynamo.utils")
    return getattr(utils, "orig_code_map", None)


def _is_dynamo_code(code: CodeType, compiled: Any) -> bool:
    """Whether TorchDynamo wrote ``code`` (it runs inside its "Torch-Compiled Region" range):
    in its map of written code, or, where that is not at hand, named as it names its resume
    functions or calling a compiled graph by the name it gives one."""
    if compiled is not None:
        return code in compiled
    if code.co_name.startswith(_DYNAMO_RESUME_PREFIX):
        return True
    return any(name.startswith(_DYNAMO_CALL_PREFIX) for name in code.co_names)
