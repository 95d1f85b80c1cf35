"""Builds mltrace's C helpers (everything else is in pyproject.toml): the layer level's
Module.__call__ and row encoder (_layercall), the Perfetto exporter's span packets
(_pftrace), the correlator's two sweeps (_sweep), and the library level's fd tap reader
(_tapread) and redirect of oneMKL's verbose timer (_mkltimer).

All are optional: without a C compiler the build goes on, and mltrace uses the same code
written in Python (run.json's ``sources.torch.modules`` says which hot path ran; the trace
and the correlated spans are the same either way, as the tests check).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("mltrace._layercall", ["src/mltrace/_layercall.c"], optional=True),
        Extension("mltrace._pftrace", ["src/mltrace/_pftrace.c"], optional=True),
        Extension("mltrace._sweep", ["src/mltrace/_sweep.c"], optional=True),
        Extension("mltrace._mkltimer", ["src/mltrace/_mkltimer.c"], optional=True),
        Extension("mltrace._tapread", ["src/mltrace/_tapread.c"], optional=True),
    ]
)
