"""torch.distributed's rank, world size and backend of this process, caught as the program's
``init_process_group`` returns (the process group is often destroyed before the process ends),
else read from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)."""

from __future__ import annotations

import functools
import os
from typing import Any

_captured: dict[str, Any] = {}
_hooks: list[Any] = []


def captured() -> dict[str, Any]:
    """The rank facts of this process: ``rank``, ``world_size``, ``backend``, ``local_rank``
    (those known); empty where neither torch.distributed nor torchrun said any."""
    out = dict(_captured)
    for key, env in (("rank", "RANK"), ("world_size", "WORLD_SIZE"), ("local_rank", "LOCAL_RANK")):
        value = os.environ.get(env, "")
        if key not in out and value.isdigit():
            out[key] = int(value)
    return out


def forget() -> None:
    """In a forked child: the facts copied from the parent are not this process's."""
    _captured.clear()


def watch_ranks(session: Any) -> None:
    """Wraps ``torch.distributed.init_process_group`` once the program imports torch.distributed,
    so that this process's rank facts are kept when it returns."""
    from mltrace.tracer.sources._imports import PostImportHook

    _hooks.append(PostImportHook("torch.distributed", _wrap))


def _wrap(dist: Any) -> None:
    c10d = getattr(dist, "distributed_c10d", None)
    original = getattr(c10d, "init_process_group", None)
    if c10d is None or original is None or getattr(original, "__mltrace_ranks__", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        _record(dist)
        return result

    init_process_group.__mltrace_ranks__ = True  # type: ignore[attr-defined]
    c10d.init_process_group = init_process_group
    if getattr(dist, "init_process_group", None) is original:
        dist.init_process_group = init_process_group


def _record(dist: Any) -> None:
    try:
        _captured.update(rank=int(dist.get_rank()), world_size=int(dist.get_world_size()), backend=str(dist.get_backend()))
    except Exception:  # noqa: BLE001 - facts only
        pass
