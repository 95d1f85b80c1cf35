"""A package installed in editable mode (``pip install -e``) is a library, not the program's own
code, unless it is the program's own project: a model call it makes for the program names the
program's line, as an installed library's does (``callsite.is_program_code``)."""

from __future__ import annotations

import json
from pathlib import Path

import mltrace
from conftest import run_cli
from mltrace.run.levels import Level
from mltrace.tracer.callsite import editable_roots


def _editable(site: Path, name: str, project: Path, editable: bool = True) -> None:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "direct_url.json").write_text(json.dumps({"url": project.resolve().as_uri(), "dir_info": {"editable": editable}}))


def test_editable_roots_are_read_from_the_distributions_direct_urls(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    _editable(site, "lib", tmp_path / "lib checkout")
    _editable(site, "plain", tmp_path / "wheel", editable=False)
    (site / "broken-1.0.dist-info").mkdir()
    (site / "broken-1.0.dist-info" / "direct_url.json").write_text("{not json")
    assert editable_roots([str(site), str(tmp_path / "missing")]) == [str((tmp_path / "lib checkout").resolve()) + "/"]


LIBRARY = '''
def run(model, x):
    """Calls the model for the program, as a pipeline would."""
    return model(x)
'''

PROGRAM = """
import torch
import lib

model = torch.nn.Sequential(torch.nn.Linear(3, 2))
lib.run(model, torch.ones(1, 3))
"""


def test_a_model_call_made_by_an_editable_library_names_the_programs_line(tmp_path: Path) -> None:
    site = tmp_path / "env" / "site-packages"
    checkout = tmp_path / "lib-checkout"
    (checkout / "src" / "lib").mkdir(parents=True)
    (checkout / "src" / "lib" / "__init__.py").write_text(LIBRARY)
    _editable(site, "lib", checkout)
    app = tmp_path / "app"
    app.mkdir()
    (app / "run.py").write_text(PROGRAM)
    env = {"PYTHONPATH": f"{site}:{checkout / 'src'}"}
    done = run_cli("python", "-q", "--level", "model", "-o", str(tmp_path / "run"), "run.py", cwd=app, env=env)
    assert done.returncode == 0, done.stderr.decode()
    (model,) = [s for s in mltrace.load_run(tmp_path / "run").spans if s.level == Level.MODEL]
    assert model.attrs["ml.call.file.path"].endswith("app/run.py") and model.attrs["ml.call.line.number"] == 6
    # The program inside the checkout (its own project, installed so): the library's line is its own.
    (checkout / "run.py").write_text(PROGRAM)
    done = run_cli("python", "-q", "--level", "model", "-o", str(tmp_path / "own"), "run.py", cwd=checkout, env=env)
    assert done.returncode == 0, done.stderr.decode()
    (model,) = [s for s in mltrace.load_run(tmp_path / "own").spans if s.level == Level.MODEL]
    assert model.attrs["ml.call.file.path"].endswith("lib/__init__.py")
