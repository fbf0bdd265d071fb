"""Buckets through vLLM's weight-transfer API (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``) to weightsync's
``"weightsync"`` backend in the workers (``in_engine/backend.py``), carried by files or gloo.

Stage, then commit. The bytes land on the engine's side while it keeps serving: every bucket's
file written and tagged (`WeightTransferFiles`), or the whole stream received into the workers'
host memory and checked there (`WeightTransferGloo`); the engine's pause then holds only the
load (the files' tag and name checks, then vLLM's layerwise reload). A trainer that fails or
dies, a cut stream or a forged bucket before the load leaves the engine untouched and, over
gloo, never paused. A load that fails after layers took their new weights is reported by the
workers (``wire.protocol.RELOAD_REPORT``, read through the worker extension's
``weightsync_weight_update``), so a server with weightsync's middleware refuses to generate
until a full sync instead of serving the mix (``server_lease.py``).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from .... import timing
from ....errors import PauseExpiredError
from ....plan import Bucket
from ....wire import gloo
from ....wire.delta import SentCopies, WireCount
from ....wire.files import write_folder
from ....wire.protocol import InitInfo, Outcome, UpdateInfo
from ....wire.scratch import private_dir, scratch_dir
from .base import (
    Rpc,
    Staged,
    Transport,
    drop_kept_copies,
    proof_args,
    send_timed,
    sent_copies,
    signer_for,
)

logger = logging.getLogger(__name__)


class LLMWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over a ``vllm.LLM`` (in or out of process).

    An ``LLM`` has the four methods, but they take *requests* (``{"init_info": ...}``,
    ``{"update_info": ...}``), not the info dicts the protocol passes; this wraps them.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()


def _call(client: Any, method: str, *args: Any) -> Any:
    """``client.<method>(*args)``, with the server's answer in the error: vLLM's HTTP client
    raises ``HTTPError`` with the status only, and the body says what went wrong."""
    try:
        return getattr(client, method)(*args)
    except Exception as e:
        body = getattr(getattr(e, "response", None), "text", "")
        if body:
            raise RuntimeError(f"{method} failed: {e}: {body[:2000]}") from e
        raise


class WeightTransferTransport(Transport):
    """Buckets through vLLM's weight-transfer API to the ``"weightsync"`` backend, carried by
    files (`WeightTransferFiles`) or a gloo group (`WeightTransferGloo`): construct one of those.

    `prepare` stages the bytes while the engine serves; the apply is one update
    (``start_weight_update``, the load, ``finish_weight_update``, over gloo opened while
    staging), after which every worker's outcome is read through the worker extension
    (``weightsync_weight_update``) and a failure is raised. An update the trainer gives up
    before its load is closed (``abort``, then ``finish_weight_update``) with nothing loaded.

    ``finish_weight_update`` does not reset vLLM's prefix cache (measured): the engine's write
    path (``RemoteVLLMEngine``) pauses, applies, resets it and resumes.

    ``client`` is a ``VLLMWeightSyncClient``: vLLM's ``HTTPVLLMWeightSyncClient(url)`` for a
    server started with ``--weight-transfer-config '{"backend": "weightsync"}'``, or
    `LLMWeightSyncClient` for an ``LLM(weight_transfer_config=...)``. A ``VLLMServerEngine``
    makes the calls of vLLM's HTTP client through its own ``HTTPControl`` (vLLM's client sends
    neither weightsync's token nor the pause's lease; ``server._speak_through``). ``tagged``: tag every bucket (``wire.tags``): the key and a
    file's tag travel in the ``update_weights`` payload, a stream's tags in the stream.
    """

    stages = True

    def __init__(self, client: Any, *, tagged: bool = True) -> None:
        self.client = client
        self.tagged = tagged
        self._copies: SentCopies | None = None
        self._rpc: Rpc | None = None
        self._world_size = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weightsync-weight-transfer")

    @property
    def last_sync(self) -> WireCount | None:
        """What the last send put on the wire (delta transports only)."""
        return None if self._copies is None else self._copies.last

    def connect(self, rpc: Rpc, world_size: int) -> None:
        self._world_size = world_size
        self._rpc = rpc
        self._join(world_size)

    def _join(self, world_size: int) -> None:
        """``init_weight_transfer_engine`` as the carrier needs it."""
        raise NotImplementedError

    def _connected(self) -> bool:
        return bool(self._world_size)

    def _check_connected(self) -> None:
        if not self._connected():
            raise RuntimeError(f"{type(self).__name__} used before connect (or after close)")

    def send(self, rpc: Rpc, buckets: Iterable[Bucket]) -> None:
        staged = self.prepare(rpc, buckets)
        try:
            staged.apply()
        finally:
            staged.drop()

    def _start(self, rpc: Rpc) -> None:
        """``start_weight_update``; if a trainer that died mid-update left its update open (vLLM
        then refuses a new one; a server's pause lease closes it when it expires, so this is a
        trainer that came first), settle it as the lease would (``weightsync_settle``: a load
        it completed whole is finished, anything else abandoned -- the layers a failed load had
        finished reported, which a server fences -- and closed) and start again.

        At TP>1 vLLM's own refusal already leaves its RPC replies out of step (every worker
        raises); only restarting the engine recovers from that."""
        try:
            _call(self.client, "start_weight_update")
        except Exception as e:
            if "already active" not in str(e):
                raise
            logger.warning("weightsync: closing a weight update another trainer left open")
            rpc("weightsync_settle", {})
            _call(self.client, "start_weight_update")

    def _update(self, info: UpdateInfo) -> None:
        _call(self.client, "update_weights", asdict(info))

    def _abort(self, reason: str) -> None:
        """Close the open update with nothing more loaded (the workers drop what is staged and
        restore any layer a load left unfinished)."""
        self._update(UpdateInfo(abort=reason))
        _call(self.client, "finish_weight_update")

    def _close_given_up(self, rpc: Rpc, error: BaseException) -> None:
        """`_abort` for an update given up because of ``error`` (which the caller raises), and
        the workers' outcome read, so a server's middleware learns of layers a load had
        finished before the update was given up (a mix, fenced)."""
        try:
            self._abort(Outcome.failed(error).error)
            rpc("weightsync_weight_update", {})
        except Exception:  # the trainer's error is the one to raise (the workers say aborted)
            logger.debug("weightsync: closing the abandoned weight update", exc_info=True)

    def _commit(self, rpc: Rpc, load: Callable[[], None]) -> None:
        """``load()`` in the open update, then ``finish_weight_update`` and every worker's
        outcome, raised if any failed (the workers report it through the extension, so a
        server's middleware sees a mix the failure left)."""
        try:
            load()
        except PauseExpiredError:  # the lease settled and closed the update: nothing is ours
            raise
        except BaseException as error:
            self._close_given_up(rpc, error)
            raise
        _call(self.client, "finish_weight_update")
        rpc("weightsync_weight_update", {})

    def close(self) -> None:
        self._world_size = 0
        self._pool.shutdown(wait=False)


def _serializing() -> Any:
    return timing.span("serialize")


class WeightTransferFiles(WeightTransferTransport):
    """`WeightTransferTransport` carried by files: every bucket written as a tagged safetensors
    file to a new folder in RAM while the engine serves, its names and shapes checked by the
    workers there (``weightsync_check_update``: an update for another model is refused before
    the engine is paused or its adapter unloaded); the commit is one ``update_weights`` naming
    them all, whose workers check every file's tag, names and shapes before loading any. Costs the synced bytes in that folder (tmpfs: RAM) from the stage to the end of the
    commit. Same host, or a shared filesystem.

    Args:
        client: see `WeightTransferTransport`.
        root: a folder the workers read at the same path; defaults to a fresh
            ``/dev/shm/weightsync-*`` folder, removed by `close`.
        tagged: see `WeightTransferTransport`.
    """

    name = "weight-transfer:files"

    def __init__(self, client: Any, root: str | Path | None = None, *, tagged: bool = True) -> None:
        super().__init__(client, tagged=tagged)
        self._owned = root is None
        self.root = private_dir(root) if root is not None else scratch_dir(self, "weight-transfer")
        self._updates = 0

    def _join(self, world_size: int) -> None:
        _call(self.client, "init_weight_transfer_engine", asdict(InitInfo()))

    def prepare(self, rpc: Rpc, buckets: Iterable[Bucket]) -> Staged:
        """Write and tag every bucket's file now, while the engine serves, and have the workers
        check their names and shapes (a failure here removes the folder and leaves the engine
        untouched); the
        apply is the update that checks and loads them, the drop removes the folder."""
        self._check_connected()
        signer = signer_for(self.tagged)
        self._updates += 1
        folder = self.root / f"update-{self._updates:06d}"
        written = write_folder(buckets, folder, around=_serializing, signer=signer)
        proof = proof_args(signer, written.tags)
        try:
            rpc("weightsync_check_update", {"folder": str(folder), "files": written.names})
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        info = UpdateInfo(folder=str(folder), files=written.names, final=True, **proof)

        def apply() -> None:
            self._start(rpc)
            self._commit(rpc, lambda: self._update(info))

        return Staged(apply, lambda: shutil.rmtree(folder, ignore_errors=True))

    def close(self) -> None:
        super().close()
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)


