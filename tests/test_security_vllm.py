"""No one else writes the weights (docs/security.md), against a real ``vllm serve``.

One server per module on 127.0.0.1, guarded by weightsync's token middleware, with the worker
extension, LoRA and the ``"weightsync"`` weight-transfer backend. Checked: every route that can
change the weights turns a caller without the token away and the server still generates what it
did; with the token every byte path syncs exactly; a bucket altered between the trainer and the
workers (a tmpfs file rewritten -- a sealed one cannot be, by anyone but its trainer --, a gloo
frame corrupted) is refused before it is loaded with a `BytesRejectedError`, the engine still serving what it had, and the next sync repairs; a
trainer without the token, or one asked to use a server reached over the network without one,
is refused before it sends anything.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import pytest
import requests
import torch
from conftest import LORA_ARGS, closed_leaving_nothing, full_model, lora_model, sync_and_check

from benchmarks.processes import VLLMServer, serving
from weightsync import AdapterSync, FullSync
from weightsync import testing as T
from weightsync.engines import (
    TOKEN_MIDDLEWARE,
    GlooTransport,
    HTTPControl,
    TmpfsTransport,
    VLLMServerEngine,
    WeightTransferFiles,
)
from weightsync.engines.vllm.control import Commit
from weightsync.engines.vllm.server_lease import COMMIT_PATH
from weightsync.errors import AuthError, BytesRejectedError
from weightsync.wire import gloo
from weightsync.wire.files import bucket_name

ARCH = "qwen2"
TOKEN = secrets.token_urlsafe(24)
PROMPT = [[3, 14, 15, 92, 65]]

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return T.save_checkpoint(T.tiny_model(ARCH), tmp_path_factory.mktemp("served") / "ck")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    args = [
        *LORA_ARGS,
        "--middleware",
        TOKEN_MIDDLEWARE,
        "--weight-transfer-config",
        '{"backend": "weightsync"}',
    ]
    log = tmp_path_factory.mktemp("logs") / "guarded.log"
    with serving(VLLMServer(checkpoint, log, args=args, env={"WEIGHTSYNC_TOKEN": TOKEN})) as (
        started,
    ):
        yield started


@pytest.fixture(scope="module")
def engines(server):
    """The guarded server's engines by byte path, made on first use, closed at the end."""
    made: dict[str, VLLMServerEngine] = {}
    transports = {
        "tmpfs": lambda: "tmpfs",
        "gloo": lambda: GlooTransport(),
        "weight-transfer": lambda: WeightTransferFiles(HTTPControl(server.url, token=TOKEN)),
    }

    def engine(path: str) -> VLLMServerEngine:
        if path not in made:
            made[path] = VLLMServerEngine(server.url, token=TOKEN, transport=transports[path]())
        return made[path]

    with closed_leaving_nothing(made):
        yield engine


def greedy(engine) -> list[int]:
    return engine.greedy_batch(PROMPT, 8)[0][0]


