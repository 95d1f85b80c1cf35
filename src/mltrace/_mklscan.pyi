from collections.abc import Sequence

def scan(lines: Sequence[str | tuple[int, str]]) -> tuple[list[str | int], list[int]]:
    """Per line, the MKL call's key (``verbose_logs.mkl_call_key``) and duration (ns); else 0 for
    no call (unparsed), 1 for no call (a header or info line), 2 where Python is to read it,
    and duration 0 (see ``_mklscan.c``)."""
