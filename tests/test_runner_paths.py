"""The script's own paths under ``mltrace python`` are plain Python's: ``__file__``, the
traceback's file names, ``sys.argv[0]`` and ``sys.path[0]`` for a script named by a relative
path or through a symbolic link, and for a module (``-m``), a directory or a zip application
run as the program, whose traceback shows runpy's frames as plain Python's does."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipapp
import zipfile
from pathlib import Path

import pytest

from conftest import run_cli

PROGRAM = """\
import os, sys
print("file", __file__)
print("argv0", sys.argv[0])
print("path0", sys.path[0])
os.chdir(os.path.dirname(os.path.abspath(__file__)) + "/..")
print("still there", os.path.exists(__file__))
raise ValueError("boom")
"""


@pytest.mark.parametrize("typed", ["prog.py", "./prog.py", "sub/../prog.py", "link/prog.py"])
def test_script_paths_are_plain_pythons(tmp_path: Path, typed: str) -> None:
    (tmp_path / "prog.py").write_text(PROGRAM)
    (tmp_path / "sub").mkdir()
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / "prog.py").symlink_to(tmp_path / "prog.py")
    # The path exactly as typed (pathlib would drop the './').
    plain = subprocess.run([sys.executable, typed], cwd=tmp_path, capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    traced = run_cli("python", "-q", "-o", str(tmp_path / "run"), typed, cwd=tmp_path)
    assert traced.returncode == plain.returncode == 1
    assert traced.stdout == plain.stdout
    assert b"still there True" in traced.stdout  # __file__ holds after a chdir, as in Python
    plain_tb = plain.stderr.decode().split("Traceback (most recent call last):")[1]
    traced_tb = traced.stderr.decode().split("Traceback (most recent call last):")[1]
    assert traced_tb.startswith(plain_tb)  # the same file names and lines


@pytest.mark.parametrize("typed", [["-m", "pkg.prog", "a"], ["app", "a"], ["./app"]])
def test_module_and_directory_runs_are_plain_pythons(tmp_path: Path, typed: list[str]) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "prog.py").write_text(PROGRAM)
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text(PROGRAM)
    plain = subprocess.run([sys.executable, *typed], cwd=tmp_path, capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    traced = run_cli("python", "-q", "-o", str(tmp_path / "run"), *typed, cwd=tmp_path)
    assert traced.returncode == plain.returncode == 1
    assert traced.stdout == plain.stdout
    plain_tb = plain.stderr.decode().split("Traceback (most recent call last):")[1]
    traced_tb = traced.stderr.decode().split("Traceback (most recent call last):")[1]
    assert '"<frozen runpy>"' in plain_tb or "runpy.py" in plain_tb  # Python's own frames
    assert traced_tb.startswith(plain_tb)  # the same frames, runpy's as plain Python shows them


SAFE_PATH_PROGRAM = """\
import sys
print("path", sys.path)
import shadow
"""


@pytest.mark.parametrize("typed", [["prog.py"], ["-m", "prog"]])
def test_a_safe_path_adds_no_program_folder_as_in_python(tmp_path: Path, typed: list[str]) -> None:
    """Under ``PYTHONSAFEPATH`` (``-P``) Python puts neither the script's folder nor the working
    directory at the head of ``sys.path``: a module there named as one the program imports is
    not found, and the path is the interpreter's own, as plain. mltrace used to put the folder
    in the place of the path's first entry."""
    (tmp_path / "prog.py").write_text(SAFE_PATH_PROGRAM)
    (tmp_path / "shadow.py").write_text("print('the folder was on the path')\n")
    env = {**{k: v for k, v in os.environ.items() if k != "MLTRACE_OUTPUT"}, "PYTHONSAFEPATH": "1"}
    plain = subprocess.run([sys.executable, *typed], cwd=tmp_path, capture_output=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
    traced = run_cli("python", "-q", "-o", str(tmp_path / "run"), *typed, cwd=tmp_path, env={"PYTHONSAFEPATH": "1"})
    if typed[0] == "-m":  # the module itself is not found without its folder: a usage error here
        assert plain.returncode == 1 and traced.returncode == 2 and b"no module named 'prog'" in traced.stderr
        return
    assert plain.returncode == traced.returncode == 1
    assert b"the folder was on the path" not in traced.stdout and b"ModuleNotFoundError" in traced.stderr
    plain_path = ast.literal_eval(plain.stdout.decode().partition("path ")[2].splitlines()[0])
    traced_path = ast.literal_eval(traced.stdout.decode().partition("path ")[2].splitlines()[0])
    assert traced_path[: len(plain_path)] == plain_path and str(tmp_path) not in traced_path


BROKEN_INIT = """\
import sys
print("init argv", sys.argv)
raise RuntimeError("the package's own error")
"""


@pytest.mark.parametrize("typed", [["-m", "broken.prog", "a"], ["-m", "pkg.nosuch", "a"], ["-m", "pkg"]])
def test_a_modules_packages_are_imported_in_the_program(tmp_path: Path, typed: list[str]) -> None:
    """``-m PKG.MOD`` imports PKG while the program runs, as Python does: with the program's
    ``sys.argv`` (``-m`` first), an error in it shown as Python shows it, and a submodule or
    ``__main__`` that is not there reported in Python's words, with its exit status 1."""
    for package, init in (("pkg", ""), ("broken", BROKEN_INIT)):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(init)
        (tmp_path / package / "prog.py").write_text(PROGRAM)
    plain = subprocess.run([sys.executable, *typed], cwd=tmp_path, capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    traced = run_cli("python", "-q", "-o", str(tmp_path / "run"), *typed, cwd=tmp_path)
    assert traced.returncode == plain.returncode == 1, traced.stderr.decode()
    assert traced.stdout == plain.stdout
    if "Traceback" in plain.stderr.decode():
        assert b"init argv ['-m', 'a']" in plain.stdout
        plain_tb = plain.stderr.decode().split("Traceback (most recent call last):")[1]
        traced_tb = traced.stderr.decode().split("Traceback (most recent call last):")[1]
        assert traced_tb.startswith(plain_tb)
    else:
        assert traced.stderr == plain.stderr  # "python: No module named ..."


#: PROGRAM without the chdir: a zip's __file__ names no directory to go to.
ZIP_PROGRAM = "\n".join(line for line in PROGRAM.splitlines() if "chdir" not in line and "still there" not in line) + "\n"


@pytest.mark.parametrize("name", ["app.pyz", "app.zip", "app.bin", "with-shebang.pyz"])
def test_a_zip_application_runs_as_plain_pythons(tmp_path: Path, name: str) -> None:
    """Python runs a file as a zip application where ``zipimport`` reads it as a zip, whatever
    its name: the zip is ``sys.path[0]`` and its ``__main__`` module runs; mltrace too."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "__main__.py").write_text(ZIP_PROGRAM)
    interpreter = "/usr/bin/env python3" if name.startswith("with-shebang") else None
    zipapp.create_archive(tmp_path / "src", tmp_path / name, interpreter=interpreter)
    plain = subprocess.run([sys.executable, name, "a"], cwd=tmp_path, capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    traced = run_cli("python", "-q", "-o", str(tmp_path / "run"), name, "a", cwd=tmp_path)
    assert f"path0 {tmp_path / name}".encode() in plain.stdout  # run as a zip, not as source
    assert traced.returncode == plain.returncode == 1, traced.stderr.decode()
    assert traced.stdout == plain.stdout
    plain_tb = plain.stderr.decode().split("Traceback (most recent call last):")[1]
    traced_tb = traced.stderr.decode().split("Traceback (most recent call last):")[1]
    assert traced_tb.startswith(plain_tb)


def test_a_zip_without_main_is_a_usage_error(tmp_path: Path) -> None:
    """As a directory without ``__main__.py``: one line, exit 2, before anything runs."""
    with zipfile.ZipFile(tmp_path / "lib.zip", "w") as archive:
        archive.writestr("other.py", "print('ran')\n")
    traced = run_cli("python", "-q", "-o", str(tmp_path / "run"), "lib.zip", cwd=tmp_path)
    err = traced.stderr.decode()
    assert traced.returncode == 2 and err.count("\n") == 1 and "can't find '__main__' module in 'lib.zip'" in err, err
    assert traced.stdout == b"" and not (tmp_path / "run").exists()


SHADOW_MAIN = """\
import os, sys
import {top}
print("module", {top}.__name__, os.path.dirname({top}.__file__) == os.getcwd() + "/{top}", "path0", sys.path[0] == os.getcwd())
"""


def _package(root: Path, top: str) -> None:
    (root / top).mkdir()
    (root / top / "__init__.py").write_text("")
    (root / top / "prog.py").write_text(SHADOW_MAIN.format(top=top))


@pytest.mark.parametrize("top", ["numpy", "mltrace_user"])
def test_a_local_package_named_like_a_library_runs_as_plain_pythons(tmp_path: Path, top: str) -> None:
    """``-m TOP.prog`` where the working directory holds a package ``TOP``, one mltrace has not
    imported before the program (``numpy``: mltrace's finish imports it after): the program runs
    the directory's package, with the working directory as ``sys.path[0]``, and the run still
    finishes with mltrace's own ``numpy``."""
    _package(tmp_path, top)
    plain = subprocess.run([sys.executable, "-m", f"{top}.prog"], cwd=tmp_path, capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    traced = run_cli("python", "-q", "-o", str(tmp_path / "run"), "-m", f"{top}.prog", cwd=tmp_path)
    assert traced.returncode == plain.returncode == 0, traced.stderr.decode()
    assert traced.stdout == plain.stdout == f"module {top} True path0 True\n".encode()
    assert traced.stderr == b""  # no warning: the run finished
    assert (tmp_path / "run" / "run.json").exists()


def test_a_package_that_mltrace_imported_first_is_named_on_stderr(tmp_path: Path) -> None:
    """``-m json.prog`` with a ``json`` package in the working directory: mltrace itself imported
    the standard library's ``json`` before the program, so Python uses that one, where plain
    ``python -m`` runs the directory's. One warning line says so, naming the package. Run through
    the ``mltrace`` command: ``python -m mltrace`` there would import the directory's ``json``
    for mltrace itself, as ``python -m`` puts the working directory first for any module."""
    command = Path(sys.executable).with_name("mltrace")
    if not command.exists():
        pytest.skip("no mltrace command beside this interpreter")
    _package(tmp_path, "json")
    plain = subprocess.run([sys.executable, "-m", "json.prog"], cwd=tmp_path, capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    assert plain.returncode == 0 and plain.stdout == b"module json True path0 True\n"
    argv = [str(command), "python", "-q", "-o", str(tmp_path / "run"), "-m", "json.prog"]
    traced = subprocess.run(argv, cwd=tmp_path, capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    warnings = [ln for ln in traced.stderr.decode().splitlines() if ln.startswith("mltrace: warning:")]
    assert len(warnings) == 1 and "'json'" in warnings[0] and "standard library" in warnings[0], traced.stderr.decode()
    assert str(tmp_path / "json") in warnings[0]
