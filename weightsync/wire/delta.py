"""Only the changed bytes on the wire: a bucket sent as the elements that changed since the copy
the worker holds. Both halves, like vLLM's weight-transfer backends: `SentCopies` on the
trainer (what it last sent to one engine), `LoadedCopies` in each worker (what it last loaded),
and `Delta`, what travels between them.

Why: between two RL steps most elements of a bf16 engine's weights do not change, so a
cross-host transport moves a few percent of the bytes. It does not pay on tmpfs, where a full
sync is already one copy on each side of shared memory. The encoding (``Delta``: for each
changed 16-bit word its gap from the previous one and its new value; long gaps bridged by no-op
entries, so the format needs no escape) was chosen by measurement. A delta is correct by
construction: the trainer tags (``wire.tags``) the WHOLE new bucket and the worker checks that
tag on its patched bytes before loading any of them, and a delta is sent only when every worker
reports the id of the copies the last successful sync left; any doubt sends the whole bucket.
The engine loads the whole patched bucket, exactly what a full sync loads. Cost: one copy of the
weights kept on each side between syncs, plus a compare pass on the trainer.

The design, the rules, the measured encodings and figures: docs/delta.md. Like everything in
``wire``, this imports nothing heavy: it runs inside vLLM's workers.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import BytesRejectedError
from . import format as fmt

#: The longest gap one entry can span (uint16); longer ones are bridged (module docstring).
MAX_GAP = 0xFFFF

_META_LEN = 8  # bytes of the little-endian length of a delta's JSON metadata


def _words(buffer: np.ndarray, word: int) -> np.ndarray:
    return buffer.view(np.uint16 if word == 2 else np.uint8)


@dataclass(frozen=True)
class Delta:
    """A bucket as the words that changed since a base the worker holds.

    Attributes:
        base: the tag (``wire.tags``) of the base it was computed against, as the worker
            recorded it when it checked that copy.
        size: bytes of the full bucket (its safetensors payload).
        word: bytes per word: 2, or 1 when the bucket holds a 1-byte dtype (any offset).
        gaps: uint16, the distance of each changed word from the previous one (the first from
            word -1).
        values: each changed word's new value.
    """

    base: str
    size: int
    word: int
    gaps: np.ndarray
    values: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (`to_bytes`)."""
        return len(self._meta()) + self.gaps.nbytes + self.values.nbytes

    def _meta(self) -> bytes:
        text = json.dumps(
            {"base": self.base, "size": self.size, "word": self.word, "count": len(self.gaps)}
        ).encode()
        text += b" " * (-(len(text) + _META_LEN) % 8)  # the gaps and values start aligned
        return len(text).to_bytes(_META_LEN, "little") + text

    def to_bytes(self) -> np.ndarray:
        """The delta as one uint8 array (a broadcast payload, an object in Ray's store)."""
        meta = self._meta()
        out = np.empty(self.nbytes, dtype=np.uint8)
        out[: len(meta)] = np.frombuffer(meta, dtype=np.uint8)
        g = len(meta) + self.gaps.nbytes
        out[len(meta) : g] = self.gaps.view(np.uint8)
        out[g:] = self.values.view(np.uint8)
        return out

    @classmethod
    def from_bytes(cls, buffer: Any) -> Delta:
        """The delta `to_bytes` wrote (views into ``buffer``, no copy).

        Raises:
            BytesRejectedError: the bytes are not a delta (cut, or not this format).
        """
        data = np.frombuffer(buffer, dtype=np.uint8)
        try:
            n = int.from_bytes(data[:_META_LEN].tobytes(), "little")
            meta = json.loads(data[_META_LEN : _META_LEN + n].tobytes())
            count, word = int(meta["count"]), int(meta["word"])
            start = _META_LEN + n
            gaps = data[start : start + 2 * count].view(np.uint16)
            values = _words(data[start + 2 * count : start + (2 + word) * count], word)
            if word not in (1, 2) or len(gaps) != count or len(values) != count:
                raise ValueError("its lengths do not match its count")
            return cls(str(meta["base"]), int(meta["size"]), word, gaps, values)
        except (ValueError, KeyError, TypeError) as e:
            raise BytesRejectedError(f"a delta frame is malformed ({e}); nothing was loaded") from e

    def apply(self, base: np.ndarray) -> None:
        """Patch ``base`` (a writable uint8 copy of the bucket it was computed against) in
        place into the new bucket.

        Raises:
            BytesRejectedError: the delta does not fit ``base`` (another size, or positions
                past its end): altered on the way; ``base`` is then untouched.
        """
        if base.size != self.size:
            raise BytesRejectedError(
                f"a delta for a bucket of {self.size} bytes arrived for a copy of {base.size}; "
                "nothing was loaded"
            )
        positions = np.cumsum(self.gaps, dtype=np.int64) - 1
        words = _words(base, self.word)
        if len(positions) and positions[-1] >= len(words):
            raise BytesRejectedError("a delta reaches past the end of its bucket; nothing loaded")
        words[positions] = self.values


