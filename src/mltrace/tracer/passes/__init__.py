"""Correlator passes: pure functions ``Run -> Run`` run in order at the end of a run.

Each pass takes the run's events and returns a run with corrected events; a
pass records what it found under ``run.meta["correlation"][<pass name>]``.
``default_pipeline()`` is the order the session applies them in:

- ``fx_layers``: layer spans for the calls of exported programs (``torch.export``)
- ``checks``: ordering, overlap separation, the containment check
- ``nesting``: parents by containment on a track; GPU work under its launch
- ``gpu_library``: cuDNN / cuBLAS / CUTLASS / Triton … from kernel names
- ``library``: oneDNN / MKL calls under the ops that issued them
- ``samples``: py-spy samples to the spans they were taken in
- ``memory``: allocations, frees and peaks of memory per span (``--memory``)
"""

from __future__ import annotations

from collections.abc import Callable

from mltrace.run.gcpause import gc_paused
from mltrace.run.store import Run
from mltrace.tracer.passes.checks import check_containment, separate_overlaps, sort_spans
from mltrace.tracer.passes.fx_layers import layers_from_fx
from mltrace.tracer.passes.gpu_library import attribute_gpu_library
from mltrace.tracer.passes.library import attach_library_calls
from mltrace.tracer.passes.memory import attribute_memory
from mltrace.tracer.passes.nesting import attach_gpu_to_launch, nest_by_containment
from mltrace.tracer.passes.samples import attribute_samples

Pass = Callable[[Run], Run]


def default_pipeline() -> list[Pass]:
    """The passes in order. Sources' passes slot in before the checks."""
    return [
        layers_from_fx,
        sort_spans,
        nest_by_containment,
        attach_gpu_to_launch,
        attribute_gpu_library,
        attach_library_calls,
        attribute_samples,
        attribute_memory,
        separate_overlaps,
        check_containment,
    ]


def correlate(run: Run, pipeline: list[Pass] | None = None) -> Run:
    """Applies every pass in order, with the cyclic garbage collector paused: the passes make a
    copy of every span they change (tens of thousands a segment of a streamed finish), in no
    cycle, and the collections those allocations set off rescanned every live span again."""
    with gc_paused():
        for p in pipeline if pipeline is not None else default_pipeline():
            run = p(run)
    return run
