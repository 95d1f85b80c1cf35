"""Run a callback once a module is imported — without importing it ourselves.

Sources use this so that ``mltrace python script.py`` hooks torch only if the
script imports torch, and only after torch has finished initializing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.callback = callback
        self.fired = False
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != self.name or self.fired or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        finally:
            self._busy.on = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original = loader.exec_module
        finder = self

        def exec_module(module: ModuleType) -> None:
            original(module)
            if not finder.fired:
                finder.fired = True
                finder.callback(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


class PostImportHook:
    """Calls ``callback(module)`` now if ``name`` is imported, else right after its import.

    ``remove()`` (always call it, in ``finally``) takes the finder off
    ``sys.meta_path``.
    """

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self._finder: _PostImportFinder | None = None
        module = sys.modules.get(name)
        if module is not None:
            callback(module)
            return
        self._finder = _PostImportFinder(name, callback)
        sys.meta_path.insert(0, self._finder)

    def remove(self) -> None:
        if self._finder is not None:
            try:
                sys.meta_path.remove(self._finder)
            except ValueError:
                pass
            self._finder = None
