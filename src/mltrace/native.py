"""mltrace's optional C helpers (built by setup.py where a compiler is found)."""

from __future__ import annotations

import importlib
from types import ModuleType

from mltrace.settings import Setting


def c_helper(module: str, switch: Setting) -> ModuleType | None:
    """The C helper ``mltrace.<module>``, or None where it was not built or the environment
    variable ``switch`` is ``python`` (the same code in Python then runs, for comparison)."""
    if switch.is_set_to("python"):
        return None
    try:
        return importlib.import_module(f"mltrace.{module}")
    except ImportError:
        return None
