"""mltrace: a cross-stack tracer for deep-learning inference.

Public API::

    import mltrace

    @mltrace.trace
    def preprocess(x): ...

    with mltrace.profile(level="layer"):
        with mltrace.span("inference", batch=8):
            model(x)

    run = mltrace.load_run("mltrace-runs/infer-20261122-101500")
"""

from mltrace._version import __version__
from mltrace.finish import RunFinish
from mltrace.profiling import profile
from mltrace.run.store import load_run
from mltrace.tracer.api import span, trace
from mltrace.tracer.session import use_finish

use_finish(RunFinish())  # every session ends with mltrace/finish.py

__all__ = ["__version__", "load_run", "profile", "span", "trace"]
