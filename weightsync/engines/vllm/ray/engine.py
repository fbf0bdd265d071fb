"""The trainer side of vLLM inside a Ray actor: `RayVLLMEngine`, an `Engine` over the actor's
handle, which ``Syncer``, ``policy``, every strategy and ``Replicas`` take like any engine
(``adapt`` takes the raw handle too once this module is imported). It is `RemoteVLLMEngine`
with two halves of its own: `RayControl` (each `Control` call forwarded to the actor, see
``actor.py``) and `RayObjectStoreTransport` (the bytes through Ray's object store, as
``wire.stream``'s frames, staged on the actor through a Ray queue while its engine serves, then
committed inside the pause). Why: docs/ray.md.

Deadlines: every actor call waits at most ``timeout_s``. An actor that died (killed, its node
lost) or did not answer in time raises `EngineUnavailableError`, never a Ray error; an error the
actor's code raised is raised as itself. Ray authenticates nobody by default: the tags make
sure the bytes loaded are those the caller of ``weightsync_call`` put (docs/security.md).
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Hashable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import torch

from .... import timing
from ....errors import EngineUnavailableError, StageLostError, WeightSyncError, untouched
from ....plan import Bucket
from ....wire import format as fmt
from ....wire import stream
from ....wire.delta import WireCount
from ....wire.stream import Kind
from ....wire.tags import Signer
from ...base import instance_of, register
from ...contract import FANOUT, Staged
from ..control import Commit, Committed, Control
from ..remote import RemoteVLLMEngine
from ..transports import Rpc, Transport
from ..transports.base import StagedCalls, sent_copies, signer_for
from .actor import (
    COMMIT,
    DELTA_DROP,
    DELTA_STATE,
    DROP_STAGE,
    RECEIVE_ADAPTER,
    STAGE,
    TIMEOUT_S,
)

logger = logging.getLogger(__name__)

__all__ = ["RayControl", "RayObjectStoreTransport", "RayVLLMEngine"]

#: The most bytes of one streamed payload (`RayObjectStoreTransport`'s ``piece_bytes``).
PIECE_BYTES = 64 << 20


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

    def commit(self, commit: Commit) -> Committed:
        """The whole commit in one actor call (`run_commit` in the actor): nothing of it
        waits on the trainer, so a trainer that dies during the call leaves an actor that
        finishes, or recovers, and resumes. A commit whose stage the actor no longer holds
        (`StageLostError`: it expired, or another sync's replaced it) is refused before the
        pause, nothing loaded (`errors.untouched`: the base is kept)."""
        try:
            return Committed.from_json(self.call("commit", commit.to_json()))
        except StageLostError as error:
            raise untouched(error) from None

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
    """Buckets through Ray's object store, staged on the actor, then committed: each piece
    tagged here as a ``wire.stream`` frame and ``ray.put`` as its header and the tensors' own
    bytes (``stream.scattered``: Ray's put, which writes them into the store, is the only copy
    on this side; a delta sync packs, its copies being whole buckets), its reference sent through
    a channel (a Ray queue: a synchronous actor runs one call at a time, so its stage call,
    once running, is handed more references this way) to the actor's stage call, which fetches
    and checks it while this side puts the next and holds it (`WeightsyncActor`); the apply,
    inside the engine's pause, is one call: the actor's load of what it staged.

    Args:
        tagged: tag every piece (``wire.tags``); the actor checks each as it stages it, and
            the stream's end (how many came).
        delta: put only the changed words of a piece whose base the actor holds
            (``wire.delta``; the actor keeps a writable copy of every piece, so one copy of the
            weights stays on each side between syncs); needs ``tagged``.
        piece_bytes: the most bytes one payload carries (a strategy's bucket is cut into
            pieces of whole tensors; a larger tensor travels alone): the grain at which
            the put here, Ray's transfer and the actor's checks overlap.
        max_stage_bytes: the most bytes one sync may put in the object store (None: no
            bound); a larger sync is refused with nothing loaded, before the piece that would
            pass it is put. What a stage holds until its commit (docs/ray.md): the synced bytes
            in the object store -- once on the trainer's node, once more on the actor's node
            when it is another -- for an engine loaded by reference (`actor_llm`); for one whose
            workers are other processes (tensor parallel, an ``AsyncLLM``), the same bytes in a
            sealed RAM files on the actor's node instead, the store's copies let go once staged.

    Raises:
        ValueError: ``delta`` without ``tagged``; ``piece_bytes`` or ``max_stage_bytes`` not
            positive.
    """

    name = "ray"
    stages = True

    def __init__(
        self,
        *,
        tagged: bool = True,
        delta: bool = False,
        piece_bytes: int = PIECE_BYTES,
        max_stage_bytes: int | None = None,
    ) -> None:
        if piece_bytes <= 0:
            raise ValueError(f"piece_bytes must be positive, got {piece_bytes}")
        if max_stage_bytes is not None and max_stage_bytes <= 0:
            raise ValueError(f"max_stage_bytes must be positive, got {max_stage_bytes}")
        self._copies = sent_copies(delta, tagged, "RayObjectStoreTransport")
        self.tagged = tagged
        self.piece_bytes = piece_bytes
        self.max_stage_bytes = max_stage_bytes
        self._rpc: Rpc | None = None
        self._channel: Any = None

    @property
    def last_sync(self) -> WireCount | None:
        """What the last send put in the store (delta transports only)."""
        return None if self._copies is None else self._copies.last

    def connect(self, rpc: Rpc, world_size: int) -> None:
        self._rpc = rpc

    def send(self, rpc: Rpc, buckets: Iterable[Bucket]) -> None:
        staged = self.prepare(rpc, buckets)
        try:
            staged.apply()
        finally:
            staged.drop()

    def prepare(self, rpc: Rpc, buckets: Iterable[Bucket]) -> Staged:
        """Stage every piece of ``buckets`` on the actor while its engine serves: the actor's
        stage call starts first (in a thread here) and takes each piece as it is put. Any
        failure here -- a piece the trainer fails to produce (an ABORT frame goes to the
        actor), a frame or tensor the actor refuses, a sync over ``max_stage_bytes``, an actor
        that stops early -- drops the stage with nothing loaded and the engine never paused;
        the first error is raised. The returned apply is one call, the actor's load of its
        stage (the trainer's references are let go once the actor staged: it holds what it
        needs). The stage has an id of its own, which its commit and drop name: neither
        touches another sync's stage, and a commit after the actor let the stage go (its time
        to live, `actor.STAGE_EXPIRY_ENV`) is refused with nothing loaded (`StageLostError`)."""
        signer = signer_for(self.tagged)
        copies = self._copies
        sync_id = ""
        stage = secrets.token_hex(8)
        if copies is not None:  # deltas only onto the copies the last committed sync left
            sync_id = copies.begin([o.value for o in rpc(DELTA_STATE, {})])
        try:
            self._stage(rpc, _pieces(buckets, self.piece_bytes), signer, sync_id, stage)
        except BaseException:
            if copies is not None:
                copies.reset()
            raise
        committed: list[bool] = []

        def applied() -> None:
            committed.append(True)
            if copies is not None:
                copies.commit()

        def drop() -> None:  # unless committed: the actor lets its stage go, copies in doubt
            if committed:
                return
            if copies is not None:
                copies.reset()
            try:
                rpc(DROP_STAGE, {"stage": stage})
            except Exception:  # a dead actor holds nothing more
                logger.warning("weightsync: dropping the actor's stage failed", exc_info=True)

        return StagedCalls(rpc, [(COMMIT, {"stage": stage})], drop, applied=applied)

    def _stage(
        self, rpc: Rpc, pieces: Iterable[Bucket], signer: Signer | None, sync_id: str, stage: str
    ) -> None:
        import ray

        channel = self._open_channel()
        key = signer.key_hex if signer else ""
        start = {"channel": channel, "key": key, "delta": sync_id, "stage": stage}
        refs: list[Any] = []  # held until the actor has staged them
        fanout = FANOUT.get() if self._copies is None else None  # deltas: each actor's own
        put = 0
        with ThreadPoolExecutor(1, thread_name_prefix="weightsync-ray-stage") as pool:
            staging = pool.submit(rpc, STAGE, start)
            try:
                for piece in pieces:
                    if staging.done():
                        break  # the actor stopped early: its error is raised below
                    with timing.span("serialize"):
                        kind, parts, tag = stream.scattered(piece, signer, self._copies)
                        put += sum(p.nbytes for p in parts)
                        if self.max_stage_bytes is not None and put > self.max_stage_bytes:
                            raise WeightSyncError(
                                f"this sync puts more than the {self.max_stage_bytes} bytes "
                                "RayObjectStoreTransport may stage (max_stage_bytes): "
                                "nothing was loaded"
                            )
                        # The one copy here: put writes each piece (a view of a tensor's
                        # own bytes, pickled out of band) straight into the store, after
                        # which the tensors may change. In a fan-out, once for every actor.
                        if fanout is None:
                            refs.append(ray.put(parts))
                        else:
                            refs.append(fanout.once(_identity(piece), partial(ray.put, parts)))
                    _put(channel, (int(kind), refs[-1], tag))
                else:
                    end = stream.end_tag(signer, len(refs)) if signer else ""
                    _put(channel, (int(Kind.END), len(refs), end))
            except BaseException as error:
                self._channel = None  # its leftovers must not meet the next sync
                try:
                    _put(channel, (int(Kind.ABORT), f"{type(error).__name__}: {error}"))
                    staging.exception()  # the actor's stage dropped; the trainer's error wins
                finally:
                    _shut(channel)
                raise
            try:
                staging.result()
            except BaseException:
                self._channel = None
                _shut(channel)
                raise

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
        self,
        rpc: Rpc,
        version: int,
        tensors: dict[str, torch.Tensor],
        config: dict,
        keep: int = 2,
    ) -> str | None:
        """The adapter through the object store; the actor writes it to a folder on its own
        node (its LoRA loader reads folders) and that path is returned."""
        import ray

        signer = signer_for(self.tagged)
        with timing.span("serialize"):
            parts = fmt.pieces(list(tensors.items()))  # copied once, by put, into the store
            tag = signer.sign(*parts) if signer is not None else ""
            ref = ray.put(parts)
        kwargs: dict[str, Any] = {
            "ref": ref,
            "version": version,
            "config": json.dumps(config, default=str),
            "keep": keep,
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


def _identity(piece: Bucket) -> Hashable:
    """What says two replicas' pieces are the same bytes (`FanOut`)."""
    return tuple(
        (name, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t._version) for name, t in piece
    )


