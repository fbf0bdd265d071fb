"""vLLM inside a Ray actor, synced from a trainer anywhere in the Ray cluster.

Both halves live here, like vLLM's own ``vllm/distributed/weight_transfer/`` backends:

- **engine side**, inside the framework's actor: `WeightsyncActor`, a mixin the actor class
  inherits. The actor creates its ``vllm.LLM`` with weightsync's worker extension (best with the
  engine core in its own process: `actor_llm` does both), and calls
  ``self.weightsync_attach(llm)``. The mixin adds one actor method, ``weightsync_call``,
  through which the trainer reaches the engine; the actor's own methods (its ``generate``) are
  untouched. An async actor holding an ``AsyncLLM`` inherits `AsyncWeightsyncActor` instead:
  its ``weightsync_call`` is a coroutine, the engine driven by `AsyncLLMControl` on the
  actor's event loop.
- **trainer side**: `RayVLLMEngine(actor)`, an `Engine` over the actor's handle, which
  ``Syncer``, ``policy``, every strategy and ``Replicas`` take like any engine (``adapt`` takes
  the raw handle too once this module is imported).

Where the cut is, and why. `RayVLLMEngine` *is* `RemoteVLLMEngine` (``engines/vllm/remote.py``)
with two new halves: `RayControl`, which forwards each `Control` call to the actor (where an
`LLMControl`, or an `AsyncLLMControl`, makes it on the actor's engine), and
`RayObjectStoreTransport` for the bytes.
Everything that makes a sync exact is then the code every out-of-process engine already runs:
the facts and the epoch come from the workers (``weightsync_facts``, ``weightsync_attest``: the
worker ledger, ``in_engine/ledger.py``), not from anything kept on the trainer's side; writes
recover part-way failures inside the worker (``model_ops.reload``) and mark the base lost; an
adapter is checked, versioned and swapped as for a server. Cutting at the `Engine` interface
instead (an in-process `VLLMEngine` in the actor, its calls forwarded) would have put a second
`Engine` -- a second record of what the engine holds, a second guard -- in the actor, and every
`Engine` method would need a forwarder; a `Control` has eleven small calls and no state.

Why the engine core runs in the actor's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` inside the
actor, which `actor_llm` sets): the worker then lives in the process that reads the object
store, so the bytes go from Ray's shared memory straight into vLLM's parameters, by reference
through ``collective_rpc(model_ops.reload, ...)`` -- no second hop through tmpfs or vLLM's
message queue. The actor is busy while its ``LLM`` generates anyway (a synchronous ``LLM``), and
Ray runs one actor call at a time, so no request is in flight while the trainer writes. An
engine whose workers run in other processes (tensor parallel, a multiprocess engine core, every
``AsyncLLM``) gets the same checked buckets through one more hop on the actor's own node: a
`TmpfsTransport` from the actor to its workers (a fresh RAM folder per sync, tagged anew,
removed after it); the object store still carries every byte between nodes.

Bytes: through Ray's object store, nothing of weightsync's own between nodes, streamed. Each
piece (a strategy's bucket cut into pieces of at most ``piece_bytes``) is packed once into a
safetensors payload (``wire.format.pack``, the one writer), tagged (``wire.tags``), ``ray.put``,
and its reference sent through the sync's *channel*, a Ray queue on the trainer's node; the
actor's load call, started first, takes each reference from the channel and a thread of it
fetches the payload (on the trainer's node a read-only view of the shared memory, no copy; on
another node Ray pulls it into that node's store) and checks its tag while the reload loads the
piece before, then streams the tensors as views (``wire.format.views``, the one reader) into
vLLM's layerwise reload. So the trainer's packing, Ray's transfer and the actor's reload
overlap. The key travels in the load call's arguments, the control path; each tag beside its
reference, its number the piece's place in the stream; the stream's end carries the tagged
count, so a piece dropped or replayed is refused too. Why a channel: a synchronous actor runs
one call at a time, so the pieces cannot arrive as calls of their own while the load call
runs, and splitting the load into calls would let the framework's own calls (a ``generate``)
run between them, on a half-loaded model; a Ray queue is Ray's own way to hand a running call
more references. Failure is as for a gloo stream: a piece refused, or a trainer that fails
producing one (its channel then says so), stops the reload part-way; the worker gives every
unfinished layer its old tensors back (``model_ops.reload``) and the engine is marked unsynced,
so only a full sync may follow; the first piece is checked before the engine is touched.
Adapters travel as one payload and are written to a folder on the actor's node (its LoRA
loader reads from a folder), the two newest versions kept.

Deltas (``RayObjectStoreTransport(delta=True)``, ``wire.delta``): a bucket whose base the actor
holds is put as the changed words only; the actor patches its kept copy, checks the whole
piece's tag on the result before loading it, and loads the whole patched piece. The
actor keeps its own writable copy of every bucket (the store's buffers are read-only and
released after the call): one copy of the weights in the actor and one in the trainer between
syncs, and a full sync copies each bucket once more in the actor.

Deadlines: every actor call waits at most ``timeout_s``. An actor that died (killed, its node
lost) or did not answer in time raises `EngineUnavailableError`, never a Ray error; an error the
actor's code raised is raised as itself.

Security (docs/security.md): Ray itself authenticates nobody by default -- whoever reaches the
cluster can call the actor. The tags make sure the bytes loaded are those the caller of
``weightsync_call`` put, with a key fresh per sync.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import queue
import shutil
import threading
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import timing
from ..engines.base import register
from ..engines.vllm.asyncllm import AsyncLLMControl
from ..engines.vllm.control import WORKER_EXTENSION, Control, LLMControl
from ..engines.vllm.in_engine import model_ops
from ..engines.vllm.remote import RemoteVLLMEngine
from ..engines.vllm.transports import Rpc, TmpfsTransport, Transport
from ..errors import BytesRejectedError, EngineUnavailableError, WeightSyncError
from ..plan import Bucket
from ..wire import format as fmt
from ..wire import scratch
from ..wire.delta import Delta, LoadedCopies, SentCopies, WireCount
from ..wire.protocol import Outcome
from ..wire.tags import Signer, check

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncWeightsyncActor",
    "RayControl",
    "RayObjectStoreTransport",
    "RayVLLMEngine",
    "WeightsyncActor",
    "actor_llm",
]

#: How long one actor call may take by default (a full sync of a large model is one call).
TIMEOUT_S = 600.0

#: The most bytes of one streamed payload (`RayObjectStoreTransport`'s ``piece_bytes``).
PIECE_BYTES = 64 << 20

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


# --- engine side: inside the framework's actor ---------------------------------------------------


def actor_llm(model: str, **options: Any) -> Any:
    """A ``vllm.LLM`` for a Ray actor that `WeightsyncActor` serves by reference: weightsync's
    worker extension, and the engine core in this process (see the module docstring for why;
    engines whose workers are other processes are served through a RAM folder instead).

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
                    "weightsync.integrations.ray.AsyncWeightsyncActor, not WeightsyncActor"
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
        if call == "label":  # only an AsyncLLM labels its outputs with a weight version
            label = getattr(control, "label", None)
            return None if label is None else label(*args)
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
        self, ref: Any, version: int, config: str, key: str = "", tag: str = ""
    ) -> Outcome:
        """Write an adapter version from the object store to a folder on this node; its path
        is the outcome's value."""
        import ray

        try:
            payload = ray.get(ref)
            if key:
                check(key, tag, "the adapter from the object store", payload)
            if self._weightsync_adapters is None:
                self._weightsync_adapters = scratch.scratch_dir(self, "adapters")
            folder = self._weightsync_adapters / f"adapter-v{int(version):06d}"
            fmt.write_adapter(folder, list(_views([payload])), json.loads(config))
            for old in sorted(folder.parent.glob("adapter-v*"))[:-2]:
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


