"""One stream of buckets from the trainer to an engine, whatever carries it: the frames, what
each tag covers, and the receiver's checks in order. Both halves; the carriers are elsewhere
(``wire/gloo.py``: broadcasts over a gloo group; ``engines/vllm/ray/``: Ray's object store).

A stream is BUCKET or DELTA frames, then an END frame carrying how many came, or an ABORT frame
when the trainer failed part-way (the receiver then abandons what it loaded). With a sync's
`Signer` (``wire.tags``) every frame but ABORT is tagged: the tag covers the frame's `header`
(its kind and length) and its payload, and its nonce is the frame's place in the stream, so a
frame altered, replayed, reordered or dropped is refused, and so is an END whose count is not
the number of frames checked. A DELTA frame (``wire.delta``) carries the tag of the whole bucket
a full sync would have sent: the receiver patches its kept copy and checks that tag on the
result, so what it loads is byte-identical to the full frame or refused.

The receiver (`Checker`) checks each frame before its bytes are handed on, so the first is
checked before the engine is touched and a refused frame is never loaded. How a carrier moves
frames, and how an abort reaches the receiver, is the carrier's; this module imports no carrier.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import NamedTuple, NoReturn

import numpy as np

from ..errors import BytesRejectedError, WeightSyncError
from . import format as fmt
from .delta import Delta, LoadedCopies, SentCopies
from .tags import Signer, check


class Kind(IntEnum):
    """A frame's kind, as it travels (gloo broadcasts it in an int64 header)."""

    ABORT = -1
    END = 0
    BUCKET = 1
    DELTA = 2


class Frame(NamedTuple):
    """One bucket as it travels: its kind (BUCKET or DELTA), its bytes, its tag ("" untagged)."""

    kind: Kind
    payload: np.ndarray
    tag: str


def header(kind: Kind, length: int) -> np.ndarray:
    """A frame's header: ``[kind, length]`` as int64 (for END, the length is the count). The
    tag covers it with the payload, so a frame cannot change kind or length unnoticed."""
    return np.array([int(kind), length], dtype=np.int64)


def bucket_tag(signer: Signer, payload: np.ndarray) -> str:
    """The tag of a BUCKET frame carrying ``payload`` (uint8), numbered by ``signer``."""
    return signer.sign(header(Kind.BUCKET, payload.nbytes), payload)


def end_tag(signer: Signer, count: int) -> str:
    """The tag of the END frame of a stream of ``count`` frames."""
    return signer.sign(header(Kind.END, count))


def frame(
    bucket: fmt.Pairs, signer: Signer | None = None, copies: SentCopies | None = None
) -> Frame:
    """The trainer's half: the next frame of a stream, ``bucket`` packed (``format.pack``) and
    tagged by ``signer``; with ``copies``, a DELTA frame instead when ``copies`` holds the
    base the receiver holds too (``wire.delta``).

    Raises:
        ValueError: ``copies`` without ``signer`` (a delta is proven by the whole bucket's tag).
    """
    if copies is None:
        payload = fmt.pack(bucket).numpy()
        return Frame(Kind.BUCKET, payload, bucket_tag(signer, payload) if signer else "")
    if signer is None:
        raise ValueError("a delta is checked by the tag of the full bucket: sign the stream")
    whole, tag, delta = copies.next(bucket, lambda data: bucket_tag(signer, data))
    if delta is None:
        return Frame(Kind.BUCKET, whole, tag)
    return Frame(Kind.DELTA, delta.to_bytes(), tag)


class Pieces(NamedTuple):
    """One bucket as it travels in pieces (`scattered`): its kind, the pieces, its tag."""

    kind: Kind
    pieces: list[np.ndarray]
    tag: str


def scattered(
    bucket: fmt.Pairs, signer: Signer | None = None, copies: SentCopies | None = None
) -> Pieces:
    """`frame`, for a carrier that copies a payload given in pieces itself (Ray's object
    store): a BUCKET frame is ``format.pieces`` -- its header, then views of the tensors' own
    bytes, not copied here -- and its tag is `frame`'s, over their concatenation (the bytes
    `frame` would pack). With ``copies``, `frame`'s frame in one piece (the sent copies are
    whole buckets, packed anyway).

    Raises:
        ValueError: as `frame`.
    """
    if copies is not None:
        made = frame(bucket, signer, copies)
        return Pieces(made.kind, [made.payload], made.tag)
    parts = fmt.pieces(bucket)
    if signer is None:
        return Pieces(Kind.BUCKET, parts, "")
    return Pieces(Kind.BUCKET, parts, signer.sign(header(Kind.BUCKET, _size(parts)), *parts))


