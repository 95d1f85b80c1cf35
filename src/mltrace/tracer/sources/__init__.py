"""Sources of events. ``default_sources()`` lists every source mltrace knows,
in start order; the session starts those whose levels are enabled and which are
available here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mltrace.run.levels import Level
from mltrace.tracer.sources.base import Source

if TYPE_CHECKING:
    from mltrace.config import ProfileOptions


def default_sources(options: ProfileOptions | None = None) -> list[Source]:
    """Fresh instances of every known source (nothing heavy is imported).

    Sources with no levels are option-driven (``--py-spy``) and listed only
    when their option is on. Where ``options`` names a level, the sources of
    deeper levels only are left out, their modules not imported: the session
    would not start them, and the program's garbage collections would scan
    their objects.
    """
    from mltrace.tracer.sources.asyncio_executor import AsyncioExecutorSource
    from mltrace.tracer.sources.gc_pauses import GcPauseSource
    from mltrace.tracer.sources.nvml import NvmlSampler
    from mltrace.tracer.sources.onnxruntime import OrtSource
    from mltrace.tracer.sources.otel_spans import OtelSpanSource
    from mltrace.tracer.sources.tensorflow import TensorFlowSource
    from mltrace.tracer.sources.torch_modules import TorchModuleSource

    deepest = options.level if options is not None and options.level is not None else Level.KERNEL
    # Order matters. cpu.library starts before torch.profiler, so the MKL warm-up it runs
    # is not profiled; CuptiSource (the kernel path) and TensorFlowSource read which sources
    # started before them.
    sources: list[Source] = [TorchModuleSource()]
    if deepest >= Level.LIBRARY:
        from mltrace.tracer.sources.cpu_library import CpuLibrarySource

        sources.append(CpuLibrarySource())
    if deepest >= Level.OP:
        from mltrace.tracer.sources.torch_ops import TorchOpSource

        sources.append(TorchOpSource())
    if deepest >= Level.KERNEL:
        from mltrace.tracer.sources.cupti import CuptiSource

        sources.append(CuptiSource())
    sources += [OrtSource(), TensorFlowSource(), NvmlSampler(), OtelSpanSource(), GcPauseSource(), AsyncioExecutorSource()]
    if options is not None and options.py_spy:
        from mltrace.tracer.sources.pyspy import PySpySource

        sources.append(PySpySource(native=options.native))
    return sources


__all__ = ["Source", "default_sources"]
