"""Where the seconds of one sync go, from the spans weightsync reports (`weightsync.timing`).

Three parts that add up to the sync's wall time:

- ``engine``: the ``"engine"`` spans (each call of the sync into the engine's write methods:
  ``load_weights``, ``load_adapter``, ``reload_checkpoint``) minus the ``"produce"`` and
  ``"serialize"`` spans inside them: vLLM's load, layerwise processing and repacking,
  ``add_lora``/adapter install, and for a server the HTTP control calls (pause, reset, resume)
  and the workers' read of what was sent.
- ``serialize``: the ``"serialize"`` spans: safetensors writes (snapshots, tmpfs buckets kept or
  fresh, adapter folders), gloo bucket packing and broadcast, and the reading of checkpoint
  files that weightsync does itself (a tied model's ``ReloadWeights(checkpoint)``).
- ``weightsync``: the rest -- the plan (reported alone too, ``plan``), producing tensors (merge,
  cast; ``produce``, the ``"produce"`` spans: time spent inside the engine pulling the stream),
  bookkeeping.

Beside the parts, ``pause``: the ``"pause"`` spans (`weightsync.timing`), how long the
engine generated nothing for its other clients (a server: from ``/pause`` to ``/resume``),
inside ``engine``, not added to the total; 0 for an engine a sync does not pause.

Timers only: each part is a sum of ``perf_counter`` spans, no profiler, no estimate. Where
replicas are written in parallel threads, ``serialize`` sums over the threads (CPU-seconds)
and ``engine`` is what remains of the wall time (clamped at 0); the row says so.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from weightsync import timing
from weightsync.execute import execute


class Phases:
    """Accumulates the spans of one sync; `add` is the `weightsync.timing` listener.

    A listener hears of a span when it ends, so which spans lie inside an engine call is told
    by when they were heard: one of the sync's thread that ended before the call began was
    heard before it (spans are reported as they end, in the thread that ran them); one heard
    after the call's start (when the engine span is heard, minus its length) ran inside it.
    That start is late by the moment between the engine span's end and its report, so a span
    short enough to begin and be heard within that moment would count as outside. Replicas'
    threads report only from inside an engine call. Engine spans do not nest (the sync opens
    one per write call), so every span heard before one ends is settled with it.
    """

    def __init__(self) -> None:
        self.plan = 0.0
        self.produce = 0.0
        self.serialize = 0.0
        self.engine = 0.0
        self.pause = 0.0  # the engine's pause window (inside "engine"; 0: never paused)
        self._heard: list[tuple[float, float]] = []  # (when, seconds) of produce/serialize spans
        self._lock = threading.Lock()  # replicas report from threads of their own

    def add(self, part: timing.Part, seconds: float) -> None:
        now = time.perf_counter()
        with self._lock:
            if part == "pause":  # a window inside "engine", not a part of the wall time
                self.pause += seconds
                return
            if part == "engine":
                began = now - seconds
                inside = sum(s for when, s in self._heard if when >= began)
                self.engine += max(0.0, seconds - inside)
                self._heard.clear()
                return
            self._heard.append((now, seconds))
            setattr(self, part, getattr(self, part) + seconds)

    def split(self, total: float) -> dict[str, float]:
        """The parts of a sync that took ``total`` seconds."""
        return {
            "total": total,
            "weightsync": max(0.0, total - self.serialize - self.engine),
            "plan": self.plan,
            "produce": self.produce,
            "serialize": self.serialize,
            "engine": self.engine,
            "pause": self.pause,
        }


def timed_sync(strategy: Any, model: Any, engine: Any) -> tuple[Any, dict[str, float]]:
    """``strategy.sync(model, engine)`` (its plan, then ``execute``), with its phases."""
    phases = Phases()
    with timing.listen(phases.add):
        start = time.perf_counter()
        plan = strategy.plan(model, engine)
        phases.plan = time.perf_counter() - start
        report = execute(plan, engine, started=start)
        total = time.perf_counter() - start
    return report, phases.split(total)
