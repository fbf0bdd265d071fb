"""Buckets broadcast over a gloo process group the trainer opens with the workers (``wire.gloo``):
the transport for an engine on another host, and the one that can send deltas."""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import torch

from ....plan import Bucket
from ....wire import gloo
from ....wire.delta import WireCount
from .base import (
    Rpc,
    Staged,
    StagedCalls,
    Transport,
    drop_kept_copies,
    proof_args,
    send_timed,
    sent_copies,
    signer_for,
)

logger = logging.getLogger(__name__)


class GlooTransport(Transport):
    """Buckets broadcast over a gloo process group (``wire.gloo``): trainer rank 0, workers
    ranks 1..N.

    Args:
        host: address the trainer listens on and the workers connect to (127.0.0.1 for one
            host; an address the engine's host can reach otherwise).
        port: the rendezvous port (0: a free one).
        timeout_s: how long a broadcast waits for a peer before failing.
        tagged: tag every bucket in the stream (``wire.tags``); the workers check each before
            loading it.
        delta: send only the changed elements of a bucket whose base the workers hold
            (``wire.delta``, docs/delta.md): after a training step of a bf16 engine a few
            percent of the bytes. Costs one copy of the weights kept here and one in each of
            the engine's workers between syncs, and a compare pass per bucket; needs
            ``tagged``. Off by default: the memory is the user's to give.
        stage: receive the whole stream before loading any of it (`prepare`): the engine keeps
            generating while the bytes travel, and a sync that fails or whose trainer dies
            part-way leaves it untouched. Costs each worker the synced bytes in host memory
            (every worker receives every bucket, TP ranks included) from the first bucket to the
            commit. False: the workers load each bucket as it comes, inside the engine's pause,
            and a failure part-way leaves a mix of old and new layers.
        max_stage_bytes: the most a worker may stage (None: no bound); a larger sync is
            refused with nothing loaded.

    The rendezvous listens on ``host`` only, under a secret the workers get over the control
    channel (``wire.gloo``). A server's workers hold one gloo group: one gloo engine per server
    at a time.

    Raises:
        ValueError: ``delta`` without ``tagged`` (the tag of the whole bucket is what proves a
            patched bucket exact).
    """

    name = "gloo"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 300.0,
        *,
        tagged: bool = True,
        delta: bool = False,
        stage: bool = True,
        max_stage_bytes: int | None = None,
    ) -> None:
        self._copies = sent_copies(delta, tagged, "GlooTransport")
        self.link = gloo.Link(host, port, timeout_s)
        self.tagged = tagged
        self.stages = stage
        self.max_stage_bytes = max_stage_bytes
        self._rpc: Rpc | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weightsync-rpc")

    @property
    def delta(self) -> bool:
        """Whether this transport sends deltas."""
        return self._copies is not None

    @property
    def last_sync(self) -> WireCount | None:
        """What the last send put on the wire (delta transports only)."""
        return None if self._copies is None else self._copies.last

    def connect(self, rpc: Rpc, world_size: int) -> None:
        self._rpc = rpc

        def join(port: int, secret: str) -> Future:
            kwargs = {
                "host": self.link.host,
                "port": port,
                "world_size": world_size + 1,
                "timeout_s": self.link.timeout_s,
                "secret": secret,
            }
            return self._pool.submit(rpc, "weightsync_join_gloo", kwargs)

        self.link.open(world_size + 1, join)

    def send(self, rpc: Rpc, buckets: Iterable[Bucket]) -> None:
        if self.link.group is None:
            raise RuntimeError("GlooTransport.send before connect")
        signer = signer_for(self.tagged)
        copies = self._copies
        if copies is None:
            received = self._pool.submit(rpc, "weightsync_receive_gloo", proof_args(signer))
            gloo.send(self.link.group, buckets, received, send_timed, signer)
            return

        # Deltas only if every worker still holds the copies the last successful sync left.
        reported = [o.value for o in rpc("weightsync_delta_state", {})]
        kwargs = proof_args(signer) | {"delta": copies.begin(reported)}
        received = self._pool.submit(rpc, "weightsync_receive_gloo", kwargs)
        try:
            gloo.send(
                self.link.group, buckets, received, partial(send_timed, copies=copies), signer
            )
        except BaseException:
            copies.reset()
            raise
        copies.commit()

    def prepare(self, rpc: Rpc, buckets: Iterable[Bucket]) -> Staged:
        """Broadcast every bucket to the workers' stages (``gloo.Staging``) while the engine
        serves and wait until every worker checked the whole stream; the apply is one call,
        each worker's load of what it staged. Any failure here (a refused frame, the trainer's
        own error, a dead trainer, a stage too large) leaves the engine untouched and never
        paused."""
        if not self.stages:
            return super().prepare(rpc, buckets)
        if self.link.group is None:
            raise RuntimeError("GlooTransport.prepare before connect")
        signer = signer_for(self.tagged)
        copies = self._copies
        stage = {"stage": secrets.token_hex(8)}  # named by its check, commit and drop
        kwargs = proof_args(signer) | {"max_bytes": self.max_stage_bytes} | stage
        if copies is not None:  # deltas only onto the copies the last successful sync left
            reported = [o.value for o in rpc("weightsync_delta_state", {})]
            kwargs["delta"] = copies.begin(reported)
        send_one = send_timed if copies is None else partial(send_timed, copies=copies)
        committed: list[bool] = []

        def applied() -> None:
            committed.append(True)
            if copies is not None:
                copies.commit()

        def drop() -> None:  # unless committed: the workers free their stage, copies in doubt
            if committed:
                return
            if copies is not None:
                copies.reset()
            try:
                rpc("weightsync_drop_staged", stage)
            except Exception:
                logger.warning("weightsync: weightsync_drop_staged failed", exc_info=True)

        try:
            rpc("weightsync_stage_gloo", kwargs)
            gloo.send(self.link.group, buckets, None, send_one, signer)
            rpc("weightsync_staged", {"timeout_s": self.link.timeout_s} | stage)
        except BaseException:
            drop()
            raise
        return StagedCalls(rpc, [("weightsync_commit_staged", stage)], drop, applied=applied)

    def put_adapter(
        self,
        rpc: Rpc,
        version: int,
        tensors: dict[str, torch.Tensor],
        config: dict,
        keep: int = 2,
    ) -> str | None:
        """Broadcast the adapter; the engine's first worker writes it to a folder on its own
        host (the server may be on another one) and its path is returned."""
        if self.link.group is None:
            raise RuntimeError("GlooTransport.put_adapter before connect")
        signer = signer_for(self.tagged)
        kwargs = {"version": version, "config": json.dumps(config, default=str), "keep": keep}
        received = self._pool.submit(rpc, "weightsync_receive_adapter", kwargs | proof_args(signer))
        gloo.send(self.link.group, [list(tensors.items())], received, send_timed, signer)
        return next(o.value for o in received.result() if o.value is not None)

    def close(self) -> None:
        if self._copies is not None and self._rpc is not None and self.link.group is not None:
            drop_kept_copies(self._rpc, self._copies, {})
        self.link.close()
        self._pool.shutdown(wait=False)
