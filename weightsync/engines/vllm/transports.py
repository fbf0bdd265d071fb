"""How weight bytes reach the workers of a vLLM engine in other processes: the trainer's half of
each transport (the workers' half is ``in_engine/``; both speak ``weightsync.wire``).

``collective_rpc`` carries JSON only (a tensor in its arguments arrives as a list, several times
slower than tmpfs), so an out-of-process engine moves bytes through a transport and uses the RPC
to tell the workers where to read. A transport is a protocol (which calls the workers get) times
a carrier (how the bytes travel):

| transport | calls | carrier |
|---|---|---|
| `TmpfsTransport` | worker extension | files in a RAM folder (kept between syncs, or fresh) |
| `GlooTransport` | worker extension | a gloo group, trainer rank 0 (any host) |
| `WeightTransferTransport` | vLLM's weight-transfer API, ``"weightsync"`` backend | files or gloo |
| `VLLMBackendTransport` | vLLM's weight-transfer API, its ``nccl`` / ``ipc`` backend | CUDA |

Each worker reports an `Outcome` whichever way the bytes came, read by
``wire.protocol.raise_failures``; every load runs in-worker recovery, so a failure part-way
leaves every worker serving. A failure while the trainer produces buckets happens before the
engine is touched (files) or is told to the workers with an abort (gloo, weight-transfer).

Every transport but vLLM's own backends tags each bucket with a key fresh per sync
(``wire.tags``; ``tagged=False`` turns it off) and sends the key and tags on the control
channel, so the workers load only the bytes this trainer produced (docs/security.md).

``VLLMBackendTransport`` is written against vLLM's API but never run here: no CUDA (see
``docs/engines.md``, "Deployments").
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ... import timing
from ...plan import Bucket
from ...wire import format as fmt
from ...wire import gloo
from ...wire.delta import SentCopies, WireCount
from ...wire.files import KeptFiles, Written, bucket_name, sign_file, write_folder
from ...wire.protocol import InitInfo, Outcome, UpdateInfo, raise_failures
from ...wire.scratch import private_dir, scratch_dir
from ...wire.tags import Signer
from .in_engine.backend import result_file

logger = logging.getLogger(__name__)

#: ``rpc(method, kwargs)`` runs a worker-extension method on every worker and returns their
#: outcomes, raising those that failed (``RemoteVLLMEngine.rpc``).
Rpc = Callable[[str, dict[str, Any]], list[Outcome]]


def _one_of(what: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {allowed}, got {value!r}")
    return value


def _serializing() -> Any:
    return timing.span("serialize")


def _send_timed(
    group: Any, bucket: fmt.Pairs, signer: Signer | None, copies: SentCopies | None = None
) -> None:
    """Send one bucket (``copies``: as a delta where the workers hold its base), timed."""
    with timing.span("serialize"):
        gloo.send_bucket(group, bucket, signer, copies)


def _drop_kept_copies(rpc: Rpc, copies: SentCopies, kwargs: dict[str, Any]) -> None:
    """A delta transport closes: the workers drop their kept copies (one copy of the weights
    each), and so does the trainer; a stopped engine does not fail the close."""
    try:
        rpc("weightsync_delta_drop", kwargs)
    except Exception:
        logger.warning("weightsync: weightsync_delta_drop failed", exc_info=True)
    copies.reset()


def _signer(tagged: bool) -> Signer | None:
    return Signer() if tagged else None


def _proof(signer: Signer | None, tags: list[str] | None = None) -> dict[str, Any]:
    """The RPC arguments that let the workers check what they load (none when untagged)."""
    if signer is None:
        return {}
    return {"key": signer.key_hex} if tags is None else {"key": signer.key_hex, "tags": tags}


class Transport(ABC):
    """Moves checkpoint-format buckets into every worker of one engine and has them loaded."""

    name: str
    #: The workers check a keyed tag of every bucket (and adapter) this transport sends.
    tagged: bool = False

    def connect(self, rpc: Rpc, world_size: int) -> None:
        """Set up whatever the transport needs with the engine's ``world_size`` workers."""

    @abstractmethod
    def send(self, rpc: Rpc, buckets: Iterable[Bucket]) -> None:
        """Load ``buckets`` into every worker. On failure the workers have already abandoned
        any half-done reload (they serve a mix of old and new layers) and the error is raised."""

    def put_adapter(
        self, rpc: Rpc, version: int, tensors: dict[str, torch.Tensor], config: dict
    ) -> str | None:
        """Put an adapter version (its tensors and ``adapter_config.json`` content) where the
        engine's LoRA loader reads it and return that path; None: this transport does not carry
        adapters, the engine writes them to a folder it shares with the server."""
        return None

    def close(self) -> None:
        """Release what `connect` set up (files, sockets)."""


