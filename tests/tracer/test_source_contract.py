"""The source contract (``tracer/sources/base.py``): every source subclasses ``Source``, so its
optional capabilities are declared, and the session reads them directly; no module of the
package probes them with ``getattr``/``hasattr``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import mltrace
import mltrace.tracer.sources as sources_pkg
from mltrace.config import ProfileOptions
from mltrace.tracer.sources import default_sources
from mltrace.tracer.sources.base import EndsEarly, FrameworkSource, Source
from mltrace.tracer.windows import can_end_early

CAPABILITIES = (
    "framework",
    "thread_ident",
    "can_end_early",
    "profiling",
    "recording_ops",
    "end_early",
    "around_profiler_start",
    "end_layer_level",
    "end_recording",
    "release_in_forked_child",
    "pending_spans",
)


def _source_classes() -> list[type]:
    """Every class defined in mltrace.tracer.sources' modules (base.py, the contract itself,
    excepted) that has ``available``, ``start`` and ``stop``: a source by its shape."""
    found: list[type] = []
    for info in pkgutil.iter_modules(sources_pkg.__path__):
        if info.name == "base":
            continue
        module = importlib.import_module(f"{sources_pkg.__name__}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__:
                continue
            if callable(getattr(cls, "start", None)) and callable(getattr(cls, "stop", None)) and hasattr(cls, "available"):
                found.append(cls)
    return found


def test_every_source_class_subclasses_the_contract() -> None:
    classes = _source_classes()
    assert len(classes) >= 9  # torch.modules, torch.profiler, cpu.library, cupti, onnxruntime, tensorflow, nvml, otel, py-spy
    assert [c.__name__ for c in classes if Source not in c.__mro__] == []
    assert {c.__name__ for c in classes if FrameworkSource in c.__mro__} == {"OrtSource", "TensorFlowSource"}
    for source in default_sources(ProfileOptions(py_spy=True)):
        assert isinstance(source, Source)
        assert isinstance(source.name, str) and isinstance(source.levels, tuple)
        assert source.framework is None or isinstance(source.framework, str)
        assert source.thread_ident is None  # before start
        assert isinstance(source.can_end_early, bool)
        assert isinstance(source.profiling, bool) and isinstance(source.recording_ops, bool)


def test_the_declared_defaults() -> None:
    """What a source that says nothing gets: shared by every framework, ended from any thread,
    runs to the end of the session, no profiler of its own, records from its start."""
    nvml = next(s for s in default_sources() if s.name == "nvml")
    assert (nvml.framework, nvml.thread_ident, nvml.can_end_early, nvml.profiling, nvml.recording_ops) == (None, None, False, False, True)
    assert not can_end_early(nvml) and not isinstance(nvml, EndsEarly)


def test_the_sources_that_can_end_early_have_end_early() -> None:
    for source in default_sources():
        if "can_end_early" in {name for c in type(source).__mro__ if c is not Source for name in vars(c)}:
            assert isinstance(source, EndsEarly), source.name


def test_no_module_probes_a_capability() -> None:
    names = "|".join(CAPABILITIES)
    probe = re.compile(rf"""(?:getattr|hasattr)\(\s*[^,()]+,\s*["'](?:{names})["']""")
    root = Path(mltrace.__file__).parent
    hits = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if probe.search(line)
    ]
    assert hits == []
