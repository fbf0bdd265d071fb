"""How weight bytes reach vLLM workers in other processes (the trainer's half).

``collective_rpc`` carries JSON only (a tensor in its arguments arrives as a list, measured ~4x
slower than tmpfs), so an out-of-process engine moves bytes through a transport and uses the RPC
only to tell the workers where to read. Both transports here end in the worker extension's
``reload_weights`` with in-worker recovery (``worker.py``), so a failure part-way leaves every
worker serving.

- `TmpfsTransport`: same host (or a shared filesystem). Each bucket is written as a
  safetensors file to a RAM folder, then every worker reads the folder. The files are kept
  between syncs and rewritten in place, both sides keeping them mapped (`KeptFiles`,
  ``worker.MappedBuckets``): a sync then costs two copies and no page faults. A failure while
  the trainer produces buckets happens before the engine is touched.
- `GlooTransport`: a gloo process group, trainer = rank 0, every worker of the engine a
  further rank; each bucket is broadcast as one flat byte buffer while the workers load it. Works
  across hosts on CPU (pass a ``host`` the workers can reach). If the trainer fails part-way it
  broadcasts an abort frame and the workers abandon the half-done reload. Adapters travel the
  same way, and the engine's first worker writes them to a folder on its own host, where the
  server's LoRA loader reads them.

On GPUs vLLM's own ``nccl``/``ipc`` weight-transfer backends are the faster path: they are
reached through ``weight_transfer.VLLMBackendTransport`` (written, never run here: no CUDA; see
``docs/engines.md``, "Deployments").
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import tempfile
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...plan import Bucket
from .worker import (
    ALIASES_KEY,
    FRAME_ABORT,
    FRAME_BUCKET,
    FRAME_END,
    SAFETENSORS_DTYPES,
    _gloo_device,
    broadcast,
)

#: ``rpc(method, kwargs)`` runs a worker-extension method on every worker and returns their
#: results (a server's ``/collective_rpc``, or ``LLM.collective_rpc``).
Rpc = Callable[[str, dict[str, Any]], list[Any]]


def _dedup(bucket: Bucket) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """One tensor per storage (tied names share one), and the other names it is sent under."""
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, list[str]] = {}
    first: dict[tuple[int, tuple[int, ...], torch.dtype], str] = {}
    for name, tensor in bucket:
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if key in first:
            aliases.setdefault(first[key], []).append(name)
        else:
            first[key] = name
            unique[name] = tensor
    return unique, aliases


def save_bucket(bucket: Bucket, path: str | Path, *, aliases: bool = True) -> None:
    """Write ``bucket`` as one safetensors file.

    Args:
        aliases: store a tensor sent under several names (tied embeddings) once, with the other
            names in the file's metadata, which only the worker extension reads. False writes a
            copy under each name, for vLLM's own ``reload_weights``.
    """
    from safetensors.torch import save_file

    unique, names = _dedup(bucket)  # safetensors refuses shared storage
    if not aliases:
        for first, others in names.items():
            unique.update({other: unique[first].clone() for other in others})
        names = {}
    save_file(
        {k: v.contiguous() for k, v in unique.items()},
        str(path),
        metadata={ALIASES_KEY: json.dumps(names)},
    )


_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


class KeptFiles:
    """Bucket files kept in a folder between syncs and rewritten in place.

    Writing a fresh tmpfs file allocates and zeroes every page, and reading it maps every page
    again: measured ~0.55 s and ~0.4 s for the 1.26 GB of the 0.5B model, most of the tmpfs
    transport's cost over the in-process load. A bucket whose layout (names, dtypes, shapes)
    is the previous sync's at the same index is copied into the same mapped file instead; its
    header is then byte-identical. Any other layout gets a new file, renamed over the old one,
    never a file shrunk in place: a worker still mapping it would fault (SIGBUS) reading past
    its new end. The files are safetensors, readable by any reader.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._maps: dict[str, tuple[bytes, mmap.mmap]] = {}

    def write(self, buckets: Iterable[Bucket]) -> list[str]:
        """Write the buckets (``bucket-00000.safetensors``, ...) and return their file names.
        Files of a previous, longer sync are removed."""
        self.folder.mkdir(parents=True, exist_ok=True)
        names = []
        for i, bucket in enumerate(buckets):
            name = f"bucket-{i:05d}.safetensors"
            self._write(name, bucket)
            names.append(name)
        for stale in set(self._maps) - set(names):
            self._maps.pop(stale)[1].close()
            (self.folder / stale).unlink(missing_ok=True)
        return names

    def _write(self, name: str, bucket: Bucket) -> None:
        unique, aliases = _dedup(bucket)
        header, places = _safetensors_layout(unique, aliases)
        kept = self._maps.get(name)
        if kept is None or kept[0] != header:
            size = len(header) + sum(n for _, _, n in places)
            tmp = self.folder / (name + ".new")
            with open(tmp, "w+b") as f:
                f.truncate(size)
                mapped = mmap.mmap(f.fileno(), size)
            mapped[: len(header)] = header
            os.replace(tmp, self.folder / name)
            if kept is not None:
                kept[1].close()
            kept = self._maps[name] = (header, mapped)
        _copy_into(np.frombuffer(kept[1], dtype=np.uint8)[len(header) :], places)

    def close(self) -> None:
        """Unmap the files (the caller removes the folder)."""
        for _, mapped in self._maps.values():
            mapped.close()
        self._maps.clear()


