"""Keyed tags of the bytes weightsync sends, so a worker loads only what the trainer produced.

Both halves: the trainer's transport makes a `Signer` per sync (a fresh random key) and tags
every bucket's bytes as it produces them; the key and the tags reach the workers over the
control channel (an RPC's arguments, or the weight-transfer API's payloads, both behind the
server's token), or, for a gloo stream, the key does and each tag follows its bucket in the
stream. A worker checks every bucket before any of its tensors is loaded (`check`) and refuses
a mismatch with `BytesRejectedError`.

Why a keyed tag and not a checksum: whoever can rewrite a tmpfs file or inject into a TCP stream
can rewrite a checksum beside it; a tag needs the key, which travels only on the control channel.
Why GMAC (AES-GCM over no plaintext, the bytes as associated data): it is several times faster
than HMAC-SHA256 or BLAKE2b on one core (figures: docs/security.md, "What it costs"). A GCM nonce
must never repeat under one key: the key is fresh per sync and each tag's nonce is the
`Signer`'s counter, which the tag carries. In a stream the receiver also requires the nonces in
order (``expect``), so a frame replayed from earlier in the same sync is refused too.
"""

from __future__ import annotations

import hmac
import os
from typing import Any

from ..errors import BytesRejectedError

#: Bytes of a sync's key (AES-256) and of one tag.
KEY_BYTES, TAG_BYTES = 32, 16

#: Associated data is fed to the MAC in pieces of this size (cryptography's one-shot calls take
#: at most 2**31 - 1 bytes; a bucket can be larger).
_PIECE = 1 << 28


def _gmac(key: bytes, nonce: int, buffers: tuple[Any, ...]) -> bytes:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    mac = Cipher(algorithms.AES(key), modes.GCM(nonce.to_bytes(12, "big"))).encryptor()
    for buffer in buffers:
        view = memoryview(buffer).cast("B")
        for start in range(0, len(view), _PIECE):
            mac.authenticate_additional_data(view[start : start + _PIECE])
    mac.finalize()
    return bytes(mac.tag)


class Signer:
    """The trainer's half for one sync: a fresh key, and a tag per buffer (nonces 0, 1, ...)."""

    def __init__(self) -> None:
        self.key = os.urandom(KEY_BYTES)
        self._nonce = 0

    @property
    def key_hex(self) -> str:
        """The key as sent to the workers (JSON)."""
        return self.key.hex()

    def sign(self, *buffers: Any) -> str:
        """The tag of the concatenated ``buffers`` (anything exposing bytes: an mmap, a numpy
        array, ``bytes``), as ``"<nonce>:<tag hex>"``."""
        nonce, self._nonce = self._nonce, self._nonce + 1
        return f"{nonce}:{_gmac(self.key, nonce, buffers).hex()}"


def check(key_hex: str, tag: str, what: str, *buffers: Any, expect: int | None = None) -> None:
    """The worker's half: raise `BytesRejectedError` unless ``tag`` is the trainer's tag of
    the concatenated ``buffers`` under the key ``key_hex`` (``expect``: the nonce it must carry,
    for a stream). ``what`` names the bucket in the error."""
    try:
        nonce_text, _, tag_hex = tag.partition(":")
        nonce, expected = int(nonce_text), bytes.fromhex(tag_hex)
        key = bytes.fromhex(key_hex)
    except (ValueError, AttributeError) as e:
        raise BytesRejectedError(f"{what}: the trainer's tag {tag!r} is malformed ({e})") from e
    if expect is not None and nonce != expect:
        raise BytesRejectedError(
            f"{what}: arrived out of order (tag number {nonce}, expected {expect}): a frame was "
            "replayed, dropped or reordered between the trainer and this worker; nothing of it "
            "was loaded"
        )
    if not hmac.compare_digest(_gmac(key, nonce, buffers), expected):
        raise BytesRejectedError(
            f"{what}: its bytes are not the ones the trainer sent (their keyed tag differs): "
            "altered on disk or in transit between the trainer and this worker; nothing of it "
            "was loaded"
        )
