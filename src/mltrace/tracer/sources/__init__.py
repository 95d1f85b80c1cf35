"""Sources of events. ``default_sources()`` lists every source mltrace knows,
in start order; the session starts those whose levels are enabled and which are
available here."""

from __future__ import annotations

from mltrace.tracer.sources.base import Source


def default_sources() -> list[Source]:
    """Fresh instances of every known source (nothing heavy is imported)."""
    from mltrace.tracer.sources.torch_modules import TorchModuleSource

    return [TorchModuleSource()]


__all__ = ["Source", "default_sources"]
