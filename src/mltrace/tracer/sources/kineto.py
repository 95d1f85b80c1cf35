"""The Kineto (``torch.profiler``) Chrome-trace conversion, now in ``mltrace.formats.kineto``
(a pure converter, run by the op level's converter process too): its names, re-exported for
the tracer's modules that import them from here."""

from __future__ import annotations

from mltrace.formats.kineto import (
    CUDA_API_CATEGORIES,
    GPU_ACTIVITY_CATEGORIES,
    MEMORY_EVENT,
    KinetoEvents,
    KinetoStats,
    kineto_to_events,
    link_launches,
    load_kineto_json,
    memory_counter_name,
    trace_cuda_major,
    trace_epoch_offset,
)

__all__ = [
    "CUDA_API_CATEGORIES",
    "GPU_ACTIVITY_CATEGORIES",
    "MEMORY_EVENT",
    "KinetoEvents",
    "KinetoStats",
    "kineto_to_events",
    "link_launches",
    "load_kineto_json",
    "memory_counter_name",
    "trace_cuda_major",
    "trace_epoch_offset",
]