#: The entries of a sync's stream (`RayObjectStoreTransport` puts them in its channel):
#: ``(BUCKET, ref, tag, is_delta)``, then ``(END, count, tag)`` or ``(ABORT, why)``.
BUCKET, END, ABORT = "bucket", "end", "abort"


def end_bytes(count: int) -> bytes:
    """What the tag of a stream's END entry covers: how many buckets came, so a stream cut
    short (an entry dropped, the END forged) is refused."""
    return f"weightsync-end:{count}".encode()


class _Incoming:
    """The actor's half of a sync's stream. A thread takes each entry from the trainer's
    channel, fetches its payload from the object store (from another node Ray pulls it here)
    while the reload loads the one before, patches the kept copy if it is a delta, and checks
    it against its tag (its number: the entry's place in the stream); iterating yields the
    checked payloads in order and raises what the thread raised. At most ``AHEAD`` payloads wait
    fetched, so the actor's node holds little more than the bucket being loaded."""

    AHEAD = 2

    def __init__(self, channel: Any, key: str, copies: LoadedCopies | None) -> None:
        if copies is not None and not key:
            raise BytesRejectedError("deltas need the trainer's tags: nothing was loaded")
        self.channel, self.key, self.copies = channel, key, copies
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

        index = 0
        while not self._stop.is_set():
            entry = self.channel.get(timeout=TIMEOUT_S)
            if entry[0] == ABORT:
                raise WeightSyncError(f"the trainer stopped the sync part-way: {entry[1]}")
            if entry[0] == END:
                if self.key:
                    check(self.key, entry[2], "the stream's end", end_bytes(entry[1]), expect=index)
                if entry[1] != index:
                    raise BytesRejectedError(
                        f"the stream ended after {index} of {entry[1]} buckets"
                    )
                return
            _, ref, tag, is_delta = entry
            yield self._checked(index, ray.get(ref, timeout=TIMEOUT_S), tag, is_delta)
            index += 1

    def _checked(self, index: int, payload: Any, tag: str, is_delta: bool) -> Any:
        what, copies = f"bucket {index} from the object store", self.copies
        if is_delta:
            if copies is None:
                raise BytesRejectedError(f"{what}: a delta, but no copies are kept here")
            payload = copies.patch(index, Delta.from_bytes(payload))
            check(self.key, tag, f"{what} (a delta)", payload, expect=index)
            copies.loaded(index, tag)
            return payload
        if self.key:
            check(self.key, tag, what, payload, expect=index)
        if copies is not None:
            payload = np.array(payload, copy=True)  # the store's buffer is read-only
            copies.keep(index, payload, tag)
        return payload


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
    also labels vLLM's weight version, so every ``RequestOutput`` says which weights produced
    which tokens (``engines/vllm/asyncllm.py``).
    """

    async def weightsync_call(self, call: str, *args: Any) -> Any:
        """One call of the trainer's `RayControl`, in a worker thread (see the class)."""
        if self._weightsync_control is None and self._weightsync_engine is not None:
            control = AsyncLLMControl(self._weightsync_engine, loop=asyncio.get_running_loop())
            self._weightsync_control = control
        return await asyncio.to_thread(self._weightsync_serve, call, *args)


