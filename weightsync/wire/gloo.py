"""Buckets over a gloo process group: the trainer is rank 0, every worker of the engine a
further rank. Both halves: `open_group` / `send` on the trainer, `join_group` / `Receiver` in the
workers. Works across hosts on CPU.

The group is one of its own (not torch's default group, which vLLM owns), rendezvoused through
a ``TCPStore`` the trainer listens on. The stream is ``wire.stream``'s (BUCKET or DELTA frames,
then END with the count, or ABORT), each frame broadcast from rank 0 as its int64 header
``[kind, length]``, then its payload (for a bucket, a safetensors file's bytes, ``format.pack``,
which the workers view in place), then, in a tagged stream, a TAG frame carrying its tag.
Outcomes come back the other way in one all-gather (`gather_outcomes`).

Who gets in. torch's ``TCPStore`` listens on every interface and has no authentication, so:

- the store listens only on the address the trainer names (a socket bound there and handed to
  the store), and rank 0's gloo device is bound to it too;
- the group's keys live under a secret prefix, fresh per rendezvous, that workers are told over
  the control channel: a process that reaches the port without it never finds the group, and
  the workers wait for no one else;
- with a sync's `Signer` (``wire.tags``) each frame but ABORT is followed by its TAG frame
  (``wire.stream``), so a worker refuses an altered, replayed or truncated stream before
  loading a byte of it.

Deltas (``wire.delta``): with the trainer's `SentCopies` and a worker's `LoadedCopies`, a bucket
whose base the worker holds travels as a DELTA frame, checked as the whole bucket
(``wire.stream``).

Staging (`Staging`): a worker can receive a whole stream in a thread of its own, into host
memory, while its engine keeps generating, and load it only once every frame and the END were
checked. A trainer that dies or fails part-way then leaves nothing loaded: the stream is staged,
then committed (``engines/vllm/transports/gloo.py``). A stage that completed but that no commit
claims -- its trainer died between the END and the commit -- is dropped after
``WEIGHTSYNC_STAGE_EXPIRY_S`` (``wire.stage``), so a dead trainer's bytes do not stay in every
worker until the next trainer comes.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from datetime import timedelta
from typing import Any

import torch

from ..errors import WeightSyncError
from . import format as fmt
from . import stream
from .delta import LoadedCopies, SentCopies
from .protocol import Outcome
from .stage import Held, Pairs
from .stream import Kind
from .tags import Signer

#: Bytes of one rank's outcome in `gather_outcomes` (a longer message is cut).
OUTCOME_BYTES = 4096

#: Bytes of a TAG frame: a ``wire.tags`` tag (``"<nonce>:<hex>"``), zero-padded.
TAG_FRAME_BYTES = 64

_LOOPBACK = ("127.0.0.1", "localhost", "::1")

logger = logging.getLogger(__name__)


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
    both).

    A worker's error (no extension, a host it cannot reach) is raised as soon as the join
    future holds it, not after the rendezvous timeout it would cause: this rank waits in a
    thread of its own, on a client of the store, and closing the store ends that wait at once
    (the port freed, the thread gone before the error is raised)."""
    from torch.distributed import TCPStore

    store = listen(host, port, timeout_s)
    secret = secrets.token_hex(16)
    own = TCPStore(host, store.port, None, False, timeout=timedelta(seconds=timeout_s))
    made: Future = Future()

    def wait_for_the_workers() -> None:
        try:
            made.set_result(rendezvous(own, host, 0, size, timeout_s, secret))
        except BaseException as e:  # noqa: BLE001 (handed over through ``made``)
            made.set_exception(e)

    joined = join(store.port, secret)
    waiting = threading.Thread(target=wait_for_the_workers, name="weightsync-rendezvous")
    waiting.start()
    wait([made, joined], return_when=FIRST_EXCEPTION)
    if joined.done() and joined.exception() is not None and not made.done():
        del store  # the only reference: the store stops, and the rendezvous with it
        waiting.join()
        joined.result()
    try:
        group = made.result()
    finally:
        joined.result()  # a worker's error over the rendezvous' own
    return group, store