def _put(channel: Any, entry: tuple) -> None:
    """One frame into the stream's channel (its kind a plain int: the queue's actor need not
    import weightsync); a channel gone (its actor died) is a weightsync error."""
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
    through the actor's handle (docs/ray.md).

    Args:
        actor: the actor's handle.
        transport: ``"ray"`` (the object store, any node), or another `Transport` the actor's
            workers can be reached by (``"tmpfs"`` on the trainer's node, ``"gloo"``) that
            stages (a stream inside the pause is refused: see `__init__`'s error).
        timeout_s: how long one actor call may take (`RayControl`).
        kwargs: as for `RemoteVLLMEngine` (``lora_name``, ...).

    Raises:
        ValueError: a transport that stages nothing (gloo with ``stage=False``): its stream
            would run inside a pause the trainer holds, which nothing ends if the trainer dies.
    """

    name = "vllm-ray"
    control: RayControl

    @classmethod
    def accepts(cls, obj: Any) -> bool:
        return instance_of(obj, "ray.actor", "ActorHandle") and hasattr(obj, "weightsync_call")

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
        if isinstance(chosen, Transport) and not chosen.stages:
            raise ValueError(
                f"{chosen.name} streams inside the engine's pause (it stages nothing), so the "
                "trainer would hold the actor's pause, and an actor has no lease to end it if "
                "the trainer dies: every write to a Ray actor is staged, then committed in one "
                "actor call. Use the object store (transport='ray'), 'tmpfs', or "
                "GlooTransport() with stage=True (the default)"
            )
        super().__init__(RayControl(actor, timeout_s=timeout_s), transport=chosen, **kwargs)

    def describe(self) -> str:
        return f"{super().describe()} in {self.control!r} (bytes: {self.transport.name})"