class TmpfsTransport(Transport):
    """Buckets as safetensors files in a RAM folder the workers can read (``wire.files``).

    Args:
        root: a folder the engine's workers can read at the same path; defaults to a fresh
            scratch folder in ``/dev/shm``, removed by `close` (or when collected, or by the
            next weightsync process after a crash).
        keep: keep the files (and both sides' mappings of them) between syncs and rewrite them
            in place: RAM for one copy of the weights stays taken between syncs, and a sync
            costs about half (``docs/benchmarks.md``). False writes a fresh folder per sync and
            removes it after.
        tagged: tag every file (``wire.tags``); the workers check them all before loading any.

    Raises:
        PermissionError: ``root`` lets others than its owner in (``wire.scratch``).
    """

    name = "tmpfs"

    def __init__(
        self, root: str | Path | None = None, *, keep: bool = True, tagged: bool = True
    ) -> None:
        self._owned = root is None
        self.root = private_dir(root) if root is not None else scratch_dir(self, "tmpfs")
        self.tagged = tagged
        self._updates = 0
        self._kept = KeptFiles(self.root / "kept") if keep else None

    def send(self, rpc: Rpc, buckets: Iterable[Bucket]) -> None:
        signer = _signer(self.tagged)
        if self._kept is not None:
            written = self._kept.write(buckets, around=_serializing, signer=signer)
            kwargs = {"folder": str(self._kept.folder), "files": written.names}
            rpc("weightsync_load_files", kwargs | _proof(signer, written.tags))
            return
        folder, written = self.stage(buckets, signer=signer)
        try:
            rpc("weightsync_load_files", {"folder": str(folder)} | _proof(signer, written.tags))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def stage(
        self, buckets: Iterable[Bucket], *, aliases: bool = True, signer: Signer | None = None
    ) -> tuple[Path, Written]:
        """Write every bucket to a new folder under `root` (tagged by ``signer`` if given) and
        return it; the caller removes it. Nothing reaches the engine here, so a failure (the
        trainer's, a full tmpfs) leaves it untouched. ``aliases``: see ``wire.format``."""
        self._updates += 1
        folder = self.root / f"update-{self._updates:06d}"
        return folder, write_folder(
            buckets, folder, aliases=aliases, around=_serializing, signer=signer
        )

    def close(self) -> None:
        if self._kept is not None:
            self._kept.close()
            shutil.rmtree(self._kept.folder, ignore_errors=True)
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)


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
    ) -> None:
        if delta and not tagged:
            raise ValueError(
                "GlooTransport(delta=True) needs tagged=True: a patched bucket is proven "
                "byte-identical to the whole one by the whole bucket's tag"
            )
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self.tagged = tagged
        self._copies = SentCopies() if delta else None
        self._rpc: Rpc | None = None
        self._group: Any = None
        self._store: Any = None
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
                "host": self.host,
                "port": port,
                "world_size": world_size + 1,
                "timeout_s": self.timeout_s,
                "secret": secret,
            }
            return self._pool.submit(rpc, "weightsync_join_gloo", kwargs)

        self._group, self._store = gloo.open_group(
            self.host, self.port, world_size + 1, self.timeout_s, join
        )

    def send(self, rpc: Rpc, buckets: Iterable[Bucket]) -> None:
        if self._group is None:
            raise RuntimeError("GlooTransport.send before connect")
        signer = _signer(self.tagged)
        copies = self._copies
        if copies is None:
            received = self._pool.submit(rpc, "weightsync_receive_gloo", _proof(signer))
            gloo.send(self._group, buckets, received, _send_timed, signer)
            return

        # Deltas only if every worker still holds the copies the last successful sync left.
        reported = [o.value for o in rpc("weightsync_delta_state", {})]
        kwargs = _proof(signer) | {"delta": copies.begin(reported)}
        received = self._pool.submit(rpc, "weightsync_receive_gloo", kwargs)
        try:
            gloo.send(self._group, buckets, received, partial(_send_timed, copies=copies), signer)
        except BaseException:
            copies.reset()
            raise
        copies.commit()

    def put_adapter(
        self, rpc: Rpc, version: int, tensors: dict[str, torch.Tensor], config: dict
    ) -> str | None:
        """Broadcast the adapter; the engine's first worker writes it to a folder on its own
        host (the server may be on another one) and its path is returned."""
        if self._group is None:
            raise RuntimeError("GlooTransport.put_adapter before connect")
        signer = _signer(self.tagged)
        kwargs = {"version": version, "config": json.dumps(config, default=str)}
        received = self._pool.submit(rpc, "weightsync_receive_adapter", kwargs | _proof(signer))
        gloo.send(self._group, [list(tensors.items())], received, _send_timed, signer)
        return next(o.value for o in received.result() if o.value is not None)

    def close(self) -> None:
        if self._copies is not None and self._rpc is not None and self._group is not None:
            _drop_kept_copies(self._rpc, self._copies, {})
        self._group = None
        self._store = None
        self._pool.shutdown(wait=False)


def make_transport(transport: str | Transport) -> Transport:
    """A transport from its name (``"tmpfs"``, ``"gloo"``) or as given."""
    if isinstance(transport, Transport):
        return transport
    if transport == "tmpfs":
        return TmpfsTransport()
    if transport == "gloo":
        return GlooTransport()
    raise ValueError(f"transport must be 'tmpfs', 'gloo' or a Transport, got {transport!r}")


