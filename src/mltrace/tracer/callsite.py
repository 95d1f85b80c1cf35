"""Call sites: the line of model code that called a layer, a model or a user span.

The rule (docs/CONVENTIONS.md, "Call sites" and "Model code and hot lines"): a layer's call site is
the innermost Python frame outside the frameworks (torch, TensorFlow/Keras, ONNX
Runtime, the standard library, mltrace); packages installed beside them, such
as transformers and torchvision, are model code. A model call's is the innermost
frame of the program's own code (outside every installed package too), else the
layer rule's. It goes to OpenTelemetry's
``code.file.path``, ``code.line.number`` and ``code.function.name``; where the
layer's own code is defined (its ``forward``/``call``, decorators unwrapped) goes
to ``ml.defined.file.path``, ``ml.defined.line.number`` and
``ml.defined.function.name``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import sysconfig
from types import CodeType, FrameType
from typing import Any, Generic, TypeVar

V = TypeVar("V")

_MLTRACE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


#: Top-level packages whose files are a framework's own code, not the model's.
FRAMEWORK_PACKAGES = frozenset({"torch", "functorch", "tensorflow", "keras", "tf_keras", "onnxruntime", "mltrace"})

#: Top-level packages whose frames only wrap the call they pass on (decorators such as
#: ``typing_extensions.deprecated``, which torch's ``quantize_dynamic`` carries): never call sites.
WRAPPER_PACKAGES = frozenset({"typing_extensions", "wrapt", "decorator"})

_PACKAGE_DIRS = ("site-packages/", "dist-packages/")


def package_path(path: str) -> str | None:
    """The path inside an installed package (``torch/nn/modules/conv.py``), or None when
    ``path`` is not under a ``site-packages/`` or ``dist-packages/`` directory."""
    norm = path.replace(os.sep, "/")
    cut = max(norm.rfind(d) + len(d) if d in norm else -1 for d in _PACKAGE_DIRS)
    return norm[cut:] if cut > 0 else None


@functools.lru_cache(maxsize=1)
def _stdlib_roots() -> tuple[str, ...]:
    """The standard library's directories (``sysconfig``'s ``stdlib`` and ``platstdlib``)."""
    paths = sysconfig.get_paths()
    return tuple(sorted({os.path.realpath(p).rstrip("/") + "/" for p in (paths.get("stdlib"), paths.get("platstdlib")) if p}))


@functools.lru_cache(maxsize=4096)
def is_stdlib(path: str) -> bool:
    """Whether ``path`` is a module of Python's standard library (not of a package installed
    under it, in ``site-packages/``)."""
    if not path or path.startswith("<") or package_path(path) is not None:
        return False
    real = os.path.realpath(path) if os.path.isabs(path) else path
    return any(real.startswith(root) for root in _stdlib_roots())


class CodeKeyed(Generic[V]):
    """Values cached by (code object, int), keyed by the code object's id: a code object's own
    hash covers its bytecode and constants (≈ 0.6 µs, more for a longer function), an id's
    does not. Each entry holds its code object, so that an id cannot be reused while it is
    cached; beyond ``limit`` entries the cache starts over."""

    def __init__(self, limit: int = 4096) -> None:
        self._entries: dict[tuple[int, int], tuple[CodeType, V]] = {}
        self._limit = limit

    def get(self, code: CodeType, at: int = 0) -> V | None:
        """The value cached for ``(code, at)``, or None."""
        known = self._entries.get((id(code), at))
        return known[1] if known is not None and known[0] is code else None

    def put(self, code: CodeType, at: int, value: V) -> V:
        """Caches ``value`` for ``(code, at)`` and returns it."""
        if len(self._entries) >= self._limit:
            self._entries.clear()
        self._entries[(id(code), at)] = (code, value)
        return value


@functools.lru_cache(maxsize=1)
def _excluded_roots() -> tuple[str, ...]:
    """Directories holding framework or standard-library code outside ``site-packages/``
    (the standard library, mltrace's own source, frameworks installed from a checkout), and
    the environment's scripts directory (the console-script launchers, ``mltrace`` itself)."""
    roots: set[str] = set(_stdlib_roots())
    roots.add(os.path.realpath(_MLTRACE_DIR))
    scripts = sysconfig.get_path("scripts")
    if scripts:
        roots.add(os.path.realpath(scripts))
    for name in sorted(FRAMEWORK_PACKAGES - {"mltrace"}):
        try:
            spec = importlib.util.find_spec(name)  # locates; imports nothing
        except (ImportError, ValueError):
            continue
        for loc in (spec.submodule_search_locations or []) if spec is not None else []:
            roots.add(os.path.realpath(loc))
    return tuple(sorted(r.rstrip("/") + "/" for r in roots))


@functools.lru_cache(maxsize=4096)
def is_model_code(path: str) -> bool:
    """Whether a Python frame's file is model code: outside the frameworks' own packages
    (``FRAMEWORK_PACKAGES``), mltrace and the standard library; third-party model libraries
    (transformers, torchvision, timm) are model code, decorator helpers (``WRAPPER_PACKAGES``)
    are not. Pseudo-files (``<string>``, ``<frozen importlib._bootstrap>``) and empty paths are not."""
    if not path or path.startswith("<"):
        return False
    inside = package_path(path)
    if inside is not None:
        top = inside.split("/", 1)[0].removesuffix(".py")  # a package, or a one-file module
        return top not in FRAMEWORK_PACKAGES and top not in WRAPPER_PACKAGES
    real = os.path.realpath(path) if os.path.isabs(path) else path
    # A stdlib root may hold the site-packages roots handled above, never model code itself.
    return not any(real.startswith(root) for root in _excluded_roots())


@functools.lru_cache(maxsize=4096)
def is_program_code(path: str) -> bool:
    """Whether a Python frame's file is the program's own code: model code (``is_model_code``)
    that is not installed under a ``site-packages/`` or ``dist-packages/`` directory, nor in
    the project folder of a package installed in editable mode (``pip install -e``) other than
    the program's own, so not a model library's (transformers, torchvision, from a checkout
    too) nor any other installed package's."""
    if not is_model_code(path) or package_path(path) is not None:
        return False
    real = os.path.realpath(path) if os.path.isabs(path) else path
    return not any(real.startswith(root) for root in _library_checkouts())


@functools.lru_cache(maxsize=1)
def _library_checkouts() -> tuple[str, ...]:
    """The project folders of the packages installed in editable mode in this environment
    (``editable_roots``), less those that hold the program's main script or the working
    directory (the user's own project, installed so: a script of it, its tests under pytest)."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    own = [os.path.realpath(p) + "/" for p in (main if isinstance(main, str) else None, os.getcwd()) if p]
    return tuple(root for root in editable_roots(_site_dirs()) if not any(place.startswith(root) for place in own))


def _site_dirs() -> list[str]:
    """The ``site-packages/`` and ``dist-packages/`` directories on ``sys.path``."""
    return [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]


def editable_roots(site_dirs: list[str]) -> list[str]:
    """The project folders (real paths, ending in ``/``) of the distributions in ``site_dirs``
    installed in editable mode: their ``*.dist-info/direct_url.json`` (PEP 610) says
    ``"dir_info": {"editable": true}`` with a ``file://`` URL. Unreadable entries are skipped."""
    roots: set[str] = set()
    for site in site_dirs:
        try:
            entries = os.listdir(site)
        except OSError:
            continue
        for entry in entries:
            if not entry.endswith(".dist-info"):
                continue
            try:
                with open(os.path.join(site, entry, "direct_url.json"), encoding="utf-8") as f:
                    direct = json.load(f)
            except (OSError, ValueError):
                continue
            url = direct.get("url") if isinstance(direct, dict) else None
            info = direct.get("dir_info") if isinstance(direct, dict) else None
            if isinstance(url, str) and url.startswith("file://") and isinstance(info, dict) and info.get("editable") is True:
                from urllib.parse import unquote, urlparse

                roots.add(os.path.realpath(unquote(urlparse(url).path)).rstrip("/") + "/")
    return sorted(roots)


def program_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame from ``frame`` outwards that is the program's own code
    (``is_program_code``), or None where every frame is installed or framework code."""
    while frame is not None and not is_program_code(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def program_site(frame: FrameType | None) -> tuple[CodeType, int] | None:
    """``(code, instruction offset)`` of ``program_frame(frame)``, or None where there is none."""
    own = program_frame(frame)
    return (own.f_code, own.f_lasti) if own is not None else None


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


def frame_site(frame: FrameType | None, outside: str = "") -> dict[str, Any]:
    """The ``code.*`` attributes of the innermost frame from ``frame`` outwards that is model
    code and, given ``outside`` (a top-level package such as ``"transformers"``), not that
    package's, by its module's name (empty where there is no such frame)."""
    while frame is not None:
        code = frame.f_code
        if is_model_code(code.co_filename) and not (outside and _in_package(frame, outside)):
            return code_attrs(code, frame.f_lineno or code.co_firstlineno)
        frame = frame.f_back
    return {}


def model_call_site(frame: FrameType | None, outside: str = "") -> dict[str, Any]:
    """The ``code.*`` attributes of a model call's call site: the program's own line that led
    to it (``program_frame``), past the installed libraries that made the call on its behalf
    (``model.get_image_features()`` calling ``self.vision_model``, a pipeline); else, where no
    frame is the program's, ``frame_site(frame, outside)``."""
    own = program_frame(frame)
    if own is not None:
        return code_attrs(own.f_code, own.f_lineno or own.f_code.co_firstlineno)
    return frame_site(frame, outside)


def _in_package(frame: FrameType, package: str) -> bool:
    module = frame.f_globals.get("__name__")
    return isinstance(module, str) and (module == package or module.startswith(package + "."))


def code_attrs(code: CodeType, line: int) -> dict[str, Any]:
    """``code.file.path``, ``code.line.number``, ``code.function.name`` of a line in ``code``."""
    return {"code.file.path": code.co_filename, "code.line.number": line, "code.function.name": getattr(code, "co_qualname", code.co_name)}


def defined_attrs(fn: Any, name: str) -> dict[str, Any]:
    """Where ``fn`` (decorators unwrapped) is defined, as ``ml.defined.*``; empty where it has no code."""
    code = getattr(unwrapped(fn), "__code__", None)
    if code is None:
        return {}
    return {"ml.defined.file.path": code.co_filename, "ml.defined.line.number": code.co_firstlineno, "ml.defined.function.name": name}