def encode(positions: np.ndarray, words: np.ndarray, base_tag: str) -> Delta:
    """The `Delta` of the new bucket ``words`` (its bytes as 8- or 16-bit words) whose words
    at ``positions`` (ascending) differ from the base tagged ``base_tag``."""
    gaps = np.diff(positions, prepend=-1)
    bridges = (gaps - 1) // MAX_GAP  # words a gap needs bridged before its entry
    total = int(bridges.sum())
    if total:
        previous = np.repeat(positions - gaps, bridges)
        step = np.arange(total) - np.repeat(np.cumsum(bridges) - bridges, bridges) + 1
        positions = np.sort(np.concatenate([positions, previous + step * MAX_GAP]))
        gaps = np.diff(positions, prepend=-1)
    word = words.itemsize
    return Delta(base_tag, words.size * word, word, gaps.astype(np.uint16), words[positions])


@dataclass
class WireCount:
    """What one sync sent: buckets and bytes, full and as deltas.

    Attributes:
        full_buckets: buckets sent whole.
        delta_buckets: buckets sent as deltas.
        bucket_bytes: bytes of every bucket whole (what a full sync sends).
        wire_bytes: bytes actually sent (whole buckets + deltas).
    """

    full_buckets: int = 0
    delta_buckets: int = 0
    bucket_bytes: int = 0
    wire_bytes: int = 0


@dataclass
class _Copy:
    payload: np.ndarray
    tag: str
    header: bytes = b""  # the trainer's: the layout the payload holds


@dataclass
class SentCopies:
    """The trainer's half, one per engine (per transport): the bucket bytes it last sent and
    the id the last successful sync left in the engine's workers.

    A sync is `begin` (with every worker's reported id), `next` for each bucket in order, then
    `commit` once every worker reported success, or `reset` on any failure.
    """

    #: The id the last successful sync left in every worker (None: none, or in doubt).
    synced: str | None = None
    #: What the last (or current) sync sent.
    last: WireCount = field(default_factory=WireCount)
    _copies: dict[int, _Copy] = field(default_factory=dict)
    _pending: str = ""
    _usable: bool = False
    _index: int = 0

    def begin(self, reported: Iterable[Any]) -> str:
        """Start a sync; ``reported``: each worker's id (``LoadedCopies.synced``). Deltas are
        sent only if every worker reports the id the last successful sync left. Returns the id
        this sync leaves in the workers if it succeeds."""
        ids = set(reported)
        self._usable = self.synced is not None and ids == {self.synced}
        if not self._usable:
            self._copies.clear()  # of no use now; frees the memory before the new copies
        self.synced = None  # in doubt until every worker reported success
        self._pending = secrets.token_hex(16)
        self._index = 0
        self.last = WireCount()
        return self._pending

    def next(
        self, bucket: fmt.Pairs, sign: Callable[[np.ndarray], str]
    ) -> tuple[np.ndarray, str, Delta | None]:
        """The next bucket of the sync: its whole payload (kept here until the next sync
        rewrites it: do not modify it), its tag (``sign(payload)``), and the delta to send
        instead of the payload (None: send it whole).

        A bucket of the layout kept at its index is compared tensor by tensor against the kept
        payload, and only the words that differ are written into it: no second copy of the
        bucket, no fresh memory to fault in, one compare pass (a tensor's bytes and the kept
        ones). Words are 16-bit unless the bucket holds a 1-byte dtype (whose tensors
        safetensors places last, at any offset)."""
        index, self._index = self._index, self._index + 1
        header, places = fmt.layout(bucket)
        kept = self._copies.get(index)
        delta = None
        if not self._usable or kept is None or kept.header != header:
            payload = np.empty(fmt.size(header, places), dtype=np.uint8)
            payload[: len(header)] = np.frombuffer(header, dtype=np.uint8)
            fmt.copy_into(payload[len(header) :], places)
            kept = self._copies[index] = _Copy(payload, sign(payload), header)
        else:
            word = 2 if all(t.element_size() >= 2 for t, _, _ in places) else 1
            words = _words(kept.payload, word)
            changed = []
            for tensor, offset, _ in places:
                raw = tensor.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
                new = _words(raw, word)
                start = (len(header) + offset) // word
                old = words[start : start + len(new)]
                found = np.flatnonzero(old != new)
                old[found] = new[found]
                changed.append(found + start)
            tag = sign(kept.payload)
            delta = encode(np.concatenate(changed or [np.empty(0, np.int64)]), words, kept.tag)
            kept.tag = tag
            if delta.nbytes >= kept.payload.size:
                delta = None
        self.last.bucket_bytes += kept.payload.size
        if delta is None:
            self.last.full_buckets += 1
            self.last.wire_bytes += kept.payload.size
        else:
            self.last.delta_buckets += 1
            self.last.wire_bytes += delta.nbytes
        return kept.payload, kept.tag, delta

    def commit(self) -> None:
        """Every worker loaded the sync: its id is the workers' now."""
        for stale in [i for i in self._copies if i >= self._index]:
            del self._copies[stale]
        self.synced = self._pending

    def reset(self) -> None:
        """The sync failed or was aborted: forget every copy (the next sync is full)."""
        self._copies.clear()
        self.synced = None


