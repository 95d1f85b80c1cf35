"""The package's layers (``scripts/layering.py``): no module imports a layer above its own, no
import cycle, every package placed in a layer; lazy and type-only imports count."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "layering.py"


def _layering() -> ModuleType:
    spec = importlib.util.spec_from_file_location("layering", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("layering", module)
    spec.loader.exec_module(module)
    return module


layering = _layering()


def test_no_module_imports_a_layer_above_its_own() -> None:
    assert layering.upward(layering.graph()) == []


def test_no_import_cycle() -> None:
    assert layering.cycles(layering.graph()) == []


def test_every_package_has_a_layer() -> None:
    assert layering.unranked(layering.graph()) == []


def test_lazy_and_type_only_imports_count(tmp_path: Path) -> None:
    """A function-level import from the ground up to the tracer, answered by a type-only import
    back: one upward import and one cycle; a package of no layer is named."""
    files = {
        "mltrace/__init__.py": "",
        "mltrace/run/__init__.py": "",
        "mltrace/run/a.py": "def f() -> None:\n    from mltrace.tracer import b\n",
        "mltrace/tracer/__init__.py": "",
        "mltrace/tracer/b.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from ..run.a import f\n",
        "mltrace/nowhere.py": "",
    }
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    edges = layering.graph(tmp_path)
    assert layering.upward(edges) == [("mltrace.run.a", "mltrace.tracer.b")]
    assert layering.cycles(edges) == [["mltrace.run.a", "mltrace.tracer.b"]]
    assert layering.unranked(edges) == ["mltrace.nowhere"]
