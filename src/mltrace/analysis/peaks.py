"""Machine peaks for the roofline: arithmetic throughput (FLOP/s) and memory bandwidth (bytes/s).

CPU peaks are *measured* once per machine — a float32 matrix multiply for
FLOP/s, a large array copy for bytes/s, both with numpy — and cached in
``$MLTRACE_CACHE_DIR`` (default ``~/.cache/mltrace``) as
``peaks-<host hash>.json``. They are what this machine reaches from Python with
the same BLAS and memory system the traced program uses, not datasheet
numbers, so the roofline's ridge point is realistic for it.

GPU peaks come from a table of known GPUs (vendor datasheets, dense math, SXM
variants where several exist), looked up by the device name that imported and
recorded runs keep in run.json (``devices``/``gpus``: ``[{"name": …}]``).

See docs/ANALYSIS.md for how the peaks are used.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mltrace.analysis.units import fmt_si
from mltrace.run.metadata import cpu_model
from mltrace.settings import CACHE_DIR

#: Version of the measurement method; a cache written by another version is re-measured.
METHOD_VERSION = 1

_HALF_DTYPES = frozenset({"float16", "bfloat16", "half", "c10::Half", "c10::BFloat16"})


@dataclass(frozen=True)
class Peaks:
    """The two roofs of one device.

    Attributes:
        device: "cpu" or "gpu".
        name: what the peaks describe ("Intel Xeon … (measured)", "NVIDIA H100 SXM").
        flops_per_s: float32 peak (FLOP/s).
        bytes_per_s: memory bandwidth (bytes/s).
        source: "measured" (now), "cache" (measured earlier on this host),
            "table" (known-device table) or "assumed" (fallback constants).
        half_flops_per_s: float16/bfloat16 dense tensor peak (FLOP/s); 0 means
            the same as ``flops_per_s``.
        note: why these peaks were chosen, when that is not obvious.
        memory_bytes_per_s: the measured memory bandwidth where ``bytes_per_s`` was raised to
            what cache-resident work reached (``raised``); 0 where it was not.
    """

    device: str
    name: str
    flops_per_s: float
    bytes_per_s: float
    source: str
    half_flops_per_s: float = 0.0
    note: str = ""
    memory_bytes_per_s: float = 0.0

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) where the two roofs meet."""
        return self.flops_per_s / self.bytes_per_s if self.bytes_per_s > 0 else float("inf")

    @property
    def bound_bytes_per_s(self) -> float:
        """The bandwidth that tells memory- from compute-bound work (``ridge_for``): the measured
        memory bandwidth, never the roof raised to cache-resident work's bytes/s, which one
        layer or op of a run sets (a single cache-resident op moved the ridge of every verdict,
        and the same program's verdicts flipped from one run to the next)."""
        return self.memory_bytes_per_s or self.bytes_per_s

    def ridge_for(self, dtype: str | None) -> float:
        """The intensity (FLOP/byte) at and above which work of ``dtype`` is compute-bound:
        its FLOP/s roof over ``bound_bytes_per_s``."""
        return self.flops_for(dtype) / self.bound_bytes_per_s if self.bound_bytes_per_s > 0 else float("inf")

    def flops_for(self, dtype: str | None) -> float:
        """Peak FLOP/s for a data type name ("float32", "bfloat16", "c10::Half", …)."""
        if dtype in _HALF_DTYPES and self.half_flops_per_s > 0:
            return self.half_flops_per_s
        return self.flops_per_s

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form."""
        return asdict(self)

    @property
    def top_flops_per_s(self) -> float:
        """The highest FLOP/s roof of any data type: the roof for work of unknown dtype."""
        return max(self.flops_per_s, self.half_flops_per_s)


#: CPU half-precision (bf16/fp16) peak per fp32 peak, by the ISA feature that computes it
#: natively: AMX tiles do 16× the FLOP per cycle of AVX-512 FMA (1024 vs 64 per core);
#: AVX512_BF16 (vdpbf16ps) and AVX512_FP16 do 2×. Without one, bf16/fp16 run at the fp32 peak.
CPU_HALF_FACTORS: tuple[tuple[str, float], ...] = (("amx_bf16", 16.0), ("amx_fp16", 16.0), ("avx512_bf16", 2.0), ("avx512_fp16", 2.0))


def is_half(dtype: str | None) -> bool:
    """Whether a dtype name is float16 or bfloat16."""
    return dtype in _HALF_DTYPES


def bandwidth_text(p: Peaks) -> str:
    """The bandwidth roof as reports print it: a roof raised to cache-resident work's bytes/s
    with the measured memory bandwidth beside it, which the ridge is set by."""
    text = fmt_si(p.bytes_per_s, "B/s")
    return f"{text}, memory {fmt_si(p.memory_bytes_per_s, 'B/s')}" if p.memory_bytes_per_s else text


def raised(p: Peaks, flops: float, half_flops: float, bytes_per_s: float, what: str) -> Peaks:
    """``p`` with each roof raised to at least what the run reached (FLOP/s, bytes/s), and a
    note when one was: a measured point above a roof means the roof underestimates the machine."""
    new = Peaks(
        p.device,
        p.name,
        max(p.flops_per_s, flops),
        max(p.bytes_per_s, bytes_per_s),
        p.source,
        max(p.half_flops_per_s, half_flops) if p.half_flops_per_s or half_flops > p.flops_per_s else 0.0,
        p.note,
        p.memory_bytes_per_s,
    )
    if new == p:
        return p
    note = f"roofs raised to what {what} reached (the {p.source} peaks were lower)"
    notes = "; ".join(x for x in (p.note, note) if x)
    memory = p.bound_bytes_per_s if new.bytes_per_s > p.bytes_per_s else p.memory_bytes_per_s
    return Peaks(new.device, new.name, new.flops_per_s, new.bytes_per_s, new.source, new.half_flops_per_s, notes, memory)


def cpu_flags() -> set[str]:
    """This machine's CPU feature flags (/proc/cpuinfo; empty where it is not readable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def half_factor(flags: set[str]) -> float:
    """bf16/fp16 CPU peak ÷ fp32 peak for these flags (``CPU_HALF_FACTORS``; 1 without any)."""
    return max((f for name, f in CPU_HALF_FACTORS if name in flags), default=1.0)


