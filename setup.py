"""Builds mltrace's one C helper, the layer level's Module.__call__ and row encoder (everything else is in pyproject.toml).

The extension is optional: without a C compiler the build goes on, and mltrace
uses the same hot path written in Python (run.json's ``sources.torch.modules``
says which one ran).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("mltrace._layercall", ["src/mltrace/_layercall.c"], optional=True)])
