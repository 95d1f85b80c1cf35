"""Hardware counters: GPU counters from NVML, CPU utilisation from /proc/stat.

``NvmlSampler`` runs a daemon thread that, every ``interval_s`` seconds, records one
``CounterSample`` per counter on the session's counter tracks (Perfetto draws them as counter
tracks), and writes run.json's ``counters_summary`` at ``stop()``. Counters are not a
hierarchy level (``levels`` is empty), so the session starts the sampler at every level; the
CPU counter needs no GPU. ``parse_proc_stat`` and ``cpu_utilization`` compute the CPU
counter, ``nvml_error_reason`` words NVML's failures.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from mltrace.run.events import Event, Track
from mltrace.run.levels import Level
from mltrace.tracer.clock import now_ns
from mltrace.tracer.sources.base import Source

if TYPE_CHECKING:
    from mltrace.tracer.sources.base import SessionView

PROC_STAT = Path("/proc/stat")

#: Reasons GPU counters may be missing (the first words are stable; tests match them).
NOT_INSTALLED = "nvidia-ml-py not installed (pip install nvidia-ml-py, or mltrace[gpu])"
NO_DRIVER = "NVIDIA driver not found (libnvidia-ml.so.1 could not be loaded)"
NO_GPU = "no NVIDIA GPU found (nvmlDeviceGetCount = 0)"

#: Reasons that mean "no GPU here", normal on a CPU machine: recorded without a warning.
_EXPECTED_ABSENCE = frozenset({NOT_INSTALLED, NO_DRIVER, NO_GPU})

# NVML return codes (nvml.h; the same values as pynvml's NVML_ERROR_* constants).
_NVML_ERROR_NO_PERMISSION = 4
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_DRIVER_NOT_LOADED = 9
_NVML_ERROR_LIBRARY_NOT_FOUND = 12
_NVML_ERROR_FUNCTION_NOT_FOUND = 13


#: What a Linux system with an NVIDIA driver has: the driver's control device (on WSL, the
#: GPU paravirtualization device) or its folder in /proc.
_DRIVER_PATHS = ("/dev/nvidiactl", "/dev/dxg", "/proc/driver/nvidia")


def no_nvidia_driver() -> bool:
    """Whether this is Linux without any sign of an NVIDIA driver (``_DRIVER_PATHS``), where
    NVML cannot load. False elsewhere: there, only NVML says."""
    return sys.platform.startswith("linux") and not any(os.path.exists(p) for p in _DRIVER_PATHS)


# -- CPU utilisation from /proc/stat (pure helpers) --------------------------------------


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative CPU time of all CPUs since boot, in jiffies (USER_HZ ticks).

    Attributes:
        busy: time not idle (user, nice, system, irq, softirq, steal).
        total: busy plus idle plus iowait.
    """

    busy: int
    total: int


def parse_proc_stat(text: str) -> CpuTimes | None:
    """Reads the aggregate ``cpu`` line of /proc/stat.

    The line is ``cpu user nice system idle iowait irq softirq steal guest
    guest_nice`` (jiffies); kernels before 2.6.11 have only the first four
    fields. ``guest`` and ``guest_nice`` are already counted in ``user`` and
    ``nice``, so they are left out of the total.

    Args:
        text: the content of /proc/stat (or just its first line).

    Returns:
        The busy and total jiffies, or None when there is no valid ``cpu`` line.
    """
    for line in text.splitlines():
        parts = line.split()
        if not parts or parts[0] != "cpu":
            continue
        try:
            values = [int(v) for v in parts[1:9]]
        except ValueError:
            return None
        if len(values) < 4:
            return None
        values += [0] * (8 - len(values))
        user, nice, system, idle, iowait, irq, softirq, steal = values
        idle_all = idle + iowait
        total = user + nice + system + idle_all + irq + softirq + steal
        return CpuTimes(busy=total - idle_all, total=total)
    return None


def cpu_utilization(before: CpuTimes, after: CpuTimes) -> float | None:
    """Utilisation of all CPUs between two readings, in percent (0–100).

    Args:
        before: the earlier reading.
        after: the later reading.

    Returns:
        busy / total jiffies elapsed × 100, clamped to [0, 100]; None when no
        jiffy elapsed (readings too close together) or the counters went back.
    """
    total = after.total - before.total
    busy = after.busy - before.busy
    if total <= 0 or busy < 0:
        return None
    return min(100.0, max(0.0, 100.0 * busy / total))


