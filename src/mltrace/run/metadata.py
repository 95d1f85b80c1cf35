"""Run metadata: what ran, where, with which versions — never secrets."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import sys
from typing import Any

from mltrace._version import __version__

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

#: Environment variables worth recording (configuration that changes results).
#: Values of anything else — tokens, keys, passwords — are never written.
RECORDED_ENV_PREFIXES = ("MLTRACE_", "OMP_", "MKL_", "ONEDNN_", "DNNL_", "CUDA_VISIBLE_DEVICES", "TF_NUM_", "TF_ENABLE_ONEDNN")
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


def installed_versions() -> dict[str, str]:
    """Versions of the installed frameworks (distribution name → version)."""
    out: dict[str, str] = {}
    for dist in FRAMEWORK_DISTRIBUTIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def recorded_environment() -> dict[str, str]:
    """The subset of the environment that configures performance, minus secrets."""
    env: dict[str, str] = {}
    for k, v in os.environ.items():
        if k.startswith(RECORDED_ENV_PREFIXES) and not any(w in k.upper() for w in _SECRET_WORDS):
            env[k] = v
    return env


def host_metadata() -> dict[str, Any]:
    """Host, OS, CPU and Python facts."""
    return {
        "hostname": socket.gethostname(),
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
    }


def base_metadata(command: list[str] | None, name: str) -> dict[str, Any]:
    """The metadata known when a run starts."""
    return {
        "format": "mltrace-run",
        "format_version": 1,
        "mltrace_version": __version__,
        "name": name,
        "command": command if command is not None else list(sys.argv),
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
