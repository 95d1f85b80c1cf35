"""A forked child's session, seen from the child: the program makes one model call, then forks
a child that notes what its session's start left ready before the child's first model call,
makes a model call, notes whether a converter process runs once that call's cycle is converted,
makes two more and notes it again; it writes its notes as JSON on stdout. Exits 0."""

import json
import os
import sys

import torch

from mltrace.tracer import session as mltrace_session

try:
    from mltrace import _mkltimer
except ImportError:  # the C helper is not built: no slots, no walks
    _mkltimer = None


def started_source(name):
    active = mltrace_session._active
    return next((s for s in active.started if s.name == name), None) if active is not None else None


def converter_runs(cycles):
    """Whether the op level's converter process runs, once the cycles handed are converted."""
    cycles.wait_converted(30.0)
    return cycles._process is not None


def main():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).eval()
    with torch.no_grad():
        model(torch.ones(1, 8))
    parent_walks = _mkltimer.walks() if _mkltimer is not None else 0
    pid = os.fork()
    if pid == 0:
        ops = started_source("torch.profiler")
        cycles = getattr(ops, "_cycles", None)
        state = {
            "own_session": mltrace_session._active is not None and mltrace_session._active.meta["process"]["start"] == "fork",
            "cycles": cycles is not None,
            "converter_at_start": cycles is not None and cycles._process is not None,
            "mkl_slots": len(_mkltimer.slots()) if _mkltimer is not None else 0,
            "walks": [parent_walks, _mkltimer.walks() if _mkltimer is not None else 0],
        }
        with torch.no_grad():
            model(torch.full((1, 8), 0.0))
            state["converter_after_one_call"] = converter_runs(cycles)
            for i in range(1, 3):
                model(torch.full((1, 8), i / 10))
            state["converter_after_three_calls"] = converter_runs(cycles)
        print(json.dumps(state), flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
