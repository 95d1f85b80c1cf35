"""Source files: whose code a file is (the user's model code or a framework's), and its
path shown whole but short.

Model code is every Python file outside the frameworks' own packages (torch, keras and
tensorflow, onnxruntime), outside mltrace itself and outside the Python standard
library; third-party model libraries (transformers, torchvision, timm) count as model
code. The rule is the recorder's (``tracer/callsite.py``: call sites and hot lines use
the same one). ``short_path`` never cuts a path: it drops what every reader already knows (the
working directory, the ``site-packages/`` prefix).
"""

from __future__ import annotations

import linecache
import os
import re

from mltrace.tracer.callsite import FRAMEWORK_PACKAGES, is_model_code, package_path

__all__ = [
    "FRAMEWORK_PACKAGES",
    "context_lines",
    "is_model_code",
    "location",
    "package_path",
    "short_path",
    "source_line",
    "split_location",
]

_HOT_LINE = re.compile(r"^(?P<path>.*):(?P<line>\d+)(?: (?P<function>.*))?$", re.DOTALL)


def short_path(path: str, cwd: str | None = None) -> str:
    """``path`` shown whole but short: the package path under ``site-packages/``, else
    relative to the working directory ``cwd`` (default: the current one) when under it,
    else as given."""
    inside = package_path(path)
    if inside is not None:
        return inside
    base = cwd if cwd is not None else os.getcwd()
    try:
        rel = os.path.relpath(path, base)
    except ValueError:  # another drive (Windows)
        return path
    return rel if os.path.isabs(path) and not rel.startswith("..") else path


def location(path: object, line: object, cwd: str | None = None) -> str:
    """``short_path:line`` of a recorded location, or "" when the path is missing or not text."""
    if not path or not isinstance(path, str):  # attributes are the program's: not always text
        return ""
    shown = short_path(path, cwd)
    return f"{shown}:{line}" if isinstance(line, int) and not isinstance(line, bool) else shown


def split_location(text: str) -> tuple[str, int | None, str]:
    """``(path, line, function)`` of ``"path:line function"`` (a hot line) or ``"path:line"``;
    line None and function "" when ``text`` has no ``:line``."""
    m = _HOT_LINE.match(text)
    if m is None:
        return text, None, ""
    return m["path"], int(m["line"]), m["function"] or ""


def source_line(path: object, line: object) -> str:
    """The text of line ``line`` of file ``path`` (stripped), read now; "" when unreadable."""
    return "".join(text for _, text in context_lines(path, line, 0)).strip()


def context_lines(path: object, line: object, around: int = 3) -> list[tuple[int, str]]:
    """Lines ``line - around`` … ``line + around`` of ``path`` as ``(number, text)`` (no
    newline), read now; empty when the file or the line does not exist (never raises)."""
    if not isinstance(path, str) or not isinstance(line, int) or isinstance(line, bool) or line < 1:
        return []
    try:
        linecache.checkcache(path)
        lines = linecache.getlines(path)
    except Exception:  # a file the program named: anything can be wrong with it
        return []
    if line > len(lines):
        return []
    first, last = max(1, line - around), min(len(lines), line + around)
    return [(n, lines[n - 1].rstrip("\r\n")) for n in range(first, last + 1)]
