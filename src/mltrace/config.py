"""Options shared by the CLI and ``mltrace.profile``.

Precedence: explicit argument, then ``MLTRACE_*`` environment variable, then
the default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mltrace.errors import UsageError
from mltrace.run.levels import Level

#: Set by ``mltrace python`` for the traced program's children (``mltrace/follow/``): a JSON
#: object naming the run directory, the options and the parent's trace context. A Python
#: child that sees it starts its own session into the run.
FOLLOW_ENV = "MLTRACE_FOLLOW"


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
            grown by this many GiB since torch.profiler started (environment:
            ``MLTRACE_OP_MEMORY_GIB``). None: 5 % of the memory available when the
            session starts, at least 1 GiB.
        max_spans: once this many spans have been streamed, the layer level ends
            (and the op level with it) after the current model call; model
            spans go on until twice as many, when the trace is full and nothing
            more is recorded (environment: ``MLTRACE_MAX_SPANS``). 0: no limit. None:
            what the end of the run can load in 10 % of the memory available
            when the session starts, between 100,000 and 2 million.
        stream_perfetto: also stream trace.pftrace while the program runs. Off by
            default: encoding costs the program ~5 µs a span; events.jsonl is
            always streamed, and the Perfetto trace is written at the end (or
            rebuilt from events.jsonl by ``mltrace export``/``view`` after a crash).
        memory: record PyTorch's allocations and frees (torch.profiler's
            ``profile_memory``): allocated, freed and peak bytes per op and layer, and a
            counter track of allocated bytes per device (environment:
            ``MLTRACE_MEMORY=1``). Needs the op level; off by default (cost:
            docs/PERFORMANCE.md, "Memory").
        redact: replace the values of secret-looking command arguments (``--token=…``,
            ``--password …``, ``Authorization: …``) and user-span attributes by
            ``[redacted]`` in the run (environment: ``MLTRACE_REDACT``, ``0`` to keep them;
            ``run/redact.py``). Recorded environment variables with such names are
            redacted either way.
        source_options: per-source settings, by source name.
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
    source_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, **kwargs: Any) -> ProfileOptions:
        """Builds options from keyword arguments, the environment and defaults.

        Raises:
            UsageError: on an unknown option or an invalid value.
        """
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise UsageError(f"unknown option(s): {', '.join(unknown)}")
        env = os.environ
        if kwargs.get("output") is None and env.get("MLTRACE_OUTPUT"):
            kwargs["output"] = env["MLTRACE_OUTPUT"]
        if kwargs.get("level") is None and env.get("MLTRACE_LEVEL"):
            kwargs["level"] = env["MLTRACE_LEVEL"]
        if kwargs.get("name") is None and env.get("MLTRACE_NAME"):
            kwargs["name"] = env["MLTRACE_NAME"]
        if kwargs.get("otlp") is None and env.get("MLTRACE_OTLP"):
            kwargs["otlp"] = env["MLTRACE_OTLP"]
        if "stream_perfetto" not in kwargs and env.get("MLTRACE_STREAM_PERFETTO"):
            kwargs["stream_perfetto"] = env["MLTRACE_STREAM_PERFETTO"].lower() in ("1", "true", "yes", "on")
        if "memory" not in kwargs and env.get("MLTRACE_MEMORY"):
            kwargs["memory"] = env["MLTRACE_MEMORY"].lower() in ("1", "true", "yes", "on")
        if "redact" not in kwargs and env.get("MLTRACE_REDACT"):
            kwargs["redact"] = env["MLTRACE_REDACT"].lower() not in ("0", "false", "no", "off")
        if "flush_interval_s" not in kwargs and env.get("MLTRACE_FLUSH_INTERVAL"):
            kwargs["flush_interval_s"] = env["MLTRACE_FLUSH_INTERVAL"]
        if kwargs.get("op_inferences") is None and env.get("MLTRACE_OP_INFERENCES"):
            kwargs["op_inferences"] = env["MLTRACE_OP_INFERENCES"]
        if kwargs.get("op_inferences") is not None:
            kwargs["op_inferences"] = _whole_number(kwargs["op_inferences"], "--op-inferences", "model calls")
            if kwargs["op_inferences"] < 1:
                raise UsageError("--op-inferences must be at least 1")
        if kwargs.get("max_spans") is None and env.get("MLTRACE_MAX_SPANS"):
            kwargs["max_spans"] = env["MLTRACE_MAX_SPANS"]
        if kwargs.get("max_spans") is not None:
            kwargs["max_spans"] = _whole_number(kwargs["max_spans"], "--max-spans", "spans (0: no limit)")
            if kwargs["max_spans"] < 0:
                raise UsageError("--max-spans must be 0 (no limit) or more")
        if kwargs.get("op_memory_gib") is None and env.get("MLTRACE_OP_MEMORY_GIB"):
            kwargs["op_memory_gib"] = env["MLTRACE_OP_MEMORY_GIB"]
        if kwargs.get("op_memory_gib") is not None:
            value = kwargs["op_memory_gib"]
            try:
                gib = float(value)
            except (TypeError, ValueError):
                gib = float("nan")
            if isinstance(value, bool) or not gib > 0:  # nan, too
                raise UsageError(f"the op level's memory budget (MLTRACE_OP_MEMORY_GIB) must be a positive number of GiB, not {value!r}")
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
