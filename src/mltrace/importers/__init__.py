"""Importers: turn traces recorded by other tools into mltrace run directories.

``import_kineto`` reads a torch.profiler (Kineto) trace. Each importer checks
its destination and reads its input before creating anything, so a refused
import leaves nothing on disk.
"""

from __future__ import annotations

from mltrace.importers.kineto import import_kineto

__all__ = ["import_kineto"]
