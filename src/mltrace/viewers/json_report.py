"""The report as JSON (``mltrace report RUN --format json``): ``analysis.report_data``'s
plain data, written as it is."""

from __future__ import annotations

import json
from typing import Any


def render_json(data: dict[str, Any]) -> str:
    """The report data as an indented JSON document (UTF-8 text, one trailing newline)."""
    return json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
