"""Keeps every active CUDA primary context alive through process exit.

``keep_primary_contexts_at_exit`` registers, once per process, an ``atexit`` handler that
retains the primary context of every device where it is active (``cuDevicePrimaryCtxRetain``),
so that no CUPTI context-destroy callback runs while C++ statics are destroyed (``_at_exit``
says why). It loads nothing: without ``libcuda.so.1`` mapped and initialised it does nothing.
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
    """Retains the active primary contexts, so the runtime's release at exit leaves them alive.

    Why: Kineto (before its April 2026 fix, which leaks the singleton) keeps its CUPTI callback
    table in a function-static ``shared_ptr``; where C++ destroys that static before the CUDA
    runtime's exit handler releases the context, CUPTI's ``CONTEXT_DESTROY_STARTING`` callback
    copies the destroyed pointer and glibc aborts (exit status 134, "double free or corruption"),
    in some runs and not others. The OS reclaims the context when the process ends; the only
    visible effect is that the context's own teardown is skipped.
    """
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
