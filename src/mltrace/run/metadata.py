"""Run metadata: what ran, where, with which versions — never secrets."""

from __future__ import annotations

import os
import platform
import re
import sys
from typing import Any

from mltrace._version import __version__
from mltrace.run.redact import REDACTED, looks_secret, redact_command
from mltrace.settings import PREFIX

#: Distributions whose versions are recorded when installed (read from package
#: metadata: nothing is imported).
FRAMEWORK_DISTRIBUTIONS = (
    "torch",
    "tensorflow",
    "tensorflow-cpu",
    "keras",
    "onnxruntime",
    "onnxruntime-gpu",
    "onnx",
    "numpy",
    "nvidia-ml-py",
    "cupti-python",
    "opentelemetry-sdk",
)

#: Environment variables worth recording (configuration that changes results). Nothing
#: else is written, and the values of these whose names look secret are ``[redacted]``.
RECORDED_ENV_PREFIXES = (PREFIX, "OMP_", "MKL_", "ONEDNN_", "DNNL_", "CUDA_VISIBLE_DEVICES", "TF_NUM_", "TF_ENABLE_ONEDNN")
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH", "HEADERS")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else platform.processor()."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def installed_versions(path: list[str] | None = None) -> dict[str, str]:
    """Versions of the installed frameworks (``FRAMEWORK_DISTRIBUTIONS``: distribution name →
    version), as ``distribution_versions`` reads them from ``path`` (``sys.path``)."""
    return distribution_versions(FRAMEWORK_DISTRIBUTIONS, path)


def distribution_versions(distributions: tuple[str, ...], path: list[str] | None = None) -> dict[str, str]:
    """The versions of those of ``distributions`` installed (name → version, in their order):
    the ``Version`` of the first ``NAME-….dist-info`` or ``NAME-….egg-info`` of each on ``path``
    (``sys.path``), where ``importlib.metadata.version`` finds it. Read here without
    ``importlib.metadata``, whose import (its email, zipfile and csv modules) left some 7,000
    objects in a traced program that had none of them, for its every full garbage collection
    to scan."""
    wanted = {_distribution_key(d): d for d in distributions}
    out: dict[str, str] = {}
    for entry in sys.path if path is None else path:
        try:
            names = sorted(os.listdir(entry or os.curdir))
        except OSError:  # not a folder (a zip file), or gone
            continue
        for name in names:
            stem, ext = os.path.splitext(name)
            dist = wanted.get(_distribution_key(stem.partition("-")[0]))
            if ext in (".dist-info", ".egg-info") and dist is not None and dist not in out:
                version = _metadata_version(os.path.join(entry or os.curdir, name))
                if version:
                    out[dist] = version
    return {d: out[d] for d in distributions if d in out}


def _distribution_key(name: str) -> str:
    """A distribution's name as metadata folder names spell it in any form (PEP 503, ``_`` for
    runs of ``-``, ``_`` and ``.``, lower case)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _metadata_version(path: str) -> str | None:
    """The ``Version`` header of a ``.dist-info`` folder's ``METADATA``, an ``.egg-info``
    folder's ``PKG-INFO`` or an ``.egg-info`` file; None where there is none."""
    if os.path.isdir(path):
        path = os.path.join(path, "METADATA" if path.endswith(".dist-info") else "PKG-INFO")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break  # the end of the headers
                if line.startswith("Version:"):
                    return line.partition(":")[2].strip() or None
    except OSError:
        pass
    return None


def recorded_environment() -> dict[str, str]:
    """The subset of the environment that configures performance; a variable whose name looks
    secret (``redact.looks_secret``, or holds one of ``_SECRET_WORDS``) has its value replaced
    by ``[redacted]``, whatever ``MLTRACE_REDACT`` says."""
    env: dict[str, str] = {}
    for k, v in os.environ.items():
        if k.startswith(RECORDED_ENV_PREFIXES):
            env[k] = REDACTED if looks_secret(k) or any(w in k.upper() for w in _SECRET_WORDS) else v
    return env


