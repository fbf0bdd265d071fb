"""verl: weightsync as a checkpoint-engine backend verl loads by name, in every process.

verl 0.9 moves the actor's weights to its rollout replicas through a ``CheckpointEngine``
(``verl/checkpoint_engine/base.py``): every sync, verl's ``CheckpointEngineManager`` calls
`prepare` on every actor and rollout rank, `build_topology` on the driver, `init_process_group`
everywhere at once, then `send_weights` on every actor rank beside `receive_weights` on every
rollout rank (whose tensors verl hands to its own ``ServerAdapter``, which loads them into the
engine), then `finalize`. Three lines of verl's config select this backend::

    actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=weightsync.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync.model_path=<the model>

What travels is weightsync's checked stream (``wire.stream``) over a gloo group of its own
(``wire.gloo``): actor rank 0 (verl's ``is_master``) is the group's rank 0, each rollout rank a
further rank; the other actor ranks walk verl's weight generator (producing a weight is
collective under FSDP and Megatron) and send nothing. Each sync has a fresh tag key
(``wire.tags``) that reaches the rollout ranks through verl's own control channel (``prepare``'s
metadata, via Ray), never through the group: a bucket altered, replayed, reordered or dropped on
the way is refused before any of its tensors reaches verl's rollout side, and so is an END whose
count is not the number of buckets checked. After the first sync only the changed words travel
(``wire.delta``), each bucket checked as the whole bucket a full sync would have sent.

The receiving side also checks what the tags cannot: every tensor's name and shape against the
model's checkpoint (``model_path``; without it, against the first sync this rank accepted, and
its dtype too), and that its values are finite. With ``all_or_nothing`` (the default) a rollout
rank hands verl nothing until the whole stream passed on every rollout rank (all ranks agree in
one all-gather), so a refused sync leaves the engine exactly as it was; the cost is one copy of
the weights held on each rollout rank, which a delta sync keeps anyway. Without it, memory is
one bucket and each bucket is handed on once checked, so a refusal part-way leaves the buckets
before it loaded.

Which guarantees a verl user gets through this seam, which stay with verl's last hop into vLLM,
and the measured figures: docs/recipes.md, "verl".
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch

from ..errors import WeightMismatchError, WeightSyncError
from ..wire import gloo, stream
from ..wire.delta import LoadedCopies, SentCopies
from ..wire.protocol import Outcome
from ..wire.tags import Signer

try:
    from verl.checkpoint_engine.base import (
        CheckpointEngine,
        CheckpointEngineRegistry,
    )
except ImportError:  # weightsync without verl: the module imports, nothing registers
    CheckpointEngine, CheckpointEngineRegistry = object, None

#: The name verl's config selects this backend by (``checkpoint_engine.backend``).
BACKEND = "weightsync"

#: A name and what each rollout rank checks it against: its shape and (None: any floating
#: point) its dtype.
Expected = dict[str, tuple[tuple[int, ...], torch.dtype | None]]


class WeightsyncCheckpointEngine(CheckpointEngine):
    """weightsync's checked stream as verl's ``CheckpointEngine`` (module docstring).

    verl builds one per actor rank (``is_master`` on rank 0) and one per rollout rank, once,
    and keeps it across syncs: the delta copies live in it. ``bucket_size`` is verl's
    ``update_weights_bucket_megabytes``; the other arguments come from
    ``checkpoint_engine.engine_kwargs.weightsync``.

    Args:
        bucket_size: bytes of a bucket; a tensor larger than that travels alone.
        is_master: the actor rank that sends (verl sets it).
        delta: after the first sync, send only the words that changed (one copy of the weights
            kept on the actor's rank 0 and on each rollout rank).
        all_or_nothing: a rollout rank hands verl no tensor until every rank checked the
            whole stream (one copy of the weights held); False: each bucket once checked.
        model_path: the model's folder or hub id (its ``config.json`` only is read): every
            tensor's name and shape are checked against its checkpoint from the first sync.
        host: the address actor rank 0 listens on for the group (None: its Ray node's).
        timeout_s: how long a rank waits for the others in the group.
    """

    wire_format = "named_tensors"

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        *,
        delta: bool = True,
        all_or_nothing: bool = True,
        model_path: str | None = None,
        host: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        if bucket_size <= 0:
            raise ValueError(f"bucket_size={bucket_size}: a bucket needs at least one byte")
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.delta = delta
        self.all_or_nothing = all_or_nothing
        self.model_path = model_path
        self.host = host
        self.timeout_s = timeout_s
        self.sent = SentCopies() if delta and is_master else None
        self.loaded: LoadedCopies | None = None  # a rollout rank's, made at its first sync
        self.expected: Expected | None = None  # a rollout rank's, from the model or first sync
        self._sync: dict[str, Any] = {}  # this sync's group, store, key, role (`finalize`)
        self._seen: Expected = {}  # what the stream under way carried

    # -- verl's six verbs ---------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """Every rank, every sync: rank 0 of the actor listens (a fresh port, group secret and
        tag key, which verl carries to the rollout ranks); a rollout rank reports the id of the
        copies its last sync left (deltas are sent only when every rank holds them)."""
        if not self.is_master:
            return {"synced": self.loaded.synced if self.loaded is not None else None}
        host = self.host or _node_ip()
        store = gloo.listen(host, 0, self.timeout_s)
        signer = Signer()
        self._sync = {"store": store, "signer": signer, "host": host}
        return {
            "master": True,
            "host": host,
            "port": store.port,
            "secret": secrets.token_hex(16),
            "key": signer.key_hex,
        }

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """The group: actor rank 0, then every rollout rank (1..N); the other actor ranks stay
        out of it. ``metadata`` is every actor rank's `prepare`, then every rollout rank's."""
        actors, rollouts = metadata[:actor_wg_world_size], metadata[actor_wg_world_size:]
        masters = [i for i, m in enumerate(actors) if m.get("master")]
        if len(masters) != 1:
            raise WeightSyncError(
                f"{len(masters)} actor ranks are verl's master (is_master): weightsync's verl "
                "backend needs exactly one to send"
            )
        master = actors[masters[0]]
        size = 1 + rollout_world_size
        reported = [m.get("synced") for m in rollouts]
        actor_kwargs: dict[str, list[Any]] = {
            "rank": [0 if i == masters[0] else None for i in range(actor_wg_world_size)],
            "size": [size] * actor_wg_world_size,
            "master": [master] * actor_wg_world_size,
            "reported": [reported] * actor_wg_world_size,
        }
        rollout_kwargs: dict[str, list[Any]] = {
            "rank": list(range(1, size)),
            "size": [size] * rollout_world_size,
            "master": [master] * rollout_world_size,
            "reported": [None] * rollout_world_size,
        }
        return actor_kwargs, rollout_kwargs

    def init_process_group(
        self, rank: int | None, size: int, master: dict[str, Any], reported: list | None
    ) -> None:
        """Join this sync's group (verl calls every rank at once: rank 0 waits here for the
        others). An idle actor rank (``rank`` None) joins nothing."""
        if rank is None:
            self._sync = {"rank": None}
            return
        if rank == 0:
            group = gloo.rendezvous(
                self._sync["store"], master["host"], 0, size, self.timeout_s, master["secret"]
            )
            sync_id = self.sent.begin(reported or []) if self.sent is not None else ""
            self._sync.update(rank=0, size=size, group=group, sync_id=sync_id)
            return
        group, store = gloo.join_group(
            master["host"], master["port"], rank, size, self.timeout_s, master["secret"]
        )
        if self.delta and self.loaded is None:
            self.loaded = LoadedCopies()
        if self.loaded is not None:
            self.loaded.begin()
        self._sync = {"rank": rank, "size": size, "group": group, "store": store}
        self._sync["key"] = master["key"]

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Actor side: rank 0 streams ``weights`` (verl's generator, sync or async) in buckets
        and returns verl's metrics once every rollout rank accepted; the other ranks walk the
        generator and return none.

        Raises:
            WeightSyncError: a rollout rank refused the stream (its reason named; nothing of
                it was handed to verl's rollout side with ``all_or_nothing``), or producing a
                weight failed (the rollout ranks were told to abandon the sync).
        """
        if not self.is_master:
            async for _ in _pairs(weights):
                pass
            return {}
        if self._sync.get("rank") != 0:
            raise WeightSyncError(
                "send_weights before init_process_group: verl's CheckpointEngineManager calls "
                "prepare, build_topology and init_process_group first, every sync"
            )
        group, signer = self._sync["group"], self._sync["signer"]
        start, count, wire, whole = time.perf_counter(), 0, 0, 0
        try:
            async for bucket in _buckets(weights, self.bucket_size):
                frame = stream.frame(bucket, signer, self.sent)
                self._send_frame(group, frame)
                count += 1
                wire += frame.payload.nbytes
                if self.sent is None:
                    whole += frame.payload.nbytes
        except BaseException:
            gloo.send_abort(group)
            self._gather(Outcome(value=self._sync["sync_id"]))
            if self.sent is not None:
                self.sent.reset()
            raise
        gloo.send_end(group, count, signer)
        refused = [o for o in self._gather(Outcome(value=self._sync["sync_id"])) if not o.ok]
        if refused:
            if self.sent is not None:
                self.sent.reset()
            raise WeightSyncError(
                "weightsync's verl backend: the rollout refused this weight update ("
                + "; ".join(f"rollout rank {o.rank}: {o.error}" for o in refused)
                + "); the next sync sends every bucket whole"
            )
        seconds = time.perf_counter() - start
        delta_buckets = 0
        if self.sent is not None:
            self.sent.commit()
            whole, delta_buckets = self.sent.last.bucket_bytes, self.sent.last.delta_buckets
        return {
            "checkpoint_engine/weightsync_bytes": float(wire),
            "checkpoint_engine/weightsync_full_bytes": float(whole),
            "checkpoint_engine/weightsync_seconds": seconds,
            "checkpoint_engine/weightsync_buckets": float(count),
            "checkpoint_engine/weightsync_delta_buckets": float(delta_buckets),
            "checkpoint_engine/weightsync_delta_fraction": wire / whole if whole else 0.0,
        }

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Rollout side: the stream's ``(name, tensor)`` pairs, each bucket checked (its tag,
        then each tensor's name, shape, dtype and values) before any of its tensors is
        yielded; with ``all_or_nothing``, none before every rank accepted the whole stream.

        Raises:
            BytesRejectedError: a frame is not the trainer's (altered, replayed, dropped).
            WeightMismatchError: a tensor the model does not have, of another shape or dtype,
                or holding NaN or inf.
            WeightSyncError: the trainer aborted, or another rollout rank refused.
        """
        receiver = gloo.Receiver(self._sync["group"], self._sync["key"], self.loaded)
        held: list[tuple[str, torch.Tensor]] = []
        error: BaseException | None = None
        try:
            for bucket in self._checked_buckets(receiver):
                if self.all_or_nothing:
                    held.extend(bucket)
                else:
                    for pair in bucket:
                        yield pair
        except (WeightSyncError, RuntimeError) as e:  # refused (or gloo failed): drain, report
            error = e
            if not receiver.finished:
                receiver.drain()
        mine = Outcome() if error is None else Outcome.failed(error, self._sync["rank"])
        outcomes = self._gather(mine)
        others = [o for o in outcomes[1:] if not o.ok and o.rank != self._sync["rank"]]
        if error is None and others:
            error = WeightSyncError(
                "another rollout rank refused this weight update ("
                + "; ".join(f"rank {o.rank}: {o.error}" for o in others)
                + "): nothing was handed on"
            )
        if error is not None:
            if self.loaded is not None:
                self.loaded.clear()
            held.clear()
            raise error
        if self.loaded is not None:
            self.loaded.commit(outcomes[0].value, receiver.buckets)
        if self.expected is None:  # the first sync accepted: later ones must match it
            self.expected = self._seen
        for pair in held:
            yield pair

    def finalize(self) -> None:
        """Every rank, after every sync: drop this sync's group, store and key (the delta
        copies stay)."""
        self._sync = {}

    # -- the pieces ----------------------------------------------------------------------------

    def _send_frame(self, group: Any, frame: stream.Frame) -> None:
        """One bucket's frame onto the group (a seam a test uses to alter one in transit)."""
        gloo.send_frame(group, frame)

    def _gather(self, mine: Outcome) -> list[Outcome]:
        work, gathered = gloo.gather_outcomes(self._sync["group"], self._sync["size"], mine)
        work.wait()
        return gloo.outcomes(gathered)

    def _checked_buckets(self, receiver: gloo.Receiver) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The stream a bucket at a time, every tensor of a bucket checked before it is given;
        at the end, every weight the model has must have come (``all_or_nothing`` only: a
        bucket-by-bucket load has already handed on the ones that came)."""
        expected = self.expected if self.expected is not None else self._model_expected()
        bucket: list[tuple[str, torch.Tensor]] = []
        index = 0
        seen: Expected = {}
        self._seen = seen
        for name, tensor in receiver:
            if receiver.buckets != index and bucket:
                yield bucket
                bucket = []
            index = receiver.buckets
            _check(name, tensor, expected)
            seen[name] = (tuple(tensor.shape), tensor.dtype)
            bucket.append((name, tensor))
        if bucket:
            yield bucket
        missing = sorted(set(expected or ()) - set(seen))
        if missing and self.all_or_nothing:
            raise WeightMismatchError(
                f"the trainer sent {len(seen)} weights but the model has {len(expected or ())}: "
                f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}; nothing was "
                "handed on (a partial update would leave those weights stale)"
            )

    def _model_expected(self) -> Expected | None:
        if self.model_path is None:
            return None
        from transformers import AutoConfig, AutoModelForCausalLM

        from ..wire.checkpoint_names import checkpoint_shapes

        config = AutoConfig.from_pretrained(self.model_path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        self.expected = {name: (shape, None) for name, shape in checkpoint_shapes(model).items()}
        return self.expected


if CheckpointEngineRegistry is not None:
    CheckpointEngineRegistry.register(BACKEND)(WeightsyncCheckpointEngine)


def _check(name: str, tensor: torch.Tensor, expected: Expected | None) -> None:
    """Refuse ``tensor`` unless the model has ``name`` in its shape (and, when ``expected``
    holds one, its dtype), with finite values."""
    if expected is not None:
        if name not in expected:
            raise WeightMismatchError(
                f"{name}: the trainer sent a weight the rollout's model does not have; nothing "
                "of this bucket was handed on"
            )
        shape, dtype = expected[name]
        if tuple(tensor.shape) != shape:
            raise WeightMismatchError(
                f"{name}: shape {tuple(tensor.shape)} from the trainer, the model's is {shape}; "
                "nothing of this bucket was handed on"
            )
        if dtype is not None and tensor.dtype != dtype:
            raise WeightMismatchError(
                f"{name}: dtype {tensor.dtype} from the trainer, {dtype} at the first sync; "
                "nothing of this bucket was handed on"
            )
    # isfinite has no 8-bit float kernels on CPU; those are quantized values, not a trainer's.
    floating = tensor.is_floating_point() and tensor.element_size() > 1
    if floating and not bool(torch.isfinite(tensor).all()):
        raise WeightMismatchError(
            f"{name}: holds NaN or inf values (the trainer's step diverged?); nothing of "
            "this bucket was handed on"
        )


async def _buckets(weights: Any, bucket_size: int) -> AsyncIterator[list[tuple[str, torch.Tensor]]]:
    """verl's ``weights`` in buckets of at most ``bucket_size`` bytes (a larger tensor alone),
    each dropped once sent: the memory held is one bucket."""
    bucket: list[tuple[str, torch.Tensor]] = []
    held = 0
    async for name, tensor in _pairs(weights):
        if bucket and held + tensor.nbytes > bucket_size:
            yield bucket
            bucket, held = [], 0
        bucket.append((name, tensor))
        held += tensor.nbytes
    if bucket:
        yield bucket


async def _pairs(weights: Any) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """verl's weight generator, sync (FSDP's ``get_per_tensor_param``) or async."""
    if hasattr(weights, "__aiter__"):
        async for pair in weights:
            yield pair
    else:
        for pair in weights:
            yield pair


def _node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())
