"""Sources of events. ``default_sources()`` lists every source mltrace knows,
in start order; the session starts those whose levels are enabled and which are
available here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mltrace.tracer.sources.base import Source

if TYPE_CHECKING:
    from mltrace.config import ProfileOptions


def default_sources(options: ProfileOptions | None = None) -> list[Source]:
    """Fresh instances of every known source (nothing heavy is imported).

    Sources with no levels are option-driven (``--py-spy``) and listed only
    when their option is on.
    """
    from mltrace.tracer.sources.cpu_library import CpuLibrarySource
    from mltrace.tracer.sources.cupti import CuptiSource
    from mltrace.tracer.sources.gc_pauses import GcPauseSource
    from mltrace.tracer.sources.nvml import NvmlSampler
    from mltrace.tracer.sources.onnxruntime import OrtSource
    from mltrace.tracer.sources.otel_spans import OtelSpanSource
    from mltrace.tracer.sources.tensorflow import TensorFlowSource
    from mltrace.tracer.sources.torch_modules import TorchModuleSource
    from mltrace.tracer.sources.torch_ops import TorchOpSource

    # Order matters. cpu.library starts before torch.profiler, so the MKL warm-up it runs
    # is not profiled; CuptiSource (the kernel path) and TensorFlowSource read which sources
    # started before them.
    sources: list[Source] = [
        TorchModuleSource(),
        CpuLibrarySource(),
        TorchOpSource(),
        CuptiSource(),
        OrtSource(),
        TensorFlowSource(),
        NvmlSampler(),
        OtelSpanSource(),
        GcPauseSource(),
    ]
    if options is not None and options.py_spy:
        from mltrace.tracer.sources.pyspy import PySpySource

        sources.append(PySpySource(native=options.native))
    return sources


__all__ = ["Source", "default_sources"]
