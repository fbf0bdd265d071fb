"""Several engines serving the same model, synced by one call: a fan-out over any engines."""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Hashable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..errors import ReplicasSplitError, WeightSyncError, untouched
from ..plan import Adapter, Bucket
from .base import CHECKPOINT, Attestation, Engine, EngineFacts, adapt
from .contract import FANOUT, FanOut, Staged


class _Abort(Exception):
    """Raised inside a replica's bucket stream when the fan-out stops part-way."""


def _held(engine: Engine, buckets: list[Bucket]) -> Staged:
    """The stage of a replica that cannot stage: the buckets held in this process."""
    return Staged(lambda: engine.load_weights(buckets))


def _staged_in(fanout: FanOut, engine: Engine, buckets: Iterable[Bucket]) -> Staged:
    """``engine.stage_weights(buckets)`` in ``fanout`` (its transport may share what it puts)."""
    token = FANOUT.set(fanout)
    try:
        return engine.stage_weights(buckets)
    finally:
        FANOUT.reset(token)


def _joined(versions: Iterable[str | None]) -> str | None:
    each = list(versions)
    return None if None in each else "|".join(str(v) for v in each)


class Replicas(Engine):
    """Several engines serving the same model, synced by one call: a fan-out.

    Every check a strategy makes (names, shapes, adapter rank and modules, sleep state) runs
    against every replica before anything is written, because this engine's facts are the
    replicas' common facts and `check_adapter` / `check_writable` ask each one.
    A sync commits on all replicas or on none. Each bucket is produced (merged, cast) once
    and handed to every replica, which *stages* it while it keeps serving (`Engine.stage_weights`:
    over tmpfs every file written and tagged, over gloo every frame received by the workers'
    stages, for a Ray actor every piece fetched from the object store and checked by the actor;
    one thread per replica, at most two buckets in flight each; Ray actors share each piece's
    put, `FanOut`); a replica that cannot
    stage (an in-process engine, a streaming transport: ``GlooTransport(stage=False)``, the
    weight-transfer API) gets the stream held in this process instead (one copy of the synced
    bytes, shared by all such replicas), loaded at the commit. Only when every replica staged
    does any commit. If producing or any stage fails, every staged copy is discarded (no file of
    the sync stays in /dev/shm), no replica was paused or written, all serve the version they
    served, and the cause is raised naming the replica (a weightsync error keeps its class,
    another becomes a `RuntimeError` with the cause chained).

    The commits then run together (one thread per replica; one after the other for replicas
    that load only after another: in-process engines share modules, see
    `Engine.loads_concurrently`). A commit can still fail (a worker error while applying, a
    server gone): if some replicas committed and others did not, `ReplicasSplitError` names
    the version each holds; a replica whose write failed part-way holds a mix, which a
    ``vllm serve`` with weightsync's middleware refuses to serve (HTTP 503) until a full
    restore. Either way every replica's base is then marked unsynced, so the next sync restores
    all of them fully. An adapter is staged too (`load_adapter`: its bytes carried to every
    replica, then loaded into each in turn); checkpoint reloads (`reload_checkpoint`) are not
    staged: they still run replica after replica.

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
        that layers are skipped only if every replica keeps unsent layers, an epoch is
        attested only if every replica attests one, and a weight any replica holds in a wider
        dtype (`EngineFacts.held`: a float32 router) travels in that one: a replica that holds
        it narrower rounds it as it would round its checkpoint's, where sent narrower the other
        would hold it rounded (a fleet mixing an older extension, or a stock server, that does
        not report it)."""
        each = [e.facts for e in self.engines]
        held: dict[str, torch.dtype] = {}
        for f in each:
            for name, dtype in f.held.items():
                wide = getattr(torch, dtype)
                held[name] = torch.promote_types(held.get(name, wide), wide)
        return dataclasses.replace(
            each[0],
            keeps_unsent_layers=all(f.keeps_unsent_layers for f in each),
            attests=all(f.attests for f in each),
            held={name: str(d).removeprefix("torch.") for name, d in held.items()},
        )

    def load_weights(self, buckets: Iterable[Bucket]) -> int:
        """Stage on every replica, then commit on every replica (see the class docstring). A
        failed stage is raised marked `errors.untouched`: no replica was paused or written."""
        try:
            staged = self._stage(buckets)
        except BaseException as error:
            untouched(error)
            raise
        try:
            return self._commit(staged)
        finally:
            for each in staged:
                each.drop()

    def _stage(self, buckets: Iterable[Bucket]) -> list[Staged]:
        """Every replica's `Engine.stage_weights`, the stream fanned out to them (a replica
        that cannot stage gets the buckets held here, once for all such replicas). If
        producing or any stage fails, every stage that succeeded is discarded and the error
        raised: nothing was applied anywhere."""
        staging = [i for i, e in enumerate(self.engines) if e.stages_weights]
        stagers = [self.engines[i] for i in staging]
        held: list[Bucket] | None = None if len(stagers) == len(self.engines) else []
        # At most two buckets in flight per staging replica.
        queues: list[queue.Queue] = [queue.Queue(maxsize=1) for _ in stagers]
        done = object()

        def stream(q: queue.Queue) -> Iterable[Bucket]:
            while (item := q.get()) is not done:
                if isinstance(item, _Abort):
                    raise item
                yield item

        fanout = FanOut()  # a Ray actor's pieces put once for all of them
        with ThreadPoolExecutor(
            max(1, len(stagers)), thread_name_prefix="weightsync-replica"
        ) as pool:
            futures = [
                pool.submit(_staged_in, fanout, e, stream(q))
                for e, q in zip(stagers, queues, strict=True)
            ]

            def put(item: Any) -> None:
                for q, f in zip(queues, futures, strict=True):
                    while not f.done():  # a replica that failed takes nothing more
                        try:
                            q.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue

            produced: BaseException | None = None
            try:
                for bucket in buckets:
                    if any(f.done() for f in futures):  # a stage failed part-way: stop all
                        break
                    put(bucket)
                    if held is not None:
                        held.append(bucket)
            except BaseException as error:  # noqa: BLE001 (raised below, after the discards)
                produced = error
                put(_Abort(f"the fan-out stopped: producing a bucket failed ({error})"))
            stopped = produced is not None or any(
                f.done() and f.exception() is not None for f in futures
            )
            put(_Abort("another replica failed to stage") if stopped else done)
        ready = [f.result() for f in futures if f.exception() is None]
        if produced is not None or len(ready) < len(futures):  # one may fail on the last bucket
            for each in ready:
                each.discard()
            errors = [(i, f.exception()) for i, f in zip(staging, futures, strict=True)]
            causes = [(i, e) for i, e in errors if e is not None and not isinstance(e, _Abort)]
            if produced is not None:
                raise produced
            index, cause = causes[0]
            assert cause is not None
            said = (
                f"replica {index} failed to stage this sync ({type(cause).__name__}: {cause}); "
                "no replica committed it (every staged copy was dropped): all serve what they "
                "served before"
            )
            if isinstance(cause, WeightSyncError):
                raise type(cause)(said) from cause
            if isinstance(cause, Exception):
                raise RuntimeError(said) from cause
            raise cause
        by_engine = dict(zip(map(id, stagers), ready, strict=True))
        return [
            by_engine[id(e)] if id(e) in by_engine else _held(e, held or []) for e in self.engines
        ]

    def _commit(self, staged: list[Staged]) -> int:
        """Apply every replica's stage: together (one thread each) where replicas load
        concurrently, one after the other where they do not. If any fails, the error names
        which replicas committed and what each holds now (`ReplicasSplitError`)."""
        results: list[int | None] = [None] * len(staged)
        errors: list[BaseException | None] = [None] * len(staged)

        def apply(i: int) -> None:
            try:
                results[i] = staged[i].apply() or 0
            except BaseException as error:  # noqa: BLE001 (collected, raised below)
                errors[i] = error

        together = [i for i, e in enumerate(self.engines) if e.loads_concurrently]
        with ThreadPoolExecutor(
            max(1, len(together)), thread_name_prefix="weightsync-replica"
        ) as pool:
            running = [pool.submit(apply, i) for i in together]
            for i, e in enumerate(self.engines):
                if not e.loads_concurrently:
                    apply(i)
            for f in running:
                f.result()
        failed = [i for i, error in enumerate(errors) if error is not None]
        if not failed:
            return sum(r or 0 for r in results)
        first = errors[failed[0]]
        assert first is not None
        self.mark_lost()  # as execute would: a caller of load_weights itself learns it too
        if len(failed) == len(staged):
            raise first
        raise ReplicasSplitError(self._split(failed, errors)) from first

    def _split(self, failed: list[int], errors: list[BaseException | None]) -> str:
        """What each replica holds after a commit that failed on ``failed`` only."""
        committed = [i for i in range(len(self.engines)) if i not in failed]

        def version(i: int) -> str:
            try:
                return repr(self.engines[i].weights_version)
            except Exception as error:  # noqa: BLE001 (a replica gone says so)
                return f"unknown ({type(error).__name__}: {error})"

        lines = [
            f"replica {i}: committed, serves the new weights (version {version(i)})"
            for i in committed
        ] + [
            f"replica {i}: its commit failed ({type(errors[i]).__name__}: {errors[i]}); it "
            f"holds its old weights, or a mix of old and new layers if its write failed "
            f"part-way (version {version(i)})"
            for i in failed
        ]
        return (
            f"Replicas: the commit failed on replica(s) {failed} after replica(s) {committed} "
            "committed, so the replicas no longer serve one version: "
            + "; ".join(lines)
            + ". A vllm serve server with weightsync's middleware refuses generation (HTTP 503) "
            "while it holds a mix. Every replica is marked lost: the next sync restores all of "
            "them fully (Syncer does it by itself)."
        )

    def check_adapter(self, adapter: Adapter) -> None:
        for e in self.engines:
            e.check_adapter(adapter)

    def load_adapter(self, adapter: Adapter) -> int:
        """Stage the adapter on every replica (`Engine.stage_adapter`: its bytes carried to
        each while all serve), then load it into each in turn. A failed stage is raised marked
        `errors.untouched`, every other stage discarded: no replica loaded it. A load failing
        after other replicas loaded it leaves the replicas on two adapters, whatever its own
        failure left: that is a `ReplicasSplitError` (never untouched), and every replica is
        marked lost."""
        staged: list[Staged] = []
        try:
            for e in self.engines:
                staged.append(e.stage_adapter(adapter))
        except BaseException as error:
            for each in staged:
                each.discard()
            untouched(error)
            raise
        calls = 0
        try:
            for i, each in enumerate(staged):
                try:
                    calls += each.apply() or 0
                except Exception as error:
                    if i == 0:
                        raise
                    self.mark_lost()
                    raise ReplicasSplitError(
                        f"Replicas: loading the adapter failed on replica {i} "
                        f"({type(error).__name__}: {error}) after replica(s) {list(range(i))} "
                        "loaded it, so the replicas no longer serve one adapter. Every replica "
                        "is marked lost: the next sync restores all of them fully (Syncer does "
                        "it by itself)."
                    ) from error
        finally:
            for each in staged:
                each.drop()
        return calls

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
        after: Attestation | None = None,
    ) -> None:
        # ``after`` is the replicas' joint attestation: each asks for its own
        for e in self.engines:
            e.remember(held, restored=restored, base=base, source=source)

    def held_base(
        self, now: Attestation | None = None
    ) -> tuple[Mapping[str, tuple] | str | None, str, str]:
        """The base *every* replica holds, by its own record: the names on which all agree,
        or the checkpoint if every replica holds its own (one stream feeds them all). Each
        replica attests for itself (``now`` is the joint attestation)."""
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
