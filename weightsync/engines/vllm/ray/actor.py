"""The engine side of `RayVLLMEngine`, inside the framework's Ray actor, where vLLM runs: the
mixins the actor class inherits (`WeightsyncActor`, `AsyncWeightsyncActor`), which answer the
trainer's `RayControl` on the actor's engine, and the actor's half of the object-store stream
(``wire.stream``'s frames, each checked before it is loaded). Why the cuts are where they are:
docs/ray.md.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import queue
import shutil
import threading
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ....errors import BytesRejectedError
from ....wire import format as fmt
from ....wire import scratch
from ....wire.delta import LoadedCopies
from ....wire.protocol import Outcome
from ....wire.stream import Checker, Kind
from ....wire.tags import check
from ..asyncllm import AsyncLLMControl
from ..control import WORKER_EXTENSION, Control, LLMControl, held_lora
from ..in_engine import model_ops
from ..transports import TmpfsTransport

__all__ = ["AsyncWeightsyncActor", "WeightsyncActor", "actor_llm"]

#: How long one actor call may take by default (a full sync of a large model is one call); the
#: actor waits as long for each piece of a stream.
TIMEOUT_S = 600.0

#: The RPC names the actor answers itself (the bytes from the object store); every other name
#: goes to vLLM's workers through ``collective_rpc``.
LOAD_STREAM = "weightsync_load_stream"
RECEIVE_ADAPTER = "weightsync_receive_object_adapter"
DROP_ADAPTERS = "weightsync_drop_adapters"
#: The actor's kept copies for deltas: the id of the sync they come from; drop them.
DELTA_STATE = "weightsync_delta_state"
DELTA_DROP = "weightsync_delta_drop"

#: What ``weightsync_call`` forwards to the actor's `LLMControl` (the `Control` interface).
_CONTROL_CALLS = frozenset(
    {
        "rpc",
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
    other processes are served through a RAM folder instead).

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

    def weightsync_attach(self, engine: Any) -> None:
        """Serve ``engine``, created with weightsync's worker extension: a ``vllm.LLM`` (any
        tensor parallel size), or, in an `AsyncWeightsyncActor`, an ``AsyncLLM``.

        Raises:
            TypeError: ``engine`` is neither.
            ValueError: an ``AsyncLLM`` in an actor whose ``weightsync_call`` is synchronous
                (its control calls must run on the actor's event loop).
        """
        from vllm import LLM
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.core_client import InprocClient

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
        """One `Control` call (``call`` names the method), or a byte call of the transport
        (``rpc`` with `LOAD_STREAM`, `RECEIVE_ADAPTER`, `DROP_ADAPTERS`, `DELTA_STATE` or
        `DELTA_DROP`)."""
        control = self._weightsync_control
        if control is None:
            raise RuntimeError("the actor has not called weightsync_attach(engine) yet")
        if call not in _CONTROL_CALLS:
            raise ValueError(f"weightsync_call: unknown call {call!r}")
        if call == "rpc":
            method, kwargs = args[0], args[1] or {}
            if method == LOAD_STREAM:
                return [o.to_json() for o in self._weightsync_load(**kwargs)]
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

    def _weightsync_load(self, channel: Any, key: str = "", delta: str = "") -> list[Outcome]:
        """Load the buckets the trainer streams through ``channel`` (`RayObjectStoreTransport`),
        each checked before it is loaded; the workers' outcomes. The first bucket is fetched and
        checked before the engine is touched, so a stream refused at its start leaves the
        engine as it was. ``delta``: the id the sync leaves in the kept copies (``wire.delta``),
        which any failure drops."""
        copies = None
        if delta:
            copies = self._weightsync_copies = self._weightsync_copies or LoadedCopies()
            copies.begin()
        incoming = None
        try:
            incoming = _Incoming(channel, key, copies)
            stream = iter(incoming)
            head = list(itertools.islice(stream, 1))
        except Exception as e:  # noqa: BLE001 (returned to the trainer as every worker's)
            outcomes = [Outcome.failed(e)]
        else:
            payloads = itertools.chain(head, stream)
            if self._weightsync_by_reference:
                engine = self._weightsync_engine
                outcomes = engine.collective_rpc(
                    model_ops.reload, kwargs={"weights": _views(payloads)}
                )
            else:
                outcomes = self._weightsync_hand_over(payloads)
        finally:
            if incoming is not None:
                incoming.close()
        if copies is not None:
            if incoming is not None and all(o.ok for o in outcomes):
                copies.commit(delta, incoming.count)
            else:
                copies.clear()
        return outcomes

    def _weightsync_hand_over(self, payloads: Iterable[Any]) -> list[Outcome]:
        """Load checked buckets into workers in other processes (a multiprocess engine core,
        tensor parallel workers, an ``AsyncLLM``): files in a RAM folder on this node
        (`TmpfsTransport`, a fresh folder per sync, removed after it), tagged anew for the
        workers, which check them before loading any."""
        assert self._weightsync_control is not None
        control = self._weightsync_control
        outcomes: list[Outcome] = []

        def rpc(method: str, kwargs: dict[str, Any]) -> list[Outcome]:
            outcomes[:] = [Outcome.from_json(r) for r in control.rpc(method, kwargs)]
            return outcomes

        hop = TmpfsTransport(keep=False)
        try:
            hop.send(rpc, (list(_views([p])) for p in payloads))
        except Exception as e:  # noqa: BLE001 (writing the files or reaching the workers)
            return [Outcome.failed(e)]
        finally:
            hop.close()  # nothing of the sync stays in RAM on this node
        return outcomes

    def _weightsync_adapter(
        self, ref: Any, version: int, config: str, key: str = "", tag: str = "", keep: int = 2
    ) -> Outcome:
        """Write an adapter version from the object store to a folder on this node, keeping the
        ``keep`` newest versions' folders; its path is the outcome's value."""
        import ray

        try:
            payload = ray.get(ref)
            if key:
                check(key, tag, "the adapter from the object store", payload)
            if self._weightsync_adapters is None:
                self._weightsync_adapters = scratch.scratch_dir(self, "adapters")
            folder = self._weightsync_adapters / f"adapter-v{int(version):06d}"
            fmt.write_adapter(folder, list(_views([payload])), json.loads(config))
            for old in sorted(folder.parent.glob("adapter-v*"))[: -max(2, int(keep))]:
                shutil.rmtree(old, ignore_errors=True)
        except Exception as e:  # noqa: BLE001 (returned to the trainer)
            return Outcome.failed(e)
        return Outcome(value=str(folder))


def _views(payloads: Iterable[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of every payload as views into the object store's memory. Ray hands the
    payload out read-only; the reload only reads it (it copies into the parameters), so torch's
    warning about a non-writable buffer is silenced here."""
    for payload in payloads:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            pairs = list(fmt.views(payload))
        yield from pairs


class _Incoming:
    """The actor's half of a sync's stream (``wire.stream``: its frames, each checked by a
    `Checker`). A thread takes each frame from the trainer's channel, fetches its payload from
    the object store (from another node Ray pulls it here) while the reload loads the one
    before, and checks it (a delta: patched into the kept copy first); iterating yields the
    checked payloads in order and raises what the thread raised. At most ``AHEAD`` payloads wait
    fetched, so the actor's node holds little more than the bucket being loaded.

    The channel carries ``(kind, ref, tag)`` for a BUCKET or DELTA frame (its payload in the
    store), ``(END, count, tag)``, or ``(ABORT, why)``."""

    AHEAD = 2

    def __init__(self, channel: Any, key: str, copies: LoadedCopies | None) -> None:
        if copies is not None and not key:
            raise BytesRejectedError("deltas need the trainer's tags: nothing was loaded")
        self.channel = channel
        self.checker = Checker(key, copies)
        self.count = 0
        self._ready: queue.Queue[Any] = queue.Queue(maxsize=self.AHEAD)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fetch, name="weightsync-fetch", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[Any]:
        while True:
            item = self._ready.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            self.count += 1
            yield item

    def close(self) -> None:
        """Stop the thread (the reload may stop before the stream ends)."""
        self._stop.set()
        self._thread.join(timeout=TIMEOUT_S)

    def _fetch(self) -> None:
        try:
            for payload in self._payloads():
                self._hand(payload)
            self._hand(_DONE)
        except BaseException as e:  # noqa: BLE001 (raised in the reload's thread)
            self._hand(e)

    def _hand(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _payloads(self) -> Iterator[Any]:
        import ray

        while not self._stop.is_set():
            frame = self.channel.get(timeout=TIMEOUT_S)
            if frame[0] == Kind.ABORT:
                self.checker.abort(frame[1])
            if frame[0] == Kind.END:
                self.checker.end(frame[1], frame[2])
                return
            kind, ref, tag = frame
            yield self.checker.bucket(kind, ray.get(ref, timeout=TIMEOUT_S), tag)


_DONE = object()


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
    through an `LLMControl` on the ``LLM``, and the calls of `RayObjectStoreTransport` (load
    buckets, receive an adapter, drop the adapter folders) itself. With the engine core in this
    process (`actor_llm`) the bytes reach the worker by reference; otherwise (tensor parallel)
    through a RAM folder on this node.
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
    ``AsyncLLM``'s: each call runs in a worker thread (a sync is long and blocking: the
    buckets are fetched from the store, checked and written to a RAM folder there) and the
    ``AsyncLLM`` calls it makes are scheduled back onto the loop (`AsyncLLMControl`), so the
    framework's generations go on while a sync runs, until the write pauses them with
    ``mode="keep"`` (requests frozen, recomputed under the new weights after it). Each write
    also labels vLLM's weight version with the base version it left, so every ``RequestOutput``
    says which weights produced which tokens (``RemoteVLLMEngine._written``, docs/async-rl.md).
    """

    async def weightsync_call(self, call: str, *args: Any) -> Any:
        """One call of the trainer's `RayControl`, in a worker thread (see the class)."""
        if self._weightsync_control is None and self._weightsync_engine is not None:
            control = AsyncLLMControl(self._weightsync_engine, loop=asyncio.get_running_loop())
            self._weightsync_control = control
        return await asyncio.to_thread(self._weightsync_serve, call, *args)
