"""Several engines serving the same model, synced by one call: a fan-out over any engines."""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Hashable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import WeightSyncError
from ..plan import Adapter, Bucket
from .base import CHECKPOINT, Attestation, Engine, EngineFacts, adapt


class _Abort(Exception):
    """Raised inside a replica's bucket stream when the fan-out stops part-way."""


def _joined(versions: Iterable[str | None]) -> str | None:
    each = list(versions)
    return None if None in each else "|".join(str(v) for v in each)


class Replicas(Engine):
    """Several engines serving the same model, synced by one call: a fan-out.

    Every check a strategy makes (names, shapes, adapter rank and modules, sleep state) runs
    against every replica before anything is written, because this engine's facts are the
    replicas' common facts and `check_adapter` / `check_writable` ask each one.
    Each bucket is produced (merged, cast) once and handed to every replica: one thread per
    replica consumes it, at most two buckets in flight (the whole stream, for a replica that loads
    only after another: in-process engines share modules, see `Engine.loads_concurrently`). If producing fails, or any replica fails,
    the others are stopped part-way and recover as on any failed write (their base is marked
    unsynced), and the first error is raised.

    Args:
        engines: the replicas (any `Engine`, or raw engines that
            `adapt` accepts); they must agree on dtype, expected
            weights, tied names and whether they serve LoRA.
    """

    name = "replicas"

    def __init__(self, engines: Iterable[Any]) -> None:
        super().__init__()
        self.engines = [adapt(e) for e in engines]
        if not self.engines:
            raise ValueError("Replicas needs at least one engine")
        first = self.engines[0].facts
        for i, e in enumerate(self.engines[1:], 1):
            for fact in ("dtype", "weights", "tied"):
                if getattr(e.facts, fact) != getattr(first, fact):
                    raise ValueError(
                        f"replica {i} differs from replica 0 in {fact}: they do not serve the same "
                        "model the same way, so one sync cannot fit both; sync them apart"
                    )
            if (e.facts.lora is None) != (first.lora is None):
                raise ValueError(
                    f"replica {i} differs from replica 0 in whether it serves LoRA: one sync "
                    "cannot fit both; sync them apart"
                )

    @property
    def facts(self) -> EngineFacts:
        """Replica 0's facts (every replica's agree on what a plan is checked against), except
        that layers are skipped only if every replica keeps unsent layers, and an epoch is
        attested only if every replica attests one."""
        each = [e.facts for e in self.engines]
        return dataclasses.replace(
            each[0],
            keeps_unsent_layers=all(f.keeps_unsent_layers for f in each),
            attests=all(f.attests for f in each),
        )

    def load_weights(self, buckets: Iterable[Bucket]) -> int:
        # At most two buckets in flight per replica; a replica that loads only after another
        # has (loads_concurrently False) gets the stream buffered, or the fan-out would wait on
        # it while the other waits for the next bucket.
        queues: list[queue.Queue] = [
            queue.Queue(maxsize=1 if e.loads_concurrently else 0) for e in self.engines
        ]
        done = object()

        def stream(q: queue.Queue) -> Iterable[Bucket]:
            while (item := q.get()) is not done:
                if isinstance(item, _Abort):
                    raise item
                yield item

        with ThreadPoolExecutor(len(self.engines), thread_name_prefix="weightsync-replica") as pool:
            futures = [
                pool.submit(e.load_weights, stream(q))
                for e, q in zip(self.engines, queues, strict=True)
            ]

            def put(item: Any) -> None:
                for q, f in zip(queues, futures, strict=True):
                    while not f.done():  # a replica that failed takes nothing more
                        try:
                            q.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue

            try:
                for bucket in buckets:
                    if any(f.done() for f in futures):  # a replica failed part-way: stop all
                        break
                    put(bucket)
            except BaseException as error:
                put(_Abort(f"the fan-out stopped: producing a bucket failed ({error})"))
                raise
            failed = [f for f in futures if f.done() and f.exception() is not None]
            put(_Abort("another replica failed") if failed else done)
            errors = [e for e in (f.exception() for f in futures) if e is not None]
        if errors:  # the cause, not a replica the fan-out stopped because of it
            raise min(errors, key=lambda e: isinstance(e, _Abort))
        return sum(f.result() for f in futures)

    def check_adapter(self, adapter: Adapter) -> None:
        for e in self.engines:
            e.check_adapter(adapter)

    def load_adapter(self, adapter: Adapter) -> int:
        return sum(e.load_adapter(adapter) for e in self.engines)

    def reload_checkpoint(self, path: str | None = None) -> int:
        return sum(e.reload_checkpoint(path) for e in self.engines)

    def greedy_batch(
        self, prompts: list[list[int]], max_tokens: int
    ) -> list[tuple[list[int], list[float]]]:
        """Replica 0's results, after checking every replica generates the same tokens."""
        results = [e.greedy_batch(prompts, max_tokens) for e in self.engines]
        for i, other in enumerate(results[1:], 1):
            if [t for t, _ in other] != [t for t, _ in results[0]]:
                raise RuntimeError(
                    f"replica {i} generates other tokens than replica 0: out of sync"
                )
        return results[0]

    def score_batch(self, prompts: list[list[int]], top_k: int) -> list[list[dict[int, float]]]:
        """Replica 0's prompt logprobs (verification then checks replica 0 thoroughly;
        `greedy_batch` checks that every replica agrees with it)."""
        return self.engines[0].score_batch(prompts, top_k)

    @property
    def weights_version(self) -> str | None:
        """Every replica's version, in order (``|``-joined); None if any reports none."""
        return _joined(e.weights_version for e in self.engines)

    @property
    def written_version(self) -> str | None:
        """Every replica's `Engine.written_version`, joined like `weights_version`."""
        return _joined(e.written_version for e in self.engines)

    # --- lifecycle: each replica attests and keeps its own record; this one combines them --

    def attest(self) -> Attestation:
        """Every replica's own attestation (its harm since *its* last restore): the epoch is
        all of theirs (None if any cannot attest), asleep their union, harm the worst."""
        each = [e.attest() for e in self.engines]
        epochs = tuple(a.epoch for a in each)
        return Attestation(
            epoch=None if None in epochs else epochs,
            asleep=frozenset().union(*(a.asleep for a in each)),
            harm=max(a.harm for a in each),
            adapters=sum(a.adapters for a in each),
        )

    def check_writable(self, *, restores_base: bool, strategy: str) -> Attestation:
        for i, e in enumerate(self.engines):
            try:
                e.check_writable(restores_base=restores_base, strategy=strategy)
            except WeightSyncError as err:
                raise type(err)(f"replica {i}: {err}") from err
        return self.attest()

    def skippable(self) -> tuple[Mapping[str, tuple], Hashable | None, str]:
        """What *every* replica still holds, by its own record and epoch: a weight is skipped
        only if each replica attests it (one stream feeds them all)."""
        records = []
        for i, e in enumerate(self.engines):
            record, _, why_not = e.skippable()
            if not record:
                return {}, None, f"replica {i}: {why_not}"
            records.append(record)
        common = {k: v for k, v in records[0].items() if all(r.get(k) == v for r in records[1:])}
        return common, self.attest().epoch, ""

    def remember(
        self,
        held: Mapping[str, tuple],
        *,
        restored: bool,
        base: Mapping[str, tuple] | None = None,
        source: str = "",
    ) -> None:
        for e in self.engines:
            e.remember(held, restored=restored, base=base, source=source)

    def held_base(self) -> tuple[Mapping[str, tuple] | str | None, str, str]:
        """The base *every* replica holds, by its own record: the names on which all agree,
        or the checkpoint if every replica holds its own (one stream feeds them all)."""
        each = [e.held_base() for e in self.engines]
        for i, (held, _, why) in enumerate(each):
            if held is None:
                return None, "", f"replica {i}: {why}"
        if all(held == CHECKPOINT for held, _, _ in each):
            return CHECKPOINT, "", ""
        if any(held == CHECKPOINT for held, _, _ in each):
            return (
                None,
                "",
                "some replicas hold their own checkpoint, others a base weightsync wrote",
            )
        first = each[0][0]
        assert isinstance(first, Mapping)
        common = {
            k: v
            for k, v in first.items()
            if all(isinstance(h, Mapping) and h.get(k) == v for h, _, _ in each[1:])
        }
        return common, each[0][1], ""

    def forget(self) -> None:
        for e in self.engines:
            e.forget()

    def mark_lost(self) -> None:
        for e in self.engines:
            e.mark_lost()

    def mark_asleep(self, level: int) -> None:
        for e in self.engines:
            e.mark_asleep(level)

    def mark_awake(self, tags: list[str] | None = None) -> None:
        for e in self.engines:
            e.mark_awake(tags)

    def _engine_sleep(self, level: int) -> None:
        for e in self.engines:
            e.sleep(level)

    def _engine_wake(self, tags: list[str] | None) -> None:
        for e in self.engines:
            e.wake_up(tags)