# --- trainer side -------------------------------------------------------------------------------


class RayControl(Control):
    """The `Control` calls made on a `WeightsyncActor` through its handle, each with a
    deadline.

    Args:
        actor: the handle of an actor whose class inherits `WeightsyncActor`.
        timeout_s: how long one call may take.

    Every call raises `EngineUnavailableError` when the actor is dead (killed, its node lost)
    or does not answer within ``timeout_s``; an error the actor's code raised is raised as
    itself (Ray's wrapper is taken off)."""

    def __init__(self, actor: Any, *, timeout_s: float = TIMEOUT_S) -> None:
        self.actor = actor
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"the Ray actor {self.actor!r}"  # Actor(<class>, <actor id>)

    def call(self, call: str, *args: Any) -> Any:
        """``weightsync_call(call, *args)`` on the actor, within the deadline."""
        import ray
        from ray import exceptions as rex

        try:
            return ray.get(self.actor.weightsync_call.remote(call, *args), timeout=self.timeout_s)
        except rex.RayTaskError as err:
            raise err.as_instanceof_cause() from None
        except rex.GetTimeoutError as err:
            raise EngineUnavailableError(
                f"{self!r} did not answer {call} within {self.timeout_s:g} s: it is hung, "
                "overloaded or busy with a long call; nothing more was sent to it"
            ) from err
        except rex.RayError as err:  # the actor died, its node is gone, its objects are lost
            raise EngineUnavailableError(
                f"{self!r} does not answer ({call}): {type(err).__name__}: {err}. The actor is "
                "gone; create a new one (and a new engine adapter for it)"
            ) from err

    def rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        return list(self.call("rpc", method, kwargs))

    def pause(self) -> None:
        self.call("pause")

    def resume(self) -> None:
        self.call("resume")

    def reset_prefix_cache(self) -> None:
        self.call("reset_prefix_cache")

    def load_lora(self, name: str, path: str) -> None:
        self.call("load_lora", name, path)

    def unload_lora(self, name: str) -> None:
        self.call("unload_lora", name)

    def generate(
        self, prompts: list[list[int]], max_tokens: int, lora: str | None
    ) -> list[tuple[list[int], list[float]]]:
        return list(self.call("generate", prompts, max_tokens, lora))

    def score(
        self, prompts: list[list[int]], top_k: int, lora: str | None
    ) -> list[list[dict[int, float]]]:
        return list(self.call("score", prompts, top_k, lora))

    def is_sleeping(self) -> bool:
        return bool(self.call("is_sleeping"))

    def sleep(self, level: int) -> None:
        self.call("sleep", level)

    def wake_up(self, tags: list[str] | None) -> None:
        self.call("wake_up", tags)

    def label(self, version: str) -> None:
        """Give an ``AsyncLLM`` in the actor ``version`` as vLLM's weight-version label of
        the tokens generated next (`AsyncLLMControl.label`); an ``LLM`` has none."""
        self.call("label", version)


