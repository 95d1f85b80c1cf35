"""The schema of ``mltrace report RUN --format json`` (JSON Schema, draft 2020-12 subset).

Only ``type``, ``properties``, ``required``, ``additionalProperties``, ``items`` and
``enum`` are used, so a small validator can check it (the tests do). Every key an
object has is listed in ``required``: keys are stable, and a value that is not known
is ``null``, never a missing key (``findings`` items, whose numbers depend on their
``kind``, are the one open object). docs/CONVENTIONS.md ("Report JSON") explains the
fields.
"""

from __future__ import annotations

from typing import Any

_INT = {"type": "integer"}
_NUM = {"type": "number"}
_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_OPT_INT = {"type": ["integer", "null"]}
_OPT_STR = {"type": ["string", "null"]}
_VERDICT = {"type": ["string", "null"], "enum": ["compute-bound", "memory-bound", "overhead-bound", "unknown", None]}


def _object(props: dict[str, Any], closed: bool = True) -> dict[str, Any]:
    """An object schema whose keys are all required (and, when ``closed``, the only ones)."""
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": not closed}


def _array(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


_OPT_NUM = {"type": ["number", "null"]}
_PEAKS = _object(
    {
        "device": _STR,
        "name": _STR,
        "flops_per_s": _NUM,
        "half_flops_per_s": _OPT_NUM,
        "bytes_per_s": _NUM,
        "memory_bytes_per_s": _OPT_NUM,
        "source": _STR,
        "note": _OPT_STR,
    }
)
_LEVEL = _object({"level": _STR, "spans": _INT, "time_ns": _INT})
_HOT_LINE = _object({"line": _OPT_STR, "function": _STR, "ns": _INT})

RUN = _object(
    {
        "schema_version": _INT,
        "name": _STR,
        "path": _STR,
        "run_id": _OPT_STR,
        "complete": _BOOL,
        "command": {"type": ["array", "null"], "items": _STR},
        "spans": _INT,
        "model_calls": _INT,
        "model_ns": _INT,
        "wall_ns": _INT,
        "levels": _array(_LEVEL),
        "peaks": _array(_PEAKS),
        "include_cold": _BOOL,
        "counts_note": _STR,
        "cold_calls": _INT,
        "cold_ns": _INT,
        "cold_spent": _array(_object({"name": _STR, "category": _OPT_STR, "ns": _INT})),
        "unfollowed": _array(_object({"pid": _OPT_INT, "argv": _array(_STR), "reason": _STR})),
        "torch_ranges": _object({"kinds": _array(_object({"kind": _STR, "count": _INT, "ns": _INT})), "text": _STR}),
        "unscoped_ops": _object({"count": _INT, "ns": _INT, "text": _STR}),
        "compile_ops": _object({"count": _INT, "ns": _INT, "text": _STR}),
        "exit": _object({"status": {"type": ["integer", "null"]}, "cause": _OPT_STR, "text": _STR}),
    }
)
MODEL = _object(
    {
        "name": _STR,
        "type": _STR,
        "calls": _INT,
        "total_ns": _INT,
        "cold_calls": _INT,
        "cold_ns": _INT,
        "cold_indices": _array(_INT),
        "failed_calls": _INT,
        "failed_indices": _array(_INT),
        "steady_median_ns": _OPT_INT,
        "steady_p90_ns": _OPT_INT,
        "kinds": _array(
            _object(
                {
                    "kind": _STR,
                    "call": _OPT_STR,
                    "mode": _OPT_STR,
                    "batch": _OPT_INT,
                    "calls": _INT,
                    "total_ns": _INT,
                    "cold_calls": _INT,
                    "failed_calls": _INT,
                    "steady_median_ns": _OPT_INT,
                    "steady_p90_ns": _OPT_INT,
                }
            )
        ),
        "one_time": _array(_object({"category": _STR, "names": _array(_STR)})),
        "source": _OPT_STR,
    }
)
LAYER = _object(
    {
        "name": _STR,
        "type": _STR,
        "calls": _INT,
        "total_ns": _INT,
        "self_ns": _INT,
        "median_ns": _OPT_INT,
        "p90_ns": _OPT_INT,
        "source": _OPT_STR,
        "source_text": _OPT_STR,
        "defined": _OPT_STR,
        "flops": _NUM,
        "bytes": _NUM,
        "achieved_flops_per_s": _OPT_NUM,
        "peak_share": _OPT_NUM,
        "verdict": _VERDICT,
        "why": _OPT_STR,
        "hot_lines": _array(_HOT_LINE),
        "gc_self_ns": _INT,
        "gc_total_ns": _INT,
        "alloc_bytes": _OPT_INT,
        "peak_alloc_bytes": _OPT_INT,
    }
)
OP = _object(
    {
        "name": _STR,
        "calls": _INT,
        "total_ns": _INT,
        "self_ns": _INT,
        "mean_ns": _INT,
        "flops": _NUM,
        "device_ns": _INT,
        "achieved_flops_per_s": _OPT_NUM,
        "peak_share": _OPT_NUM,
        "verdict": _VERDICT,
        "why": _OPT_STR,
        "alloc_bytes": _OPT_INT,
        "peak_alloc_bytes": _OPT_INT,
    }
)
TYPE = _object(
    {
        "type": _STR,
        "calls": _INT,
        "total_ns": _INT,
        "self_ns": _INT,
        "flops": _NUM,
        "bytes": _NUM,
        "verdict": _VERDICT,
        "why": _OPT_STR,
    }
)
MEMORY_PEAK = _object({"track": _STR, "device": _INT, "bytes": _INT, "ts_ns": _INT, "layer": _OPT_STR, "samples": _INT})
MEMORY = {"type": ["object", "null"], "properties": {"peaks": _array(MEMORY_PEAK)}, "required": ["peaks"], "additionalProperties": False}
FINDING = _object(
    {
        "kind": {
            "type": "string",
            "enum": ["cold_start", "call_kinds", "bound", "idle", "generate", "cpu_vs_gpu", "data_movement", "framework_overhead", "note"],
        },
        "text": _STR,
    },
    closed=False,
)

GENERATE = _object(
    {
        "model": _STR,
        "start_ns": _INT,
        "total_ns": _INT,
        "model_calls": _INT,
        "new_tokens": _OPT_INT,
        "ttft_ns": _OPT_INT,
        "tpot_median_ns": _OPT_INT,
        "tpot_p90_ns": _OPT_INT,
        "tokens_per_s": _OPT_NUM,
        "paused_ns": _INT,
        "cold_calls": _INT,
        "cold_ns": _INT,
        "source": _OPT_STR,
        "source_text": _OPT_STR,
    }
)
_NAME_NS = _object({"name": _STR, "ns": _INT})
REQUEST = _object(
    {
        "name": _STR,
        "label": _OPT_STR,
        "source": _OPT_STR,
        "pid": _INT,
        "start_ns": _INT,
        "total_ns": _INT,
        "model_calls": _INT,
        "model_ns": _INT,
        "outside_ns": _INT,
        "before_model_ns": _INT,
        "between_models_ns": _INT,
        "after_model_ns": _INT,
        "outside_ops_ns": _INT,
        "paused_ns": _INT,
        "layers": _array(_object({"name": _STR, "type": _OPT_STR, "ns": _INT})),
        "ops": _array(_NAME_NS),
    }
)
_REQUESTS_PROPS = {
    "source": {"type": "string", "enum": ["otel-server", "user"]},
    "names": _array(_STR),
    "count": _INT,
    "p50_ns": _INT,
    "p90_ns": _INT,
    "p99_ns": _INT,
    "total_ns": _INT,
    "model_ns": _INT,
    "paused_ns": _INT,
    "slowest": _array(REQUEST),
}
REQUESTS = {**_object(_REQUESTS_PROPS), "type": ["object", "null"]}
RANK = _object(
    {
        "rank": _INT,
        "pid": _INT,
        "role": _STR,
        "model_calls": _INT,
        "model_ns": _INT,
        "collective_ns": _INT,
        "collectives": _array(_object({"name": _STR, "spans": _INT, "ns": _INT})),
        "setup_ns": _INT,
    }
)
RANKS = {**_object({"world_size": _OPT_INT, "backend": _OPT_STR, "straggler": _OPT_INT, "ranks": _array(RANK)}), "type": ["object", "null"]}
PROCESS = _object(
    {
        "pid": _INT,
        "role": _STR,
        "start": _OPT_STR,
        "parent": _OPT_STR,
        "model_calls": _INT,
        "model_ns": _INT,
        "spans": _INT,
        "note": _STR,
    }
)
PROCESSES = {**_array(PROCESS), "type": ["array", "null"]}

#: The whole document.
REPORT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "mltrace report",
    **_object(
        {
            "run": RUN,
            "models": _array(MODEL),
            "layers": _array(LAYER),
            "ops": _array(OP),
            "types": _array(TYPE),
            "findings": _array(FINDING),
            "generate": _array(GENERATE),
            "memory": MEMORY,
            "requests": REQUESTS,
            "ranks": RANKS,
            "processes": PROCESSES,
        }
    ),
}
