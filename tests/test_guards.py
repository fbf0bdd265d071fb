"""The data plane's own doors, without vLLM (docs/security.md): keyed tags of the bytes, the
gloo rendezvous (bound to the named address, a secret a stranger does not have), owner-only
folders and files, and the token middleware as an ASGI app. The same guards against a real
``vllm serve`` are in ``test_security_vllm.py``."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from weightsync.engines import TmpfsTransport
from weightsync.errors import BytesRejectedError
from weightsync.wire import format as fmt
from weightsync.wire import gloo, tags
from weightsync.wire.files import KeptFiles, MappedFiles, check_files, write_folder
from weightsync.wire.scratch import private_dir
from weightsync.wire.stream import Kind

BUCKETS = [[("a", torch.randn(300))], [("b", torch.randn(2, 3)), ("c", torch.ones(4))]]


def test_a_tag_holds_only_for_the_bytes_key_and_nonce_it_was_made_for():
    signer = tags.Signer()
    data = bytearray(os.urandom(1000))
    tag = signer.sign(data)
    tags.check(signer.key_hex, tag, "x", data)
    tags.check(signer.key_hex, tag, "x", bytes(data[:10]), bytes(data[10:]))  # pieces: the same
    data[500] ^= 1
    with pytest.raises(BytesRejectedError, match="x: its bytes are not the ones"):
        tags.check(signer.key_hex, tag, "x", data)
    data[500] ^= 1
    with pytest.raises(BytesRejectedError):  # another sync's key
        tags.check(tags.Signer().key_hex, tag, "x", data)
    with pytest.raises(BytesRejectedError, match="out of order"):
        tags.check(signer.key_hex, tag, "x", data, expect=1)
    with pytest.raises(BytesRejectedError, match="malformed"):
        tags.check(signer.key_hex, "zz", "x", data)
    assert signer.sign(data) != tag  # the next tag has the next nonce


def _pair(timeout_s: float):
    """Two ranks over loopback: (trainer's group, worker's group, pool)."""
    pool = ThreadPoolExecutor(2)
    joined = {}

    def join(port: int, secret: str):
        def run():
            joined["worker"] = gloo.join_group("127.0.0.1", port, 1, 2, timeout_s, secret)

        return pool.submit(run)

    trainer = gloo.open_group("127.0.0.1", 0, 2, timeout_s, join)
    return trainer[0], joined["worker"][0], pool


@pytest.fixture
def ranks(request):
    """A pair whose operations time out after 60 s, or the seconds ``request.param`` says."""
    trainer, worker, pool = _pair(getattr(request, "param", 60.0))
    yield trainer, worker, pool
    pool.shutdown(wait=True)


def _receive(worker, key):
    return [(n, t.clone()) for n, t in gloo.Receiver(worker, key)]


def test_a_tagged_stream_arrives_whole(ranks):
    trainer, worker, pool = ranks
    signer = tags.Signer()
    received = pool.submit(_receive, worker, signer.key_hex)
    gloo.send(trainer, BUCKETS, received, signer=signer)
    got = dict(received.result())
    assert all(torch.equal(got[n], t) for bucket in BUCKETS for n, t in bucket)


@pytest.mark.parametrize(
    ("attack", "ranks"),
    [("corrupt", 60.0), ("replay", 60.0), ("truncate", 3.0)],
    indirect=["ranks"],
)
def test_a_worker_refuses_a_stream_changed_on_the_way(ranks, monkeypatch, attack):
    """Bytes flipped after the tag was taken, the first frame sent again in place of the
    second, or an END frame forged early: refused, and otherwise the stream still drains (the
    trainer's broadcasts complete). After a forged END the worker reads no more, so the
    trainer's next broadcast fails when its peer times out (3 s here, ``timeout_s`` in use)."""
    trainer, worker, pool = ranks
    signer = tags.Signer()
    real_send = gloo.broadcast
    frames: list[torch.Tensor] = []

    def tampering(group, tensor):
        if group is trainer:
            frames.append(tensor.clone())
            if attack == "corrupt" and len(frames) == 2:  # bucket 0's payload
                tensor = tensor.clone()
                tensor[7] ^= 0x40
            if attack == "replay" and 4 <= len(frames) <= 6:  # bucket 1: bucket 0's frames
                tensor = frames[len(frames) - 4]
            if attack == "truncate" and len(frames) == 4:  # an END for one bucket, untagged
                real_send(group, torch.tensor([Kind.END, 1], dtype=torch.int64))
                real_send(group, torch.zeros(gloo.TAG_FRAME_BYTES, dtype=torch.uint8))
                tensor = torch.tensor([Kind.END, 0], dtype=torch.int64)  # a stray frame
        real_send(group, tensor)

    monkeypatch.setattr(gloo, "broadcast", tampering)

    def receive():
        receiver = gloo.Receiver(worker, signer.key_hex)
        try:
            list(receiver)
        except BytesRejectedError as e:
            receiver.drain()
            return str(e)
        return "accepted"

    received = pool.submit(receive)
    if attack == "truncate":  # the worker stops at the forged END; nothing more is read
        with pytest.raises(Exception):  # noqa: B017 (the trainer's broadcast loses its peer)
            gloo.send(trainer, BUCKETS, received, signer=signer)
    else:
        gloo.send(trainer, BUCKETS, received, signer=signer)
    outcome = received.result(timeout=60)
    expected = {"corrupt": "not the ones", "replay": "out of order", "truncate": "stream's end"}
    assert expected[attack] in outcome


def test_a_stranger_without_the_secret_does_not_get_in():
    """A process that reaches the rendezvous port and joins as rank 1 without the secret waits
    for a group it never finds and gives up; the worker told the secret joins, and the group
    carries a stream."""
    pool = ThreadPoolExecutor(2)
    tried: list[subprocess.CompletedProcess] = []
    joined = {}

    def join(port: int, secret: str):
        code = f"from weightsync.wire import gloo; gloo.join_group('127.0.0.1', {port}, 1, 2, 5.0, 'guess')"
        tried.append(
            subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
            )
        )

        def run():
            joined["worker"] = gloo.join_group("127.0.0.1", port, 1, 2, 60.0, secret)

        return pool.submit(run)

    try:
        trainer, _ = gloo.open_group("127.0.0.1", 0, 2, 60.0, join)
        assert tried[0].returncode != 0, "the stranger joined a group"
        assert "timed out" in tried[0].stderr.lower() or "timeout" in tried[0].stderr.lower()
        received = pool.submit(_receive, joined["worker"][0], "")
        gloo.send(trainer, BUCKETS, received)
        assert sorted(dict(received.result(timeout=60))) == ["a", "b", "c"]
    finally:
        pool.shutdown(wait=True)