class RayObjectStoreTransport(Transport):
    """Buckets through Ray's object store, streamed (see the module docstring): each piece
    packed and tagged here, ``ray.put``, its reference sent through a channel to the actor's
    load call, which fetches, checks and loads it while this side packs the next.

    Args:
        tagged: tag every piece (``wire.tags``); the actor checks each before loading it, and
            the stream's end (how many came).
        delta: put only the changed words of a piece whose base the actor holds (see the
            module docstring and ``wire.delta``); needs ``tagged``.
        piece_bytes: the most bytes one payload carries (a strategy's bucket is cut into
            pieces of whole tensors; a larger tensor travels alone): the grain at which
            packing here, Ray's transfer and the actor's reload overlap.

    Raises:
        ValueError: ``delta`` without ``tagged``; ``piece_bytes`` not positive.
    """

    name = "ray"

    def __init__(
        self, *, tagged: bool = True, delta: bool = False, piece_bytes: int = PIECE_BYTES
    ) -> None:
        if delta and not tagged:
            raise ValueError(
                "RayObjectStoreTransport(delta=True) needs tagged=True: a patched bucket is "
                "proven byte-identical to the whole one by the whole bucket's tag"
            )
        if piece_bytes <= 0:
            raise ValueError(f"piece_bytes must be positive, got {piece_bytes}")
        self.tagged = tagged
        self.piece_bytes = piece_bytes
        self._copies = SentCopies() if delta else None
        self._rpc: Rpc | None = None
        self._channel: Any = None

    @property
    def last_sync(self) -> WireCount | None:
        """What the last send put in the store (delta transports only)."""
        return None if self._copies is None else self._copies.last

    def connect(self, rpc: Rpc, world_size: int) -> None:
        self._rpc = rpc

    def send(self, rpc: Rpc, buckets: Iterable[Bucket]) -> None:
        """Stream the pieces of ``buckets``: the actor's load call starts first (in a thread
        here) and loads each piece as it comes. A piece the trainer fails to produce, or an
        actor that stops early, ends the stream with the first error raised here; the actor
        then abandons its reload as on any failed write (docs/failure-modes.md)."""
        signer = Signer() if self.tagged else None
        copies = self._copies
        sync_id = ""
        if copies is not None:
            sync_id = copies.begin([o.value for o in rpc(DELTA_STATE, {})])
        try:
            self._stream(rpc, _pieces(buckets, self.piece_bytes), signer, sync_id)
        except BaseException:
            if copies is not None:
                copies.reset()
            raise
        if copies is not None:
            copies.commit()

    def _stream(
        self, rpc: Rpc, pieces: Iterable[Bucket], signer: Signer | None, sync_id: str
    ) -> None:
        import ray

        channel = self._open_channel()
        start = {"channel": channel, "key": signer.key_hex if signer else "", "delta": sync_id}
        refs: list[Any] = []  # held until the actor has loaded them
        with ThreadPoolExecutor(1, thread_name_prefix="weightsync-ray-load") as pool:
            loading = pool.submit(rpc, LOAD_STREAM, start)
            try:
                for piece in pieces:
                    if loading.done():
                        break  # the actor stopped early: its error is raised below
                    with timing.span("serialize"):
                        data, tag, is_delta = self._payload(piece, signer)
                        refs.append(ray.put(data))
                    _put(channel, (BUCKET, refs[-1], tag, is_delta))
                else:
                    end = signer.sign(end_bytes(len(refs))) if signer else ""
                    _put(channel, (END, len(refs), end))
            except BaseException as error:
                self._channel = None  # its leftovers must not meet the next sync
                try:
                    _put(channel, (ABORT, f"{type(error).__name__}: {error}"))
                    loading.exception()  # the actor's reload abandoned; the trainer's error wins
                finally:
                    _shut(channel)
                raise
            try:
                loading.result()
            except BaseException:
                self._channel = None
                _shut(channel)
                raise

    def _payload(self, piece: Bucket, signer: Signer | None) -> tuple[Any, str, bool]:
        """One piece's payload (or its delta), its tag, whether it is a delta."""
        if self._copies is not None:
            assert signer is not None  # checked in __init__
            payload, tag, delta = self._copies.next(piece, signer.sign)
            # put copies the payload into the store: the kept one may change after
            return (payload if delta is None else delta.to_bytes()), tag, delta is not None
        payload = fmt.pack(piece).numpy()
        return payload, (signer.sign(payload) if signer is not None else ""), False

    def _open_channel(self) -> Any:
        """The stream's channel: a Ray queue on this node (an actor of its own, no CPU
        reserved), made at the first sync and again after a failed one."""
        if self._channel is None:
            import ray
            from ray.util.queue import Queue
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), False)
            self._channel = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": here})
        return self._channel

    def put_adapter(
        self, rpc: Rpc, version: int, tensors: dict[str, torch.Tensor], config: dict
    ) -> str | None:
        """The adapter through the object store; the actor writes it to a folder on its own
        node (its LoRA loader reads folders) and that path is returned."""
        import ray

        signer = Signer() if self.tagged else None
        with timing.span("serialize"):
            payload = fmt.pack(list(tensors.items())).numpy()
            tag = signer.sign(payload) if signer is not None else ""
            ref = ray.put(payload)
        kwargs: dict[str, Any] = {
            "ref": ref,
            "version": version,
            "config": json.dumps(config, default=str),
        }
        if signer is not None:
            kwargs |= {"key": signer.key_hex, "tag": tag}
        return str(rpc(RECEIVE_ADAPTER, kwargs)[0].value)

    def close(self) -> None:
        if self._channel is not None:
            _shut(self._channel)
            self._channel = None
        if self._copies is not None and self._rpc is not None:
            try:
                self._rpc(DELTA_DROP, {})  # the actor's copy of the weights
            except Exception:  # closing must not fail on a dead actor
                logger.warning("weightsync: dropping the actor's kept copies failed", exc_info=True)
            self._copies.reset()