def _size(parts: Sequence[np.ndarray]) -> int:
    return sum(p.nbytes for p in parts)


class Checker:
    """The receiver's half: checks each frame of one stream, in order, before its bytes are
    used.

    Args:
        key: the sync's tag key (``wire.tags``) when the trainer tags the stream ("": untagged,
            nothing is checked but the END's count).
        copies: the receiver's kept copies (``wire.delta``) when the trainer sends deltas: each
            whole bucket is kept there, each DELTA frame patches one. Without them, or without
            ``key``, a DELTA frame is refused.
    """

    def __init__(self, key: str = "", copies: LoadedCopies | None = None) -> None:
        self.key = key
        self.copies = copies
        self.count = 0  # frames checked: the next one's place (its tag's nonce)

    def bucket(self, kind: int, payload: np.ndarray, tag: str) -> np.ndarray:
        """The bytes to load for the next frame, a BUCKET's ``payload`` or the bucket a DELTA
        patches this receiver's copy into, checked against ``tag``. A whole bucket is kept in
        ``copies`` (a read-only buffer, as Ray's store hands out, is copied first: a later
        delta patches it in place).

        Raises:
            BytesRejectedError: the frame is not the trainer's (altered, out of order, of an
                unknown kind), or a delta this receiver cannot patch. Nothing of it was loaded.
        """
        what = f"bucket {self.count} of the stream"
        if kind == Kind.DELTA:
            payload = self._patched(f"{what} (a delta)", payload, tag)
        elif kind != Kind.BUCKET:
            raise BytesRejectedError(f"{what}: a frame of unknown kind {kind}: nothing was loaded")
        elif self.key:
            whole = header(Kind.BUCKET, payload.nbytes)
            check(self.key, tag, what, whole, payload, expect=self.count)
            if self.copies is not None:
                if not payload.flags.writeable:
                    payload = np.array(payload, copy=True)
                self.copies.keep(self.count, payload, tag)
        self.count += 1
        return payload

    def pieces(self, kind: int, parts: Sequence[np.ndarray], tag: str) -> list[np.ndarray]:
        """`bucket` for a frame whose payload came in pieces (`scattered`): a BUCKET's tag is
        checked over the pieces in order, which are returned as they came (nothing copied: a
        reader views them, ``format.pieces_views``). A DELTA frame, or a BUCKET kept in
        ``copies``, is one whole buffer (joined here if it came in more pieces).

        Raises:
            BytesRejectedError: as `bucket`.
        """
        if kind != Kind.BUCKET or self.copies is not None:
            whole = parts[0] if len(parts) == 1 else np.concatenate(parts)
            return [self.bucket(kind, whole, tag)]
        if self.key:
            what = f"bucket {self.count} of the stream"
            frame_header = header(Kind.BUCKET, _size(parts))
            check(self.key, tag, what, frame_header, *parts, expect=self.count)
        self.count += 1
        return list(parts)

    def _patched(self, what: str, payload: np.ndarray, tag: str) -> np.ndarray:
        if self.copies is None or not self.key:
            raise BytesRejectedError(
                f"{what}: this receiver keeps no copies to patch (or the stream is not tagged): "
                "nothing of it was loaded"
            )
        delta = Delta.from_bytes(payload)
        patched = self.copies.patch(self.count, delta)
        check(self.key, tag, what, header(Kind.BUCKET, delta.size), patched, expect=self.count)
        self.copies.loaded(self.count, tag)
        return patched

    def end(self, count: int, tag: str) -> None:
        """The END frame: its tag, then its count against the frames checked.

        Raises:
            BytesRejectedError: the END is not the trainer's, or frames were dropped.
        """
        if self.key:
            check(self.key, tag, "the stream's end", header(Kind.END, count), expect=self.count)
        if count != self.count:
            raise BytesRejectedError(
                f"the stream ended after {self.count} of {count} buckets: a frame was dropped "
                "or the end was forged"
            )

    def abort(self, why: str = "") -> NoReturn:
        """The ABORT frame: the trainer failed part-way (``why``, when the carrier says)."""
        raise WeightSyncError(
            "the trainer aborted this weight update part-way" + (f": {why}" if why else "")
        )
