"""Buckets over a gloo process group: the trainer is rank 0, every worker of the engine a
further rank. Both halves: `open_group` / `send` on the trainer, `join_group` / `Receiver` in the
workers. Works across hosts on CPU.

The group is one of its own (not torch's default group, which vLLM owns), rendezvoused through
a ``TCPStore`` the trainer listens on. A stream is a sequence of frames, each an int64 header
``[kind, payload_len]`` broadcast from rank 0, then for a bucket one payload: the bucket as a
safetensors file's bytes (``format.pack``), which the workers view in place. It ends with an
END frame (its length field: how many buckets came), or an ABORT frame when the trainer failed
part-way (the workers then abandon what they loaded). Outcomes come back the other way in one
all-gather (`gather_outcomes`).

Who gets in. torch's ``TCPStore`` listens on every interface and has no authentication, so:

- the store listens only on the address the trainer names (a socket bound there and handed to
  the store), and rank 0's gloo device is bound to it too;
- the group's keys live under a secret prefix, fresh per rendezvous, that workers are told over
  the control channel: a process that reaches the port without it never finds the group, and
  the workers wait for no one else;
- with a sync's `Signer` (``wire.tags``) each bucket and the END frame are followed by a TAG
  frame: the keyed tag of the header and payload, its nonce the frame's number, so a worker
  refuses an altered, replayed or truncated stream before loading a byte of it.

Deltas (``wire.delta``): with the trainer's `SentCopies` and a worker's `LoadedCopies`, a bucket
whose base the worker holds travels as a DELTA frame (header ``[DELTA, len]``, the encoded
delta), followed by the TAG frame of the bucket a full sync would have sent (its BUCKET header
and whole payload): the worker patches its copy and checks that tag on the result, so what it
loads is byte-identical to the full frame or refused.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch

from ..errors import BytesRejectedError
from . import format as fmt
from .delta import Delta, LoadedCopies, SentCopies
from .protocol import Outcome
from .tags import Signer, check

FRAME_BUCKET, FRAME_END, FRAME_ABORT, FRAME_DELTA = 1, 0, -1, 2

#: Bytes of one rank's outcome in `gather_outcomes` (a longer message is cut).
OUTCOME_BYTES = 4096

#: Bytes of a TAG frame: a ``wire.tags`` tag (``"<nonce>:<hex>"``), zero-padded.
TAG_FRAME_BYTES = 64

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _group(store: Any, host: str, rank: int, size: int, timeout: timedelta, secret: str) -> Any:
    from torch.distributed import PrefixStore, ProcessGroupGloo

    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    if host in _LOOPBACK:
        device = ProcessGroupGloo.create_device(hostname="127.0.0.1")
    elif rank == 0:  # the trainer: on the address it was told to listen on, no other
        device = ProcessGroupGloo.create_device(hostname=host)
    else:  # a worker: its own host's address, which the trainer's host must reach
        device = ProcessGroupGloo.create_default_device()
    options._devices = [device]
    return ProcessGroupGloo(PrefixStore(f"weightsync-{secret}/", store), rank, size, options)


def open_group(
    host: str, port: int, size: int, timeout_s: float, join: Callable[[int, str], Future]
) -> tuple[Any, Any]:
    """Rank 0 of a group of ``size``: listen on ``host:port`` only (0: a free port), start the
    workers joining with ``join(store_port, secret)`` (a future: their RPC, which carries the
    secret, runs while this rank waits in the rendezvous), and return ``(group, store)`` (keep
    both). A worker's error (no extension, unreachable host) is raised rather than the
    rendezvous timeout it causes."""
    from torch.distributed import TCPStore

    timeout = timedelta(seconds=timeout_s)
    listening = socket.create_server((host, port), family=_family(host), backlog=128)
    bound = listening.getsockname()[1]
    fd = listening.detach()  # the store owns the socket from here on
    try:
        store = TCPStore(
            host, bound, size, True, timeout=timeout, wait_for_workers=False, master_listen_fd=fd
        )
    except BaseException:
        socket.close(fd)
        raise
    secret = secrets.token_hex(16)
    joined = join(store.port, secret)
    try:
        group = _group(store, host, 0, size, timeout, secret)
    finally:
        joined.result()
    return group, store


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def join_group(
    host: str, port: int, rank: int, size: int, timeout_s: float, secret: str
) -> tuple[Any, Any]:
    """A worker's end of the group rank 0 opened at ``host:port`` under ``secret``;
    ``(group, store)``."""
    from torch.distributed import TCPStore

    timeout = timedelta(seconds=timeout_s)
    store = TCPStore(host, port, size, False, timeout=timeout)
    return _group(store, host, rank, size, timeout, secret), store


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Rank 0's ``tensor`` into every rank's (one frame of a stream)."""
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def _header(kind: int, payload_len: int = 0) -> torch.Tensor:
    return torch.tensor([kind, payload_len], dtype=torch.int64)


