"""No one else writes the weights (docs/security.md), against a real ``vllm serve``.

One server per module on 127.0.0.1, guarded by weightsync's token middleware, with the worker
extension, LoRA and the ``"weightsync"`` weight-transfer backend. Checked: every route that can
change the weights turns a caller without the token away and the server still generates what it
did; with the token every byte path syncs exactly; a bucket altered between the trainer and the
workers (a tmpfs file rewritten, a gloo frame corrupted) is refused before it is loaded with a
`BytesRejectedError`, the engine still serving what it had, and the next sync repairs; a
trainer without the token, or one asked to use a server reached over the network without one,
is refused before it sends anything.
"""

from __future__ import annotations

import secrets

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
    VLLMServerEngine,
    WeightTransferFiles,
)
from weightsync.engines.vllm.control import Commit
from weightsync.engines.vllm.server_lease import COMMIT_PATH
from weightsync.errors import AuthError, BytesRejectedError
from weightsync.wire import gloo

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


def test_a_bucket_file_rewritten_before_the_load_is_refused_with_nothing_loaded(engines):
    engine = engines("tmpfs")
    sync_and_check(FullSync(), full_model(ARCH, seed=20), engine)
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
            FullSync().sync(full_model(ARCH, seed=21), engine)
    finally:
        del engine.control.commit
    assert greedy(engine) == before  # every file is checked before the first is loaded
    sync_and_check(FullSync(), full_model(ARCH, seed=21), engine)


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
