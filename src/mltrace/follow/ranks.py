"""torch.distributed's rank, world size and backend of this process, caught as the program's
``init_process_group`` returns (the process group is often destroyed before the process ends),
else read from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), where the
process did not inherit it from the process that started it: a rank's forked or multiprocessing
children (DataLoader workers, pools) carry its environment without being ranks themselves."""

from __future__ import annotations

import functools
import os
from typing import Any

_captured: dict[str, Any] = {}
_hooks: list[Any] = []
#: torchrun's variables and the values this process inherited from its parent (``inherit``).
_inherited: dict[str, str] = {}
#: The rank facts' names and torchrun's variables for them.
_ENVIRONMENT = (("rank", "RANK"), ("world_size", "WORLD_SIZE"), ("local_rank", "LOCAL_RANK"))


def captured() -> dict[str, Any]:
    """The rank facts of this process: ``rank``, ``world_size``, ``backend``, ``local_rank``
    (those known), and ``source``: ``init_process_group`` or ``environment`` (the rank came from
    torchrun's variables alone); empty where neither torch.distributed nor torchrun said any.
    A variable holding the value this process inherited (``inherit``) is its parent's, not read."""
    out = dict(_captured)
    for key, env in _ENVIRONMENT:
        value = os.environ.get(env, "")
        if key not in out and value.isdigit() and _inherited.get(env) != value:
            out[key] = int(value)
    if "rank" in out:
        out["source"] = "init_process_group" if "rank" in _captured else "environment"
    return out


def forget() -> None:
    """In a forked child: the facts copied from the parent are not this process's, nor are
    torchrun's variables as they are now (``inherit``)."""
    _captured.clear()
    inherit()


def inherit() -> None:
    """Marks torchrun's variables, as they are now, as inherited from the parent process (a
    fork, a multiprocessing child): ``captured`` reads them only once the process sets other
    values (torch's elastic launcher sets them in its multiprocessing children)."""
    _inherited.clear()
    _inherited.update((env, os.environ[env]) for _, env in _ENVIRONMENT if env in os.environ)


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
