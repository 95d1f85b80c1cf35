"""``mltrace.profile``: the tracer's ``profile`` (``tracer/api.py``) with the OTLP export that
``mltrace python`` has. With ``otlp=URL`` (``""``: the OTEL_* endpoint) or the environment
asking for OTLP (``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT`` or ``OTEL_TRACES_EXPORTER=otlp``, said
once on stderr), model, layer and user spans are sent while the profiled region runs
(``exporters/otlp_live.py``), and the rest of the run once it stops, with one stderr line. It
sits above the exporters so that the tracer imports none of them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mltrace.tracer import api


class profile(api.profile):  # noqa: N801 - reads as a verb, like contextlib's helpers
    """Profiles a region of a program: context manager, decorator, or start()/stop().

    Takes the same options as the CLI (see ``ProfileOptions``; ``otlp=URL`` sends the spans
    over OTLP, as ``--otlp`` does)::

        with mltrace.profile(level="layer", output="runs/r1") as p:
            model(x)
        print(p.run_dir)

    Attributes:
        run_dir: the run directory, once started.
    """

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._live: Any = None

    def start(self) -> profile:
        """Starts a session, and its live OTLP export where ``otlp=`` or the environment asks.

        Raises:
            mltrace.errors.UsageError: for invalid options or a second session.
        """
        super().start()
        session = self._session
        if session is not None and (session.options.otlp is not None or any(n.startswith("OTEL_") for n in os.environ)):
            from mltrace.exporters.otlp_live import start_live

            self._live = start_live(session)
        return self

    def stop(self) -> Path | None:
        """Stops the session, writes the run, prints the summary if asked, and sends over OTLP
        what the live export did not deliver."""
        session, live = self._session, self._live
        self._live = None
        if session is not None and live is not None:
            live.stop(session)
        run_dir = super().stop()
        if session is not None and run_dir is not None and session.options.otlp is not None and not session.forked_copy:
            from mltrace.exporters.otlp_live import send_rest

            send_rest(run_dir, session.options.otlp or None, live)
        return run_dir