def _other_address() -> str | None:
    """An address of this machine that is not loopback (the source of a route; nothing is
    sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


def test_the_rendezvous_listens_on_the_named_address_only():
    other = _other_address()
    if other is None:
        pytest.skip("this machine has no address besides loopback")
    ports = []

    def join(port: int, secret: str):
        ports.append(port)
        with pytest.raises(OSError), socket.create_connection((other, port), timeout=5):
            pass  # refused: nothing listens there on that port
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the named address answers
        return pool.submit(gloo.join_group, "127.0.0.1", port, 1, 2, 60.0, secret)

    pool = ThreadPoolExecutor(1)
    try:
        gloo.open_group("127.0.0.1", 0, 2, 60.0, join)
    finally:
        pool.shutdown(wait=True)
    assert ports


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_folders_and_files_are_the_owners_only(tmp_path):
    transport = TmpfsTransport(tmp_path / "root")
    try:
        assert _mode(transport.root) == 0o700
        kept = transport._kept
        assert kept is not None and kept.folder is not None
        written = kept.write(BUCKETS)
        assert _mode(kept.folder) == 0o700
        assert {_mode(kept.folder / n) for n in written.names} == {0o600}
    finally:
        transport.close()
    fresh = write_folder(BUCKETS, tmp_path / "fresh")
    assert _mode(tmp_path / "fresh") == 0o700
    assert {_mode(tmp_path / "fresh" / n) for n in fresh.names} == {0o600}
    fmt.write_adapter(tmp_path / "adapter", [("x", torch.zeros(2))], {"r": 1})
    assert _mode(tmp_path / "adapter") == 0o700
    assert {_mode(p) for p in (tmp_path / "adapter").iterdir()} == {0o600}


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o777])
def test_a_folder_others_can_enter_is_refused_not_reused(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(PermissionError, match=f"mode {mode:04o}"):
        TmpfsTransport(shared)
    with pytest.raises(PermissionError, match="lets others"):
        KeptFiles(shared).write(BUCKETS)
    assert _mode(shared) == mode and list(shared.iterdir()) == []  # untouched
    link = tmp_path / "link"
    link.symlink_to(private_dir(tmp_path / "mine"))
    with pytest.raises(PermissionError, match="symlink"):
        TmpfsTransport(link)


def test_signed_files_are_checked_before_anything_is_read(tmp_path):
    signer = tags.Signer()
    kept = KeptFiles(tmp_path / "kept")
    try:
        written = kept.write(BUCKETS, signer=signer)
        reader = MappedFiles()
        got = dict(reader.read(str(kept.folder), written.names, signer.key_hex, written.tags))
        assert torch.equal(got["a"], BUCKETS[0][0][1])
        with open(kept.folder / written.names[1], "r+b") as f:  # someone rewrites the second
            f.seek(-1, 2)
            last = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([last[0] ^ 1]))
        with pytest.raises(BytesRejectedError, match=written.names[1]):
            reader.read(str(kept.folder), written.names, signer.key_hex, written.tags)
        with pytest.raises(BytesRejectedError, match="2 bucket files came with 1 tags"):
            check_files(str(kept.folder), written.names, signer.key_hex, written.tags[:1])
    finally:
        kept.close()


def _asgi(app, path: str, headers: list[tuple[bytes, bytes]]) -> int:
    """One HTTP request through an ASGI app; the response status."""
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "root_path": "", "method": "POST", "headers": headers}
    asyncio.run(app(scope, receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_the_middleware_denies_by_default_and_compares_the_token(monkeypatch):
    from weightsync.engines.vllm.server_auth import HEADER, RequireToken

    token = "t" * 32
    monkeypatch.setenv("WEIGHTSYNC_TOKEN", token)

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guard = RequireToken(app)
    right = [(HEADER.encode(), token.encode())]
    assert _asgi(guard, "/v1/completions", []) == 200  # inference: open
    assert _asgi(guard, "/v1/completions/", []) == 200
    for path in ("/collective_rpc", "/sleep", "/v1/load_lora_adapter", "/new_in_vllm_0_40"):
        assert _asgi(guard, path, []) == 401, path
        assert _asgi(guard, path, [(HEADER.encode(), b"t" * 31)]) == 401, path
        assert _asgi(guard, path, [*right, *right]) == 401, path  # one token, not two
        assert _asgi(guard, path, right) == 200, path