def _tag_frame(tag: str) -> torch.Tensor:
    frame = torch.zeros(TAG_FRAME_BYTES, dtype=torch.uint8)
    data = tag.encode()
    frame[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return frame


def _signed(
    group: Any, signer: Signer | None, header: torch.Tensor, *payload: Any, tag: str = ""
) -> None:
    """Broadcast ``header`` and ``payload``, then (with ``signer``) the tag of what this rank
    holds before sending (``tag``: one made already): bytes changed on the way cannot match
    it."""
    if signer is not None and not tag:
        tag = signer.sign(header.numpy(), *(p.numpy() for p in payload))
    broadcast(group, header)
    for part in payload:
        broadcast(group, part)
    if tag:
        broadcast(group, _tag_frame(tag))


def send_bucket(
    group: Any,
    bucket: fmt.Pairs,
    signer: Signer | None = None,
    copies: SentCopies | None = None,
) -> None:
    """One bucket frame: its header, the bucket's bytes, and (with ``signer``) their tag; with
    ``copies`` (which need a ``signer``), a DELTA frame instead when ``copies`` has a base."""
    if copies is None:
        payload = fmt.pack(bucket)
        _signed(group, signer, _header(FRAME_BUCKET, payload.numel()), payload)
        return
    if signer is None:
        raise ValueError("a delta is checked by the tag of the full bucket: sign the stream")
    whole, tag, delta = copies.next(
        bucket, lambda data: signer.sign(_header(FRAME_BUCKET, data.size).numpy(), data)
    )
    if delta is None:
        data = torch.from_numpy(whole)
        _signed(group, signer, _header(FRAME_BUCKET, data.numel()), data, tag=tag)
    else:
        wire = torch.from_numpy(delta.to_bytes())
        _signed(group, signer, _header(FRAME_DELTA, wire.numel()), wire, tag=tag)


def send(
    group: Any,
    buckets: Iterable[fmt.Pairs],
    received: Future,
    send_one: Callable[[Any, fmt.Pairs, Signer | None], None] = send_bucket,
    signer: Signer | None = None,
) -> None:
    """Broadcast ``buckets`` then END while the workers receive (``received``: their RPC);
    with ``signer``, every frame but ABORT is tagged (the workers must hold its key).

    If the workers stop receiving part-way (their RPC returned: the engine refused), sending
    stops and that is raised. If producing or sending a bucket fails, an ABORT frame tells the
    workers to abandon the update; once they have (``received`` done) the trainer's error, the
    cause, is raised."""
    count = 0
    try:
        for bucket in buckets:
            if received.done():
                received.result()
                raise RuntimeError("the engine's workers stopped receiving part-way")
            send_one(group, bucket, signer)
            count += 1
    except BaseException:
        if not received.done():
            broadcast(group, _header(FRAME_ABORT))
        received.exception()  # wait: the workers have restored their layers
        raise
    _signed(group, signer, _header(FRAME_END, count))
    received.result()


class Receiver:
    """A worker's view of one stream: iterates its (name, tensor) pairs, one bucket a frame.

    Args:
        group: the worker's end of the group.
        key: the sync's tag key (``wire.tags``) when the trainer tags the stream: every bucket
            is checked before its tensors are yielded, and the END frame's count too.
        copies: this worker's kept copies (``wire.delta``) when the trainer sends deltas: each
            whole bucket is kept there, each DELTA frame patches one and is checked as the
            whole bucket. Without them a DELTA frame is refused.
    """

    def __init__(self, group: Any, key: str = "", copies: LoadedCopies | None = None) -> None:
        self.group = group
        self.key = key
        self.copies = copies
        self.finished = False  # the END or ABORT frame was received
        self._frames = 0  # tagged frames checked so far (the next one's nonce)
        self._buckets = 0
        self._draining = False

    @property
    def buckets(self) -> int:
        """Buckets received and checked so far."""
        return self._buckets

    def _tag(self) -> str:
        """The TAG frame that follows a frame (received even when draining, so the stream
        stays in step)."""
        frame = torch.zeros(TAG_FRAME_BYTES, dtype=torch.uint8)
        broadcast(self.group, frame)
        return bytes(frame.numpy()).rstrip(b"\0").decode(errors="replace")

    def _check(self, what: str, *parts: torch.Tensor) -> str:
        """Check ``parts`` against the TAG frame that follows them; the tag ("" untagged)."""
        if not self.key:
            return ""
        tag = self._tag()
        if self._draining:
            return tag
        check(self.key, tag, what, *(p.numpy() for p in parts), expect=self._frames)
        self._frames += 1
        return tag

    def _patched(self, payload: torch.Tensor) -> Any:
        """The bucket a DELTA frame's ``payload`` patches this worker's copy into, checked
        against the tag of the whole bucket; None when draining."""
        tag = self._tag() if self.key else ""
        if self._draining:
            return None
        what = f"bucket {self._buckets} of the stream (a delta)"
        if self.copies is None or not self.key:
            raise BytesRejectedError(
                f"{what}: this worker keeps no copies to patch (or the stream is not tagged): "
                "nothing of it was loaded"
            )
        delta = Delta.from_bytes(payload.numpy())
        patched = self.copies.patch(self._buckets, delta)
        whole = _header(FRAME_BUCKET, delta.size).numpy()
        check(self.key, tag, what, whole, patched, expect=self._frames)
        self.copies.loaded(self._buckets, tag)
        self._frames += 1
        return patched

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while not self.finished:
            header = torch.zeros(2, dtype=torch.int64)
            broadcast(self.group, header)
            kind, payload_len = (int(x) for x in header)
            if kind == FRAME_END:
                self.finished = True
                self._check("the stream's end", header)
                if self.key and not self._draining and payload_len != self._buckets:
                    raise RuntimeError(
                        f"the stream ended after {self._buckets} buckets, the trainer sent "
                        f"{payload_len}"
                    )
                return
            if kind == FRAME_ABORT:
                self.finished = True
                raise RuntimeError("the trainer aborted this weight update part-way")
            payload = torch.empty(payload_len, dtype=torch.uint8)
            broadcast(self.group, payload)
            if kind == FRAME_DELTA:
                data = self._patched(payload)
            else:
                tag = self._check(f"bucket {self._buckets} of the stream", header, payload)
                data = payload.numpy()
                if self.copies is not None and tag and not self._draining:
                    self.copies.keep(self._buckets, data, tag)
            if self._draining:
                continue
            self._buckets += 1
            yield from fmt.views(data)

    def drain(self) -> None:
        """Consume the rest of the stream unchecked (nothing of it is loaded), so the trainer's
        broadcasts complete."""
        self._draining = True
        for _ in self:
            pass


def gather_outcomes(group: Any, size: int, mine: Outcome) -> tuple[Any, list[torch.Tensor]]:
    """Start the all-gather of every rank's outcome (rank 0, the trainer, sends a success);
    wait on the returned work, then read them with `outcomes`."""
    data = mine.to_bytes()[: OUTCOME_BYTES - 1]
    own = torch.zeros(OUTCOME_BYTES, dtype=torch.uint8)
    if data:
        own[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.zeros(OUTCOME_BYTES, dtype=torch.uint8) for _ in range(size)]
    return group.allgather([gathered], [own]), gathered


def outcomes(gathered: list[torch.Tensor]) -> list[Outcome]:
    """The outcomes `gather_outcomes` collected, rank 0's included."""
    return [Outcome.from_bytes(bytes(t.numpy()).rstrip(b"\0")) for t in gathered]
