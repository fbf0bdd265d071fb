"""The engine side of `RayVLLMEngine`, inside the framework's Ray actor, where vLLM runs: the
mixins the actor class inherits (`WeightsyncActor`, `AsyncWeightsyncActor`), which answer the
trainer's `RayControl` on the actor's engine, and the actor's half of the object-store stream
(``wire.stream``'s frames, each checked as it is staged while the engine serves; the commit
loads the stage). Why the cuts are where they are: docs/ray.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ....errors import BytesRejectedError, StageLostError, WeightSyncError
from ....wire import format as fmt
from ....wire import scratch
from ....wire.delta import LoadedCopies
from ....wire.protocol import EngineFacts, Outcome
from ....wire.stage import DEFAULT_STAGE_EXPIRY_S, STAGE_EXPIRY_ENV, stage_expiry_s
from ....wire.stream import Checker, Kind
from ....wire.tags import check
from ..asyncllm import AsyncLLMControl
from ..control import (
    WORKER_EXTENSION,
    Commit,
    Committed,
    Control,
    LLMControl,
    held_lora,
    run_commit,
)
from ..in_engine import model_ops
from ..in_engine.extension import check_loadable
from ..transports import TmpfsTransport

__all__ = ["AsyncWeightsyncActor", "WeightsyncActor", "actor_llm"]

#: How long one actor call may take by default (a full sync's stage of a large model is one
#: call); the actor waits as long for each piece of a stream.
TIMEOUT_S = 600.0


#: The RPC names the actor answers itself (the bytes from the object store); every other name
#: goes to vLLM's workers through ``collective_rpc`` (so none is a worker extension's name).
#: A sync's stream is staged, then committed or dropped:
STAGE = "weightsync_ray_stage"
COMMIT = "weightsync_ray_commit"
DROP_STAGE = "weightsync_ray_drop"
RECEIVE_ADAPTER = "weightsync_receive_object_adapter"
DROP_ADAPTERS = "weightsync_drop_adapters"
#: The actor's kept copies for deltas: the id of the sync they come from; drop them.
DELTA_STATE = "weightsync_delta_state"
DELTA_DROP = "weightsync_delta_drop"

#: What ``weightsync_call`` forwards to the actor's `LLMControl` (the `Control` interface).
_CONTROL_CALLS = frozenset(
    {
        "rpc",
        "commit",
        "pause",
        "resume",
        "reset_prefix_cache",
        "load_lora",
        "unload_lora",
        "generate",
        "score",
        "is_sleeping",
        "sleep",
        "wake_up",
        "label",
    }
)


def actor_llm(model: str, **options: Any) -> Any:
    """A ``vllm.LLM`` for a Ray actor that `WeightsyncActor` serves by reference: weightsync's
    worker extension, and the engine core in this process, so the bytes go from Ray's shared
    memory into the parameters with no second hop (docs/ray.md; engines whose workers are
    other processes are served through sealed RAM files instead).

    Raises:
        RuntimeError: ``VLLM_ENABLE_V1_MULTIPROCESSING`` is set to something else than ``0``.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise RuntimeError(
            "a Ray actor synced by weightsync runs vLLM's engine core in its own process: set "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 in the actor's environment"
        )
    from vllm import LLM

    return LLM(model=model, worker_extension_cls=WORKER_EXTENSION, **options)


