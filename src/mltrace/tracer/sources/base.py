"""The source contract.

A source produces events for one or more levels. Live sources (hooks,
decorators) record spans through ``session.recorder`` while the program runs;
post-hoc sources (profilers, log parsers) return a batch of events from
``stop()``. Sources import their framework lazily, never at module import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from mltrace.run.events import Event
from mltrace.run.levels import Level

if TYPE_CHECKING:
    from mltrace.tracer.session import Session


@runtime_checkable
class Source(Protocol):
    """What every source provides.

    Attributes:
        name: short identifier used in run.json and messages ("torch.modules").
        levels: the levels this source can produce.
    """

    name: str
    levels: tuple[Level, ...]

    def available(self) -> str | None:
        """Returns None when the source can run here, else the reason it cannot."""
        ...

    def start(self, session: Session) -> None:
        """Starts recording; ``session.levels`` says which levels are enabled."""
        ...

    def stop(self) -> list[Event]:
        """Stops recording, removes every hook, and returns post-hoc events."""
        ...
