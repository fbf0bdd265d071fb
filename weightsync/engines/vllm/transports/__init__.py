"""How weight bytes reach the workers of a vLLM engine in other processes: the trainer's half
of each transport, one file each (trainer process; the workers' half is ``in_engine/``, and both
speak ``weightsync.wire``).

``collective_rpc`` carries JSON only, so an out-of-process engine moves bytes through a transport
and uses the RPC to tell the workers where to read. A transport is a protocol (which calls the
workers get) times a carrier (how the bytes travel):

| transport | calls | carrier |
|---|---|---|
| `TmpfsTransport` | worker extension | sealed memory files, or files in a RAM folder (kept between syncs, or fresh) |
| `GlooTransport` | worker extension | a gloo group, trainer rank 0 (any host) |
| `WeightTransferFiles`, `WeightTransferGloo` | vLLM's weight-transfer API, ``"weightsync"`` backend | files; a gloo group |

One file each (``tmpfs.py``, ``gloo.py``, ``weight_transfer.py``); ``base.py`` holds the
`Transport` interface and the steps they share.

Each worker reports an `Outcome` whichever way the bytes came, read by
``wire.protocol.raise_failures``; every load runs in-worker recovery, so a failure part-way
leaves every worker serving. A failure while the trainer produces buckets happens before the
engine is touched (files) or is told to the workers with an abort (gloo, weight-transfer).
Every transport tags each bucket with a key fresh per sync (``wire.tags``; ``tagged=False``
turns it off) and sends the key and tags on the control channel, so the workers load only the
bytes this trainer produced (docs/security.md). The byte paths end to end: docs/architecture.md.
"""

from __future__ import annotations

from .base import Rpc, Transport
from .gloo import GlooTransport
from .tmpfs import TmpfsTransport
from .weight_transfer import (
    LLMWeightSyncClient,
    WeightTransferFiles,
    WeightTransferGloo,
    WeightTransferTransport,
)

__all__ = [
    "GlooTransport",
    "LLMWeightSyncClient",
    "Rpc",
    "TmpfsTransport",
    "Transport",
    "WeightTransferFiles",
    "WeightTransferGloo",
    "WeightTransferTransport",
    "make_transport",
]


def make_transport(transport: str | Transport) -> Transport:
    """A transport from its name (``"tmpfs"``, ``"gloo"``) or as given."""
    if isinstance(transport, Transport):
        return transport
    if transport == "tmpfs":
        return TmpfsTransport()
    if transport == "gloo":
        return GlooTransport()
    raise ValueError(f"transport must be 'tmpfs', 'gloo' or a Transport, got {transport!r}")
