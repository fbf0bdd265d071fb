"""The trainer's half of a transport: the `Transport` interface every transport implements, and
the few steps two or more transports share (tagging a sync, sending one timed bucket, dropping
the kept copies of a delta transport)."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .... import timing
from ....plan import Bucket
from ....wire import format as fmt
from ....wire import gloo
from ....wire.delta import SentCopies
from ....wire.protocol import Outcome
from ....wire.tags import Signer
from ...contract import Staged

logger = logging.getLogger(__name__)

#: ``rpc(method, kwargs)`` runs a worker-extension method on every worker and returns their
#: outcomes, raising those that failed (``RemoteVLLMEngine.rpc``).
Rpc = Callable[[str, dict[str, Any]], list[Outcome]]


class StagedCalls(Staged):
    """A stage whose apply is worker calls known when it is staged: ``calls`` (``(method,
    kwargs)``, in order), then ``applied()``, this side's note that they ran. An engine that
    commits on its own side in one call (``RemoteVLLMEngine._paused_write``) takes the calls
    as its steps and calls ``applied`` after; `apply` makes them from here."""

    def __init__(
        self,
        rpc: Rpc,
        calls: list[tuple[str, dict[str, Any]]],
        drop: Callable[[], None] = lambda: None,
        discard: Callable[[], None] | None = None,
        applied: Callable[[], None] = lambda: None,
    ) -> None:
        def apply() -> None:
            for method, kwargs in calls:
                rpc(method, kwargs)
            applied()

        super().__init__(apply, drop, discard)
        self.calls = calls
        self.applied = applied


class Transport(ABC):
    """Moves checkpoint-format buckets into every worker of one engine and has them loaded."""

    name: str
    #: The workers check a keyed tag of every bucket (and adapter) this transport sends.
    tagged: bool = False
    #: `prepare` stages the bytes where the workers read them (consuming the buckets) before
    #: the apply; False: its apply is the whole `send`, the bytes travel while the workers load.
    stages: bool = False

    def connect(self, rpc: Rpc, world_size: int) -> None:
        """Set up whatever the transport needs with the engine's ``world_size`` workers."""

    @abstractmethod
    def send(self, rpc: Rpc, buckets: Iterable[Bucket]) -> None:
        """Load ``buckets`` into every worker. On failure the workers have already abandoned
        any half-done reload (the layers they had finished keep their new weights: a mix, which
        a server's middleware refuses to serve) and the error is raised."""

    def prepare(self, rpc: Rpc, buckets: Iterable[Bucket]) -> Staged:
        """Stage ``buckets`` where the workers will read them, while the engine keeps serving,
        and return what applies them (run inside the engine's pause). A transport whose bytes
        can only travel while the workers load them (a stream) stages nothing: its apply is
        the whole `send`."""
        return Staged(lambda: self.send(rpc, buckets))

    def put_adapter(
        self,
        rpc: Rpc,
        version: int,
        tensors: dict[str, torch.Tensor],
        config: dict,
        keep: int = 2,
    ) -> str | None:
        """Put an adapter version (its tensors and ``adapter_config.json`` content) where the
        engine's LoRA loader reads it and return that path; None: this transport does not carry
        adapters, the engine writes them to a folder it shares with the server. The engine side
        keeps the ``keep`` newest versions' folders (a request admitted under an older version
        may still read its folder: ``adapter_versions``)."""
        return None

    def close(self) -> None:
        """Release what `connect` set up (files, sockets)."""


def send_timed(
    group: Any, bucket: fmt.Pairs, signer: Signer | None, copies: SentCopies | None = None
) -> None:
    """Send one bucket (``copies``: as a delta where the workers hold its base), timed."""
    with timing.span("serialize"):
        gloo.send_bucket(group, bucket, signer, copies)


def drop_kept_copies(rpc: Rpc, copies: SentCopies, kwargs: dict[str, Any]) -> None:
    """A delta transport closes: the workers drop their kept copies (one copy of the weights
    each), and so does the trainer; a stopped engine does not fail the close."""
    try:
        rpc("weightsync_delta_drop", kwargs)
    except Exception:
        logger.warning("weightsync: weightsync_delta_drop failed", exc_info=True)
    copies.reset()


def sent_copies(delta: bool, tagged: bool, who: str) -> SentCopies | None:
    """The trainer's kept copies of a transport that sends deltas (``delta``), else None.

    Raises:
        ValueError: ``delta`` without ``tagged``: the whole bucket's tag is what proves a patched
            bucket byte-identical to the whole one.
    """
    if delta and not tagged:
        raise ValueError(
            f"{who}(delta=True) needs tagged=True: the whole bucket's tag proves a patched "
            "bucket byte-identical to the whole one"
        )
    return SentCopies() if delta else None


def signer_for(tagged: bool) -> Signer | None:
    """A signer with a key fresh for this sync, or None when the transport is untagged."""
    return Signer() if tagged else None


def proof_args(signer: Signer | None, tags: list[str] | None = None) -> dict[str, Any]:
    """The RPC arguments that let the workers check what they load (none when untagged)."""
    if signer is None:
        return {}
    return {"key": signer.key_hex} if tags is None else {"key": signer.key_hex, "tags": tags}