def _copy_into(data: np.ndarray, places: list[tuple[torch.Tensor, int, int]]) -> None:
    """Copy each tensor's bytes to its offset in ``data``. A single-threaded copy that releases
    the GIL (numpy's), not torch's multithreaded one: a vLLM worker on the same cores busy-polls
    for 1 s after each RPC (its shm message queue), and a two-thread copy then waits on the
    thread sharing its core (measured on 2 cores, 1.26 GB: 1.0-1.25 s right after a /pause vs
    0.13 s single-threaded); replicas copy from parallel threads, so it must not hold the GIL."""
    for tensor, offset, n in places:
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8).cpu()
        data[offset : offset + n] = raw.numpy()


def _safetensors_layout(
    unique: dict[str, torch.Tensor], aliases: dict[str, list[str]]
) -> tuple[bytes, list[tuple[torch.Tensor, int, int]]]:
    """The safetensors header (length prefix included) for ``unique`` and each tensor's
    (tensor, data offset, byte count). Widest elements first, as safetensors lays them out:
    every offset is then a multiple of its tensor's element size, so a reader can view the
    bytes in place."""
    entries: dict[str, Any] = {"__metadata__": {ALIASES_KEY: json.dumps(aliases)}}
    places, offset = [], 0
    for name, tensor in sorted(unique.items(), key=lambda kv: -kv[1].element_size()):
        if tensor.dtype not in _DTYPE_NAMES:
            raise TypeError(f"{name}: dtype {tensor.dtype} cannot be written to a bucket file")
        n = tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": _DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + n],
        }
        places.append((tensor, offset, n))
        offset += n
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(text).to_bytes(8, "little") + text, places


def send_frame(group: Any, kind: int, payload_len: int = 0) -> None:
    """The fixed-size header every gloo frame starts with (``worker.GlooReceiver`` reads it)."""
    broadcast(group, torch.tensor([kind, payload_len], dtype=torch.int64))


def broadcast_bucket(group: Any, bucket: Bucket) -> None:
    """One bucket over gloo in ``worker.GlooReceiver``'s format: a frame header, then the bucket
    as the bytes of a safetensors file (tied twins as aliases), which the workers view in place."""
    unique, aliases = _dedup(bucket)
    header, places = _safetensors_layout(unique, aliases)
    payload = torch.empty(len(header) + sum(n for _, _, n in places), dtype=torch.uint8)
    data = payload.numpy()
    data[: len(header)] = np.frombuffer(header, dtype=np.uint8)
    _copy_into(data[len(header) :], places)
    send_frame(group, FRAME_BUCKET, payload.numel())
    broadcast(group, payload)


def open_gloo_group(
    host: str, port: int, size: int, timeout_s: float, join: Callable[[int], Future]
) -> tuple[Any, Any]:
    """Rank 0 of a gloo process group of ``size`` (trainer + workers): listen on ``host:port``
    (0: a free port), start the workers joining with ``join(store_port)`` (a future: their RPC
    runs while this rank blocks in the rendezvous), and return ``(group, store)`` (keep both).
    A worker's error (no extension, unreachable host) is raised rather than the rendezvous'
    timeout it causes."""
    from torch.distributed import ProcessGroupGloo, TCPStore

    timeout = timedelta(seconds=timeout_s)
    store = TCPStore(host, port, size, True, timeout=timeout, wait_for_workers=False)
    joined = join(store.port)
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [_gloo_device(host)]
    try:
        group = ProcessGroupGloo(store, 0, size, options)
    finally:
        joined.result()
    return group, store


class Transport(ABC):
    """Moves checkpoint-format buckets into every worker of one engine and has them loaded."""

    name: str

    def connect(self, rpc: Rpc, world_size: int) -> None:
        """Set up whatever the transport needs with the engine's ``world_size`` workers."""

    @abstractmethod
    def send(self, rpc: Rpc, buckets: Iterable[Bucket]) -> None:
        """Load ``buckets`` into every worker. On failure the workers have already abandoned
        any half-done reload (they serve a mix of old and new layers) and the error is raised."""

    def put_adapter(
        self, rpc: Rpc, version: int, tensors: dict[str, torch.Tensor], config: str
    ) -> str | None:
        """Put an adapter version (its tensors and ``adapter_config.json`` text) where the
        engine's LoRA loader reads it and return that path; None: this transport does not carry
        adapters, the engine writes them to a folder it shares with the server."""
        return None

    def close(self) -> None:
        """Release what `connect` set up (files, sockets)."""


