"""``metadata.installed_versions`` reads the frameworks' versions from their metadata folders
as ``importlib.metadata.version`` finds them, without importing ``importlib.metadata``."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from mltrace.run import metadata


def test_the_versions_are_importlib_metadatas(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every distribution installed here: the same version as ``importlib.metadata`` gives."""
    names = tuple(sorted({d.metadata["Name"] for d in importlib.metadata.distributions() if d.metadata["Name"]}))
    assert len(names) > 10
    monkeypatch.setattr(metadata, "FRAMEWORK_DISTRIBUTIONS", names)
    expected = {name: importlib.metadata.version(name) for name in names}
    assert metadata.installed_versions() == expected


def test_name_forms_egg_info_and_path_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    (first / "Tensorflow_CPU-2.21.0.dist-info").mkdir(parents=True)
    headers = "Metadata-Version: 2.1\nName: tensorflow-cpu\nVersion: 2.21.0\n\nVersion: no\n"  # the body's is not read
    (first / "Tensorflow_CPU-2.21.0.dist-info" / "METADATA").write_text(headers)
    (second / "tensorflow_cpu-1.0.dist-info").mkdir(parents=True)  # later on the path: not read
    (second / "tensorflow_cpu-1.0.dist-info" / "METADATA").write_text("Name: tensorflow-cpu\nVersion: 1.0\n")
    (second / "onnx-1.2.3-py3.11.egg-info").write_text("Metadata-Version: 1.1\nName: onnx\nVersion: 1.2.3\n")
    (second / "keras.egg-info").mkdir()
    (second / "keras.egg-info" / "PKG-INFO").write_text("Name: keras\nVersion: 3.0\n")
    (second / "numpy-9.dist-info").mkdir()  # no METADATA: left out
    versions = metadata.installed_versions([str(first), str(second / "missing"), str(second)])
    assert versions == {"tensorflow-cpu": "2.21.0", "keras": "3.0", "onnx": "1.2.3"}


def test_a_session_start_does_not_import_importlib_metadata(tmp_path: Path) -> None:
    """The metadata a run starts with (``base_metadata``) leaves ``importlib.metadata`` unimported."""
    code = "import sys\nfrom mltrace.run.metadata import base_metadata\nbase_metadata(None, 'x')\n"
    code += "print('importlib.metadata' in sys.modules)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, cwd=tmp_path)
    assert done.stdout == b"False\n", done.stderr.decode()
