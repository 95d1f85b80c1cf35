"""How MKL call placement depends on when the lines were received, from a recorded run.

MKL_VERBOSE lines carry no timestamp; ``attach_library_calls`` places each
untimed call by issue order and room in its op, its line's receipt time only
bounding the search (an earlier rule, which needed prompt receipts, gave each
call to the op running when its line arrived). This script takes a run recorded
at ``--level library``, delays every MKL line's receipt to the end of a
simulated read batch (plus up to 0.2 ms), re-runs the pass, and counts the
calls that keep the op the receipts as recorded gave them.

    mltrace python --level library -o RUN examples/infer.py
    python benchmarks/mkl_placement.py RUN [--batches-ms 2,10,20] [--seeds 3]
"""

from __future__ import annotations

import argparse
import random
import sys

from mltrace.run.events import Span
from mltrace.run.levels import Level
from mltrace.run.store import Run, RunError, load_run
from mltrace.tracer.passes.library import attach_library_calls


def delayed(run: Run, batch_ns: int, seed: int) -> Run:
    """The run with each untimed call's receipt moved to the end of its simulated read batch."""
    rng = random.Random(seed)
    phase = rng.randrange(batch_ns)
    spans = []
    for s in run.spans:
        if s.level == Level.LIBRARY and s.attrs.get("ml.library.untimed") and "ml.library.receive_ns" in s.attrs:
            attrs = dict(s.attrs)
            r = int(attrs["ml.library.receive_ns"])
            attrs["ml.library.receive_ns"] = ((r - phase) // batch_ns + 1) * batch_ns + phase + rng.randrange(200_000)
            s = Span(s.id, s.parent_id, s.level, s.name, s.start_ns, s.end_ns, s.track_id, attrs)
        spans.append(s)
    return run.replace(spans=spans)


def untimed_parents(run: Run) -> dict[int, int | None]:
    return {s.id: s.parent_id for s in run.spans if s.level == Level.LIBRARY and s.attrs.get("ml.library.untimed")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a run directory recorded at --level library")
    parser.add_argument("--batches-ms", default="2,10,20", help="simulated read batches (ms), comma list")
    parser.add_argument("--seeds", type=int, default=3, help="batch phases tried per batch length")
    args = parser.parse_args()
    try:
        run = load_run(args.run)
    except RunError as exc:
        print(f"mkl_placement: {exc}", file=sys.stderr)
        return 2
    reference = untimed_parents(attach_library_calls(run))
    if not reference:
        print(f"{args.run}: no untimed (MKL) library calls", file=sys.stderr)
        return 2
    print(f"{len(reference)} untimed calls; placement with prompt receipts is the reference")
    for ms in (float(x) for x in args.batches_ms.split(",") if x.strip()):
        kept = []
        for seed in range(args.seeds):
            got = untimed_parents(attach_library_calls(delayed(run, int(ms * 1e6), seed)))
            kept.append(sum(got.get(k) == v for k, v in reference.items()))
        print(f"  {ms:5.1f} ms batches: same op for " + ", ".join(f"{k}/{len(reference)}" for k in kept))
    return 0


if __name__ == "__main__":
    sys.exit(main())