def _tmpfs() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class TmpfsTransport(Transport):
    """Buckets as safetensors files in a RAM folder the workers can read.

    Args:
        root: a folder the engine's workers can read at the same path; defaults to a fresh
            ``/dev/shm/weightsync-*`` folder, removed by `close` (or when collected).
        keep: keep the files (and both sides' mappings of them) between syncs and rewrite them
            in place (`KeptFiles`): RAM for one copy of the weights stays taken between syncs,
            and a sync costs about half (measured in ``docs/benchmarks.md``). False writes a
            fresh folder per sync and removes it after.
    """

    name = "tmpfs"

    def __init__(self, root: str | Path | None = None, *, keep: bool = True) -> None:
        self.root = Path(root or tempfile.mkdtemp(prefix="weightsync-", dir=_tmpfs()))
        self._owned = root is None
        self._updates = 0
        self._kept = KeptFiles(self.root / "kept") if keep else None
        if self._owned:
            self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.root), True)

    def send(self, rpc: Rpc, buckets: Iterable[Bucket]) -> None:
        if self._kept is not None:
            files = self._kept.write(buckets)
            rpc("weightsync_load_files", {"folder": str(self._kept.folder), "files": files})
            return
        folder = self.stage(buckets)
        try:
            rpc("weightsync_load_files", {"folder": str(folder)})
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def stage(self, buckets: Iterable[Bucket], *, aliases: bool = True) -> Path:
        """Write every bucket to a new folder under `root` and return it; the caller
        removes it. Nothing reaches the engine here, so a failure (the trainer's, a full tmpfs)
        leaves it untouched.

        ``aliases``: see `save_bucket`.
        """
        self._updates += 1
        folder = self.root / f"update-{self._updates:06d}"
        folder.mkdir(parents=True)
        try:
            for i, bucket in enumerate(buckets):
                save_bucket(bucket, folder / f"bucket-{i:05d}.safetensors", aliases=aliases)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return folder

    def close(self) -> None:
        if self._kept is not None:
            self._kept.close()
            if not self._owned:
                shutil.rmtree(self._kept.folder, ignore_errors=True)
        if self._owned:
            self._finalizer()


class GlooTransport(Transport):
    """Buckets broadcast over a gloo process group: trainer rank 0, workers ranks 1..N.

    Args:
        host: address the trainer listens on and the workers connect to (127.0.0.1 for one
            host; an address the engine's host can reach otherwise).
        port: the rendezvous port (0: a free one).
        timeout_s: how long a broadcast waits for a peer before failing.

    A server's workers hold one gloo group: one gloo engine per server at a time.
    """

    name = "gloo"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 300.0) -> None:
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self._group: Any = None
        self._store: Any = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weightsync-rpc")

    def connect(self, rpc: Rpc, world_size: int) -> None:
        def join(port: int) -> Future:
            kwargs = {
                "host": self.host,
                "port": port,
                "world_size": world_size + 1,
                "timeout_s": self.timeout_s,
            }
            return self._pool.submit(rpc, "weightsync_join_gloo", kwargs)

        self._group, self._store = open_gloo_group(
            self.host, self.port, world_size + 1, self.timeout_s, join
        )

    def send(self, rpc: Rpc, buckets: Iterable[Bucket]) -> None:
        if self._group is None:
            raise RuntimeError("GlooTransport.send before connect")
        received = self._pool.submit(rpc, "weightsync_receive_gloo", {})
        try:
            for bucket in buckets:
                self._send_bucket(bucket)
        except BaseException:
            self._frame(FRAME_ABORT)
            # The workers report the abort we sent (their error is ours): wait for them to have
            # restored their layers, then raise the trainer's error, the cause.
            wait([received])
            raise
        self._frame(FRAME_END)
        received.result()

    def put_adapter(
        self, rpc: Rpc, version: int, tensors: dict[str, torch.Tensor], config: str
    ) -> str | None:
        """Broadcast the adapter; the engine's first worker writes it to a folder on its own
        host (the server may be on another one) and its path is returned."""
        if self._group is None:
            raise RuntimeError("GlooTransport.put_adapter before connect")
        kwargs = {"version": version, "config": config}
        received = self._pool.submit(rpc, "weightsync_receive_adapter", kwargs)
        try:
            broadcast_bucket(self._group, list(tensors.items()))
        except BaseException:
            self._frame(FRAME_ABORT)
            wait([received])
            raise
        self._frame(FRAME_END)
        return next(r["path"] for r in received.result() if isinstance(r, dict) and "path" in r)

    def _frame(self, kind: int) -> None:
        send_frame(self._group, kind)

    def _send_bucket(self, bucket: Bucket) -> None:  # a method: the benchmark times it
        broadcast_bucket(self._group, bucket)

    def close(self) -> None:
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
