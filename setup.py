"""Builds mltrace's two C helpers: the layer level's Module.__call__ and row encoder, and the
Perfetto exporter's span packets (everything else is in pyproject.toml).

Both are optional: without a C compiler the build goes on, and mltrace uses the same code
written in Python (run.json's ``sources.torch.modules`` says which hot path ran; the Perfetto
output is byte for byte the same either way).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("mltrace._layercall", ["src/mltrace/_layercall.c"], optional=True),
        Extension("mltrace._pftrace", ["src/mltrace/_pftrace.c"], optional=True),
    ]
)
