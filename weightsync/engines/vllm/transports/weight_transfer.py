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
from .base import Rpc, Transport, drop_kept_copies, proof_args, send_timed, signer_for

logger = logging.getLogger(__name__)


def _one_of(what: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {allowed}, got {value!r}")
    return value


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
    """Buckets through vLLM's weight-transfer API to the ``"weightsync"`` backend.

    Every write is one update: ``start_weight_update``, then the buckets (``inner="files"``: one
    ``update_weights`` per safetensors file in a RAM folder, the next bucket written while the
    workers load the last, so at most two are on disk; ``inner="gloo"``: one ``update_weights``
    while the buckets are broadcast), then ``finish_weight_update``, after which every worker's
    outcome is read back (files, or an all-gather over gloo) and a failure is raised. If the
    trainer fails part-way it tells the workers to abandon the update before finishing it.

    ``finish_weight_update`` does not reset vLLM's prefix cache (measured): the engine's write
    path (``RemoteVLLMEngine``) pauses, sends, resets it and resumes around `send`.

    Args:
        client: a ``VLLMWeightSyncClient``: vLLM's ``HTTPVLLMWeightSyncClient(url)`` for a server
            started with ``--weight-transfer-config '{"backend": "weightsync"}'``, or
            `LLMWeightSyncClient` for an ``LLM(weight_transfer_config=...)``.
        inner: ``"files"`` (same host or a shared filesystem) or ``"gloo"`` (any host).
        root: files: a folder the workers read at the same path; defaults to a fresh
            ``/dev/shm/weightsync-*`` folder, removed by `close`.
        host: gloo: address the trainer listens on and the workers connect to.
        port: gloo: the rendezvous port (0: a free one).
        timeout_s: gloo: how long an operation waits for a peer before failing.
        tagged: tag every bucket (``wire.tags``): the key and a file's tag travel in the
            ``update_weights`` payload, a stream's tags in the stream.
        delta: gloo: send only the changed words of a bucket whose base every worker's backend
            holds (``wire.delta``, as `GlooTransport`); needs ``tagged``. The trainer asks the
            workers for their copies' id through weightsync's worker extension (vLLM's four
            calls cannot answer), so the engine needs that extension too.

    Raises:
        ValueError: ``delta`` with ``inner="files"`` or without ``tagged``.

    With a server, pass an ``HTTPControl(url, token=...)`` as ``client`` when the server checks
    weightsync's token (vLLM's own HTTP client sends none).
    """

    def __init__(
        self,
        client: Any,
        inner: str = "files",
        *,
        root: str | Path | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 300.0,
        tagged: bool = True,
        delta: bool = False,
    ) -> None:
        self.client = client
        self.inner = _one_of("inner", inner, ("files", "gloo"))
        if delta and (inner != "gloo" or not tagged):
            raise ValueError(
                "WeightTransferTransport(delta=True) needs inner='gloo' (the workers patch "
                "their kept copies as the stream arrives) and tagged=True (the whole bucket's "
                "tag proves a patched bucket byte-identical)"
            )
        self._copies = SentCopies() if delta else None
        self._rpc: Rpc | None = None
        self.name = f"weight-transfer:{inner}"
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.tagged = tagged
        self.root: Path | None = None
        self._owned = inner == "files" and root is None
        if inner == "files":
            self.root = (
                private_dir(root) if root is not None else scratch_dir(self, "weight-transfer")
            )
        self._world_size = 0
        self._updates = 0
        self._group: Any = None
        self._store: Any = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weightsync-weight-transfer")

    # --- set-up -------------------------------------------------------------------------------

    @property
    def last_sync(self) -> WireCount | None:
        """What the last send put on the wire (delta transports only)."""
        return None if self._copies is None else self._copies.last

    def connect(self, rpc: Rpc, world_size: int) -> None:
        self._world_size = world_size
        self._rpc = rpc
        if self.inner == "files":
            _call(self.client, "init_weight_transfer_engine", asdict(InitInfo()))
            return
        size = world_size + 1

        def join(port: int, secret: str) -> Future:
            info = InitInfo(
                host=self.host, port=port, world_size=size, timeout_s=self.timeout_s, secret=secret
            )
            return self._pool.submit(
                _call, self.client, "init_weight_transfer_engine", asdict(info)
            )

        self._group, self._store = gloo.open_group(self.host, self.port, size, self.timeout_s, join)

    # --- one update -----------------------------------------------------------------------------

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
            rpc("weightsync_abandon", {})
            _call(self.client, "finish_weight_update")
            _call(self.client, "start_weight_update")

    def send(self, rpc: Rpc, buckets: Iterable[Bucket]) -> None:
        if not self._world_size or (self.inner == "gloo" and self._group is None):
            raise RuntimeError(f"{type(self).__name__}.send before connect (or after close)")
        folder = None
        if self.root is not None:
            self._updates += 1
            folder = self.root / f"update-{self._updates:06d}"
            folder.mkdir(mode=0o700, parents=True)
        signer = signer_for(self.tagged)
        copies = self._copies
        delta = ""
        if copies is not None:  # deltas only if every worker holds the last sync's copies
            delta = copies.begin(o.value for o in rpc("weightsync_delta_state", {"backend": True}))
        try:
            self._start(rpc)
            if folder is not None:
                failure = self._stream_files(folder, buckets, signer)
            else:
                failure = self._stream_gloo(buckets, signer, delta)
            outcomes = self._finish(folder)
        except BaseException:
            if copies is not None:
                copies.reset()
            raise
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
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

    def _stream_files(
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

    def _stream_gloo(
        self, buckets: Iterable[Bucket], signer: Signer | None, delta: str
    ) -> BaseException | None:
        """Broadcast the buckets (``delta``: as deltas where the workers hold the base)
        while the workers receive; returns the trainer-side failure."""
        update = asdict(UpdateInfo(gloo=True, delta=delta, **proof_args(signer)))
        received = self._pool.submit(_call, self.client, "update_weights", update)
        send_one = partial(send_timed, copies=self._copies)
        try:
            gloo.send(self._group, buckets, received, send_one, signer)
        except BaseException as error:  # noqa: BLE001 (raised by send after finishing)
            return error
        return None

    def _finish(self, folder: Path | None) -> list[Outcome]:
        """``finish_weight_update`` and every worker's outcome."""
        if folder is not None:
            _call(self.client, "finish_weight_update")
            outcomes = []
            for rank in range(self._world_size):
                path = result_file(folder, rank)
                if not path.exists():
                    outcomes.append(Outcome.failed(_NO_OUTCOME, rank))
                else:
                    outcomes.append(Outcome.from_bytes(path.read_bytes()))
            return outcomes
        work, gathered = gloo.gather_outcomes(self._group, self._world_size + 1, Outcome())
        try:
            _call(self.client, "finish_weight_update")
        except BaseException:
            # The workers never reached the exchange, which now waits for them: this group
            # can carry nothing more. Make a new transport (engine) to go on.
            self._group = None
            raise
        work.wait()
        return gloo.outcomes(gathered)[1:]

    def close(self) -> None:
        if self._copies is not None and self._rpc is not None and self._group is not None:
            drop_kept_copies(self._rpc, self._copies, {"backend": True})
        if self._group is not None:
            shutdown = getattr(self.client, "shutdown_weight_transfer_engine", None)
            try:
                if shutdown is not None:
                    shutdown()  # the workers drop their end of the group
            except Exception:  # closing must not fail on a stopped server
                logger.warning("weightsync: shutdown_weight_transfer_engine failed", exc_info=True)
        self._group = self._store = None
        self._world_size = 0
        self._pool.shutdown(wait=False)
        if self._owned and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
