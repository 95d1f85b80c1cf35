from typing import Any

def containers(ordered: Any, track: Any, start: Any, end: Any, level: Any, user: int, user_holder: int, out: Any) -> None:
    """Each row's innermost container row on its track (-1: none), into ``out`` (see ``_sweep.c``)."""

def lanes(ordered: Any, track: Any, start: Any, end: Any, out: Any) -> None:
    """Each row's lane on its track (0: the track itself), into ``out``."""
