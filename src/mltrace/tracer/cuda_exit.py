"""Keeps every active CUDA primary context alive through process exit.

Why: a CUPTI subscriber's callbacks can outlive the C++ object behind them.
torch's Kineto (torch 2.11 bundles one) subscribes to CUPTI's resource callbacks
and keeps its callback table in a function-static ``shared_ptr``. If that static
was constructed after the CUDA runtime registered its exit handler, C++
destroys it first; the runtime's exit handler then releases the primary
context, CUPTI reports ``CONTEXT_DESTROY_STARTING`` to Kineto's callback, and
the callback copies the destroyed ``shared_ptr``: glibc aborts with
"double free or corruption" or "free(): invalid pointer" (exit status 134,
after the run directory was complete). Which static comes first depends on
whether the program touched CUDA before the profiler started, so some runs
abort and others do not. Kineto since April 2026 leaks its singleton instead,
which ends the problem at its source; this module is for the versions before.

What: :func:`keep_primary_contexts_at_exit` registers, once per process, a
Python ``atexit`` handler that retains the primary context of every device
where it is active (``cuDevicePrimaryCtxRetain``). The runtime's release at
exit then leaves the context alive, so no context-destroy callback runs while
C++ statics are being destroyed; the operating system reclaims the context
when the process ends, as it does for any process killed with a live context.
The handler loads nothing: where ``libcuda.so.1`` is not already mapped, or
the driver was never initialised, it does nothing. It changes nothing the
program computes; its only visible effect is that the context's own teardown
(which frees device memory the process is about to lose anyway) is skipped.
"""

from __future__ import annotations

import atexit
import ctypes
import os
from typing import Any, Protocol

_registered = False


class Driver(Protocol):
    """The four CUDA driver entry points the handler calls (``ctypes.CDLL`` of libcuda)."""

    def cuDeviceGetCount(self, count: Any) -> int: ...
    def cuDeviceGet(self, device: Any, ordinal: int) -> int: ...
    def cuDevicePrimaryCtxGetState(self, device: int, flags: Any, active: Any) -> int: ...
    def cuDevicePrimaryCtxRetain(self, context: Any, device: int) -> int: ...


def loaded_driver() -> Driver | None:
    """The CUDA driver library if this process has already loaded it, else None (never loads it)."""
    try:
        return ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # type: ignore[return-value]
    except (OSError, AttributeError):  # not mapped here, or a platform without RTLD_NOLOAD
        return None


def retain_active_primary_contexts(driver: Driver) -> list[int]:
    """Retains the primary context of each device where it is active; returns those device ordinals.

    Any driver error (not initialised, a device gone) ends the walk quietly:
    this runs at exit, where nothing may be raised into the program.
    """
    count = ctypes.c_int(0)
    if driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return []
    retained = []
    for ordinal in range(count.value):
        device = ctypes.c_int(0)
        flags, active = ctypes.c_uint(0), ctypes.c_int(0)
        if driver.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
            continue
        if driver.cuDevicePrimaryCtxGetState(device.value, ctypes.byref(flags), ctypes.byref(active)) != 0 or not active.value:
            continue
        context = ctypes.c_void_p(0)
        if driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device.value) == 0:
            retained.append(ordinal)
    return retained


def _at_exit() -> None:
    driver = loaded_driver()
    if driver is not None:
        try:
            retain_active_primary_contexts(driver)
        except Exception:  # noqa: BLE001 - never into the program's exit
            pass


def keep_primary_contexts_at_exit() -> None:
    """Registers the exit handler (once per process).

    Call it when a CUPTI user starts (torch.profiler, the kernel level). Python
    runs ``atexit`` handlers last-registered first, so registering before the
    program's code runs (as ``mltrace python`` does) makes this one of the last.
    """
    global _registered
    if not _registered:
        atexit.register(_at_exit)
        _registered = True
