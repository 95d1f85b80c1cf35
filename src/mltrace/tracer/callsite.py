"""Call sites: the line of model code that called a layer, a model or a user span.

The rule (docs/CONVENTIONS.md, "Source locations"): a span's call site is the
innermost Python frame outside the frameworks (torch, TensorFlow/Keras, ONNX
Runtime, the standard library, mltrace); packages installed beside them, such
as transformers and torchvision, are model code. It goes to OpenTelemetry's
``code.file.path``, ``code.line.number`` and ``code.function.name``; where the
layer's own code is defined (its ``forward``/``call``, decorators unwrapped) goes
to ``ml.defined.file.path``, ``ml.defined.line.number`` and
``ml.defined.function.name``.
"""

from __future__ import annotations

import importlib.util
import os
from types import CodeType, FrameType
from typing import Any

_MLTRACE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FrameworkCode:
    """Which source files are a framework's, and so never a layer's call site: torch's,
    mltrace's, TensorFlow's, Keras's and ONNX Runtime's (found without importing them), and
    the standard library's (``contextlib``, ``functools``), but not the packages installed
    beside it (``site-packages``): model libraries such as transformers and torchvision are
    model code."""

    def __init__(self, torch_dir: str = "") -> None:
        import site
        import sysconfig

        dirs = [torch_dir, _MLTRACE_DIR]
        for name in ("tensorflow", "keras", "tf_keras", "onnxruntime"):
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                continue
            if spec is not None and spec.submodule_search_locations:
                dirs.extend(spec.submodule_search_locations)
        paths = sysconfig.get_paths()
        packages = [paths["purelib"], paths["platlib"], *site.getsitepackages()]
        self.dirs = tuple(os.path.join(d, "") for d in dirs if d)
        self.stdlib = os.path.join(paths["stdlib"], "")
        self.packages = tuple(os.path.join(d, "") for d in packages if d)

    def owns(self, filename: str) -> bool:
        """Whether ``filename`` is a framework's."""
        if filename.startswith(self.dirs):
            return True
        return filename.startswith(self.stdlib) and not filename.startswith(self.packages)


def line_of(code: CodeType, lasti: int) -> int:
    """The source line of the instruction at byte offset ``lasti`` (``co_lines``), else the first line."""
    for start, end, line in code.co_lines():
        if start <= lasti < end and line is not None:
            return line
    return code.co_firstlineno


def unwrapped(fn: Any) -> Any:
    """``fn`` without its decorators (``functools.wraps``' ``__wrapped__`` chain); ``fn`` where that fails."""
    import inspect

    try:
        return inspect.unwrap(fn) if fn is not None else None
    except ValueError:  # a cycle of __wrapped__
        return fn


def frame_site(frame: FrameType | None, frameworks: FrameworkCode) -> dict[str, Any]:
    """The ``code.*`` attributes of the innermost frame from ``frame`` outwards that is model
    code (empty where every frame is a framework's)."""
    while frame is not None:
        code = frame.f_code
        if not frameworks.owns(code.co_filename):
            return code_attrs(code, frame.f_lineno or code.co_firstlineno)
        frame = frame.f_back
    return {}


def code_attrs(code: CodeType, line: int) -> dict[str, Any]:
    """``code.file.path``, ``code.line.number``, ``code.function.name`` of a line in ``code``."""
    return {"code.file.path": code.co_filename, "code.line.number": line, "code.function.name": getattr(code, "co_qualname", code.co_name)}


def defined_attrs(fn: Any, name: str) -> dict[str, Any]:
    """Where ``fn`` (decorators unwrapped) is defined, as ``ml.defined.*``; empty where it has no code."""
    code = getattr(unwrapped(fn), "__code__", None)
    if code is None:
        return {}
    return {"ml.defined.file.path": code.co_filename, "ml.defined.line.number": code.co_firstlineno, "ml.defined.function.name": name}
