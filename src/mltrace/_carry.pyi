from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

class CarriedCall:
    """``func`` called with each ``(ContextVar, value)`` of ``pairs`` set, reset after (see ``_carry.c``)."""

    func: Callable[..., Any]
    pairs: tuple[tuple[ContextVar[Any], Any], ...]

    def __init__(self, func: Callable[..., Any], pairs: tuple[tuple[ContextVar[Any], Any], ...]) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
