"""The exit guard that keeps CUDA primary contexts alive through C++ teardown (tracer/cuda_exit.py)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from typing import Any

from mltrace.tracer import cuda_exit


class FakeDriver:
    """The four driver calls, over a table of devices: ordinal -> primary context active?"""

    def __init__(self, active: list[bool], fail: str | None = None) -> None:
        self.active = active
        self.fail = fail
        self.retained: list[int] = []

    def _status(self, name: str) -> int:
        return 3 if self.fail == name else 0  # 3: CUDA_ERROR_NOT_INITIALIZED

    def cuDeviceGetCount(self, count: Any) -> int:
        ctypes.cast(count, ctypes.POINTER(ctypes.c_int)).contents.value = len(self.active)
        return self._status("count")

    def cuDeviceGet(self, device: Any, ordinal: int) -> int:
        ctypes.cast(device, ctypes.POINTER(ctypes.c_int)).contents.value = 100 + ordinal
        return self._status("get")

    def cuDevicePrimaryCtxGetState(self, device: int, flags: Any, active: Any) -> int:
        ctypes.cast(active, ctypes.POINTER(ctypes.c_int)).contents.value = int(self.active[device - 100])
        return self._status("state")

    def cuDevicePrimaryCtxRetain(self, context: Any, device: int) -> int:
        self.retained.append(device)
        return self._status("retain")


def test_only_the_devices_with_an_active_primary_context_are_retained() -> None:
    driver = FakeDriver([True, False, True])
    assert cuda_exit.retain_active_primary_contexts(driver) == [0, 2]
    assert driver.retained == [100, 102]  # the driver's device handles, not the ordinals


def test_a_driver_that_was_never_initialised_is_left_alone() -> None:
    driver = FakeDriver([True], fail="count")
    assert cuda_exit.retain_active_primary_contexts(driver) == []
    assert driver.retained == []


def test_a_device_whose_state_cannot_be_read_is_skipped() -> None:
    driver = FakeDriver([True, True], fail="state")
    assert cuda_exit.retain_active_primary_contexts(driver) == []
    assert driver.retained == []


def test_a_failed_retain_is_not_reported_as_retained() -> None:
    driver = FakeDriver([True], fail="retain")
    assert cuda_exit.retain_active_primary_contexts(driver) == []


def test_the_handler_never_loads_the_driver_and_leaves_the_exit_status_alone() -> None:
    # No CUDA here: the handler must find no driver mapped (RTLD_NOLOAD), load none, and
    # the process must exit with its own status.
    code = (
        "import atexit, sys\n"
        "from mltrace.tracer import cuda_exit\n"
        "assert cuda_exit.loaded_driver() is None\n"
        "# registered first, so it runs after the guard's handler (atexit runs last-registered first)\n"
        "atexit.register(lambda: print('maps libcuda:', 'libcuda' in open('/proc/self/maps').read()))\n"
        "cuda_exit.keep_primary_contexts_at_exit(); cuda_exit.keep_primary_contexts_at_exit()\n"
        "sys.exit(7)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout.strip() == "maps libcuda: False"
    assert proc.stderr == ""


def test_registration_happens_once(monkeypatch: Any) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(cuda_exit, "_registered", False)
    monkeypatch.setattr(cuda_exit.atexit, "register", calls.append)
    cuda_exit.keep_primary_contexts_at_exit()
    cuda_exit.keep_primary_contexts_at_exit()
    assert calls == [cuda_exit._at_exit]
