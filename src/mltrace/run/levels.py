"""Trace levels, ordered from the outermost (model) to the innermost (kernel).

A run records every level down to the deepest one asked for: ``--level layer``
records model and layer spans. User spans (decorators, context managers) are
outside that order and always recorded.
"""

from __future__ import annotations

import enum


class Level(enum.IntEnum):
    """One level of the cross-stack hierarchy.

    The integer order is the nesting order: a span of a lower level may contain
    spans of higher levels, never the other way round. ``USER`` is not part of
    the order; user spans may appear at any depth.
    """

    MODEL = 1
    LAYER = 2
    OP = 3
    LIBRARY = 4
    KERNEL = 5
    USER = 9
    SOURCE = 10

    @property
    def label(self) -> str:
        """Lower-case name used in files, categories and on the command line."""
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Level:
        """Parses a level name such as ``"layer"`` (case-insensitive).

        Raises:
            ValueError: if ``text`` names no level.
        """
        try:
            return cls[text.strip().upper()]
        except KeyError:
            names = ", ".join(lv.label for lv in HIERARCHY)
            raise ValueError(f"unknown level {text!r} (choose from {names})") from None


#: The ordered levels, outermost first (``USER`` excluded).
HIERARCHY: tuple[Level, ...] = (Level.MODEL, Level.LAYER, Level.OP, Level.LIBRARY, Level.KERNEL)


def levels_down_to(deepest: Level) -> tuple[Level, ...]:
    """Returns every hierarchy level from ``MODEL`` down to ``deepest`` inclusive."""
    return tuple(lv for lv in HIERARCHY if lv <= deepest)