def listen(host: str, port: int, timeout_s: float) -> Any:
    """The ``TCPStore`` of a rendezvous, listening on ``host:port`` only (0: a free port;
    ``.port`` says which). For a caller whose workers learn the port before the group's size
    is known (verl's ``prepare``, then ``init_process_group``); `open_group` otherwise."""
    from torch.distributed import TCPStore

    listening = socket.create_server((host, port), family=_family(host), backlog=128)
    bound = listening.getsockname()[1]
    fd = listening.detach()  # the store owns the socket from here on
    try:
        return TCPStore(
            host,
            bound,
            None,
            True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        socket.close(fd)
        raise


def rendezvous(store: Any, host: str, rank: int, size: int, timeout_s: float, secret: str) -> Any:
    """``rank``'s end of the group of ``size`` under ``secret`` on ``store`` (rank 0 holds the
    store `listen` made; every rank waits here until all have joined)."""
    return _group(store, host, rank, size, timedelta(seconds=timeout_s), secret)


class Link:
    """Rank 0's end of a group with an engine's workers, as a transport carried by gloo holds
    it: where it listens, how long it waits for a peer, and the group once `open`."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.group: Any = None
        self.store: Any = None

    def open(self, size: int, join: Callable[[int, str], Future]) -> None:
        """`open_group` at this address, keeping the group and its store."""
        self.group, self.store = open_group(self.host, self.port, size, self.timeout_s, join)

    def close(self) -> None:
        """Drop the group: it carries nothing more."""
        self.group = self.store = None


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def join_group(
    host: str, port: int, rank: int, size: int, timeout_s: float, secret: str
) -> tuple[Any, Any]:
    """A worker's end of the group rank 0 opened at ``host:port`` under ``secret``;
    ``(group, store)``."""
    from torch.distributed import TCPStore

    store = TCPStore(host, port, size, False, timeout=timedelta(seconds=timeout_s))
    return rendezvous(store, host, rank, size, timeout_s, secret), store


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Rank 0's ``tensor`` into every rank's (one frame of a stream)."""
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def _header(kind: Kind, length: int = 0) -> torch.Tensor:
    return torch.from_numpy(stream.header(kind, length))


def _tag_frame(tag: str) -> torch.Tensor:
    frame = torch.zeros(TAG_FRAME_BYTES, dtype=torch.uint8)
    data = tag.encode()
    frame[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return frame


def _broadcast_frame(group: Any, head: torch.Tensor, tag: str, *payload: torch.Tensor) -> None:
    """One frame: its header, its payload, and (tagged) its TAG frame."""
    broadcast(group, head)
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
    """One bucket's frame (``stream.frame``): its header, the bucket's bytes, and (with
    ``signer``) their tag; with ``copies`` (which need a ``signer``), a DELTA frame instead
    when ``copies`` has a base."""
    send_frame(group, stream.frame(bucket, signer, copies))


def send_frame(group: Any, frame: stream.Frame) -> None:
    """One BUCKET or DELTA frame (``stream.frame``): its header, its bytes, its tag."""
    _broadcast_frame(
        group, _header(frame.kind, frame.payload.size), frame.tag, torch.from_numpy(frame.payload)
    )


def send_end(group: Any, count: int, signer: Signer | None = None) -> None:
    """The END frame of a stream of ``count`` frames (tagged by ``signer``, if any)."""
    _broadcast_frame(
        group, _header(Kind.END, count), stream.end_tag(signer, count) if signer else ""
    )


def send_abort(group: Any) -> None:
    """The ABORT frame: the workers abandon what they received of the stream."""
    broadcast(group, _header(Kind.ABORT))


def send(
    group: Any,
    buckets: Iterable[fmt.Pairs],
    received: Future | None,
    send_one: Callable[[Any, fmt.Pairs, Signer | None], None] = send_bucket,
    signer: Signer | None = None,
) -> None:
    """Broadcast ``buckets`` then END while the workers receive (``received``: their RPC, or
    None when they receive in a `Staging` thread, which reports at its ``wait``); with
    ``signer``, every frame but ABORT is tagged (the workers must hold its key).

    If the workers stop receiving part-way (their RPC returned: the engine refused), sending
    stops and that is raised. If producing or sending a bucket fails, an ABORT frame tells the
    workers to abandon the update; once they have (``received`` done) the trainer's error, the
    cause, is raised."""
    count = 0
    try:
        for bucket in buckets:
            if received is not None and received.done():
                received.result()
                raise RuntimeError("the engine's workers stopped receiving part-way")
            send_one(group, bucket, signer)
            count += 1
    except BaseException:
        if received is None or not received.done():
            send_abort(group)
        if received is not None:
            received.exception()  # wait: the workers have restored their layers
        raise
    send_end(group, count, signer)
    if received is not None:
        received.result()


class Receiver:
    """A worker's view of one stream: iterates its (name, tensor) pairs, one bucket a frame,
    each frame checked by a ``stream.Checker`` before its tensors are yielded.

    Args:
        group: the worker's end of the group.
        key: the sync's tag key (``wire.tags``) when the trainer tags the stream: every frame
            is checked before its tensors are yielded, and the END frame's count too.
        copies: this worker's kept copies (``wire.delta``) when the trainer sends deltas: each
            whole bucket is kept there, each DELTA frame patches one and is checked as the
            whole bucket. Without them a DELTA frame is refused.
    """

    def __init__(self, group: Any, key: str = "", copies: LoadedCopies | None = None) -> None:
        self.group = group
        self.key = key
        self.finished = False  # the END or ABORT frame was received
        self._checker = stream.Checker(key, copies)
        self._draining = False

    @property
    def buckets(self) -> int:
        """Buckets received and checked so far."""
        return self._checker.count

    def _tag(self) -> str:
        """The TAG frame that follows a frame (received even when draining, so the stream
        stays in step); "" in an untagged stream."""
        if not self.key:
            return ""
        frame = torch.zeros(TAG_FRAME_BYTES, dtype=torch.uint8)
        broadcast(self.group, frame)
        return bytes(frame.numpy()).rstrip(b"\0").decode(errors="replace")

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while not self.finished:
            head = torch.zeros(2, dtype=torch.int64)
            broadcast(self.group, head)
            kind, length = (int(x) for x in head)
            if kind == Kind.END:
                self.finished = True
                tag = self._tag()
                if not self._draining:
                    self._checker.end(length, tag)
                return
            if kind == Kind.ABORT:
                self.finished = True
                self._checker.abort()
            payload = torch.empty(length, dtype=torch.uint8)
            broadcast(self.group, payload)
            tag = self._tag()
            if self._draining:
                continue
            yield from fmt.views(self._checker.bucket(kind, payload.numpy(), tag))

    def drain(self) -> None:
        """Consume the rest of the stream unchecked (nothing of it is loaded), so the trainer's
        broadcasts complete."""
        self._draining = True
        for _ in self:
            pass


class Staging(Held):
    """A worker's receipt of one whole stream into host memory, in a thread of its own, so the
    engine keeps generating while the bytes travel; nothing is loaded here.

    Every frame is checked as it arrives (``stream.Checker``: tags, order, the END's count);
    any failure -- a refused frame, the trainer's ABORT, the trainer gone (gloo reports the
    closed connection), more than ``max_bytes`` -- drains the rest of the stream if it can and
    keeps the error instead of the tensors. Costs the stream's bytes in host memory until the
    stage is claimed by its commit, dropped, or expires (``wire.stage.Held``: the expiry runs
    from the stream's END).

    Args:
        group, key, copies: as for `Receiver`.
        max_bytes: the most this stage may hold (None: no bound).
        expire_s: as for `Held`.

    Raises:
        ValueError: ``expire_s`` is None and the environment's expiry is not a valid one.
    """

    def __init__(
        self,
        group: Any,
        key: str = "",
        copies: LoadedCopies | None = None,
        *,
        max_bytes: int | None = None,
        expire_s: float | None = None,
    ) -> None:
        super().__init__(expire_s)
        self._receiver = Receiver(group, key, copies)
        self._max_bytes = max_bytes
        self._thread = threading.Thread(target=self._run, name="weightsync-stage", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        held = 0
        pairs: Pairs = []
        try:
            for name, tensor in self._receiver:
                held += tensor.nbytes
                if self._max_bytes is not None and held > self._max_bytes:
                    raise WeightSyncError(
                        f"the stream needs more than the {self._max_bytes} bytes this worker "
                        "may stage (max_stage_bytes): nothing was loaded"
                    )
                pairs.append((name, tensor))
                self._pairs = pairs  # counted by `held` as the bytes come
        except BaseException as e:  # noqa: BLE001 (kept for `wait`; this thread ends here)
            self.fail(e)
            if not self._receiver.finished:
                with contextlib.suppress(Exception):  # the trainer is gone: nothing to drain
                    self._receiver.drain()
            return
        self.hold(pairs, self._receiver.buckets)

    def _ready(self) -> None:
        self._thread.join(0.0)
        if self._thread.is_alive():
            raise WeightSyncError("the staged stream has not ended: nothing was loaded")

    def wait(self, timeout_s: float) -> Pairs:
        """The staged ``(name, tensor)`` pairs, once the END frame was received and checked.

        Raises:
            WeightSyncError: nothing came in ``timeout_s`` seconds.
            StageExpiredError: the stage ended whole but expired unclaimed.
            Exception: what failed the stage (``BytesRejectedError`` for a refused frame).
        """
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise WeightSyncError(
                f"the staged stream did not end within {timeout_s:g} s: nothing was loaded"
            )
        with self._lock:
            if self._error is not None:
                raise self._error
            return self._pairs


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
