"""Timing and peak extra resident memory of one call.

Peak memory is the process's resident set size (RSS) sampled by a thread every ~1 ms while
the call runs, minus the RSS just before it: what the sync costs in host memory, trainer and
(in-process) engine side together. RSS counts pages actually touched; memory the allocator
kept from an earlier run and reuses does not show up again, so the warm-up run is the one that
shows first-touch costs and the timed runs show steady state.
"""

from __future__ import annotations

import gc
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil


class PeakRSS:
    """Context manager: ``peak_extra`` = max RSS seen inside minus RSS at entry (bytes)."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self._proc = psutil.Process()
        self.peak_extra = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = self._proc.memory_info().rss
            if rss > self._peak:
                self._peak = rss
            time.sleep(self.interval)

    def __enter__(self) -> PeakRSS:
        self._before = self._proc.memory_info().rss
        self._peak = self._before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._proc.memory_info().rss)
        self.peak_extra = self._peak - self._before


@dataclass
class Runs:
    """Every timed run of one row (the warm-up is kept apart)."""

    seconds: list[float] = field(default_factory=list)
    peak_extra: list[int] = field(default_factory=list)
    warmup_seconds: float | None = None
    warmup_peak_extra: int | None = None
    result: Any = None  # what the last call returned (e.g. a SyncReport)
    phases: list[dict[str, float]] = field(default_factory=list)  # per timed run, if measured

    def summary(self) -> dict[str, Any]:
        parts = {}
        if self.phases:  # each part's median over the timed runs (see phases.py)
            parts = {k: statistics.median(p[k] for p in self.phases) for k in self.phases[0]}
        return {
            "phases": parts,
            "seconds": {
                "median": statistics.median(self.seconds),
                "min": min(self.seconds),
                "max": max(self.seconds),
                "runs": self.seconds,
                "warmup": self.warmup_seconds,
            },
            "peak_extra_bytes": {
                "max": max(self.peak_extra),
                "median": int(statistics.median(self.peak_extra)),
                "runs": self.peak_extra,
                "warmup": self.warmup_peak_extra,
            },
        }


def measure(
    fn: Callable[[], Any],
    repeats: int,
    *,
    warmup: int = 1,
    tick: Callable[[], None] = lambda: None,
    before: Callable[[], None] | None = None,
) -> Runs:
    """Call ``fn`` ``warmup`` times untimed-for-summary, then ``repeats`` times timed.

    ``before`` runs ahead of every call, outside the timer (a training step between syncs).
    A ``fn`` that returns a tuple whose 4th item is a dict of phases has them kept per run.
    """
    runs = Runs()
    for i in range(warmup + repeats):
        if before is not None:
            before()
        gc.collect()
        with PeakRSS() as mem:
            start = time.perf_counter()
            runs.result = fn()
            seconds = time.perf_counter() - start
        if i < warmup:
            runs.warmup_seconds, runs.warmup_peak_extra = seconds, mem.peak_extra
        else:
            runs.seconds.append(seconds)
            runs.peak_extra.append(mem.peak_extra)
            if isinstance(runs.result, tuple) and len(runs.result) > 3 and runs.result[3]:
                runs.phases.append(runs.result[3])
        tick()
    return runs


def timed_runs(sync: Any, model: Any, engine: Any, runs: int) -> dict[str, Any]:
    """A warm-up sync, then ``runs`` timed ones (``sync.sync(model, engine)``): their median,
    min and max seconds (each sync's own `SyncReport.seconds`), the median pause window
    (`SyncReport.pause_seconds`; None for an engine a sync does not pause) and the bytes one
    sends."""
    sync.sync(model, engine)  # warm-up
    reports = [sync.sync(model, engine) for _ in range(runs)]
    seconds = [r.seconds for r in reports]
    pauses = [r.pause_seconds for r in reports if r.pause_seconds is not None]
    return {
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
        "pause_s": statistics.median(pauses) if pauses else None,
        "bytes": reports[-1].bytes,
    }


def verified_row(label: str, sync: Any, model: Any, engine: Any, runs: int) -> dict[str, Any]:
    """`timed_runs` under ``label``, then the engine checked against the trainer (raises unless
    it serves ``model``): a row whose seconds came from syncs that were right."""
    from weightsync.verify import check_engine

    row = {"sync": label, **timed_runs(sync, model, engine, runs)}
    check_engine(model, engine, strategy="FullSync")
    return row