class _EngineSide:
    """What both mixins share: the engine the actor attached, its `Control`, and the byte calls
    of `RayObjectStoreTransport` (see `WeightsyncActor`)."""

    _weightsync_engine: Any = None
    _weightsync_control: Control | None = None
    #: The engine's one worker runs in this process: the bytes go to it by reference.
    _weightsync_by_reference = False
    _weightsync_adapters: Path | None = None
    _weightsync_copies: LoadedCopies | None = None
    _weightsync_staged: _Stage | None = None
    _weightsync_weights: dict[str, tuple[int, ...]] | None = None
    #: How long a stage is held uncommitted, in seconds (`STAGE_EXPIRY_ENV`, set by
    #: ``weightsync_attach``); then it is dropped and its commit refused (`StageLostError`).
    #: An actor may set it itself; it applies to the stages that follow.
    weightsync_stage_expiry_s: float = DEFAULT_STAGE_EXPIRY_S
    _weightsync_lock: threading.Lock
    _weightsync_expiry: threading.Timer | None = None
    #: The id of the last stage let go uncommitted, and why (for its commit's error).
    _weightsync_gone: tuple[str, str] = ("", "")

    def weightsync_attach(self, engine: Any) -> None:
        """Serve ``engine``, created with weightsync's worker extension: a ``vllm.LLM`` (any
        tensor parallel size), or, in an `AsyncWeightsyncActor`, an ``AsyncLLM``.

        A stage the trainer does not commit within ``WEIGHTSYNC_STAGE_EXPIRY_S`` seconds of its
        end (the actor's environment; default `DEFAULT_STAGE_EXPIRY_S`) is dropped -- its bytes,
        its RAM files -- and its commit refused with nothing loaded: a trainer that died
        between its stage and its commit holds nothing here for longer (docs/ray.md).

        Raises:
            TypeError: ``engine`` is neither.
            ValueError: an ``AsyncLLM`` in an actor whose ``weightsync_call`` is synchronous
                (its control calls must run on the actor's event loop); ``WEIGHTSYNC_STAGE_EXPIRY_S``
                set to something else than a positive number of seconds.
        """
        ttl = stage_expiry_s()  # the workers' variable and default (``wire.gloo``)
        from vllm import LLM
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.core_client import InprocClient

        self.weightsync_stage_expiry_s = ttl
        self._weightsync_lock = threading.Lock()
        self._weightsync_engine = engine
        if isinstance(engine, AsyncLLM):
            if not isinstance(self, AsyncWeightsyncActor):
                raise ValueError(
                    "an AsyncLLM runs on the actor's event loop: the actor class inherits "
                    "weightsync.engines.vllm.ray.AsyncWeightsyncActor, not WeightsyncActor"
                )
            return  # its control is made on the actor's loop, at the first call
        if not isinstance(engine, LLM):
            raise TypeError(
                f"weightsync_attach takes a vllm.LLM or an AsyncLLM, got {type(engine).__name__}"
            )
        world = engine.llm_engine.vllm_config.parallel_config.world_size
        self._weightsync_by_reference = (
            isinstance(engine.llm_engine.engine_core, InprocClient) and world == 1
        )
        self._weightsync_control = LLMControl(engine)

    def weightsync_lora_request(self, name: str | None) -> Any:
        """The ``LoRARequest`` of the adapter version weightsync loaded under ``name`` (a name
        of the trainer's `RayVLLMEngine.resident_adapters`, or its ``served_adapter``), for the
        actor's own generations: a rollout admitted with version k's request finishes on k,
        and `RayVLLMEngine.weights_spans` of its output names k. None: ``name`` is None.

        Raises:
            AdapterError: no adapter version is loaded under ``name``.
        """
        control = self._weightsync_control
        if control is None:  # nothing synced yet: no adapter loaded
            return held_lora({}, name)
        assert isinstance(control, LLMControl | AsyncLLMControl)
        return control.lora_request(name)

    def _weightsync_serve(self, call: str, *args: Any) -> Any:
        """One `Control` call (``call`` names the method), a whole commit (``commit``, a
        ``control.Commit`` as JSON; its ``Committed`` as JSON), or a byte call of the transport
        (``rpc`` with `STAGE`, `COMMIT`, `DROP_STAGE`, `RECEIVE_ADAPTER`, `DROP_ADAPTERS`,
        `DELTA_STATE` or `DELTA_DROP`)."""
        control = self._weightsync_control
        if control is None:
            raise RuntimeError("the actor has not called weightsync_attach(engine) yet")
        if call not in _CONTROL_CALLS:
            raise ValueError(f"weightsync_call: unknown call {call!r}")
        if call == "commit":
            return self._weightsync_run_commit(control, Commit.from_json(args[0])).to_json()
        if call == "rpc":
            method, kwargs = args[0], args[1] or {}
            if method == STAGE:
                return [self._weightsync_stage_stream(**kwargs).to_json()]
            if method == COMMIT:
                try:
                    stage = self._weightsync_take(kwargs.get("stage", ""))
                except StageLostError as e:
                    return [Outcome.failed(e).to_json()]
                return [o.to_json() for o in self._weightsync_load(stage)]
            if method == DROP_STAGE:
                self._weightsync_drop_stage(kwargs.get("stage", ""), "its trainer dropped it")
                return [Outcome().to_json()]
            if method == RECEIVE_ADAPTER:
                return [self._weightsync_adapter(**kwargs).to_json()]
            if method == DROP_ADAPTERS:
                if self._weightsync_adapters is not None:
                    shutil.rmtree(self._weightsync_adapters, ignore_errors=True)
                    self._weightsync_adapters = None
                return [Outcome().to_json()]
            if method == DELTA_STATE:
                copies = self._weightsync_copies
                return [Outcome(value=None if copies is None else copies.synced).to_json()]
            if method == DELTA_DROP:
                self._weightsync_copies = None
                return [Outcome().to_json()]
        return getattr(control, call)(*args)

    def _weightsync_run_commit(self, control: Control, commit: Commit) -> Committed:
        """The whole commit in this call (`run_commit`), its rpc steps answered as the
        trainer's rpc calls are. The stage its `COMMIT` step names is taken first, before the
        pause, so its expiry cannot take it from under the commit: a commit racing the expiry
        loads the whole stage, or is refused (`StageLostError`) with the engine never paused."""
        named = [step[2] or {} for step in commit.steps if step[:2] == ("rpc", COMMIT)]
        stage = self._weightsync_take(named[0].get("stage", "")) if named else None
        serve = partial(self._weightsync_serve, "rpc")

        def rpc(method: str, kwargs: dict[str, Any] | None) -> list[Any]:
            nonlocal stage
            if method != COMMIT or stage is None:
                return serve(method, kwargs)
            taken, stage = stage, None
            return [o.to_json() for o in self._weightsync_load(taken)]

        try:
            return run_commit(control, commit, rpc=rpc)
        finally:
            if stage is not None:  # the commit failed before its load: the stage let go
                with self._weightsync_lock:
                    self._weightsync_release(stage, "its commit failed before loading it")

    def _weightsync_stage_stream(
        self, channel: Any, key: str = "", delta: str = "", stage: str = ""
    ) -> Outcome:
        """Stage the stream the trainer puts through ``channel`` (`RayObjectStoreTransport`)
        while the engine serves: every frame fetched from the object store and checked
        (``wire.stream``: its tag, its place, the END's count), every tensor checked against
        what the engine loads (`check_loadable`), and held for `_weightsync_commit`: the
        object store's bytes themselves for an engine loaded by reference, else files in a RAM
        folder on this node for its workers (`TmpfsTransport`, tagged anew; the store's bytes
        are let go). Nothing is loaded and nothing paused here; a failure drops what was
        staged (and, for a delta, the kept copies: the next sync is whole). The outcome's
        value is how many frames were staged. ``delta``: the id the kept copies
        (``wire.delta``) carry once the sync is committed; ``stage``: the id its commit names
        (the trainer's, fresh per sync). The stage is held until its commit, the next stage,
        or `weightsync_stage_expiry_s` seconds, whichever comes first."""
        # One stage at a time: an uncommitted one is abandoned (its commit refused).
        self._weightsync_drop_stage("", "another sync's stage replaced it")
        copies = None
        if delta:
            copies = self._weightsync_copies = self._weightsync_copies or LoadedCopies()
            copies.begin()
        try:
            if copies is not None and not key:
                raise BytesRejectedError("deltas need the trainer's tags: nothing was staged")
            checker = Checker(key, copies)
            refs: list[Any] = []  # held by reference: the store keeps what a reference names
            kept = refs if self._weightsync_by_reference else None
            expected = self._weightsync_expected()
            checked = _checked(_frames(channel, checker, kept), expected)
            if self._weightsync_by_reference:
                held = list(checked)  # views into the store (or into the kept copies)
                engine = self._weightsync_engine

                def load() -> list[Outcome]:
                    weights = (pair for pairs in held for pair in pairs)
                    return engine.collective_rpc(
                        model_ops.reload, kwargs={"weights": weights, "expected": expected}
                    )

                def drop() -> None:
                    held.clear()
                    refs.clear()

                staged = _Stage(load, drop, delta, checker.count, stage)
            else:
                staged = self._weightsync_stage_files(checked, delta, checker, stage)
        except Exception as e:  # noqa: BLE001 (returned to the trainer: nothing was loaded)
            if copies is not None:
                copies.clear()
            return Outcome.failed(e)
        self._weightsync_hold(staged)
        return Outcome(value=staged.frames)

    def _weightsync_stage_files(
        self,
        checked: Iterable[list[tuple[str, torch.Tensor]]],
        delta: str,
        checker: Checker,
        stage: str,
    ) -> _Stage:
        """Stage checked buckets for workers in other processes (a multiprocess engine core,
        tensor parallel workers, an ``AsyncLLM``): fresh sealed RAM files on this node
        (`TmpfsTransport.prepare`, written as the frames come, tagged anew for the workers,
        which check them before loading any), let go when the stage is dropped.

        The one copy on this side is the files' write, from views of the object store; the
        workers load views of their mappings of the files. It stays a copy: vLLM starts such
        workers itself (an ``AsyncLLM``'s engine core, its multiprocessing executor's
        workers), processes outside Ray that cannot read Ray's store, so the bytes reach them
        through memory they can map. Fresh files, not kept ones (which would keep the
        workers' mappings, one copy of the weights, in RAM between syncs): nothing of a sync
        stays on this node once it is committed or dropped."""
        control = self._weightsync_control
        assert control is not None

        def rpc(method: str, kwargs: dict[str, Any]) -> list[Outcome]:
            outcomes[:] = [Outcome.from_json(r) for r in control.rpc(method, kwargs)]
            return outcomes

        outcomes: list[Outcome] = []

        def load() -> list[Outcome]:
            try:
                staged.apply()
            except Exception as e:  # noqa: BLE001 (reaching the workers: returned as theirs)
                return outcomes if outcomes else [Outcome.failed(e)]
            return outcomes

        def drop() -> None:
            staged.drop()
            hop.close()  # nothing of the sync stays in RAM on this node

        hop = TmpfsTransport(keep=False)
        try:
            staged = hop.prepare(rpc, checked)
        except BaseException:
            hop.close()
            raise
        return _Stage(load, drop, delta, checker.count, stage)

    def _weightsync_hold(self, stage: _Stage) -> None:
        """Hold ``stage`` for its commit, for `weightsync_stage_expiry_s` seconds at most."""
        ttl = self.weightsync_stage_expiry_s
        expiry = threading.Timer(ttl, self._weightsync_expire, (stage, ttl, time.monotonic()))
        expiry.daemon = True
        with self._weightsync_lock:
            self._weightsync_staged, self._weightsync_expiry = stage, expiry
        expiry.start()

    def _weightsync_expire(self, stage: _Stage, ttl: float, since: float) -> None:
        """The expiry of ``stage``: dropped if it is still held uncommitted (a commit that
        took it first loads it whole)."""
        with self._weightsync_lock:
            if self._weightsync_staged is not stage:
                return
            self._weightsync_staged = None
            held = time.monotonic() - since
            why = f"it expired: held {held:.1f} s uncommitted, past {STAGE_EXPIRY_ENV}={ttl:g}"
            self._weightsync_release(stage, why)

    def _weightsync_take(self, stage_id: str) -> _Stage:
        """Take the stage with id ``stage_id`` ("": whichever is held) for its commit: its
        expiry can no longer drop it.

        Raises:
            StageLostError: no such stage is held (it expired, another sync's replaced it, it
                was dropped, or none was made); nothing was loaded.
        """
        with self._weightsync_lock:
            stage = self._weightsync_staged
            if stage is not None and stage_id in ("", stage.id):
                self._weightsync_staged = None
                if self._weightsync_expiry is not None:
                    self._weightsync_expiry.cancel()
                return stage
            gone, why = self._weightsync_gone
        if not stage_id or gone != stage_id:
            why = "this actor holds no stage of it (another sync's, or none)"
        raise StageLostError(
            f"the commit's stage is no longer held by this actor: {why}. Nothing was loaded; "
            "the engine serves what it did. Sync again"
        )

    def _weightsync_load(self, stage: _Stage) -> list[Outcome]:
        """Load ``stage`` (taken: `_weightsync_take`; inside the commit's pause) and let it
        go; the workers' outcomes. The kept copies of a delta sync carry its id once every
        worker loaded it, and are dropped otherwise."""
        try:
            outcomes = stage.load()
        finally:
            stage.drop()
        copies = self._weightsync_copies
        if stage.delta and copies is not None:
            if all(o.ok for o in outcomes):
                copies.commit(stage.delta, stage.frames)
            else:
                copies.clear()
        return outcomes

    def _weightsync_drop_stage(self, stage_id: str, why: str) -> None:
        """Drop the uncommitted stage with id ``stage_id`` ("": whichever is held; the
        trainer's sync failed, another replica's stage did, or the next stage replaces it)."""
        with self._weightsync_lock:
            stage = self._weightsync_staged
            if stage is None or stage_id not in ("", stage.id):
                return
            self._weightsync_staged = None
            if self._weightsync_expiry is not None:
                self._weightsync_expiry.cancel()
            self._weightsync_release(stage, why)

    def _weightsync_release(self, stage: _Stage, why: str) -> None:
        """Let an uncommitted stage go (the lock held): its bytes (and RAM files) freed, the
        kept copies it patched dropped, and ``why`` kept for its commit's error."""
        self._weightsync_gone = (stage.id, why)
        stage.drop()
        if stage.delta and self._weightsync_copies is not None:
            self._weightsync_copies.clear()

    def _weightsync_expected(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every weight the engine loads (its workers' `EngineFacts`)."""
        if self._weightsync_weights is None:
            assert self._weightsync_control is not None
            answer = Outcome.from_json(self._weightsync_control.rpc("weightsync_facts")[0])
            if not answer.ok:
                raise WeightSyncError(f"the actor's workers do not report their facts: {answer}")
            self._weightsync_weights = dict(EngineFacts.from_json(answer.value).weights)
        return self._weightsync_weights

    def _weightsync_adapter(
        self, ref: Any, version: int, config: str, key: str = "", tag: str = "", keep: int = 2
    ) -> Outcome:
        """Write an adapter version from the object store to a folder on this node, keeping the
        ``keep`` newest versions' folders; its path is the outcome's value."""
        import ray

        try:
            what = "the adapter from the object store"
            parts = _parts(ray.get(ref), what)
            if key:
                check(key, tag, what, *parts)
            if self._weightsync_adapters is None:
                self._weightsync_adapters = scratch.scratch_dir(self, "adapters")
            folder = self._weightsync_adapters / f"adapter-v{int(version):06d}"
            fmt.write_adapter(folder, _views(parts), json.loads(config))
            for old in sorted(folder.parent.glob("adapter-v*"))[: -max(2, int(keep))]:
                shutil.rmtree(old, ignore_errors=True)
        except Exception as e:  # noqa: BLE001 (returned to the trainer)
            return Outcome.failed(e)
        return Outcome(value=str(folder))


class _Stage(NamedTuple):
    """What one sync staged on the actor: ``load`` applies it (the workers' outcomes),
    ``drop`` lets its bytes go; ``delta`` the id its kept copies carry once committed ("":
    not a delta sync), ``frames`` how many frames it holds, ``id`` the id its commit names
    ("": any commit)."""

    load: Callable[[], list[Outcome]]
    drop: Callable[[], None]
    delta: str
    frames: int
    id: str


def _frames(channel: Any, checker: Checker, refs: list[Any] | None) -> Iterator[list[np.ndarray]]:
    """The payloads of the stream the trainer puts through ``channel``, each fetched from the
    object store (from another node Ray pulls it here; on this node its pieces are read-only
    views of the store, nothing copied) and checked (a delta: patched into the kept copy
    first) before it is yielded; the END's count is checked, the trainer's ABORT raised. Each
    payload's reference goes to ``refs`` (if given): the trainer lets go of its own once the
    stage is done, and Ray frees an object nobody references. The channel carries ``(kind,
    ref, tag)`` for a BUCKET or DELTA frame (its payload in the store, `stream.scattered`'s
    pieces), ``(END, count, tag)``, or ``(ABORT, why)``."""
    import ray

    while True:
        frame = channel.get(timeout=TIMEOUT_S)
        if frame[0] == Kind.ABORT:
            checker.abort(frame[1])
        if frame[0] == Kind.END:
            checker.end(frame[1], frame[2])
            return
        kind, ref, tag = frame
        if refs is not None:
            refs.append(ref)
        parts = _parts(ray.get(ref, timeout=TIMEOUT_S), f"bucket {checker.count} of the stream")
        yield checker.pieces(kind, parts, tag)


def _parts(payload: Any, what: str) -> list[np.ndarray]:
    """``payload`` as the trainer puts it: a list of byte arrays (``stream.scattered``).

    Raises:
        BytesRejectedError: it is something else (not the trainer's); nothing was loaded.
    """
    if isinstance(payload, list) and payload and all(_is_bytes(p) for p in payload):
        return payload
    raise BytesRejectedError(
        f"{what}: not a payload the trainer puts (a list of byte arrays) but "
        f"{type(payload).__name__}: nothing of it was loaded"
    )


def _is_bytes(part: Any) -> bool:
    return isinstance(part, np.ndarray) and part.dtype == np.uint8 and part.ndim == 1


def _checked(
    payloads: Iterable[list[np.ndarray]], expected: Mapping[str, tuple[int, ...]]
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Each payload's tensors (`_views`), once each is known to be a weight the engine loads,
    at its shape (`check_loadable`)."""
    for payload in payloads:
        pairs = _views(payload)
        check_loadable(pairs, expected)
        yield pairs


def _views(parts: list[np.ndarray]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a payload's pieces (``format.pieces_views``) as views into them. Ray
    hands them out read-only; the reload only reads them (it copies into the parameters), so
    torch's warning about a non-writable buffer is silenced here.

    Raises:
        BytesRejectedError: the pieces do not split the file at its tensors (checked before
            any tensor is viewed); nothing was loaded.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        try:
            return list(fmt.pieces_views(parts))
        except ValueError as e:
            raise BytesRejectedError(f"a payload's pieces are not a bucket's: {e}") from e


class WeightsyncActor(_EngineSide):
    """Mixin for a Ray actor class holding a ``vllm.LLM``: the engine side of `RayVLLMEngine`.

    ::

        @ray.remote
        class Rollout(WeightsyncActor):
            def __init__(self, checkpoint):
                self.llm = actor_llm(checkpoint, enable_lora=True)
                self.weightsync_attach(self.llm)

            def generate(self, prompts, params): ...

    Only ``weightsync_call`` is an actor method the trainer uses; it answers `Control` calls
    through an `LLMControl` on the ``LLM``, the calls of `RayObjectStoreTransport` (load
    buckets, receive an adapter, drop the adapter folders) itself, and a whole commit in one
    call (``"commit"``: `control.run_commit` here, so nothing of it waits on the trainer). With the engine core in this
    process (`actor_llm`) the bytes reach the worker by reference; otherwise (tensor parallel)
    through sealed RAM files on this node.
    """

    def weightsync_call(self, call: str, *args: Any) -> Any:
        """One call of the trainer's `RayControl` (see `_EngineSide`)."""
        return self._weightsync_serve(call, *args)


class AsyncWeightsyncActor(_EngineSide):
    """Mixin for an async Ray actor holding a vLLM ``AsyncLLM`` (SkyRL's, verl's agent loop's
    layout): the engine side of `RayVLLMEngine`.

    ::

        @ray.remote
        class Rollout(AsyncWeightsyncActor):
            def __init__(self, checkpoint):
                args = AsyncEngineArgs(checkpoint, worker_extension_cls=WORKER_EXTENSION)
                self.engine = AsyncLLM.from_engine_args(args)
                self.weightsync_attach(self.engine)

            async def generate(self, prompt, params, request_id): ...

    ``weightsync_call`` is a coroutine, so Ray runs the actor's calls on one event loop, the
    ``AsyncLLM``'s: each call runs in a worker thread (a stage is long and blocking: the
    buckets are fetched from the store, checked and written to sealed RAM files there) and the
    ``AsyncLLM`` calls it makes are scheduled back onto the loop (`AsyncLLMControl`), so the
    framework's generations go on while a sync stages, until the commit pauses them with
    ``mode="keep"`` (requests frozen, recomputed under the new weights after it): the pause
    covers the workers' load of the staged files, not the transfer. Each write
    also labels vLLM's weight version with the base version it left, so every ``RequestOutput``
    says which weights produced which tokens (``control.run_commit``, docs/async-rl.md).
    """

    async def weightsync_call(self, call: str, *args: Any) -> Any:
        """One call of the trainer's `RayControl`, in a worker thread (see the class)."""
        if self._weightsync_control is None and self._weightsync_engine is not None:
            control = AsyncLLMControl(self._weightsync_engine, loop=asyncio.get_running_loop())
            self._weightsync_control = control
        return await asyncio.to_thread(self._weightsync_serve, call, *args)