# --- vLLM's weight-transfer API -------------------------------------------------------------------


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
        signer = _signer(self.tagged)
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
                    proof = _proof(signer, [sign_file(signer, path)] if signer else None)
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
        update = asdict(UpdateInfo(gloo=True, delta=delta, **_proof(signer)))
        received = self._pool.submit(_call, self.client, "update_weights", update)
        send_one = partial(_send_timed, copies=self._copies)
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
            _drop_kept_copies(self._rpc, self._copies, {"backend": True})
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


# --- vLLM's own GPU backends --------------------------------------------------------------------


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _bucket_source() -> Any:
    """A vLLM ``WeightSource`` over the bucket currently being sent (swapped per chunk)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class BucketSource(WeightSource):
        def __init__(self) -> None:
            self.bucket: Bucket = []

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.bucket]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(list(self.bucket))

    return BucketSource()


class VLLMBackendTransport(Transport):
    """vLLM's own ``nccl`` or ``ipc`` weight-transfer backend, fed weightsync's buckets (CUDA).

    The engine must run that backend (``--weight-transfer-config '{"backend": "nccl"}'``) and
    weightsync's worker extension (for its facts and recovery). vLLM's trainer engine
    (``WeightTransferTrainerFactory.trainer_init``) makes the rendezvous; each write is one
    update: ``start_weight_update``, one ``update_weights`` chunk per bucket (NCCL: broadcast
    while the workers receive; IPC: CUDA IPC handles), ``finish_weight_update``. Buckets go
    one by one because vLLM's ``send_weights`` wants the whole model's metadata before the first
    tensor, and weightsync produces (merges, casts) tensors lazily.

    If the trainer fails part-way, the half-done layers are restored with weightsync's
    ``weightsync_abandon`` before ``finish_weight_update`` (which would otherwise process them
    with missing parts). vLLM's backends raise from ``update_weights`` on a bad tensor: at TP>1
    that leaves vLLM's RPC replies out of step (see this module's docstring); prefer the
    ``"weightsync"`` backend where its speed suffices.

    Not run on this project's CPU machines: its test is skipped without CUDA.

    Args:
        client: a ``VLLMWeightSyncClient`` (see `WeightTransferTransport`).
        backend: ``"nccl"`` (any host) or ``"ipc"`` (same GPUs' host).
        master_address: nccl: the address the trainer listens on.
        master_port: nccl: the rendezvous port (0: a free one).
        packed: send through vLLM's packed buffers.
        device: where CPU tensors of a bucket are moved before sending.
    """

    def __init__(
        self,
        client: Any,
        backend: str = "nccl",
        *,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        packed: bool = True,
        device: str = "cuda",
    ) -> None:
        self.client = client
        self.backend = _one_of("backend", backend, ("nccl", "ipc"))
        self.name = f"vllm-{backend}"
        self.master_address, self.master_port = master_address, master_port
        self.packed, self.device = packed, device
        self._engine: Any = None
        self._source: Any = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weightsync-nccl")

    def connect(self, rpc: Rpc, world_size: int) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        info: Any
        if self.backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info = NCCLTrainerInitInfo(
                rank=0,
                master_address=self.master_address,
                master_port=self.master_port or _free_port(self.master_address),
                world_size=world_size + 1,
                packed=self.packed,
            )
        else:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            info = IPCTrainerInitInfo(rank=0, packed=self.packed)
        self._source = _bucket_source()
        self._engine = WeightTransferTrainerFactory.trainer_init(
            info, client=self.client, source=self._source
        )

    def send(self, rpc: Rpc, buckets: Iterable[Bucket]) -> None:
        if self._engine is None:
            raise RuntimeError(f"{type(self).__name__}.send before connect (or after close)")
        keep: list[Any] = []  # IPC: the shared copies must outlive finish_weight_update
        _call(self.client, "start_weight_update")
        try:
            for bucket in buckets:
                self._source.bucket = [
                    (n, t if t.is_cuda else t.to(self.device)) for n, t in bucket
                ]
                keep.append(self._send_chunk())
        except BaseException:
            try:
                rpc("weightsync_abandon", {})
            finally:
                _call(self.client, "finish_weight_update")
            raise
        _call(self.client, "finish_weight_update")
        self._engine._post_send_sync()  # the transfer has landed (IPC: handles released)
        del keep

    def _send_chunk(self) -> Any:
        if self.backend == "ipc":
            return self._engine._send(self._source)
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

        meta = self._source.metadata()
        update = NCCLWeightTransferUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
        )
        # The workers receive inside update_weights while the trainer broadcasts.
        received = self._pool.submit(_call, self.client, "update_weights", asdict(update))
        self._engine._broadcast(self._source, meta)
        received.result()
        return None

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
        self._engine = None
        self._pool.shutdown(wait=False)