def _pieces(buckets: Iterable[Bucket], limit: int) -> Iterator[Bucket]:
    """Each bucket cut into consecutive pieces of whole tensors, each at most ``limit`` bytes
    (a larger tensor alone); the same buckets give the same pieces (deltas compare them)."""
    for bucket in buckets:
        piece: Bucket = []
        size = 0
        for name, tensor in bucket:
            nbytes = tensor.numel() * tensor.element_size()
            if piece and size + nbytes > limit:
                yield piece
                piece, size = [], 0
            piece.append((name, tensor))
            size += nbytes
        if piece:
            yield piece


def _put(channel: Any, entry: tuple) -> None:
    """One entry into the stream's channel; a channel gone (its actor died) is a weightsync
    error."""
    from ray import exceptions as rex

    try:
        channel.put(entry)
    except rex.RayError as err:
        raise EngineUnavailableError(f"the sync's channel (a Ray queue) is gone: {err}") from err


def _shut(channel: Any) -> None:
    """Stop the channel's actor (closing must not fail: it may be gone already)."""
    try:
        channel.shutdown(force=True)
    except Exception:
        logger.warning("weightsync: stopping the sync's channel failed", exc_info=True)


@register
class RayVLLMEngine(RemoteVLLMEngine):
    """A ``vllm.LLM`` inside a Ray actor (its class inherits `WeightsyncActor`), reached
    through the actor's handle; see the module docstring.

    Args:
        actor: the actor's handle.
        transport: ``"ray"`` (the object store, any node), or another `Transport` the actor's
            workers can be reached by (``"tmpfs"`` on the trainer's node, ``"gloo"``).
        timeout_s: how long one actor call may take (`RayControl`).
        kwargs: as for `RemoteVLLMEngine` (``lora_name``, ...).
    """

    name = "vllm-ray"
    control: RayControl

    @classmethod
    def accepts(cls, obj: Any) -> bool:
        if not type(obj).__module__.startswith("ray"):
            return False
        from ray.actor import ActorHandle

        return isinstance(obj, ActorHandle) and hasattr(obj, "weightsync_call")

    def __init__(
        self,
        actor: Any,
        *,
        transport: str | Transport = "ray",
        timeout_s: float = TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        self.actor = actor
        chosen = RayObjectStoreTransport() if transport == "ray" else transport
        super().__init__(RayControl(actor, timeout_s=timeout_s), transport=chosen, **kwargs)

    def describe(self) -> str:
        return f"{super().describe()} in {self.control!r} (bytes: {self.transport.name})"

    def _written(self, version: str | None) -> None:
        """Label the outputs of an ``AsyncLLM`` in the actor with the version the write left,
        before it resumes (as `AsyncLLMEngine` does in process)."""
        if version is not None:
            self.control.label(version)