#: fp32 FLOP per cycle and core by the widest FMA the flags show, with two FMA units per
#: core (the most an x86 core has): AVX-512 16 lanes x 2 (multiply-add) x 2 units, AVX2+FMA
#: 8 lanes, AVX without FMA 8 lanes x (add + multiply), SSE2 4 lanes x 2. First match wins.
ISA_FLOPS_PER_CYCLE: tuple[tuple[str, float], ...] = (("avx512f", 64.0), ("fma", 32.0), ("avx", 16.0), ("sse2", 8.0))


#: Where this machine's clocks are read: cpufreq's maximum, and /proc/cpuinfo.
CPUFREQ_MAX = "/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"
CPUINFO = "/proc/cpuinfo"


def cpu_frequency_hz(model: str | None, this_host: bool = True, cpufreq: str = CPUFREQ_MAX, cpuinfo: str = CPUINFO) -> float | None:
    """The highest clock a core runs at (Hz): when ``this_host``, this machine's cpufreq
    maximum (``cpufreq``); else the ``@ 2.50GHz`` of the CPU's model name; else, on this host,
    the highest ``cpu MHz`` in ``cpuinfo`` (a virtual machine without cpufreq shows its
    nominal clock there; a lower reading only leaves the measured roof in place); else None."""
    try:
        if this_host:
            with open(cpufreq, encoding="utf-8") as f:
                return float(f.read().strip()) * 1e3
    except (OSError, ValueError):
        pass
    found = re.search(r"@\s*([0-9.]+)\s*GHz", model or "")
    if found:
        return float(found.group(1)) * 1e9
    return _cpuinfo_mhz(cpuinfo) if this_host else None


