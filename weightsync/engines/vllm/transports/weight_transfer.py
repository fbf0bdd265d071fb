"""Buckets through vLLM's weight-transfer API (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``) to weightsync's
``"weightsync"`` backend in the workers (``in_engine/backend.py``), carried by files or gloo."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from .... import timing
from ....plan import Bucket
from ....wire import format as fmt
from ....wire import gloo
from ....wire.delta import SentCopies, WireCount
from ....wire.files import bucket_name, sign_file
from ....wire.protocol import InitInfo, Outcome, UpdateInfo, raise_failures
from ....wire.scratch import private_dir, scratch_dir
from ....wire.tags import Signer
from ..in_engine.backend import result_file
from .base import Rpc, Transport, drop_kept_copies, proof_args, send_timed, sent_copies, signer_for

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


_NO_OUTCOME = (
    "reported no outcome: is the engine running the 'weightsync' weight-transfer backend "
    """(--weight-transfer-config '{"backend": "weightsync"}') and reading this folder?"""
)


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

    Every write is one update: ``start_weight_update``, then the buckets, then
    ``finish_weight_update``, after which every worker's outcome is read back and a failure is
    raised. If the trainer fails part-way it tells the workers to abandon the update before
    finishing it.

    ``finish_weight_update`` does not reset vLLM's prefix cache (measured): the engine's write
    path (``RemoteVLLMEngine``) pauses, sends, resets it and resumes around `send`.

    ``client`` is a ``VLLMWeightSyncClient``: vLLM's ``HTTPVLLMWeightSyncClient(url)`` for a
    server started with ``--weight-transfer-config '{"backend": "weightsync"}'``, or
    `LLMWeightSyncClient` for an ``LLM(weight_transfer_config=...)``. With a server, pass an
    ``HTTPControl(url, token=...)`` instead when the server checks weightsync's token (vLLM's
    own HTTP client sends none). ``tagged``: tag every bucket (``wire.tags``): the key and a
    file's tag travel in the ``update_weights`` payload, a stream's tags in the stream.
    """

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

    def _start(self, rpc: Rpc) -> None:
        """``start_weight_update``; if a trainer that died mid-update left its update open (vLLM
        then refuses a new one, and the layers it began wait on the meta device), restore those
        layers through the worker extension, close that update and start again.

        At TP>1 vLLM's own refusal already leaves its RPC replies out of step (every worker
        raises); only restarting the engine recovers from that."""
        try:
            _call(self.client, "start_weight_update")
        except Exception as e:
            if "already active" not in str(e):
                raise
            logger.warning("weightsync: closing a weight update another trainer left open")
            # Inside this trainer's pause, and the update that follows rewrites every weight:
            # the dead trainer's finished layers are never served, so no fence (server_lease).
            rpc("weightsync_abandon", {"fence": False})
            _call(self.client, "finish_weight_update")
            _call(self.client, "start_weight_update")

    def send(self, rpc: Rpc, buckets: Iterable[Bucket]) -> None:
        if not self._connected():
            raise RuntimeError(f"{type(self).__name__}.send before connect (or after close)")
        signer = signer_for(self.tagged)
        copies = self._copies
        delta = ""
        if copies is not None:  # deltas only if every worker holds the last sync's copies
            delta = copies.begin(o.value for o in rpc("weightsync_delta_state", {"backend": True}))
        try:
            self._start(rpc)
            failure, outcomes = self._update(buckets, signer, delta)
        except BaseException:
            if copies is not None:
                copies.reset()
            raise
        if copies is not None:
            if failure is None and all(o.ok for o in outcomes):
                copies.commit()
            else:
                copies.reset()
        if failure is not None:
            raise failure  # the trainer's error is the cause; the workers abandoned the update
        raise_failures(
            "the weight update",
            outcomes,
            hint=(
                " (they restored their unfinished layers and keep serving a mix of old and new "
                "weights; sync every weight again)"
            ),
        )

    def _update(
        self, buckets: Iterable[Bucket], signer: Signer | None, delta: str
    ) -> tuple[BaseException | None, list[Outcome]]:
        """The buckets of one started update, then its finish: the trainer-side failure (the
        workers were told to abandon) and every worker's outcome."""
        raise NotImplementedError

    def close(self) -> None:
        self._world_size = 0
        self._pool.shutdown(wait=False)


