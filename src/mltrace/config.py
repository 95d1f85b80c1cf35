"""Options shared by the CLI and ``mltrace.profile``.

Precedence: explicit argument, then the environment variable (``settings.PROFILE_SETTINGS``),
then the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mltrace.errors import UsageError
from mltrace.run.levels import Level
from mltrace.settings import OP_MEMORY_GIB, from_environment


@dataclass
class ProfileOptions:
    """How a session records.

    Attributes:
        output: the run directory to create (must be absent or empty). None:
            ``./mltrace-runs/<name>-<YYYYmmdd-HHMMSS>/``.
        name: the run's name (default: the script's stem, or "profile").
        level: the deepest level recorded; None records every level available.
        flush_interval_s: how often (s) completed events are streamed to disk.
        summary: print the short report and the run directory on stderr at the end.
        command: the command line recorded in run.json.
        py_spy: sample Python stacks with py-spy (source level).
        native: include native frames in py-spy samples.
        otlp: OTLP endpoint to send spans to at the end (None: do not send).
        op_inferences: end each framework's op level after this many of its model calls
            (outermost ``nn.Module``, Keras model or ``InferenceSession.run`` calls), and
            the library level with the last of them; the model and layer levels go on.
            None: they run until the end, or until the process grows past the op
            level's memory budget (``op_memory_gib``).
        op_memory_gib: the op level's memory budget: it ends when the process has
            grown by this many GiB since torch.profiler started. None: 5 % of the memory available when the
            session starts, at least 1 GiB.
        max_spans: once this many spans have been streamed, the layer level ends
            (and the op level with it) after the current model call; model
            spans go on until twice as many, when the trace is full and nothing
            more is recorded. 0: no limit. None:
            what the end of the run can load in 10 % of the memory available
            when the session starts, between 100,000 and 2 million.
        stream_perfetto: also stream trace.pftrace while the program runs. Off by
            default: encoding costs the program ~5 µs a span; events.jsonl is
            always streamed, and the Perfetto trace is written at the end (or
            rebuilt from events.jsonl by ``mltrace export``/``view`` after a crash).
        memory: record PyTorch's allocations and frees (torch.profiler's
            ``profile_memory``): allocated, freed and peak bytes per op and layer, and a
            counter track of allocated bytes per device. Needs the op level; off by default (cost:
            docs/PERFORMANCE.md, "Memory").
        redact: replace the values of secret-looking command arguments (``--token=…``,
            ``--password …``, ``Authorization: …``) and user-span attributes by
            ``[redacted]`` in the run (``run/redact.py``). Recorded environment variables with such names are
            redacted either way.
    """

    output: Path | None = None
    name: str | None = None
    level: Level | None = None
    flush_interval_s: float = 0.5
    summary: bool = True
    command: list[str] | None = None
    py_spy: bool = False
    native: bool = False
    otlp: str | None = None
    op_inferences: int | None = None
    op_memory_gib: float | None = None
    max_spans: int | None = None
    stream_perfetto: bool = False
    memory: bool = False
    redact: bool = True

    @classmethod
    def build(cls, **kwargs: Any) -> ProfileOptions:
        """Builds options from keyword arguments, the environment (``settings``) and defaults.

        Raises:
            UsageError: on an unknown option or an invalid value.
        """
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise UsageError(f"unknown option(s): {', '.join(unknown)}")
        kwargs = from_environment(kwargs)
        if kwargs.get("op_inferences") is not None:
            kwargs["op_inferences"] = _whole_number(kwargs["op_inferences"], "--op-inferences", "model calls")
            if kwargs["op_inferences"] < 1:
                raise UsageError("--op-inferences must be at least 1")
        if kwargs.get("max_spans") is not None:
            kwargs["max_spans"] = _whole_number(kwargs["max_spans"], "--max-spans", "spans (0: no limit)")
            if kwargs["max_spans"] < 0:
                raise UsageError("--max-spans must be 0 (no limit) or more")
        if kwargs.get("op_memory_gib") is not None:
            value = kwargs["op_memory_gib"]
            try:
                gib = float(value)
            except (TypeError, ValueError):
                gib = float("nan")
            if isinstance(value, bool) or not gib > 0:  # nan, too
                raise UsageError(f"the op level's memory budget ({OP_MEMORY_GIB.name}) must be a positive number of GiB, not {value!r}")
            kwargs["op_memory_gib"] = gib
        if isinstance(kwargs.get("level"), str):
            try:
                kwargs["level"] = Level.parse(kwargs["level"])
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        if kwargs.get("level") is Level.USER:
            raise UsageError("--level takes a hierarchy level: model, layer, op, library or kernel")
        if kwargs.get("memory") and kwargs.get("level") in (Level.MODEL, Level.LAYER):
            raise UsageError("--memory needs the op level (torch.profiler records the allocations): use --level op or deeper")
        if kwargs.get("output") is not None:
            kwargs["output"] = Path(kwargs["output"])
        if "flush_interval_s" in kwargs:
            try:
                kwargs["flush_interval_s"] = float(kwargs["flush_interval_s"])
            except ValueError:
                raise UsageError(f"flush interval must be a number of seconds, not {kwargs['flush_interval_s']!r}") from None
            if not 0.01 <= kwargs["flush_interval_s"] <= 60:
                raise UsageError("flush interval must be between 0.01 and 60 seconds")
        return cls(**kwargs)


def _whole_number(value: Any, option: str, unit: str) -> int:
    """``value`` (an int, or a string of digits from the command line or the environment) as an int.

    Raises:
        UsageError: for anything else.
    """
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{option} takes a whole number of {unit}, not {value!r}")
    return value
