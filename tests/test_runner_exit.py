"""The end of a program under ``mltrace python`` waits for its threads as plain Python's does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import run_cli

POOL = """\
import time
from concurrent.futures import ThreadPoolExecutor

pool = ThreadPoolExecutor(2)
print([f.result() for f in [pool.submit(lambda i=i: i * i) for i in range(4)]], flush=True)

def late():
    time.sleep(0.3)
    print("late job done", flush=True)

pool.submit(late)  # still running when the script ends, the pool never shut down
"""


def test_a_thread_pool_left_open_ends_as_in_plain_python(tmp_path: Path) -> None:
    """Its workers wait for work until threading's exit hook tells them to stop: joined without
    it, the program never ended."""
    (tmp_path / "pool.py").write_text(POOL)
    plain = subprocess.run([sys.executable, "pool.py"], cwd=tmp_path, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    traced = run_cli("python", "-q", "-o", str(tmp_path / "run"), "pool.py", cwd=tmp_path, timeout=60)
    assert traced.returncode == plain.returncode == 0
    assert traced.stdout == plain.stdout == b"[0, 1, 4, 9]\nlate job done\n"