@dataclass
class LoadedCopies:
    """A worker's half: the bytes of every bucket it last loaded, each with the tag it was
    checked against, and the id of the sync that left them (the trainer asks for it)."""

    #: The id of the last complete successful sync (None: none, or one is under way).
    synced: str | None = None
    _copies: dict[int, _Copy] = field(default_factory=dict)

    def begin(self) -> None:
        """A sync starts: until `commit`, the copies are in doubt."""
        self.synced = None

    def keep(self, index: int, payload: np.ndarray, tag: str) -> None:
        """A bucket that arrived whole (``payload``: writable and this worker's own, checked
        against ``tag``) is the copy at ``index`` now."""
        self._copies[index] = _Copy(payload, tag)

    def patch(self, index: int, delta: Delta) -> np.ndarray:
        """Patch the copy at ``index`` in place with ``delta`` and return it. Until `loaded`
        records its new tag, the copy matches no base (a refused check leaves no usable copy).

        Raises:
            BytesRejectedError: this worker holds no copy at ``index`` or another one than the
                delta was computed against.
        """
        kept = self._copies.get(index)
        if kept is None or not kept.tag or kept.tag != delta.base:
            raise BytesRejectedError(
                f"bucket {index} arrived as a delta against a copy this worker does not hold "
                "(it was restarted, or its copy changed since): nothing of it was loaded; the "
                "trainer's next sync sends every bucket whole"
            )
        kept.tag = ""
        delta.apply(kept.payload)
        return kept.payload

    def loaded(self, index: int, tag: str) -> None:
        """The patched copy at ``index`` passed the check against ``tag``."""
        self._copies[index].tag = tag

    def commit(self, sync_id: str, count: int) -> None:
        """The sync ``sync_id`` of ``count`` buckets loaded: keep its copies, drop the rest."""
        for stale in [i for i in self._copies if i >= count]:
            del self._copies[stale]
        self.synced = sync_id

    def clear(self) -> None:
        """Drop every copy (a failed sync, or the trainer closed): the next sync is full."""
        self._copies.clear()
        self.synced = None

    def copy(self, index: int) -> np.ndarray | None:
        """The bytes kept at ``index`` (None: none); for checks, read only."""
        kept = self._copies.get(index)
        return None if kept is None else kept.payload

    def digests(self) -> dict[str, str]:
        """Name -> SHA-256 of every tensor's bytes in the kept copies (aliases included): what
        a trainer compares against its own weights to see the copies are exactly what a full
        sync sends, whatever the bucketing."""
        out = {}
        for index in sorted(self._copies):
            for name, tensor in fmt.views(self._copies[index].payload):
                out[name] = hashlib.sha256(
                    tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                ).hexdigest()
        return out
