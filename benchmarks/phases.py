"""Where the seconds of one sync go, measured with timers at the engine's boundary.

Three parts that add up to the sync's wall time:

- ``engine``: time inside the engine's write methods (``load_weights``, ``load_adapter``,
  ``reload_checkpoint`` of the engine object the sync was given) minus the time spent there
  pulling tensors from weightsync's stream or serialising them: vLLM's load, layerwise
  processing and repacking, ``add_lora``/adapter install, and for a server the HTTP control
  calls (pause, reset, resume) and the workers' read of what was sent.
- ``serialize``: safetensors writes (``safetensors.torch.save_file``: snapshots, fresh tmpfs
  buckets, adapter folders; the tmpfs transport's kept files), gloo bucket packing and broadcast, and the reading of checkpoint files
  that weightsync does itself (a tied model's ``ReloadWeights(checkpoint)``).
- ``weightsync``: the rest -- the plan (reported alone too, ``plan``), producing tensors (merge,
  cast; ``produce``, time spent inside the engine pulling the stream), bookkeeping.

Timers only: each part is a sum of ``perf_counter`` spans, no profiler, no estimate. Where
replicas are written in parallel threads, ``serialize`` sums over the threads (CPU-seconds)
and ``engine`` is what remains of the wall time (clamped at 0); the row says so.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

ENGINE_METHODS = ("load_weights", "load_adapter", "reload_checkpoint")


class Phases:
    """Accumulates the timed spans of one sync."""

    def __init__(self) -> None:
        self.plan = 0.0
        self.produce = 0.0
        self.serialize = 0.0
        self.engine = 0.0
        self._depth = 0
        self._lock = threading.Lock()

    def _add(self, part: str, seconds: float) -> None:
        with self._lock:
            setattr(self, part, getattr(self, part) + seconds)

    def _timed_iter(self, items: Iterable[Any], part: str) -> Iterator[Any]:
        it = iter(items)
        while True:
            t = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                self._add(part, time.perf_counter() - t)
                return
            self._add(part, time.perf_counter() - t)
            yield item

    def _timed(self, fn: Callable[..., Any], part: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(part, time.perf_counter() - t)

        return call

    def _engine_method(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._depth:  # reload_checkpoint -> load_weights of files weightsync reads itself
                if name == "load_weights":  # its buckets are lazy readers: time their pairs
                    lazy = (self._timed_iter(bucket, "serialize") for bucket in args[0])
                    args = (lazy, *args[1:])
                return fn(*args, **kwargs)
            self._depth += 1
            inside = self.produce + self.serialize
            t = time.perf_counter()
            try:
                if name == "load_weights":
                    args = (self._timed_iter(args[0], "produce"), *args[1:])
                return fn(*args, **kwargs)
            finally:
                wall = time.perf_counter() - t
                self._depth -= 1
                self._add("engine", max(0.0, wall - (self.produce + self.serialize - inside)))

        return call

    @contextmanager
    def watch(self, engine: Any) -> Iterator[Phases]:
        """Time ``engine``'s write methods and every serialisation while the block runs."""
        import safetensors.torch as st

        with ExitStack() as undo:
            for name in ENGINE_METHODS:
                if hasattr(engine, name):
                    setattr(engine, name, self._engine_method(name, getattr(engine, name)))
                    undo.callback(delattr, engine, name)
            for each in getattr(engine, "engines", [engine]):  # Replicas: every replica
                transport = getattr(each, "transport", None)
                if transport is not None and hasattr(transport, "_send_bucket"):  # gloo
                    transport._send_bucket = self._timed(transport._send_bucket, "serialize")
                    undo.callback(delattr, transport, "_send_bucket")
                kept = getattr(transport, "_kept", None)  # tmpfs: the kept files' writes
                if kept is not None:
                    kept._write = self._timed(kept._write, "serialize")
                    undo.callback(delattr, kept, "_write")
            save_file = st.save_file
            st.save_file = self._timed(save_file, "serialize")
            undo.callback(setattr, st, "save_file", save_file)
            yield self

    def split(self, total: float) -> dict[str, float]:
        """The parts of a sync that took ``total`` seconds."""
        return {
            "total": total,
            "weightsync": max(0.0, total - self.serialize - self.engine),
            "plan": self.plan,
            "produce": self.produce,
            "serialize": self.serialize,
            "engine": self.engine,
        }


def timed_sync(strategy: Any, model: Any, engine: Any) -> tuple[Any, dict[str, float]]:
    """``strategy.sync(model, engine)`` (its plan, then ``execute``), with its phases."""
    from weightsync.strategies.base import execute

    phases = Phases()
    with phases.watch(engine):
        start = time.perf_counter()
        plan = strategy.plan(model, engine)
        phases.plan = time.perf_counter() - start
        report = execute(plan, engine, started=start)
        total = time.perf_counter() - start
    return report, phases.split(total)
