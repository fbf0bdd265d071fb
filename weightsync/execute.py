"""Executing a plan: the one place anything is written into an engine.

A strategy decides what a sync writes (`weightsync.plan.Plan`); `execute` writes exactly that,
the same way for every strategy, after checking again that the engine may be written (it may
have slept, or been written by someone else, since the plan was made). If a write fails part-way
the engine holds a mix of old and new weights: it is marked lost (only a full restore may
follow) and the error propagates; a ``vllm serve`` with weightsync's middleware refuses to
generate from the mix meanwhile (``engines/vllm/server_lease.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from . import errors, timing
from .engines.base import Engine, adapt
from .errors import EngineChangedError
from .plan import Bucket, Plan, Weight, numel
from .trainer.tensors import buckets
from .wire import format as fmt
from .wire.scratch import private_dir


@dataclass(frozen=True)
class SyncReport:
    """What one sync did.

    Attributes:
        strategy: the strategy's name (with its mode, e.g. ``FullSync(lora=merge)``).
        reason: why it was chosen (from `weightsync.policy.choose`, or its default).
        plan: the plan that was executed (``print(report.plan)`` explains it).
        tensors: tensors written into the engine (adapter tensors included).
        bytes: bytes written into the engine, in the dtype they were sent in.
        seconds: wall time of the sync, checks included, verification excluded.
        pause_seconds: how long the engine generated nothing for its other clients because of
            this sync: from each pause to its resume, summed over the sync's writes (and over
            the engines of `Replicas`, which pause together); None for an engine the sync does
            not pause (an in-process engine, idle while the trainer syncs it).
        engine_calls: calls made into the engine (RPCs, adapter loads, reloads).
        buckets: buckets the weight stream was cut into (0 if none was streamed).
        verified_logprob_diff: mean logprob difference on the canary prompts, if verified.
        weights_version: the version the engine reports right after the sync
            (`Engine.weights_version`; set by `weightsync.Syncer`), None if it reports none.
    """

    strategy: str
    reason: str
    tensors: int
    bytes: int
    seconds: float
    engine_calls: int
    buckets: int = 0
    pause_seconds: float | None = None
    verified_logprob_diff: float | None = None
    weights_version: str | None = None
    plan: Plan | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The figures, without the plan (which holds references to the trainer's tensors)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "plan"}


@dataclass
class Tally:
    tensors: int = 0
    bytes: int = 0
    engine_calls: int = 0
    buckets: int = 0
    paused: float | None = None  # seconds the engine was paused (None: never paused)

    def heard(self, part: timing.Part, seconds: float) -> None:
        """A `timing` listener: sums the ``"pause"`` spans of the write."""
        if part == "pause":
            self.paused = (self.paused or 0.0) + seconds

    def count(self, stream: Iterable[Bucket]) -> Iterator[Bucket]:
        """Pass ``stream`` through, counting buckets, tensors and bytes as they are sent."""
        for bucket in stream:
            self.buckets += 1
            self.tensors += len(bucket)
            self.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            yield bucket


def execute(plan: Plan, engine: Engine | Any, *, started: float | None = None) -> SyncReport:
    """Write ``plan`` into ``engine``, exactly and in its order (see `Plan`).

    The sleep guard is checked again, since the engine may have slept since the plan was made.
    If a write fails part-way the error propagates and the engine holds a mix of old and new
    weights: the base must be treated as unsynced (``Syncer`` does). An engine that staged the
    write and failed before committing any of it says so (`errors.untouched`): its base stays.
    """
    engine = adapt(engine)
    now = engine.check_writable(restores_base=plan.restores_base, strategy=plan.strategy)
    if plan.skipped and now.epoch != plan.attested:
        raise EngineChangedError(
            f"{plan.strategy}: the engine's epoch moved between planning and writing (a sleep, "
            "wake, reload or weight write by someone else), so the weights the plan skips may "
            "no longer be there; nothing was written. Plan the sync again."
        )
    start = time.perf_counter() if started is None else started
    tally = Tally()
    try:
        with timing.listen(tally.heard):
            _write_plan(plan, engine, tally)
    except BaseException as error:
        if not errors.left_untouched(error):
            engine.mark_lost()  # a part-written engine holds nothing we can vouch for
        raise
    # A folder reload re-read what it holds from disk: keep no record (skipping is off once).
    # An adapter alone moves no epoch: the check above is the engine's state after it too.
    engine.remember(
        {} if plan.reload else plan.held_after,
        restored=plan.restores_base,
        base=plan.base_after,
        source=plan.strategy,
        after=None if plan.weights or plan.reload else now,
    )
    return SyncReport(
        strategy=plan.strategy,
        reason=plan.reason,
        tensors=tally.tensors,
        bytes=tally.bytes,
        seconds=time.perf_counter() - start,
        engine_calls=tally.engine_calls,
        buckets=tally.buckets,
        pause_seconds=tally.paused,
        plan=plan,
    )


def _write_plan(plan: Plan, engine: Engine, tally: Tally) -> None:
    if plan.reload == "snapshot":
        assert plan.snapshot_dir is not None
        write_snapshot(plan.weights, plan.dtype, Path(plan.snapshot_dir), plan.bucket_bytes)
        with timing.span("engine"):
            tally.engine_calls += engine.reload_checkpoint(plan.snapshot_dir)
        tally.tensors += len(plan.weights)
        tally.bytes += plan.weight_bytes
    else:
        if plan.reload == "checkpoint":
            with timing.span("engine"):
                tally.engine_calls += engine.reload_checkpoint()
            tally.tensors += len(engine.expected_weights)
            tally.bytes += _expected_bytes(engine)
        if plan.weights:
            produced = buckets(list(plan.weights), plan.dtype, plan.bucket_bytes)
            stream = tally.count(timing.spanned(produced, "produce"))
            with timing.span("engine"):
                tally.engine_calls += engine.load_weights(stream)
    if plan.adapter is not None:
        with timing.span("engine"):
            tally.engine_calls += engine.load_adapter(plan.adapter)
        tally.tensors += len(plan.adapter.tensors)
        tally.bytes += plan.adapter.nbytes


def _expected_bytes(engine: Engine) -> int:
    """Bytes of every weight the engine loads, in its dtype."""
    itemsize = torch.empty((), dtype=engine.dtype).element_size()
    return sum(numel(shape) * itemsize for shape in engine.expected_weights.values())


def write_snapshot(
    tensors: Iterable[Weight], dtype: torch.dtype, folder: Path, bucket_bytes: int
) -> None:
    """Write ``tensors`` as safetensors shards into ``folder``, replacing earlier shards.

    Raises:
        PermissionError: ``folder`` lets others than its owner in (``wire.scratch``): whoever
            can write there changes what the engine reloads. Nothing is written then.
    """
    private_dir(folder)
    for old in folder.glob("*.safetensors"):
        old.unlink()
    # A tied tensor is stored once, under its first name, as a checkpoint stores it; the
    # engine's reload sends it under its other names.
    unique: dict[int, Weight] = {}
    for t in tensors:
        unique.setdefault(t.source, t)
    for i, bucket in enumerate(buckets(list(unique.values()), dtype, bucket_bytes)):
        with timing.span("serialize"):
            fmt.write(bucket, folder / f"weights-{i:05d}.safetensors")