class WeightTransferFiles(WeightTransferTransport):
    """`WeightTransferTransport` carried by files: one ``update_weights`` per safetensors file
    in a RAM folder, the next bucket written while the workers load the last, so at most two
    are on disk; every worker writes its outcome to a result file there. Same host, or a
    shared filesystem.

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
        self._folder = self.root  # the running update's folder (`send`)

    def _join(self, world_size: int) -> None:
        _call(self.client, "init_weight_transfer_engine", asdict(InitInfo()))

    def send(self, rpc: Rpc, buckets: Iterable[Bucket]) -> None:
        """The update's folder is made before the engine is touched and removed after."""
        self._updates += 1
        self._folder = self.root / f"update-{self._updates:06d}"
        self._folder.mkdir(mode=0o700, parents=True)
        try:
            super().send(rpc, buckets)
        finally:
            shutil.rmtree(self._folder, ignore_errors=True)

    def _update(
        self, buckets: Iterable[Bucket], signer: Signer | None, delta: str
    ) -> tuple[BaseException | None, list[Outcome]]:
        failure = self._stream(self._folder, buckets, signer)
        return failure, self._finish(self._folder)

    def _stream(
        self, folder: Path, buckets: Iterable[Bucket], signer: Signer | None
    ) -> BaseException | None:
        """Write and load the buckets one file each; returns the trainer-side failure."""
        loading: Future | None = None
        previous: Path | None = None
        try:
            for i, bucket in enumerate(buckets):
                path = folder / bucket_name(i)
                with timing.span("serialize"):
                    fmt.write(bucket, path)
                    proof = proof_args(signer, [sign_file(signer, path)] if signer else None)
                if loading is not None and previous is not None:
                    loading.result()
                    previous.unlink()
                update = asdict(UpdateInfo(folder=str(folder), files=[path.name], **proof))
                loading = self._pool.submit(_call, self.client, "update_weights", update)
                previous = path
            if loading is not None:
                loading.result()
            return None
        except BaseException as error:  # noqa: BLE001 (raised by send after finishing)
            if loading is not None and not loading.done():
                loading.exception()  # wait: never two chunks at once
            try:
                _call(
                    self.client,
                    "update_weights",
                    asdict(UpdateInfo(folder=str(folder), abort=Outcome.failed(error).error)),
                )
            except Exception:  # the trainer's error is the one to raise
                logger.exception("weightsync: telling the workers to abandon the update failed")
            return error

    def _finish(self, folder: Path) -> list[Outcome]:
        """``finish_weight_update`` and every worker's outcome, from its result file."""
        _call(self.client, "finish_weight_update")
        outcomes = []
        for rank in range(self._world_size):
            path = result_file(folder, rank)
            if not path.exists():
                outcomes.append(Outcome.failed(_NO_OUTCOME, rank))
            else:
                outcomes.append(Outcome.from_bytes(path.read_bytes()))
        return outcomes

    def close(self) -> None:
        super().close()
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)


class WeightTransferGloo(WeightTransferTransport):
    """`WeightTransferTransport` carried by a gloo group (trainer rank 0, any host): one
    ``update_weights`` while the buckets are broadcast as ``wire.stream``'s frames, every
    worker's outcome all-gathered over the group.

    Args:
        client: see `WeightTransferTransport`.
        host: address the trainer listens on and the workers connect to.
        port: the rendezvous port (0: a free one).
        timeout_s: how long an operation waits for a peer before failing.
        tagged: see `WeightTransferTransport`.
        delta: send only the changed words of a bucket whose base every worker's backend holds
            (``wire.delta``, as `GlooTransport`); needs ``tagged``. The trainer asks the
            workers for their copies' id through weightsync's worker extension (vLLM's four
            calls cannot answer), so the engine needs that extension too.

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
    ) -> None:
        super().__init__(client, tagged=tagged)
        self._copies = sent_copies(delta, tagged, "WeightTransferGloo")
        self.link = gloo.Link(host, port, timeout_s)

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

    def _update(
        self, buckets: Iterable[Bucket], signer: Signer | None, delta: str
    ) -> tuple[BaseException | None, list[Outcome]]:
        failure = self._stream(buckets, signer, delta)
        return failure, self._finish()

    def _stream(
        self, buckets: Iterable[Bucket], signer: Signer | None, delta: str
    ) -> BaseException | None:
        """Broadcast the buckets (``delta``: as deltas where the workers hold the base)
        while the workers receive; returns the trainer-side failure."""
        update = asdict(UpdateInfo(gloo=True, delta=delta, **proof_args(signer)))
        received = self._pool.submit(_call, self.client, "update_weights", update)
        send_one = partial(send_timed, copies=self._copies)
        try:
            gloo.send(self.link.group, buckets, received, send_one, signer)
        except BaseException as error:  # noqa: BLE001 (raised by send after finishing)
            return error
        return None

    def _finish(self) -> list[Outcome]:
        """``finish_weight_update`` and every worker's outcome, all-gathered over the group."""
        work, gathered = gloo.gather_outcomes(self.link.group, self._world_size + 1, Outcome())
        try:
            _call(self.client, "finish_weight_update")
        except BaseException:
            # The workers never reached the exchange, which now waits for them: this group
            # can carry nothing more. Make a new transport (engine) to go on.
            self.link.close()
            raise
        work.wait()
        return gloo.outcomes(gathered)[1:]

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
