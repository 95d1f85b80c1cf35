"""The streamed finish's process: ``python -m mltrace.finish_serve RUN_DIR`` runs a
``StreamedFinish`` (``finish_stream.py``) over the run outside the traced process (and its GIL).

It reads one request per line on stdin (JSON):

- ``{"seal": S, "open": O}``: every event that ends at or before session time ``S`` is in
  events.jsonl, and no span still running began before ``O`` (null: none runs); it correlates
  and writes that part (no answer). Seals that queued up while it worked are
  taken together: only the last one counts, and none once a finish came.
- ``{"finish": meta}``: the program ended and every event is written; it finishes the run and
  answers ``{"phase": step}`` lines as it goes, then ``{"done": meta}`` (run.json written) or
  ``{"fallback": why}`` (nothing written: the traced process finishes the run whole).

At the end of its input without a finish (the traced process died) it removes its temporary
files and exits; the run stays as streamed. Ctrl-C in the terminal is the program's to handle.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import IO, Any

from mltrace.run.jsoncodec import dumps, loads


class _Requests:
    """The requests read from the input on a thread of their own: the last seal not yet taken,
    and the finish (or the end of the input) once it came."""

    def __init__(self, inp: IO[bytes]) -> None:
        self._inp = inp
        self._changed = threading.Condition()
        self._seal: tuple[int, int | None] | None = None
        self._last: dict[str, Any] | None = None
        self._ended = False

    def read(self) -> None:
        """Reads request lines until the end of the input (the thread's target)."""
        try:
            for line in iter(self._inp.readline, b""):
                try:
                    obj = loads(line)
                except ValueError:
                    continue
                if not isinstance(obj, dict):
                    continue
                with self._changed:
                    if "seal" in obj:
                        self._seal = (int(obj["seal"]), obj.get("open"))
                    elif "finish" in obj:
                        self._last = obj
                    self._changed.notify()
        finally:
            with self._changed:
                self._ended = True
                self._changed.notify()

    def next(self) -> dict[str, Any] | None:
        """The next request: the finish once it came (a seal waiting before it is passed over:
        the finish takes everything), else a seal waiting (the last of those that came), else
        None at the end of the input."""
        with self._changed:
            while self._seal is None and self._last is None and not self._ended:
                self._changed.wait()
            if self._last is None and self._seal is not None:
                (seal, open_ns), self._seal = self._seal, None
                return {"seal": seal, "open": open_ns}
            return self._last


def serve(run_dir: Path, inp: IO[bytes], out: IO[bytes]) -> int:
    """Answers requests until a finish or the end of ``inp``; 0."""
    from mltrace.finish_stream import StreamedFinish

    def send(obj: Any) -> None:
        out.write(dumps(obj) + b"\n")
        out.flush()

    finish = StreamedFinish(run_dir)
    requests = _Requests(inp)
    reader = threading.Thread(target=requests.read, name="mltrace-finish-requests", daemon=True)
    reader.start()
    while True:
        request = requests.next()
        if request is None:
            finish.discard()
            return 0
        if "seal" in request:
            try:
                finish.seal(request["seal"], request.get("open"))
            except Exception as exc:  # noqa: BLE001 - the run is then finished whole
                finish.broken = f"a segment failed: {type(exc).__name__}: {exc}"
            continue
        _finish(finish, request["finish"], send)
        reader.join(timeout=5.0)  # the traced process closes the input once it has the answer
        return 0


def _finish(finish: Any, meta: dict[str, Any], send: Any) -> None:
    """Finishes the run and answers (``serve``)."""
    try:
        run = finish.finalize(meta, lambda step: send({"phase": step}))
    except Exception as exc:  # noqa: BLE001 - the traced process finishes the run whole
        finish.discard()
        send({"fallback": f"{type(exc).__name__}: {exc}"})
        return
    if run is None:
        send({"fallback": finish.broken or "unknown"})
    else:
        send({"done": meta})


def main() -> int:
    """The process's entry (``python -m mltrace.finish_serve RUN_DIR``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if len(sys.argv) != 2:
        print("usage: python -m mltrace.finish_serve RUN_DIR", file=sys.stderr)
        return 2
    status = serve(Path(sys.argv[1]), sys.stdin.buffer, sys.stdout.buffer)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # the request reader may still wait on the input: no teardown to race it


if __name__ == "__main__":
    sys.exit(main())
