"""torch's own ``record_function`` ranges, told apart from the program's.

torch.profiler records every ``record_function`` range as a ``user_annotation``, the ones a
program opens and the ones torch opens itself around its own work: the DataLoader's batches,
optimizer steps, torch.profiler's steps, torch.compile's regions, data-parallel wrappers.
They stay user-level spans in the trace (attribute ``torch.range``), but the report does not
count torch's as the program's regions: ops inside them are not in the name tables unless a
model call or a span of the program's holds them, and the DataLoader's batches between model
calls are the time the model waited for its input.
"""

from __future__ import annotations

#: The range kind of the DataLoader's batches (``enumerate(DataLoader)#…__next__``).
DATALOADER = "dataloader"

#: Name prefixes of the ranges torch opens itself, and each one's kind.
TORCH_RANGE_PREFIXES: tuple[tuple[str, str], ...] = (
    ("enumerate(DataLoader)#", DATALOADER),
    ("Optimizer.step#", "optimizer"),
    ("Optimizer.zero_grad#", "optimizer"),
    ("ProfilerStep#", "profiler step"),
    ("Torch-Compiled Region: ", "torch.compile"),
    ("## Call CompiledFxGraph ", "torch.compile"),
    ("DataParallel.forward", "data parallel"),
    ("DistributedDataParallel.forward", "data parallel"),
    ("FullyShardedDataParallel.", "data parallel"),
    ("FSDP::", "data parallel"),
)


def torch_range_kind(name: str) -> str | None:
    """The kind of torch's own range named ``name``, or None for a range of the program's."""
    for prefix, kind in TORCH_RANGE_PREFIXES:
        if name.startswith(prefix):
            return kind
    return None