def _hostname() -> str:
    """The host's name, as ``socket.gethostname`` gives it (``uname``'s node name on POSIX,
    read without importing ``socket``)."""
    if hasattr(os, "uname"):
        return os.uname().nodename
    import socket

    return socket.gethostname()


def host_metadata() -> dict[str, Any]:
    """Host, OS, CPU and Python facts."""
    return {
        "hostname": _hostname(),
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
    }


def base_metadata(command: list[str] | None, name: str, *, redact: bool = True) -> dict[str, Any]:
    """The metadata known when a run starts; with ``redact``, the command's secret-looking
    values are ``[redacted]`` (``redact.redact_command``)."""
    argv = command if command is not None else list(sys.argv)
    return {
        "format": "mltrace-run",
        "format_version": 1,
        "mltrace_version": __version__,
        "name": name,
        "command": redact_command(argv) if redact else argv,
        "cwd": os.getcwd(),
        "pid": os.getpid(),
        "host": host_metadata(),
        "versions": installed_versions(),
        "environment": recorded_environment(),
        "complete": False,
    }


def unrecorded_levels(meta: dict[str, Any]) -> list[str]:
    """``"<level>: <reason>"`` for each level asked for and not recorded (run.json ``levels``);
    a hand-edited or foreign run.json whose entries have other shapes gives none for them."""
    levels = meta.get("levels")
    if not isinstance(levels, dict):
        return []
    return [f"{k}: {v.get('reason')}" for k, v in levels.items() if isinstance(v, dict) and v.get("requested") and not v.get("recorded")]


def limitations(meta: dict[str, Any]) -> list[str]:
    """run.json's ``limitations`` as text (none where it is not a list)."""
    found = meta.get("limitations")
    return [str(x) for x in found] if isinstance(found, list) else []


#: The type of each run.json field that readers use (a field may be absent; ``int`` excludes
#: ``bool``). A run.json whose field has another type is refused with a line naming it.
META_TYPES: dict[str, type] = {
    "format_version": int,
    "name": str,
    "command": list,
    "cwd": str,
    "pid": int,
    "host": dict,
    "versions": dict,
    "environment": dict,
    "complete": bool,
    "run_id": str,
    "clock": dict,
    "sources": dict,
    "sources_info": dict,
    "levels": dict,
    "op_window": dict,
    "layer_window": dict,
    "started_at_epoch_ns": int,
    "stopped_at_epoch_ns": int,
    "duration_ns": int,
    "exit_status": int,
    "exit_cause": str,
    "limitations": list,
    "errors": list,
    "correlation": dict,
    "summary": dict,
    "gpus": list,
    "devices": list,
    "otel_parent": dict,
    "kernel_path": str,
    "stopped_early": dict,
    "trace_full": dict,
    "events_bytes": int,
}
_NAMES = {bool: "true or false", int: "a whole number", str: "text", list: "a list", dict: "an object"}
_INT64 = range(-(1 << 63), 1 << 63)


def meta_problem(meta: dict[str, Any]) -> str | None:
    """What is wrong with run.json's fields (``META_TYPES``, the clock's anchors), or None."""
    for key, kind in META_TYPES.items():
        if key not in meta:
            continue
        value = meta[key]
        if type(value) is not kind:
            return f"{key!r} is {_kind_of(value)}, not {_NAMES[kind]}"
        if kind is int and value not in _INT64:
            return f"{key!r} is {value}, beyond a 64-bit integer"
    clock = meta.get("clock", {})
    for key in ("anchor_monotonic_ns", "anchor_epoch_ns", "anchor_uncertainty_ns"):
        if key in clock and (type(clock[key]) is not int or clock[key] not in _INT64):
            return f"'clock.{key}' is {_kind_of(clock[key])}, not a 64-bit whole number (ns)"
    return None


def _kind_of(value: Any) -> str:
    if value is None:
        return "null"
    for kind, name in _NAMES.items():
        if type(value) is kind:
            return name if kind is not int else str(value)
    return "a number" if isinstance(value, float) else type(value).__name__
