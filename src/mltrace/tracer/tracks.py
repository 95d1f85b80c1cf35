"""The track registry of a session: one id per thread, GPU stream and counter."""

from __future__ import annotations

import os
import threading
from collections import deque

from mltrace.run.events import Track, TrackKind


class TrackRegistry:
    """Allocates track ids and remembers tracks not yet written to disk.

    Thread-safe. ``pending`` holds tracks created since the last flush.
    """

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid if pid is not None else os.getpid()
        self._lock = threading.Lock()
        self._by_key: dict[tuple[object, ...], Track] = {}
        self.tracks: dict[int, Track] = {}
        self.pending: deque[Track] = deque()
        self._next_id = 1

    def _get(self, key: tuple[object, ...], make: type[Track], **fields: object) -> Track:
        track = self._by_key.get(key)
        if track is not None:
            return track
        with self._lock:
            track = self._by_key.get(key)
            if track is None:
                track = make(id=self._next_id, **fields)  # type: ignore[arg-type]
                self._next_id += 1
                self._by_key[key] = track
                self.tracks[track.id] = track
                self.pending.append(track)
        return track

    def thread(self, tid: int, name: str = "", pid: int | None = None) -> Track:
        """The track of OS thread ``tid`` of process ``pid`` (default: this process)."""
        p = self.pid if pid is None else pid
        return self._get(("thread", p, tid), Track, kind=TrackKind.THREAD, name=name or f"thread {tid}", pid=p, tid=tid)

    def current_thread(self) -> Track:
        """The track of the calling thread."""
        t = threading.current_thread()
        return self.thread(threading.get_native_id(), t.name)

    def gpu_stream(self, device: int, stream: int, pid: int | None = None) -> Track:
        """The track of CUDA stream ``stream`` on GPU ``device``."""
        p = self.pid if pid is None else pid
        return self._get(
            ("gpu", p, device, stream),
            Track,
            kind=TrackKind.GPU_STREAM,
            name=f"GPU {device} stream {stream}",
            pid=p,
            device=device,
            stream=stream,
        )

    def counter(self, name: str, unit: str = "", device: int = -1) -> Track:
        """A counter track, e.g. ``counter("gpu.utilization", "%", device=0)``."""
        return self._get(("counter", name, device), Track, kind=TrackKind.COUNTER, name=name, pid=self.pid, device=device, unit=unit)
