"""An installed library made up for a test: a one-function package in a ``site-packages``
folder of the test's own, so that mltrace reads its frames as an installed package's."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def installed_infer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> Callable[..., Any]:
    """``fakeinfer.infer`` of a package ``fakeinfer`` installed under ``tmp_path``'s
    ``site-packages``, whose ``__init__.py`` is ``body``; the package is left out of
    ``sys.modules`` again (a later test writes its own)."""
    root = tmp_path / "lib" / "site-packages"
    (root / "fakeinfer").mkdir(parents=True)
    (root / "fakeinfer" / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(root))
    sys.modules.pop("fakeinfer", None)
    try:
        infer: Callable[..., Any] = __import__("fakeinfer").infer
    finally:
        sys.modules.pop("fakeinfer", None)
    return infer
