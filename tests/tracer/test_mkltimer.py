"""mltrace._mkltimer on stand-in libraries: which slots it redirects, and that it leaves each
page's protection as it found it (lazy binding, and RELRO under BIND_NOW)."""

from __future__ import annotations

import importlib.util
import json
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mltrace._mkltimer") is None
    or shutil.which("cc") is None
    or sys.platform != "linux"
    or platform.machine() != "x86_64",
    reason="needs the _mkltimer helper, a C compiler, and Linux on x86-64",
)

REPO = Path(__file__).resolve().parents[2]

# The "library" that defines MKL's timer (a constant, to tell it from the monotonic clock) and
# three that import it: through their PLT bound lazily (a writable slot), through their PLT
# with BIND_NOW (the slot on a RELRO page, read-only), and without a PLT (-fno-plt: a GOT entry
# the call reads, on a RELRO page).
PROVIDER = "double mkl_serv_iface_dsecnd(void) { return 42.0; }\n"
CALLER = textwrap.dedent(
    """
    double mkl_serv_iface_dsecnd(void);
    double read_timer(void) { return mkl_serv_iface_dsecnd(); }
    """
)

PROGRAM = textwrap.dedent(
    r"""
    import ctypes, json, sys, time
    from mltrace import _mkltimer

    def perms(address):
        for line in open("/proc/self/maps"):
            span, mode = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return mode
        return None

    provider = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
    callers = [ctypes.CDLL(path) for path in sys.argv[2:]]
    for c in callers:
        c.read_timer.restype = ctypes.c_double
    before = [c.read_timer() for c in callers]  # binds the lazy slot
    n = _mkltimer.install()
    slots = _mkltimer.slots()
    modes = [perms(slot) for slot, _, _ in slots]
    during = []
    for c in callers:
        t0 = time.monotonic(); v = c.read_timer(); t1 = time.monotonic()
        during.append([t0, v, t1])
    again = _mkltimer.install()  # already redirected: nothing more
    restored = _mkltimer.remove()
    after = [c.read_timer() for c in callers]
    print(json.dumps({"n": n, "again": again, "restored": restored, "before": before, "during": during,
                      "after": after, "modes": modes, "modes_after": [perms(s) for s, _, _ in slots],
                      "left": _mkltimer.slots()}))
    """
)


def test_redirects_each_importing_slot_and_restores_it_with_its_protection(tmp_path: Path) -> None:
    (tmp_path / "provider.c").write_text(PROVIDER)
    (tmp_path / "caller.c").write_text(CALLER)
    cc = shutil.which("cc")
    assert cc is not None
    provider = tmp_path / "libprovider.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", provider, tmp_path / "provider.c"], check=True)
    callers = {
        "lazy": ["-Wl,-z,lazy"],
        "now": ["-Wl,-z,now", "-Wl,-z,relro"],
        "noplt": ["-fno-plt", "-Wl,-z,relro"],
    }
    for name, flags in callers.items():
        out = tmp_path / f"libcaller_{name}.so"
        subprocess.run([cc, "-shared", "-fPIC", *flags, "-o", out, tmp_path / "caller.c", "-L", tmp_path, "-lprovider"], check=True)
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(provider), *(str(tmp_path / f"libcaller_{name}.so") for name in callers)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO / "src"), "LD_LIBRARY_PATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["before"] == [42.0] * 3 and report["after"] == [42.0] * 3
    assert report["n"] == 3 and report["again"] == 0 and report["restored"] == 3 and report["left"] == []
    for t0, seconds, t1 in report["during"]:  # the monotonic clock, in seconds
        assert t0 <= seconds <= t1
    # the lazy caller's slot is writable, the other two read-only: each left as it was
    assert sorted(m[:2] for m in report["modes"]) == ["r-", "r-", "rw"]
    assert report["modes_after"] == report["modes"]