def read_cpu_times(path: Path = PROC_STAT) -> CpuTimes | None:
    """Reads /proc/stat; None where it cannot be read (not Linux) or parsed."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return parse_proc_stat(f.readline())
    except OSError:
        return None


# -- NVML ------------------------------------------------------------------------------------


def nvml_error_reason(code: int | None, text: str) -> str:
    """One line saying why NVML could not start, from ``nvmlInit``'s error.

    Args:
        code: the NVML return code (``NVMLError.value``), or None.
        text: the error's message.

    Returns:
        The reason, naming the fix where there is one.
    """
    if code == _NVML_ERROR_LIBRARY_NOT_FOUND:
        return NO_DRIVER
    if code == _NVML_ERROR_DRIVER_NOT_LOADED:
        return "NVIDIA driver not loaded (nvmlInit: NVML_ERROR_DRIVER_NOT_LOADED; is the kernel module loaded?)"
    if code == _NVML_ERROR_NO_PERMISSION:
        return "no permission to use NVML (nvmlInit: NVML_ERROR_NO_PERMISSION; check access to /dev/nvidia*)"
    return f"nvmlInit failed: {text} (NVML error {code})" if code is not None else f"nvmlInit failed: {text}"


def _nvml_code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _gpu_readers(nv: ModuleType) -> tuple[tuple[str, str, Callable[[Any], float]], ...]:
    """(counter suffix, unit, read(handle)) for every GPU counter."""

    def temperature(h: Any) -> float:
        try:
            return float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        except nv.NVMLError as exc:  # removed from drivers after CUDA 13: use the versioned call
            if _nvml_code(exc) != _NVML_ERROR_FUNCTION_NOT_FOUND or not hasattr(nv, "nvmlDeviceGetTemperatureV"):
                raise
            return float(nv.nvmlDeviceGetTemperatureV(h, nv.NVML_TEMPERATURE_GPU))

    return (
        ("memory.used", "bytes", lambda h: float(nv.nvmlDeviceGetMemoryInfo(h).used)),
        ("power", "W", lambda h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
        ("clock.sm", "MHz", lambda h: float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))),
        ("clock.memory", "MHz", lambda h: float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM))),
        ("temperature", "C", temperature),
    )


@dataclass
class _Stat:
    """Running min / mean / max of one counter."""

    unit: str
    device: int
    n: int = 0
    total: float = 0.0
    lo: float = float("inf")
    hi: float = float("-inf")

    def add(self, v: float) -> None:
        self.n += 1
        self.total += v
        self.lo = min(self.lo, v)
        self.hi = max(self.hi, v)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"unit": self.unit, "samples": self.n}
        if self.device >= 0:
            out["device"] = self.device
        if self.n:
            out.update(min=self.lo, mean=self.total / self.n, max=self.hi)
        return out


@dataclass
class _Gpu:
    index: int
    handle: Any
    name: str


class NvmlSampler(Source):
    """Samples GPU counters (NVML) and CPU utilisation in a daemon thread.

    =========================== ====== ========================================================
    track                       unit   source
    =========================== ====== ========================================================
    ``cpu.utilization``         %      /proc/stat, all CPUs: busy jiffies / all jiffies between
                                       two samples (``cpu_utilization``)
    ``gpu<i>.utilization``      %      ``nvmlDeviceGetUtilizationRates().gpu``: share of the
                                       driver's last sample period (1/6 s to 1 s, by GPU) in
                                       which at least one kernel ran — not SM occupancy
    ``gpu<i>.memory.utilization`` %    ``…UtilizationRates().memory``: share of that period in
                                       which device memory was read or written
    ``gpu<i>.memory.used``      bytes  ``nvmlDeviceGetMemoryInfo().used`` (every process's)
    ``gpu<i>.power``            W      ``nvmlDeviceGetPowerUsage()`` (mW) / 1000
    ``gpu<i>.clock.sm``         MHz    ``nvmlDeviceGetClockInfo(NVML_CLOCK_SM)``
    ``gpu<i>.clock.memory``     MHz    ``nvmlDeviceGetClockInfo(NVML_CLOCK_MEM)``
    ``gpu<i>.temperature``      C      ``nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)``
    =========================== ====== ========================================================

    A GPU sample's time is the midpoint of session-clock readings (``time.monotonic_ns``)
    around that device's reads.

    Attributes:
        name: "nvml".
        levels: empty: counters are recorded at every level.
        interval_s: time between samples (s).
        gpu_reason: after ``start``, why GPU counters are not recorded (None
            when they are).
    """

    name = "nvml"
    levels: tuple[Level, ...] = ()

    def __init__(self, interval_s: float = 0.1, proc_stat: Path = PROC_STAT) -> None:
        """Creates a sampler.

        Args:
            interval_s: time between samples (s); at least 0.001.
            proc_stat: the /proc/stat file to read CPU times from.
        """
        self.interval_s = max(0.001, float(interval_s))
        self._proc_stat = proc_stat
        self._session: SessionView | None = None
        self._nv: ModuleType | None = None
        self._gpus: list[_Gpu] = []
        self._readers: tuple[tuple[str, str, Callable[[Any], float]], ...] = ()
        self._disabled: dict[str, str] = {}  # counter track name → why it stopped being read
        self._stats: dict[str, _Stat] = {}
        self._tracks: dict[str, Track] = {}
        self._cpu_prev: CpuTimes | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one sample at a time (thread vs. the final sample)
        self.gpu_reason: str | None = None
        self.errors = 0

    # -- Source contract -------------------------------------------------------------------

    def available(self) -> str | None:
        """None when CPU or GPU counters can be read here, else why not."""
        if read_cpu_times(self._proc_stat) is not None:
            return None
        if importlib.util.find_spec("pynvml") is None:
            return f"no counters: {self._proc_stat} unreadable and {NOT_INSTALLED}"
        return None

    def start(self, session: SessionView) -> None:
        """Opens NVML (when it can), takes a first sample and starts the thread.

        Where nvidia-ml-py is missing, the driver cannot be loaded or there is no GPU, only the
        CPU is sampled, and run.json's ``sources.nvml.gpu`` says why (``"unavailable:
        <reason>"``) without a warning: a machine without a GPU is normal. Any other NVML
        failure (no permission, a driver not loaded) is recorded there too and printed as one
        warning line. A counter the board does not support (or whose read fails) is no longer
        read, and is recorded under ``sources.nvml.unsupported`` (``_disable``).
        """
        self._session = session
        self._cpu_prev = read_cpu_times(self._proc_stat)
        self.gpu_reason = self._open_nvml()
        info: dict[str, Any] = {"interval_s": self.interval_s}
        if self.gpu_reason is None:
            info["gpu"] = f"sampling {len(self._gpus)} GPU(s)"
            info["devices"] = [{"index": g.index, "name": g.name} for g in self._gpus]
            host = session.meta.get("host")
            if isinstance(host, dict):  # run.json's host facts name the GPUs (the report's roofline reads them)
                host["gpus"] = [dict(d) for d in info["devices"]]
        else:
            info["gpu"] = f"unavailable: {self.gpu_reason}"
            if self.gpu_reason not in _EXPECTED_ABSENCE:  # a GPU seems present but cannot be read: say so
                from mltrace.tracer.messages import warn

                warn(f"no GPU counters: {self.gpu_reason}")
        info["cpu"] = "sampling /proc/stat" if self._cpu_prev is not None else f"unavailable: {self._proc_stat} unreadable"
        session.meta.setdefault("sources", {})[self.name] = info
        if self._cpu_prev is not None:
            self._track("cpu.utilization", "%", -1)
        for g in self._gpus:
            self._track(f"gpu{g.index}.utilization", "%", g.index)
            self._track(f"gpu{g.index}.memory.utilization", "%", g.index)
            for suffix, unit, _ in self._readers:
                self._track(f"gpu{g.index}.{suffix}", unit, g.index)
        self._sample_gpus()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="mltrace-nvml", daemon=True)
        self._thread.start()

    def stop(self) -> list[Event]:
        """Stops the thread, takes a last sample, closes NVML, writes the summary.

        run.json's ``counters_summary``: per counter track, its unit, sample count and
        min / mean / max (the mean is over samples, which are evenly spaced).

        Returns:
            No events: samples were recorded live through the session's recorder.
        """
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            thread.join(timeout=max(5.0, 10 * self.interval_s))
        session = self._session
        try:
            self._sample()
        finally:
            nv, self._nv = self._nv, None
            if nv is not None:
                try:
                    nv.nvmlShutdown()
                except Exception:  # closing is best effort
                    pass
        if session is not None:
            session.meta["counters_summary"] = {name: st.as_dict() for name, st in sorted(self._stats.items())}
            info = session.meta.setdefault("sources", {}).setdefault(self.name, {})
            if self._disabled:
                info["unsupported"] = dict(sorted(self._disabled.items()))
            if self.errors:
                info["sampling_errors"] = self.errors
        return []

    # -- internals -------------------------------------------------------------------------

    def _open_nvml(self) -> str | None:
        """Initialises NVML and lists the GPUs; returns why not, or None. Where the system shows
        no NVIDIA driver (``no_nvidia_driver``), ``pynvml`` is not imported: it adds some 5,600
        objects that the program's every full garbage collection would scan."""
        if "pynvml" not in sys.modules:
            if importlib.util.find_spec("pynvml") is None:
                return NOT_INSTALLED
            if no_nvidia_driver():
                return NO_DRIVER
        try:
            import pynvml as nv
        except ImportError:
            return NOT_INSTALLED
        except Exception as exc:  # a broken install must not stop the CPU counter
            return f"nvidia-ml-py could not be imported: {exc}"
        try:
            nv.nvmlInit()
        except Exception as exc:
            return nvml_error_reason(_nvml_code(exc), str(exc))
        try:
            count = int(nv.nvmlDeviceGetCount())
            if count <= 0:
                nv.nvmlShutdown()
                return NO_GPU
            gpus = []
            for i in range(count):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                try:
                    name = nv.nvmlDeviceGetName(h)
                    name = name.decode() if isinstance(name, bytes) else str(name)
                except Exception:
                    name = f"GPU {i}"
                gpus.append(_Gpu(i, h, name))
        except Exception as exc:
            try:
                nv.nvmlShutdown()
            except Exception:
                pass
            return f"NVML could not list GPUs: {exc}"
        self._nv = nv
        self._gpus = gpus
        self._readers = _gpu_readers(nv)
        return None

    def _track(self, name: str, unit: str, device: int) -> Track:
        assert self._session is not None
        track = self._session.tracks.counter(name, unit, device)
        self._tracks[name] = track
        self._stats.setdefault(name, _Stat(unit, device))
        return track

    def _record(self, name: str, value: float, ts_ns: int) -> None:
        assert self._session is not None
        self._session.recorder.counter(self._tracks[name], value, ts_ns)
        self._stats[name].add(value)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        """One sample of every counter; never raises (errors are counted)."""
        with self._lock:
            for part in (self._sample_cpu, self._sample_gpus_locked):
                try:
                    part()
                except Exception:  # never into the user's program
                    self.errors += 1

    def _sample_gpus(self) -> None:
        with self._lock:
            try:
                self._sample_gpus_locked()
            except Exception:
                self.errors += 1

    def _sample_cpu(self) -> None:
        prev = self._cpu_prev
        if prev is None:
            return
        t = now_ns()
        cur = read_cpu_times(self._proc_stat)
        if cur is None:
            return
        util = cpu_utilization(prev, cur)
        if util is None:  # no jiffy elapsed: keep the older reading as the base
            return
        self._cpu_prev = cur
        self._record("cpu.utilization", util, t)

    def _sample_gpus_locked(self) -> None:
        nv = self._nv
        if nv is None:
            return
        for g in self._gpus:
            t0 = now_ns()
            values: list[tuple[str, float]] = []
            util_names = (f"gpu{g.index}.utilization", f"gpu{g.index}.memory.utilization")
            if util_names[0] not in self._disabled:
                try:
                    rates = nv.nvmlDeviceGetUtilizationRates(g.handle)
                    values += [(util_names[0], float(rates.gpu)), (util_names[1], float(rates.memory))]
                except Exception as exc:
                    for n in util_names:
                        self._disable(n, exc)
            for suffix, _unit, read in self._readers:
                name = f"gpu{g.index}.{suffix}"
                if name in self._disabled:
                    continue
                try:
                    values.append((name, read(g.handle)))
                except Exception as exc:
                    self._disable(name, exc)
            ts = (t0 + now_ns()) // 2
            for name, value in values:
                self._record(name, value, ts)

    def _disable(self, name: str, exc: BaseException) -> None:
        """Stops reading a counter that failed (unsupported boards fail every time)."""
        code = _nvml_code(exc)
        why = "NVML_ERROR_NOT_SUPPORTED" if code == _NVML_ERROR_NOT_SUPPORTED else f"{type(exc).__name__}: {exc}"
        self._disabled[name] = why