def _cpuinfo_mhz(path: str) -> float | None:
    """The highest ``cpu MHz`` line of ``/proc/cpuinfo`` (Hz), or None."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    clocks = [float(mhz) for mhz in re.findall(r"^cpu MHz\s*:\s*([0-9.]+)", text, re.MULTILINE)]
    return max(clocks) * 1e6 if clocks and max(clocks) > 0 else None


def isa_flops_per_core(flags: set[str], hz: float | None) -> float | None:
    """The fp32 FLOP/s one core cannot exceed (``ISA_FLOPS_PER_CYCLE`` × ``hz``), or None
    when the flags or the clock are unknown."""
    per_cycle = next((f for name, f in ISA_FLOPS_PER_CYCLE if name in flags), None)
    return per_cycle * hz if per_cycle is not None and hz else None


def run_threads(meta: dict[str, Any]) -> int | None:
    """The compute threads the program used: run.json ``threads.torch`` (torch.get_num_threads()
    at the end of the run), else ``OMP_NUM_THREADS`` from its environment; None when unknown."""
    threads = meta.get("threads")
    if isinstance(threads, dict) and isinstance(threads.get("torch"), int) and threads["torch"] > 0:
        return int(threads["torch"])
    env = meta.get("environment")
    value = env.get("OMP_NUM_THREADS") if isinstance(env, dict) else None
    try:
        n = int(str(value).split(",")[0]) if value is not None else 0
    except ValueError:
        return None
    return n if n > 0 else None


def cpu_for_run(cpu: Peaks, meta: dict[str, Any], cores: int | None, flags: set[str], hz: float | None = None) -> Peaks:
    """CPU peaks for a run: the fp32 FLOP roof per core is the higher of the measured one and
    the ISA's bound (``isa_flops_per_core``: no code can exceed it, whereas a matmul measured
    on a busy machine or by another library can be beaten), times the threads the program
    used (``run_threads``; all ``cores`` when unknown); a bf16/fp16 roof from the CPU's flags.

    The copy bandwidth is not scaled: a few threads already reach most of it."""
    factor = half_factor(flags)
    threads = run_threads(meta)
    used = min(threads, cores) if threads and cores else (cores or 1)
    measured = cpu.flops_per_s / cores if cores else cpu.flops_per_s
    isa = isa_flops_per_core(flags, hz)
    notes = [cpu.note] if cpu.note else []
    if isa is not None and isa > measured:
        notes.append(f"FLOP/s roof: the ISA's bound, {isa / 1e9:.0f} GFLOP/s a core (the measured matmul reached {measured / 1e9:.0f})")
    if cores and used < cores:
        notes.append(f"FLOP/s scaled to the {used} of {cores} threads the program used")
    if factor > 1.0:
        notes.append(f"bf16/fp16 peak {factor:g}× fp32 ({', '.join(n for n, _ in CPU_HALF_FACTORS if n in flags)})")
    flops = max(measured, isa or 0.0) * (used if cores else 1)
    return Peaks(cpu.device, cpu.name, flops, cpu.bytes_per_s, cpu.source, flops * factor if factor > 1.0 else 0.0, "; ".join(notes))


@dataclass(frozen=True)
class PeakSet:
    """The peaks a report uses: always a CPU, and a GPU when the run has kernels.

    Attributes:
        cpu: peaks of the host (used for CPU layers and ops).
        gpu: peaks of the GPU the kernels ran on, or None (CPU-only run, or a
            GPU not in the table).
    """

    cpu: Peaks
    gpu: Peaks | None = None


# (name pattern, display name, fp32 TFLOP/s, fp16/bf16 dense tensor TFLOP/s, GB/s).
# Datasheet numbers, dense (no sparsity), SXM/top memory variant where several exist.
KNOWN_GPUS: tuple[tuple[str, str, float, float, float], ...] = (
    (r"\bB200\b", "NVIDIA B200", 80.0, 2250.0, 8000.0),
    (r"\bH200\b", "NVIDIA H200", 67.0, 989.0, 4800.0),
    (r"\bH100\b.*\bPCIe\b", "NVIDIA H100 PCIe", 51.0, 756.0, 2000.0),
    (r"\bH100\b|\bH800\b", "NVIDIA H100 SXM", 67.0, 989.0, 3350.0),
    (r"\bGH200\b", "NVIDIA GH200", 67.0, 989.0, 4000.0),
    (r"\bA100\b.*80\s*GB", "NVIDIA A100 80GB", 19.5, 312.0, 2039.0),
    (r"\bA100\b|\bA800\b", "NVIDIA A100 40GB", 19.5, 312.0, 1555.0),
    (r"\bA10G\b", "NVIDIA A10G", 31.2, 125.0, 600.0),
    (r"\bA10\b", "NVIDIA A10", 31.2, 125.0, 600.0),
    (r"\bL40S\b", "NVIDIA L40S", 91.6, 362.0, 864.0),
    (r"\bL40\b", "NVIDIA L40", 90.5, 181.0, 864.0),
    (r"\bL4\b", "NVIDIA L4", 30.3, 121.0, 300.0),
    (r"\bV100\b", "NVIDIA V100", 15.7, 125.0, 900.0),
    (r"\bT4\b", "NVIDIA T4", 8.1, 65.0, 320.0),
    (r"RTX\s*4090", "NVIDIA GeForce RTX 4090", 82.6, 165.0, 1008.0),
    (r"RTX\s*3090", "NVIDIA GeForce RTX 3090", 35.6, 71.0, 936.0),
    (r"\bMI300X\b", "AMD Instinct MI300X", 163.4, 1307.0, 5300.0),
    (r"\bMI250X?\b", "AMD Instinct MI250X", 47.9, 383.0, 3277.0),
)

#: Used only when numpy is missing and nothing is cached: an ordinary server
#: core pair; the report says so.
ASSUMED_CPU = Peaks("cpu", "CPU (assumed: numpy missing, nothing measured)", 100e9, 10e9, "assumed")


def gpu_peaks(name: str) -> Peaks | None:
    """Looks a GPU up in ``KNOWN_GPUS`` by its device name.

    Args:
        name: the name the driver reports ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3").

    Returns:
        Its peaks (source "table"), or None when the GPU is not in the table.
    """
    for pattern, display, fp32, half, gbps in KNOWN_GPUS:
        if re.search(pattern, name, re.IGNORECASE):
            return Peaks("gpu", display, fp32 * 1e12, gbps * 1e9, "table", half * 1e12, f"datasheet peaks for {name}")
    return None


def gpu_names(meta: dict[str, Any]) -> list[str]:
    """GPU names recorded in a run's metadata (``devices``, ``gpus`` or ``host.gpus``)."""
    names: list[str] = []
    host = meta.get("host")
    if not isinstance(host, dict):
        host = {}
    for entries in (meta.get("devices"), meta.get("gpus"), host.get("gpus")):
        if not isinstance(entries, list):
            continue
        for entry in entries:
            name = entry.get("name") if isinstance(entry, dict) else entry
            if isinstance(name, str) and name and name not in names:
                names.append(name)
    return names


