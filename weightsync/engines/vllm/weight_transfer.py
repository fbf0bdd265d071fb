"""weightsync over vLLM's native weight-transfer API (init / start / update / finish).

vLLM 0.32 exposes a four-call weight-update protocol: ``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights`` (one or many chunks), ``finish_weight_update``, as
``LLM`` methods, ``AsyncLLM`` methods and HTTP routes (``vllm serve --weight-transfer-config
'{"backend": ...}'``). The bytes travel through a *backend* that vLLM creates in every worker.
This module is both halves of weightsync's backend, plus the trainer half of vLLM's own GPU ones:

- `WeightsyncTransferEngine` (worker side, registered as backend ``"weightsync"``):
  receives checkpoint-format buckets as safetensors files in a folder named by each chunk
  (same host or shared filesystem), or over a gloo process group (trainer rank 0, workers
  1..N; works across hosts on CPU), and loads them with vLLM's layerwise reload between
  ``start_weight_update`` and ``finish_weight_update``.
- `WeightTransferTransport` (trainer side): a weightsync ``Transport`` that drives the
  four calls through any ``VLLMWeightSyncClient`` (vLLM's ``HTTPVLLMWeightSyncClient(url)``, or
  `LLMWeightSyncClient` for an ``LLM``), so ``VLLMServerEngine(url,
  transport=WeightTransferTransport(client))`` syncs through the weight-transfer routes.
- `VLLMBackendTransport` (trainer side, CUDA only): vLLM's own ``nccl``/``ipc`` backends,
  fed weightsync's planned buckets.

Why the worker side never raises from vLLM's four calls: vLLM's multiprocess executor stops
reading replies at the first failed worker, so with TP>1 the other workers' replies stay queued
and answer the next calls; and a raising ``finish_weight_update`` leaves vLLM's
``_weight_update_active`` set, so every later update is refused. Instead, a failure abandons the
half-done layerwise reload at once (every unfinished layer gets its previous tensors back, as
``worker.abandon_layerwise_reload`` does for weightsync's own RPCs), the rest of the update is
skipped, and at ``finish_weight_update`` each worker reports its outcome back the way the bytes
came: a ``result-rank*.json`` file in the update's folder, or an all-gather over the gloo group.
The trainer side raises it. The server keeps serving a mix of old and new layers, and the
engine marks its base unsynced, so only a full sync may follow.

Registration: the backend must be registered in every worker process before vLLM builds it
(``Worker.load_model``). ``worker.py`` imports this module, and vLLM imports ``worker.py`` in each
worker (``--worker-extension-cls``); see `register` for how this stays free of a vLLM
import in a trainer that never uses it.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import json
import logging
import shutil
import socket
import sys
import tempfile
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...plan import Bucket
from .transport import (
    Rpc,
    Transport,
    _tmpfs,
    broadcast_bucket,
    open_gloo_group,
    save_bucket,
    send_frame,
)
from .worker import (
    ALIASES_KEY,
    FRAME_ABORT,
    FRAME_END,
    GlooReceiver,
    abandon_layerwise_reload,
    gloo_group,
    has_cpu_moe,
    repack_cpu_moe,
)

logger = logging.getLogger(__name__)

#: The name to put in ``--weight-transfer-config '{"backend": "weightsync"}'``.
BACKEND = "weightsync"

#: Bytes of one worker's outcome message in the gloo result exchange (longer ones are cut).
RESULT_BYTES = 4096

_FACTORY = "vllm.distributed.weight_transfer.factory"


# --- registration ---------------------------------------------------------------------------------


def register() -> None:
    """Register `WeightsyncTransferEngine` with vLLM's worker-side factory as
    ``"weightsync"``. Idempotent: safe in every process, as often as it is called."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # The factory raises ValueError for a name already registered (its only other ValueError
    # is a module path without a class name, which this call never makes).
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "WeightsyncTransferEngine")


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers the backend the moment vLLM's factory module is first imported.

    Importing weightsync must not import vLLM (4 s, and a trainer may never use it), so when
    this module is imported before vLLM, registration waits for vLLM's factory. The finder stays
    in ``sys.meta_path`` until then, so a process forked from this one (vLLM forks its engine
    core and workers by default) registers too, when its worker imports the factory.
    """

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _FACTORY:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            register()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _register_now_or_on_import() -> None:
    if _FACTORY in sys.modules:
        register()
    elif not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())


# --- worker side --------------------------------------------------------------------------------


@dataclass
class WeightsyncInitInfo:
    """``init_weight_transfer_engine`` payload of the ``"weightsync"`` backend.

    Attributes:
        host: gloo rendezvous address (the trainer's ``TCPStore``); empty for files only.
        port: the rendezvous port.
        world_size: the gloo group's size: 1 (the trainer) + every worker of the engine.
        timeout_s: how long a gloo operation waits for a peer.
        protocol: a field only this backend knows, so a server running another backend
            rejects the init instead of misreading it.
    """

    host: str = ""
    port: int = 0
    world_size: int = 0
    timeout_s: float = 300.0
    protocol: int = 1


@dataclass
class WeightsyncUpdateInfo:
    """``update_weights`` payload (one chunk) of the ``"weightsync"`` backend.

    Attributes:
        folder: the update's folder; workers write their outcome there at finish (files mode).
        files: bucket files in ``folder`` to load now, in order.
        gloo: load what the trainer broadcasts over the gloo group until its END frame.
        abort: the trainer failed part-way (the reason): abandon this update.
    """

    folder: str = ""
    files: list[str] = field(default_factory=list)
    gloo: bool = False
    abort: str = ""


def _worker_rank(parallel_config: Any) -> int:
    """This worker's rank among all workers of all data-parallel replicas (as vLLM's NCCL
    backend computes it): result files and gloo ranks are keyed on it."""
    return int(
        parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank
    )


def _result_file(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"result-rank{rank:04d}.json"


def _encode(message: str) -> torch.Tensor:
    data = message.encode()[: RESULT_BYTES - 1]
    out = torch.zeros(RESULT_BYTES, dtype=torch.uint8)
    if data:
        out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def _start_result_exchange(group: Any, size: int, message: str) -> tuple[Any, list[torch.Tensor]]:
    """Start an all-gather of every rank's outcome message ("" = success) over ``group``."""
    gathered = [torch.zeros(RESULT_BYTES, dtype=torch.uint8) for _ in range(size)]
    return group.allgather([gathered], [_encode(message)]), gathered


