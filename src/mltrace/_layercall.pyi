from collections.abc import Callable
from typing import Any

class LayerFrame:
    """A nested module call of the layer level: reads and writes as the 11-item frame list of
    ``torch_modules.py`` (module, parent, id, start, end, in, out, kid, root, None, site)."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> Any: ...
    def __setitem__(self, index: int, value: Any) -> None: ...

class LayerCall:
    """``Module.__call__`` for the layer level, in C (see ``_layercall.c``)."""

    def __init__(
        self,
        tls: Any,
        new_stack: Callable[[], list[Any]],
        outer: Callable[..., Any],
        raw_shapes: Callable[[Any], list[Any]],
        tensor_type: type,
        next_id: Callable[[], int],
        append_frame: Callable[[list[Any]], None],
        original: Callable[..., Any],
        direct: bool,
        forward_check: tuple[Callable[..., Any], Callable[[], Any], dict[str, Any]] | None = None,
        internal: dict[Any, bool] | None = None,
        classify: Callable[[Any], bool] | None = None,
        compiling: Callable[[], Any] | None = None,
        bound: Callable[..., Any] | None = None,
        owner: type | None = None,
        untraced_shapes: Callable[[Any], list[Any]] | None = None,
    ) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def __get__(self, obj: Any, objtype: Any = None) -> Any: ...

def encode_rows(
    frames: list[list[Any]],
    place: Callable[[list[Any]], Any],
    shapes_json: Callable[[Any, dict[Any, str], str], str],
    in_cache: dict[Any, str],
    out_cache: dict[Any, str],
    templates: dict[tuple[str, str, str, str, str], int],
    next_template: Callable[[], int],
    level: int,
    site_json: Callable[[Any, int], str],
) -> tuple[bytes, bytes]:
    """Completed layer frames as events.jsonl template and span rows (see ``TorchModuleSource._encode_frames``);
    the span rows' numbers are formatted with the GIL given up."""

def forget_templates() -> None:
    """Empties the template ids cached by address (when the templates dict starts over)."""

def take_frames(queue: Any) -> list[Any]:
    """Every item of the deque, removed at once (no append from another thread falls between)."""

def clear_caches() -> None:
    """Empties the drain's process-wide caches of shape encodings and placed entries."""

def bind_tracing_state(path: str | None) -> bool:
    """Reads libtorch's JIT tracing state directly from the loaded library at ``path``; whether found (None: no more)."""

def tracing_now() -> bool | None:
    """Whether this thread records a JIT trace, by the bound state (None: none bound)."""