def cache_dir() -> Path:
    """The cache folder: ``$MLTRACE_CACHE_DIR`` or ``~/.cache/mltrace``."""
    override = CACHE_DIR.get()
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "mltrace"


def host_key(hostname: str | None, cpu: str | None, cpu_count: int | None) -> str:
    """A short stable hash naming a machine (host name, CPU model, core count)."""
    text = f"{hostname or ''}|{cpu or ''}|{cpu_count or 0}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def this_host_key() -> str:
    """``host_key`` of the machine this process runs on."""
    import socket

    return host_key(socket.gethostname(), cpu_model(), os.cpu_count())


def run_host_key(meta: dict[str, Any]) -> str | None:
    """``host_key`` of the machine a run was recorded on, or None if run.json does not say."""
    host = meta.get("host")
    if not isinstance(host, dict) or not host.get("hostname"):
        return None
    return host_key(host.get("hostname"), host.get("cpu"), host.get("cpu_count"))


def measure_cpu_peaks(matmul_n: int = 1024, copy_bytes: int = 64 << 20, repeats: int = 5) -> Peaks:
    """Measures this machine's float32 matmul FLOP/s and copy bandwidth with numpy.

    Takes about half a second. Best of ``repeats`` for each, after a warm-up,
    so that a busy machine lowers the figures as little as possible.

    Args:
        matmul_n: square matrix size; one product is 2·n³ FLOP.
        copy_bytes: size of the copied array (bytes); one copy reads and writes
            it, i.e. moves 2× that many bytes.
        repeats: timed repetitions of each.

    Returns:
        Peaks with source "measured".

    Raises:
        ImportError: numpy is not installed.
    """
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((matmul_n, matmul_n), dtype=np.float32)
    b = rng.standard_normal((matmul_n, matmul_n), dtype=np.float32)
    out = np.empty_like(a)
    np.matmul(a, b, out=out)  # warm-up: BLAS thread pool, page faults
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        np.matmul(a, b, out=out)
        best = min(best, time.perf_counter_ns() - t0)
    flops = 2.0 * matmul_n**3 / (best * 1e-9)

    src = np.ones(copy_bytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # warm-up: first touch of dst
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        np.copyto(dst, src)
        best = min(best, time.perf_counter_ns() - t0)
    bandwidth = 2.0 * src.nbytes / (best * 1e-9)
    return Peaks("cpu", f"{cpu_model()} (measured)", flops, bandwidth, "measured")


def _cache_file(key: str, directory: Path | None = None) -> Path:
    return (directory or cache_dir()) / f"peaks-{key}.json"


def read_cached(key: str, directory: Path | None = None) -> Peaks | None:
    """The peaks cached for host ``key``, or None (absent, unreadable or stale)."""
    try:
        data = json.loads(_cache_file(key, directory).read_text(encoding="utf-8"))
        if data.get("method_version") != METHOD_VERSION:
            return None
        p = data["peaks"]
        return Peaks(p["device"], p["name"], float(p["flops_per_s"]), float(p["bytes_per_s"]), "cache", note=p.get("note", ""))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_cache(key: str, peaks: Peaks, directory: Path | None = None) -> Path | None:
    """Caches measured peaks for host ``key`` (atomically); None when the folder is not writable."""
    path = _cache_file(key, directory)
    data = {"method_version": METHOD_VERSION, "host_key": key, "measured_at": time.time(), "peaks": peaks.to_dict()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def cpu_peaks(remeasure: bool = False, directory: Path | None = None) -> Peaks:
    """This machine's CPU peaks: from the cache, else measured now and cached.

    Args:
        remeasure: measure even when a cached value exists (and replace it).
        directory: cache folder (default ``cache_dir()``).
    """
    key = this_host_key()
    if not remeasure:
        cached = read_cached(key, directory)
        if cached is not None:
            return cached
    try:
        peaks = measure_cpu_peaks()
    except ImportError:
        return ASSUMED_CPU
    write_cache(key, peaks, directory)
    return peaks


def peaks_for_run(meta: dict[str, Any], has_gpu_kernels: bool, remeasure: bool = False, directory: Path | None = None) -> PeakSet:
    """The peaks to judge a run by.

    CPU: the run's own host when its peaks are cached (it was reported on
    there before, or it is this machine); otherwise this machine's, with a
    note saying so. GPU: the table entry of the first recorded GPU name.

    Args:
        meta: the run's run.json.
        has_gpu_kernels: whether the run holds GPU kernels (only then is a GPU looked up).
        remeasure: re-measure this machine's CPU peaks.
        directory: cache folder (default ``cache_dir()``).
    """
    key = run_host_key(meta)
    here = this_host_key()
    cpu: Peaks | None = None
    if key is not None and key != here and not remeasure:
        cpu = read_cached(key, directory)
    if cpu is None:
        cpu = cpu_peaks(remeasure=remeasure, directory=directory)
        if key != here:
            cpu = Peaks(
                cpu.device,
                cpu.name,
                cpu.flops_per_s,
                cpu.bytes_per_s,
                cpu.source,
                note="measured on this machine, not on the host that recorded the run",
            )
    found = meta.get("host")
    host: dict[str, Any] = found if isinstance(found, dict) else {}
    on_this_host = key in (None, here)
    flags = cpu_flags() if on_this_host else set(host.get("cpu_flags") or ())
    hz = cpu_frequency_hz(cpu_model() if on_this_host else str(host.get("cpu") or ""), on_this_host)
    cpu = cpu_for_run(cpu, meta, host.get("cpu_count") or os.cpu_count(), flags, hz)
    gpu: Peaks | None = None
    if has_gpu_kernels:
        for name in gpu_names(meta):
            gpu = gpu_peaks(name)
            if gpu is not None:
                break
    return PeakSet(cpu=cpu, gpu=gpu)
