"""Builds mltrace's C helpers (everything else is in pyproject.toml): the layer level's
Module.__call__ and row encoder (_layercall), the Perfetto exporter's span packets
(_pftrace), the correlator's two sweeps (_sweep), and the library level's fd tap reader
(_tapread), reading of oneMKL's verbose lines (_mklscan) and redirect of oneMKL's verbose
timer (_mkltimer), the recorder's untracking of finished spans by the garbage collector
(_untrack), and the call that carries the current span into run_in_executor's worker (_carry).

All are optional: without a C compiler the build goes on, and mltrace uses the same code
written in Python (run.json's ``sources.torch.modules`` says which hot path ran; the trace
and the correlated spans are the same either way, as the tests check).
"""

import sys

from setuptools import Extension, setup

#: dlopen and dlsym (the layer hot path reads libtorch's JIT tracing state): in libc from glibc 2.34, in libdl before.
DL = ["dl"] if sys.platform.startswith("linux") else []

setup(
    ext_modules=[
        Extension("mltrace._layercall", ["src/mltrace/_layercall.c"], libraries=DL, optional=True),
        Extension("mltrace._pftrace", ["src/mltrace/_pftrace.c"], optional=True),
        Extension("mltrace._sweep", ["src/mltrace/_sweep.c"], optional=True),
        Extension("mltrace._mkltimer", ["src/mltrace/_mkltimer.c"], optional=True),
        Extension("mltrace._tapread", ["src/mltrace/_tapread.c"], optional=True),
        Extension("mltrace._mklscan", ["src/mltrace/_mklscan.c"], optional=True),
        Extension("mltrace._untrack", ["src/mltrace/_untrack.c"], optional=True),
        Extension("mltrace._carry", ["src/mltrace/_carry.c"], optional=True),
    ]
)
