"""Run callbacks once a module is imported — without importing it ourselves.

Sources use this so that ``mltrace python script.py`` hooks torch only if the
script imports torch, and only after torch has finished initializing. Several
sources may wait for the same module: one finder per module name serves them
all, in registration order.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str) -> None:
        self.name = name
        self.callbacks: list[Callback] = []
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != self.name or getattr(self._busy, "on", False):
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
            callbacks, finder.callbacks = list(finder.callbacks), []
            _remove_finder(finder)
            for callback in callbacks:
                callback(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_finders: dict[str, _PostImportFinder] = {}
_lock = threading.Lock()


def _remove_finder(finder: _PostImportFinder) -> None:
    with _lock:
        if _finders.get(finder.name) is finder:
            del _finders[finder.name]
        try:
            sys.meta_path.remove(finder)
        except ValueError:
            pass


class PostImportHook:
    """Calls ``callback(module)`` now if ``name`` is imported, else right after its import.

    ``remove()`` (always call it, in ``finally``) withdraws the callback; the
    finder leaves ``sys.meta_path`` when no callback waits on it.
    """

    def __init__(self, name: str, callback: Callback) -> None:
        self._name = name
        self._callback: Callback | None = None
        module = sys.modules.get(name)
        if module is not None:
            callback(module)
            return
        with _lock:
            finder = _finders.get(name)
            if finder is None:
                finder = _finders[name] = _PostImportFinder(name)
                sys.meta_path.insert(0, finder)
            finder.callbacks.append(callback)
        self._callback = callback

    def remove(self) -> None:
        if self._callback is None:
            return
        callback, self._callback = self._callback, None
        with _lock:
            finder = _finders.get(self._name)
        if finder is None:
            return
        if callback in finder.callbacks:
            finder.callbacks.remove(callback)
        if not finder.callbacks:
            _remove_finder(finder)
