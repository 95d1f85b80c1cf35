from collections.abc import Callable
from typing import Any

def encode_spans(
    ks: list[int],
    spans: list[Any],
    n_ends: int,
    end_tails: dict[int, bytes],
    begin_heads: dict[Any, bytes],
    blocks: dict[Any, bytes],
    dict_blocks: dict[int, bytes],
    layer: Any,
    flowing: set[int],
    fallback: Callable[[int], bytes],
    interned: tuple[dict[str, bytes], dict[bytes, bytes], Callable[[Any], bytes], set[int], int] | None = None,
) -> bytes:
    """The packets at indices ``ks``, joined (see ``_pftrace.c``)."""
