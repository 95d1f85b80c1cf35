"""Following the traced program's Python children into the same run.

``mltrace python`` traces the processes the program starts as well (``--no-follow`` turns it
off): multiprocessing's fork, spawn and forkserver children (DataLoader workers, pools,
``torch.multiprocessing.spawn``), ``subprocess`` running Python, torchrun's ranks.

- The parent (``parent.py``) puts ``bootstrap/`` on ``PYTHONPATH`` and the run's directory,
  level and trace context in ``MLTRACE_FOLLOW`` (``settings.FOLLOW``). Python runs
  ``bootstrap/sitecustomize.py`` in every child that starts from an interpreter (spawn,
  forkserver, subprocess, torchrun): it runs the ``sitecustomize`` it hides, if any, and
  starts the child's own session (``child.py``) right before the child's first import of
  torch, TensorFlow, Keras or ONNX Runtime, so the child's start is not delayed by
  mltrace's imports; a child that imports none is named in the run, with nothing recorded.
- A child forked without exec (``os.fork``, multiprocessing's fork start method, DataLoader
  workers on Linux) starts its own session from an ``os.register_at_fork`` handler.
- Each child session streams its events into ``procs/<pid>/`` of the run (one writer per
  directory) and, at its end, writes its run.json without correlating. The parent's finish
  (``collect.py``) waits briefly for children still writing, merges their events into the
  run (``run/merge.py``: fresh ids, one track set per process, one clock) before the
  correlator passes, and records every process under run.json's ``processes``; a child
  that could not be followed is listed under ``unfollowed``.
"""

from __future__ import annotations

from pathlib import Path

#: The run directory's folder for the children's own streams, one ``<pid>`` folder each.
PROCS_DIR = "procs"
#: The folder put on the children's ``PYTHONPATH`` (holds ``sitecustomize.py``).
BOOTSTRAP_DIR = Path(__file__).resolve().parent / "bootstrap"
#: A child that could not be followed leaves ``procs/unfollowed-<pid>.json``.
UNFOLLOWED_PREFIX = "unfollowed-"
#: A child that never imported a framework (so never started a session) leaves ``procs/process-<pid>.json``.
IDLE_PREFIX = "process-"
