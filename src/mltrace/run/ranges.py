"""torch's own ``record_function`` ranges, told apart from the program's.

torch.profiler records every ``record_function`` range as a ``user_annotation``, the ones a
program opens and the ones torch opens itself around its own work: the DataLoader's batches,
optimizer steps, torch.profiler's steps, torch.compile's regions (and the empty ranges that
carry its compile events' metadata), data-parallel wrappers, torch.distributed's collectives
(``gloo:all_reduce``, ``nccl:all_reduce``: the report's ranks section counts them). The
ranges torch opens in C++ or with ``_RecordFunctionFast`` (torch.compile's region, its cache
lookup) it records as ``cpu_op`` instead; the converter makes those user-level spans too
(``formats/kineto.py``).
They stay user-level spans in the trace (attribute ``torch.range``), but the report does not
count torch's as the program's regions: ops inside them are not in the name tables unless a
model call or a span of the program's holds them, and the DataLoader's batches between model
calls are the time the model waited for its input.

torch.compile's compile-time ranges (``COMPILE_SUFFIX``; torch records them as ops) mark the
ops torch runs while it compiles: the report counts those apart from the model's work
(``analysis/span_pass.py``, docs/ANALYSIS.md "Compile time inside the counted calls").
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
    ("TorchDynamo Cache Lookup", "torch.compile"),
    ("Pregraph bytecode", "torch.compile"),
    ("AOTDispatcher Runtime Wrapper Prologue", "torch.compile"),
    ("DataParallel.forward", "data parallel"),
    ("DistributedDataParallel.forward", "data parallel"),
    ("FullyShardedDataParallel.", "data parallel"),
    ("FSDP::", "data parallel"),
    ("gloo:", "collectives"),  # the process group backends' ranges around their collectives
    ("nccl:", "collectives"),
    ("mpi:", "collectives"),
    ("ucc:", "collectives"),
)


#: The middle of the empty ranges that TorchDynamo opens to attach a compile event's metadata
#: (``dynamo_data: compile_id=0/0``, ``build_guards_data: compile_id=0/1``: the event's name,
#: ``_data: ``, then ``key=value`` pairs, ``compile_id`` always among them).
COMPILE_DATA_MARK = "_data: "


def torch_range_kind(name: str) -> str | None:
    """The kind of torch's own range named ``name``, or None for a range of the program's."""
    for prefix, kind in TORCH_RANGE_PREFIXES:
        if name.startswith(prefix):
            return kind
    if _is_compile_data(name):
        return "torch.compile"
    return None


def _is_compile_data(name: str) -> bool:
    """Whether ``name`` is a compile event's metadata range (``COMPILE_DATA_MARK``)."""
    event, mark, data = name.partition(COMPILE_DATA_MARK)
    return bool(mark) and event.isidentifier() and "compile_id=" in data


#: The name suffix of the ranges TorchDynamo's ``dynamo_timed`` opens around torch.compile's
#: compile-time work (tracing, AOTAutograd, Inductor's passes and code generation, loading the
#: compiled code, autotuning, CUDA graph recording): ``_compile.compile_inner (dynamo_timed)``.
COMPILE_SUFFIX = " (dynamo_timed)"
#: ``dynamo_timed`` ranges that time work each call runs, not compiling: the guard check that
#: distributed compiling runs as a collective.
COMPILE_SUFFIX_RUNTIME = frozenset({"guard_collective" + COMPILE_SUFFIX})
#: Ranges torch opens around its compile-time ranges (its compile events: a frame's whole
#: compile, the backend's, the backward's), named without the suffix. A ``dynamo_timed``
#: range is also wrapped in one named as itself without the suffix.
COMPILE_EVENTS = frozenset(
    {
        "dynamo",
        "entire_frame_compile",
        "entire_backward_compile",
        "backend_compile",
        "inductor_compile",
        "code_gen",
        "compile_fx_aot",
        "compiled_autograd",
    }
)


def is_compile_range(name: str) -> bool:
    """Whether ``name`` is one of torch.compile's compile-time ranges (``COMPILE_SUFFIX``)."""
    return name.endswith(COMPILE_SUFFIX) and name not in COMPILE_SUFFIX_RUNTIME


def wraps_compile_range(name: str, inner: str) -> bool:
    """Whether a range named ``name`` around the compile-time range ``inner`` is torch's own
    wrapper of it (``COMPILE_EVENTS``, or ``inner`` without its suffix)."""
    return name in COMPILE_EVENTS or name + COMPILE_SUFFIX == inner