def _decode(gathered: list[torch.Tensor]) -> list[str]:
    return [bytes(t.numpy()).rstrip(b"\0").decode(errors="replace") for t in gathered]


def _make_engine_class() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class WeightsyncTransferEngine(WeightTransferEngine):
        """vLLM weight-transfer backend ``"weightsync"``: checkpoint-format buckets from files
        or a gloo group, loaded with vLLM's layerwise reload; see the module docstring for why
        it reports failures at finish instead of raising them."""

        init_info_cls = WeightsyncInitInfo
        update_info_cls = WeightsyncUpdateInfo
        # The trainer's buckets carry the main model's checkpoint names.
        supports_draft_weight_update = False

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.rank = _worker_rank(self.parallel_config)
            self._group: Any = None
            self._store: Any = None
            self._group_size = 0
            self._new_round()

        def _new_round(self) -> None:
            self._error = ""  # the first failure of this update ("" = none)
            self._folder = ""  # files mode: where the outcome is written
            self._gloo = False  # gloo mode: the outcome is all-gathered at finish

        # -- vLLM's calls ------------------------------------------------------------------

        def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
            # A new trainer: an update the last one left open reports to nobody.
            self._new_round()
            if not init_info.host:
                return  # files only: nothing to set up
            try:
                self._group, self._store = gloo_group(
                    init_info.host,
                    int(init_info.port),
                    1 + self.rank,
                    int(init_info.world_size),
                    float(init_info.timeout_s),
                )
                self._group_size = int(init_info.world_size)
            except Exception:  # the trainer's rendezvous times out and says so
                logger.exception("weightsync: worker %d could not join the gloo group", self.rank)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            self._new_round()
            try:
                initialize_layerwise_reload(self.model)
            except Exception as e:  # noqa: BLE001 (reported at finish, see the module docstring)
                self._fail(e)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            try:
                info = self.parse_update_info(update_info)
            except Exception as e:  # noqa: BLE001 (reported at finish)
                self._fail(e)
                return
            self._folder = info.folder or self._folder
            self._gloo = self._gloo or info.gloo
            if info.abort:
                self._fail(RuntimeError(f"the trainer aborted the update: {info.abort}"))
            receiver = GlooReceiver(self._group) if info.gloo and self._group else None
            if info.gloo and receiver is None:
                self._fail(RuntimeError("no gloo group: init_weight_transfer_engine with a host"))
            if not self._error:
                try:
                    self._load(info, receiver)
                except Exception as e:  # noqa: BLE001 (reported at finish)
                    self._fail(e)
            if receiver is not None:
                receiver.drain()  # the trainer's broadcasts complete even after a failure

        def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
            self._load(update_info, GlooReceiver(self._group) if update_info.gloo else None)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            if not self._error:
                try:
                    finalize_layerwise_reload(self.model, self.model_config)
                    # vLLM-CPU's reload skips the experts' prepack (see worker.repack_cpu_moe).
                    if has_cpu_moe(self.model):
                        repack_cpu_moe(self.model)
                except Exception as e:  # noqa: BLE001 (reported at finish)
                    self._fail(e)
            self._report()
            self._new_round()

        def shutdown(self) -> None:
            self._group = self._store = None
            self._group_size = 0

        # -- helpers -------------------------------------------------------------------------

        def _load(self, info: WeightsyncUpdateInfo, receiver: GlooReceiver | None) -> None:
            from vllm.model_executor.model_loader.mtp_validation import (
                disable_mtp_completeness_check,
            )

            if receiver is not None:
                pairs: Iterable[tuple[str, torch.Tensor]] = iter(receiver)
            else:
                pairs = self._read_files(info.folder, info.files)
            with torch.no_grad(), disable_mtp_completeness_check():
                self.model.load_weights(pairs)

        @staticmethod
        def _read_files(folder: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
            from safetensors import safe_open

            for name in files:
                path = Path(folder) / name
                with safe_open(str(path), framework="pt") as h:
                    aliases = json.loads((h.metadata() or {}).get(ALIASES_KEY, "{}"))
                    for key in h.keys():  # noqa: SIM118 (safe_open is not a dict)
                        tensor = h.get_tensor(key)
                        yield key, tensor
                        for other in aliases.get(key, []):  # tied names, stored once
                            yield other, tensor

        def _fail(self, error: BaseException) -> None:
            """Record the first failure of this update and give every layer the reload left
            unfinished its previous tensors back, so the worker keeps serving."""
            logger.error("weightsync: weight update failed on worker %d: %s", self.rank, error)
            if not self._error:
                self._error = f"{type(error).__name__}: {error}"
            try:
                abandon_layerwise_reload(self.model, self.model_config)
            except Exception as e:  # the trainer must restart this engine
                logger.exception("weightsync: restoring the unfinished layers failed")
                self._error += f"; restoring the unfinished layers failed too ({e})"

        def _report(self) -> None:
            """Send this update's outcome back the way its bytes came (files or gloo)."""
            try:
                if self._gloo and self._group is not None:
                    work, _ = _start_result_exchange(self._group, self._group_size, self._error)
                    work.wait()
                elif self._folder:
                    _result_file(self._folder, self.rank).write_text(
                        json.dumps({"rank": self.rank, "error": self._error})
                    )
            except Exception:  # the trainer is gone: nobody to tell (and never raise here)
                logger.exception("weightsync: could not report the update's outcome")

    return WeightsyncTransferEngine


def __getattr__(name: str) -> Any:
    """``WeightsyncTransferEngine`` is built on first access: its base class is vLLM's, and
    importing this module must not import vLLM (see `register`)."""
    if name == "WeightsyncTransferEngine":
        cls = _make_engine_class()
        cls.__module__, cls.__qualname__ = __name__, name
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- trainer side -------------------------------------------------------------------------------


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


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


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
    ) -> None:
        if inner not in ("files", "gloo"):
            raise ValueError(f"inner must be 'files' or 'gloo', got {inner!r}")
        self.client = client
        self.inner = inner
        self.name = f"weight-transfer:{inner}"
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.root: Path | None = None
        self._remove_root: Any = None
        if inner == "files":
            self.root = Path(root or tempfile.mkdtemp(prefix="weightsync-", dir=_tmpfs()))
            if root is None:
                self._remove_root = weakref.finalize(self, shutil.rmtree, str(self.root), True)
        self._world_size = 0
        self._updates = 0
        self._group: Any = None
        self._store: Any = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weightsync-weight-transfer")

    # --- set-up -------------------------------------------------------------------------------

    def connect(self, rpc: Rpc, world_size: int) -> None:
        self._world_size = world_size
        if self.inner == "files":
            _call(self.client, "init_weight_transfer_engine", asdict(WeightsyncInitInfo()))
            return
        size = world_size + 1

        def join(port: int) -> Future:
            info = WeightsyncInitInfo(
                host=self.host, port=port, world_size=size, timeout_s=self.timeout_s
            )
            return self._pool.submit(
                _call, self.client, "init_weight_transfer_engine", asdict(info)
            )

        self._group, self._store = open_gloo_group(self.host, self.port, size, self.timeout_s, join)

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
            folder.mkdir(parents=True)
        try:
            self._start(rpc)
            if folder is not None:
                failure = self._stream_files(folder, buckets)
            else:
                failure = self._stream_gloo(buckets)
            outcomes = self._finish(folder)
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        if failure is not None:
            raise failure  # the trainer's error is the cause; the workers abandoned the update
        errors = [f"worker {rank}: {msg}" for rank, msg in enumerate(outcomes) if msg]
        if errors:
            raise RuntimeError(
                "the weight update failed in the engine's workers (they restored their "
                "unfinished layers and keep serving a mix of old and new weights; sync every "
                "weight again): " + "; ".join(errors)
            )

    def _stream_files(self, folder: Path, buckets: Iterable[Bucket]) -> BaseException | None:
        """Write and load the buckets one file each; returns the trainer-side failure."""
        loading: Future | None = None
        previous: Path | None = None
        try:
            for i, bucket in enumerate(buckets):
                path = folder / f"bucket-{i:05d}.safetensors"
                save_bucket(bucket, path)
                if loading is not None and previous is not None:
                    loading.result()
                    previous.unlink()
                update = {"folder": str(folder), "files": [path.name]}
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
                    {"folder": str(folder), "abort": _describe(error)},
                )
            except Exception:  # the trainer's error is the one to raise
                logger.exception("weightsync: telling the workers to abandon the update failed")
            return error

    def _stream_gloo(self, buckets: Iterable[Bucket]) -> BaseException | None:
        """Broadcast the buckets while the workers receive; returns the trainer-side failure."""
        received = self._pool.submit(_call, self.client, "update_weights", {"gloo": True})
        try:
            for bucket in buckets:
                if received.done():  # the server refused the chunk: nobody is receiving
                    received.result()
                    raise RuntimeError("the engine's workers stopped receiving part-way")
                broadcast_bucket(self._group, bucket)
            send_frame(self._group, FRAME_END)
            received.result()
            return None
        except BaseException as error:  # noqa: BLE001 (raised by send after finishing)
            if not received.done():
                try:
                    send_frame(self._group, FRAME_ABORT)
                except Exception:
                    logger.exception("weightsync: sending the abort frame failed")
            received.exception()
            return error

    def _finish(self, folder: Path | None) -> list[str]:
        """``finish_weight_update`` and every worker's outcome ("" = loaded)."""
        if folder is not None:
            _call(self.client, "finish_weight_update")
            outcomes = []
            for rank in range(self._world_size):
                path = _result_file(folder, rank)
                if not path.exists():
                    outcomes.append(
                        "reported no outcome: is the engine running the 'weightsync' "
                        "weight-transfer backend (--weight-transfer-config "
                        '\'{"backend": "weightsync"}\') and reading this folder?'
                    )
                else:
                    outcomes.append(json.loads(path.read_text())["error"])
            return outcomes
        work, gathered = _start_result_exchange(self._group, self._world_size + 1, "")
        try:
            _call(self.client, "finish_weight_update")
        except BaseException:
            # The workers never reached the exchange, which now waits for them: this group
            # can carry nothing more. Make a new transport (engine) to go on.
            self._group = None
            raise
        work.wait()
        return _decode(gathered)[1:]

    def close(self) -> None:
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
        if self._remove_root is not None:
            self._remove_root()


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
        if backend not in ("nccl", "ipc"):
            raise ValueError(f"backend must be 'nccl' or 'ipc', got {backend!r}")
        self.client = client
        self.backend = backend
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


_register_now_or_on_import()