def _attacker_folder(tmp_path, engine) -> str:
    """Random weights for every name the engine loads, as a checkpoint folder of one's own."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(7)
    junk = {n: torch.randn(s, generator=gen) for n, s in engine.expected_weights.items()}
    save_file(junk, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def test_every_weight_changing_route_turns_away_a_caller_without_the_token(
    server, engines, tmp_path
):
    engine = engines("tmpfs")
    before = greedy(engine)
    junk = _attacker_folder(tmp_path, engine)
    reload = {
        "method": "reload_weights",
        "kwargs": {"weights_path": junk, "is_checkpoint_format": True},
    }
    calls = [
        ("POST", "/collective_rpc", {"json": reload}),
        ("POST", "/collective_rpc", {"json": {"method": "weightsync_abandon", "kwargs": {}}}),
        ("POST", "/sleep", {"params": {"level": 2}}),
        ("POST", "/wake_up", {}),
        ("POST", "/pause", {}),
        ("POST", "/resume", {}),
        ("POST", "/reset_prefix_cache", {}),
        ("POST", "/init_weight_transfer_engine", {"json": {"init_info": {}}}),
        ("POST", "/start_weight_update", {}),
        ("POST", "/update_weights", {"json": {"update_info": {"folder": junk}}}),
        ("POST", "/finish_weight_update", {}),
        ("POST", "/update_weight_version", {"json": {"weight_version": "x"}}),
        ("POST", "/v1/load_lora_adapter", {"json": {"lora_name": "evil", "lora_path": junk}}),
        ("POST", "/v1/unload_lora_adapter", {"json": {"lora_name": "weightsync"}}),
        ("GET", "/server_info", {}),
        ("POST", "/a_route_a_later_vllm_adds", {}),
        ("POST", COMMIT_PATH, {"json": Commit("x", (("rpc", *reload.values()),)).to_json()}),
    ]
    for headers in ({}, {"X-Weightsync-Token": "not-the-token-" + TOKEN[:8]}):
        for method, path, kwargs in calls:
            r = requests.request(method, server.url + path, headers=headers, timeout=60, **kwargs)
            assert r.status_code == 401, (path, headers, r.status_code, r.text[:300])
            assert "weightsync token required" in r.text
    # Inference stays open (rollout clients), and the server still serves what it did.
    assert requests.get(server.url + "/v1/models", timeout=60).status_code == 200
    assert greedy(engine) == before
    assert not engine.control.is_sleeping()
    # The same reload with the token does change the weights: the 401s above are what stopped
    # it. The workers' ledger sees that write, so the Syncer restores everything next.
    with_token = {"X-Weightsync-Token": TOKEN}
    r = requests.post(server.url + "/collective_rpc", json=reload, headers=with_token, timeout=300)
    assert r.status_code == 200, r.text[:300]
    assert greedy(engine) != before
    sync_and_check(FullSync(), full_model(ARCH, seed=1), engine)


@pytest.mark.parametrize("path", ["tmpfs", "gloo", "weight-transfer"])
def test_with_the_token_every_byte_path_syncs_exactly(engines, path):
    engine = engines(path)
    assert engine.transport.tagged  # the workers check every bucket's tag
    sync_and_check(FullSync(), full_model(ARCH, seed=10 + len(path)), engine)


def test_a_served_adapter_is_checked_then_loaded(engines):
    """tmpfs: the adapter folder's files are checked against their tags before vLLM reads it."""
    engine = engines("tmpfs")
    model = lora_model(ARCH, seed=3)
    sync_and_check(FullSync(lora="separate"), model, engine)
    T.perturb(model, seed=4, scale=0.3)
    sync_and_check(AdapterSync(), model, engine)


OTHER_WRITER = """
import mmap, os, sys
path = sys.argv[1]
tried = []
for what, attempt in [
    ("write", lambda f: (f.seek(0), f.write(b"x"), f.flush())),
    ("map", lambda f: mmap.mmap(f.fileno(), 0)),
    ("truncate", lambda f: os.ftruncate(f.fileno(), 1)),
]:
    try:
        with open(path, "r+b") as f:
            attempt(f)
        tried.append(what + ": done")
    except OSError as e:
        tried.append(f"{what}: {e.strerror}")
print(";".join(tried))
"""


def test_a_staged_file_cannot_be_rewritten_and_a_rewrite_before_the_seal_is_refused(engines):
    """tmpfs's sealed files. Another process of the same user, holding the path the workers
    open, can neither write a staged file, map it writable nor resize it; a writer that mapped
    a file before its seal (standing in: the trainer's own mapping) and changes a byte after
    the trainer's tag is refused by the workers' stage: never paused, nothing loaded."""
    engine = engines("tmpfs")
    assert engine.transport.sealed
    sync_and_check(FullSync(), full_model(ARCH, seed=20), engine)
    before, version = greedy(engine), engine.weights_version
    kept = engine.transport._kept
    paths = [f"/proc/{os.getpid()}/fd/{fd}" for _, _, fd in kept._maps.values()]
    for path in paths:
        said = subprocess.run(
            [sys.executable, "-c", OTHER_WRITER, path], capture_output=True, text=True
        ).stdout.strip()
        assert said == "write: Operation not permitted;map: Operation not permitted;" + (
            "truncate: Operation not permitted"
        ), (path, said)

    write = kept.write

    def rewritten_after_the_tag(*args, **kwargs):
        written = write(*args, **kwargs)
        _, mapped, _ = kept._maps[bucket_name(len(written.names) - 1)]
        mapped[-1] ^= 0x55
        return written

    kept.write = rewritten_after_the_tag  # type: ignore[method-assign]
    try:
        with pytest.raises(BytesRejectedError, match=r"bucket file /proc/.*not the ones"):
            FullSync().sync(full_model(ARCH, seed=21), engine)
    finally:
        del kept.write
    assert greedy(engine) == before and engine.weights_version == version  # never written
    sync_and_check(FullSync(), full_model(ARCH, seed=21), engine)


