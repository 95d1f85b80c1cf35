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


CALLERS = {
    "lazy": ["-Wl,-z,lazy"],
    "now": ["-Wl,-z,now", "-Wl,-z,relro"],
    "noplt": ["-fno-plt", "-Wl,-z,relro"],
}


def _build(tmp_path: Path) -> tuple[Path, list[Path]]:
    """Compiles the provider and one caller per ``CALLERS`` entry; their paths."""
    (tmp_path / "provider.c").write_text(PROVIDER)
    (tmp_path / "caller.c").write_text(CALLER)
    cc = shutil.which("cc")
    assert cc is not None
    provider = tmp_path / "libprovider.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", provider, tmp_path / "provider.c"], check=True)
    callers = []
    for name, flags in CALLERS.items():
        out = tmp_path / f"libcaller_{name}.so"
        subprocess.run([cc, "-shared", "-fPIC", *flags, "-o", out, tmp_path / "caller.c", "-L", tmp_path, "-lprovider"], check=True)
        callers.append(out)
    return provider, callers


def _run(tmp_path: Path, program: str, provider: Path, callers: list[Path]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", program, str(provider), *map(str, callers)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO / "src"), "LD_LIBRARY_PATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_redirects_each_importing_slot_and_restores_it_with_its_protection(tmp_path: Path) -> None:
    provider, callers = _build(tmp_path)
    report = _run(tmp_path, PROGRAM, provider, callers)
    assert report["before"] == [42.0] * 3 and report["after"] == [42.0] * 3
    assert report["n"] == 3 and report["again"] == 0 and report["restored"] == 3 and report["left"] == []
    for t0, seconds, t1 in report["during"]:  # the monotonic clock, in seconds
        assert t0 <= seconds <= t1
    # the lazy caller's slot is writable, the other two read-only: each left as it was
    assert sorted(m[:2] for m in report["modes"]) == ["r-", "r-", "rw"]
    assert report["modes_after"] == report["modes"]


# Installs, removes and installs again (in this process, then in a forked child), then loads one
# more caller and installs again: which installs walked the relocation tables, which slots each
# redirected, and what the callers read.
AGAIN = textwrap.dedent(
    r"""
    import ctypes, json, os, sys, time
    from mltrace import _mkltimer

    def timer_reads(callers):
        reads = []
        for c in callers:
            c.read_timer.restype = ctypes.c_double
            t0 = time.monotonic(); v = c.read_timer(); t1 = time.monotonic()
            reads.append(t0 <= v <= t1)
        return reads

    provider = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
    callers = [ctypes.CDLL(path) for path in sys.argv[2:-1]]
    out = {"first": _mkltimer.install(), "walks_first": _mkltimer.walks()}
    first_slots = sorted(s for s, _, _ in _mkltimer.slots())
    _mkltimer.remove()
    out["again"] = _mkltimer.install()
    out["walks_again"] = _mkltimer.walks()
    out["same_slots"] = sorted(s for s, _, _ in _mkltimer.slots()) == first_slots
    out["reads_again"] = timer_reads(callers)
    _mkltimer.remove()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        child = {"n": _mkltimer.install(), "walks": _mkltimer.walks(), "reads": timer_reads(callers)}
        child["restored"] = _mkltimer.remove()
        os.write(w, json.dumps(child).encode())
        os._exit(0)
    os.close(w)
    out["child"] = json.loads(os.read(r, 65536))
    os.waitpid(pid, 0)
    callers.append(ctypes.CDLL(sys.argv[-1]))  # a new object: the remembered slots are not all
    out["after_load"] = _mkltimer.install()
    out["walks_after_load"] = _mkltimer.walks()
    out["reads_after_load"] = timer_reads(callers)
    out["restored"] = _mkltimer.remove()
    out["after"] = [c.read_timer() for c in callers]
    print(json.dumps(out))
    """
)


def test_install_again_reuses_the_walk_until_an_object_is_loaded(tmp_path: Path) -> None:
    provider, callers = _build(tmp_path)
    late = tmp_path / "libcaller_late.so"
    shutil.copy(callers[0], late)
    report = _run(tmp_path, AGAIN, provider, [*callers, late])
    assert report["first"] == 3 and report["walks_first"] == 1
    # the same slots, found without a walk, and the callers read the monotonic clock
    assert report["again"] == 3 and report["walks_again"] == 1 and report["same_slots"]
    assert report["reads_again"] == [True] * 3
    # a forked child: its parent's walk is in its copy
    assert report["child"] == {"n": 3, "walks": 1, "reads": [True] * 3, "restored": 3}
    # an object loaded since: walked again, its slot redirected too
    assert report["after_load"] == 4 and report["walks_after_load"] == 2
    assert report["reads_after_load"] == [True] * 4
    assert report["restored"] == 4 and report["after"] == [42.0] * 4