class WeightTransferGloo(WeightTransferTransport):
    """`WeightTransferTransport` carried by a gloo group (trainer rank 0, any host): the
    buckets are broadcast as ``wire.stream``'s frames into every worker's stage (host memory)
    while the engine serves, checked whole there, and loaded by the commit.

    Args:
        client: see `WeightTransferTransport`.
        host: address the trainer listens on and the workers connect to.
        port: the rendezvous port (0: a free one).
        timeout_s: how long an operation waits for a peer before failing.
        tagged: see `WeightTransferTransport`.
        delta: send only the changed words of a bucket whose base every worker's backend holds
            (``wire.delta``, as `GlooTransport`); needs ``tagged``. The trainer asks the
            workers for their copies' id through weightsync's worker extension.
        stage: receive the whole stream before loading any of it, as `GlooTransport` does:
            costs each worker the synced bytes in host memory (TP ranks included) from the
            first bucket to the commit. False: the workers load each bucket as it comes, inside
            the engine's pause, and a failure part-way leaves a mix (fenced on a server with
            weightsync's middleware).
        max_stage_bytes: the most a worker may stage (None: no bound); a larger sync is
            refused with nothing loaded.

    Raises:
        ValueError: ``delta`` without ``tagged``.
    """

    name = "weight-transfer:gloo"

    def __init__(
        self,
        client: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 300.0,
        *,
        tagged: bool = True,
        delta: bool = False,
        stage: bool = True,
        max_stage_bytes: int | None = None,
    ) -> None:
        super().__init__(client, tagged=tagged)
        self._copies = sent_copies(delta, tagged, "WeightTransferGloo")
        self.link = gloo.Link(host, port, timeout_s)
        self.stages = stage
        self.max_stage_bytes = max_stage_bytes

    def _join(self, world_size: int) -> None:
        size = world_size + 1

        def join(port: int, secret: str) -> Future:
            link = self.link
            info = InitInfo(
                host=link.host, port=port, world_size=size, timeout_s=link.timeout_s, secret=secret
            )
            return self._pool.submit(
                _call, self.client, "init_weight_transfer_engine", asdict(info)
            )

        self.link.open(size, join)

    def _connected(self) -> bool:
        return super()._connected() and self.link.group is not None

    def prepare(self, rpc: Rpc, buckets: Iterable[Bucket]) -> Staged:
        """Open the update and broadcast every bucket into the workers' stages while the engine
        serves, then wait until every worker checked the whole stream; the apply loads what
        they staged. Any failure here (a refused frame, the trainer's own error, a dead
        trainer, a stage too large, a name the engine does not load) closes the update with
        nothing loaded and the engine never paused. ``stage=False``: the whole update is the
        apply."""
        self._check_connected()
        signer = signer_for(self.tagged)
        copies = self._copies
        delta = ""
        if copies is not None:  # deltas only if every worker holds the last sync's copies
            delta = copies.begin(o.value for o in rpc("weightsync_delta_state", {"backend": True}))
        send_one = partial(send_timed, copies=copies)
        proof = proof_args(signer)
        settled: list[bool] = []

        def settle(ok: bool) -> None:  # the trainer's kept copies follow the workers'
            settled.append(True)
            if copies is not None and ok:
                copies.commit()
            elif copies is not None:
                copies.reset()

        def unsettled() -> None:  # the apply never ran
            if not settled:
                settle(False)

        if not self.stages:

            def stream() -> None:
                info = UpdateInfo(gloo=True, delta=delta, final=True, **proof)
                received = self._pool.submit(self._update, info)
                gloo.send(self.link.group, buckets, received, send_one, signer)

            def apply_streamed() -> None:
                try:
                    self._start(rpc)
                    self._commit(rpc, stream)
                except BaseException:
                    settle(False)
                    raise
                settle(True)

            return Staged(apply_streamed, unsettled)

        try:
            self._start(rpc)
            info = UpdateInfo(gloo=True, stage=True, delta=delta, max_bytes=self.max_stage_bytes)
            self._update(UpdateInfo(**{**asdict(info), **proof}))
            gloo.send(self.link.group, buckets, None, send_one, signer)
            self._update(UpdateInfo(gloo=True, staged=True))
            rpc("weightsync_weight_update", {})  # every worker staged and checked it all
        except BaseException as error:
            settle(False)
            self._close_given_up(rpc, error)
            raise

        def apply() -> None:
            try:
                commit = UpdateInfo(gloo=True, commit=True, final=True)
                self._commit(rpc, lambda: self._update(commit))
            except BaseException:
                settle(False)
                raise
            settle(True)

        def drop() -> None:  # never committed: close the update, the workers drop the stage
            if not settled:
                unsettled()
                dropped = RuntimeError("the staged sync was dropped before its commit")
                self._close_given_up(rpc, dropped)

        return Staged(apply, drop)

    def close(self) -> None:
        if self._copies is not None and self._rpc is not None and self.link.group is not None:
            drop_kept_copies(self._rpc, self._copies, {"backend": True})
        if self.link.group is not None:
            shutdown = getattr(self.client, "shutdown_weight_transfer_engine", None)
            try:
                if shutdown is not None:
                    shutdown()  # the workers drop their end of the group
            except Exception:  # closing must not fail on a stopped server
                logger.warning("weightsync: shutdown_weight_transfer_engine failed", exc_info=True)
        self.link.close()
        super().close()