def test_a_bucket_file_rewritten_before_the_load_is_refused_with_nothing_loaded(server, tmp_path):
    """tmpfs with files in a folder (``root``: for workers that cannot open the trainer's
    sealed files): any process of the same user can rewrite these, so the workers check every
    file inside the commit, before loading the first."""
    engine = VLLMServerEngine(server.url, token=TOKEN, transport=TmpfsTransport(tmp_path / "b"))
    try:
        assert not engine.transport.sealed
        sync_and_check(FullSync(), full_model(ARCH, seed=22), engine)
        before = greedy(engine)
        forward = engine.control.commit

        def rewrite_then_forward(commit):
            # someone rewrites a file the trainer wrote, just before the commit that loads it
            [kwargs] = [step[2] for step in commit.steps if step[1] == "weightsync_load_files"]
            path = f"{kwargs['folder']}/{kwargs['files'][-1]}"
            with open(path, "r+b") as f:
                f.seek(-4, 2)
                last = f.read(4)
                f.seek(-4, 2)
                f.write(bytes(b ^ 0x55 for b in last))
            return forward(commit)

        engine.control.commit = rewrite_then_forward  # type: ignore[method-assign]
        try:
            with pytest.raises(BytesRejectedError, match=r"bucket file bucket-\d+.*not the ones"):
                FullSync().sync(full_model(ARCH, seed=23), engine)
        finally:
            del engine.control.commit
        assert greedy(engine) == before  # every file is checked before the first is loaded
        sync_and_check(FullSync(), full_model(ARCH, seed=23), engine)
    finally:
        engine.close()


def test_a_gloo_frame_corrupted_on_the_way_is_refused_and_the_next_sync_repairs(
    engines, monkeypatch
):
    """A late frame of a many-bucket stream is corrupted: the workers stage the whole stream
    before loading any of it (`GlooTransport.prepare`), so nothing was loaded, the server was
    never paused, and its base stays the synced one."""
    engine = engines("gloo")
    sync_and_check(FullSync(), full_model(ARCH, seed=30), engine)
    before, written = greedy(engine), engine.written_version
    send = gloo.broadcast
    frames = []

    def corrupting(group, tensor):
        if tensor.dtype == torch.uint8 and tensor.numel() > 1024:  # a bucket
            frames.append(tensor.numel())
            if len(frames) == 5:
                tensor[-1] ^= 0x55  # after the tag was taken: as if changed on the wire
        send(group, tensor)

    monkeypatch.setattr(gloo, "broadcast", corrupting)
    with pytest.raises(BytesRejectedError, match=r"bucket 4 of the stream.*not the ones"):
        FullSync(bucket_bytes=64 << 10).sync(full_model(ARCH, seed=31), engine)
    monkeypatch.undo()
    assert len(frames) > 5, f"{len(frames)} bucket frames: the corrupted one was not late"
    assert greedy(engine) == before  # four buckets came before it: nothing was loaded
    assert not engine.base_discarded
    assert written is not None and engine.written_version == written  # never paused
    sync_and_check(FullSync(), full_model(ARCH, seed=31), engine)


def test_a_trainer_without_the_token_is_refused_before_it_sends(server):
    with pytest.raises(AuthError, match="sent no token"):
        VLLMServerEngine(server.url)
    with pytest.raises(AuthError, match="does not accept"):
        VLLMServerEngine(server.url, token="x" * 32)
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    with pytest.raises(requests.HTTPError, match="401"):  # vLLM's client sends no token
        HTTPVLLMWeightSyncClient(server.url).start_weight_update()


def test_a_server_over_the_network_without_a_token_is_refused():
    """Nothing is sent: the address (TEST-NET-1, routed nowhere) is never contacted."""
    with pytest.raises(AuthError, match="not loopback"):
        VLLMServerEngine("http://192.0.2.1:8000")


def test_the_guard_refuses_to_start_without_a_token(monkeypatch):
    from weightsync.engines.vllm.server_auth import RequireToken

    monkeypatch.delenv("WEIGHTSYNC_TOKEN", raising=False)
    with pytest.raises(RuntimeError, match=r"WEIGHTSYNC_TOKEN.*unset"):
        RequireToken(lambda *a: None)
    monkeypatch.setenv("WEIGHTSYNC_TOKEN", "short")
    with pytest.raises(RuntimeError, match="too short"):
        RequireToken(lambda *a: None)
