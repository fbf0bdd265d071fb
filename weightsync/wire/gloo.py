"""Buckets over a gloo process group: the trainer is rank 0, every worker of the engine a
further rank. Both halves: `open_group` / `send` on the trainer, `join_group` / `Receiver` in the
workers. Works across hosts on CPU.

The group is one of its own (not torch's default group, which vLLM owns), rendezvoused through
a ``TCPStore`` the trainer listens on. A stream is a sequence of frames, each an int64 header
``[kind, payload_len]`` broadcast from rank 0, then for a bucket one payload: the bucket as a
safetensors file's bytes (``format.pack``), which the workers view in place. It ends with an
END frame, or an ABORT frame when the trainer failed part-way (the workers then abandon what
they loaded). Outcomes come back the other way in one all-gather (`gather_outcomes`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch

from . import format as fmt
from .protocol import Outcome

FRAME_BUCKET, FRAME_END, FRAME_ABORT = 1, 0, -1

#: Bytes of one rank's outcome in `gather_outcomes` (a longer message is cut).
OUTCOME_BYTES = 4096


def _group(store: Any, host: str, rank: int, size: int, timeout: timedelta) -> Any:
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    local = host in ("127.0.0.1", "localhost")
    device = (
        ProcessGroupGloo.create_device(hostname="127.0.0.1")
        if local
        else ProcessGroupGloo.create_default_device()
    )
    options._devices = [device]
    return ProcessGroupGloo(store, rank, size, options)


def open_group(
    host: str, port: int, size: int, timeout_s: float, join: Callable[[int], Future]
) -> tuple[Any, Any]:
    """Rank 0 of a group of ``size``: listen on ``host:port`` (0: a free port), start the
    workers joining with ``join(store_port)`` (a future: their RPC runs while this rank waits in
    the rendezvous), and return ``(group, store)`` (keep both). A worker's error (no extension,
    unreachable host) is raised rather than the rendezvous timeout it causes."""
    from torch.distributed import TCPStore

    timeout = timedelta(seconds=timeout_s)
    store = TCPStore(host, port, size, True, timeout=timeout, wait_for_workers=False)
    joined = join(store.port)
    try:
        group = _group(store, host, 0, size, timeout)
    finally:
        joined.result()
    return group, store


def join_group(host: str, port: int, rank: int, size: int, timeout_s: float) -> tuple[Any, Any]:
    """A worker's end of the group rank 0 opened at ``host:port``; ``(group, store)``."""
    from torch.distributed import TCPStore

    timeout = timedelta(seconds=timeout_s)
    store = TCPStore(host, port, size, False, timeout=timeout)
    return _group(store, host, rank, size, timeout), store


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def _frame(group: Any, kind: int, payload_len: int = 0) -> None:
    _broadcast(group, torch.tensor([kind, payload_len], dtype=torch.int64))


def send_bucket(group: Any, bucket: fmt.Pairs) -> None:
    """One bucket frame: its header, then the bucket's bytes."""
    payload = fmt.pack(bucket)
    _frame(group, FRAME_BUCKET, payload.numel())
    _broadcast(group, payload)


def send(
    group: Any,
    buckets: Iterable[fmt.Pairs],
    received: Future,
    send_one: Callable[[Any, fmt.Pairs], None] = send_bucket,
) -> None:
    """Broadcast ``buckets`` then END while the workers receive (``received``: their RPC).

    If the workers stop receiving part-way (their RPC returned: the engine refused), sending
    stops and that is raised. If producing or sending a bucket fails, an ABORT frame tells the
    workers to abandon the update; once they have (``received`` done) the trainer's error, the
    cause, is raised."""
    try:
        for bucket in buckets:
            if received.done():
                received.result()
                raise RuntimeError("the engine's workers stopped receiving part-way")
            send_one(group, bucket)
    except BaseException:
        if not received.done():
            _frame(group, FRAME_ABORT)
        received.exception()  # wait: the workers have restored their layers
        raise
    _frame(group, FRAME_END)
    received.result()


class Receiver:
    """A worker's view of one stream: iterates its (name, tensor) pairs, one bucket a frame."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.finished = False  # the END or ABORT frame was received

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while not self.finished:
            header = torch.zeros(2, dtype=torch.int64)
            _broadcast(self.group, header)
            kind, payload_len = (int(x) for x in header)
            if kind == FRAME_END:
                self.finished = True
                return
            if kind == FRAME_ABORT:
                self.finished = True
                raise RuntimeError("the trainer aborted this weight update part-way")
            payload = torch.empty(payload_len, dtype=torch.uint8)
            _broadcast(self.group, payload)
            yield from fmt.views(payload.numpy())

    def drain(self) -> None:
        """Consume the rest of the stream, so the trainer's broadcasts complete."""
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
