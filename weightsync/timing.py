"""Where a sync's seconds go: spans the code reports, for whoever listens (the benchmark).

A span names one of three parts of a sync's wall time:

- ``"produce"``: pulling tensors from weightsync's stream (merge, cast, gather);
- ``"serialize"``: turning tensors into bytes on the trainer side (safetensors files,
  kept-file copies, gloo payloads and their broadcast, snapshots, adapter folders) and reading
  checkpoint files weightsync reads itself;
- ``"engine"``: a call into the engine's write methods, as a whole; spans of the other two
  parts made inside it are the listener's to subtract.

And one span that is not a part of the wall time but a window inside ``"engine"``:

- ``"pause"``: an engine that serves others while it is synced (a ``vllm serve`` server, an
  engine in another process) generating nothing for them: from its pause to its resume.
  `weightsync.execute.SyncReport.pause_seconds` is their sum.

Spans cost two ``perf_counter`` calls when nobody listens. Listeners are process-wide, not
per thread: replicas write from threads of their own, and their spans count too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Literal, TypeVar

Part = Literal["produce", "serialize", "engine", "pause"]
Listener = Callable[[Part, float], None]

_listeners: list[Listener] = []
_lock = threading.Lock()
_T = TypeVar("_T")


@contextmanager
def span(part: Part) -> Iterator[None]:
    """Report the time the block takes as ``part`` to every listener."""
    start = time.perf_counter()
    try:
        yield
    finally:
        if _listeners:
            seconds = time.perf_counter() - start
            for listener in list(_listeners):
                listener(part, seconds)


def report(part: Part, seconds: float) -> None:
    """Report ``seconds`` measured elsewhere as ``part`` (an engine's pause, timed on the
    engine's own side where the commit ran there)."""
    for listener in list(_listeners):
        listener(part, seconds)


def spanned(items: Iterable[_T], part: Part) -> Iterator[_T]:
    """``items``, the time taken to produce each one reported as ``part``."""
    it = iter(items)
    while True:
        with span(part):
            try:
                item = next(it)
            except StopIteration:
                return
        yield item


@contextmanager
def listen(listener: Listener) -> Iterator[None]:
    """Call ``listener(part, seconds)`` for every span that ends while the block runs."""
    with _lock:
        _listeners.append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)
