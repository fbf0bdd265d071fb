"""The decision table against real ``vllm serve`` processes, TP=1 and TP=2, both transports.

Two servers per module (CPU is shared): one at TP=1 and one at TP=2, both serving LoRA, both
started with weightsync's worker extension, on 127.0.0.1 and free ports, stopped by process
group even when a test fails. Every sync is checked to change what the server generates, then
to make it generate exactly the trainer's greedy tokens (float32 logprobs within 1e-3).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from weightsync import AdapterSync, FullSync, policy
from weightsync import testing as T
from weightsync.engines.vllm.server import (
    WORKER_EXTENSION,
    EngineBrokenError,
    HTTPControl,
    Replicas,
    VLLMServerEngine,
)
from weightsync.errors import BaseDiscardedError

ARCH = "qwen2"  # tied embeddings: the harder case for a remote reload
ATOL = 1e-3
LORA = {
    "r": 8,
    "lora_alpha": 16,
    "target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
}
START_TIMEOUT_S = 420

pytestmark = pytest.mark.timeout(900)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``vllm serve`` process group of our own, stopped by its PID."""

    def __init__(self, checkpoint: str, tp: int, log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
        }
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a server always runs its core apart
        if tp == 2:
            env.update(VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", checkpoint, "--host", "127.0.0.1", "--port", str(self.port),
            "--enforce-eager", "--max-model-len", "256", "--skip-tokenizer-init",
            "--dtype", "float32", "--seed", "0", "--tensor-parallel-size", str(tp),
            "--enable-lora", "--max-lora-rank", "16", "--max-loras", "1",
            "--worker-extension-cls", WORKER_EXTENSION,
        ]  # fmt: skip
        self.log = log
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait(self) -> None:
        import requests

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}): {self.tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vllm serve not up after {START_TIMEOUT_S}s: {self.tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self) -> str:
        return "\n".join(self.log.read_text().splitlines()[-30:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return T.save_checkpoint(T.tiny_model(ARCH), tmp_path_factory.mktemp("served") / "ck")


@pytest.fixture(scope="module")
def servers(checkpoint, tmp_path_factory):
    """One TP=1 and one TP=2 server, started together (start-up is the slow part)."""
    logs = tmp_path_factory.mktemp("logs")
    started: dict[int, Server] = {}
    try:
        for tp in (1, 2):
            started[tp] = Server(checkpoint, tp, logs / f"tp{tp}.log")
        for s in started.values():
            s.wait()
        yield started
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def engines(servers):
    """One engine per (TP, transport), made once: a gloo engine keeps its process group."""
    made: dict[tuple[int, str], VLLMServerEngine] = {}

    def engine(tp: int, transport: str) -> VLLMServerEngine:
        if (tp, transport) not in made:
            made[tp, transport] = VLLMServerEngine(servers[tp].url, transport=transport)
        return made[tp, transport]

    try:
        yield engine
    finally:
        for e in made.values():
            e.close()
    leftovers = [p for e in made.values() for p in (e._adapter_root,) if p.exists()]
    assert not leftovers, f"adapter folders left behind: {leftovers}"


SERVERS = [pytest.param(1, id="tp1"), pytest.param(2, id="tp2")]
TRANSPORTS = ["tmpfs", "gloo"]


def full_model(seed):
    model = T.tiny_model(ARCH)
    T.perturb(model, seed=seed)
    return model


def lora_model(seed):
    model = get_peft_model(T.tiny_model(ARCH), LoraConfig(**LORA))
    T.perturb(model, seed=seed, scale=0.3)
    return model


def sync_and_check(strategy, model, engine):
    stale = T.compare(model, engine)
    assert stale["engine"] != stale["trainer"], (
        "the server already matched the trainer: the test proves nothing"
    )
    report = strategy.sync(model, engine)
    T.assert_matches(model, engine, atol=ATOL)
    return report


def test_facts_come_from_the_workers(engines, servers):
    engine = engines(1, "tmpfs")
    assert engine.dtype == torch.float32
    assert engine.shared_weights == [("model.embed_tokens.weight", "lm_head.weight")]
    assert (
        engine.expected_weights["lm_head.weight"]
        == engine.expected_weights["model.embed_tokens.weight"]
    )
    assert engine.serves_lora and engine.facts["lora"]["max_lora_rank"] == 16
    assert "q_proj" in engine.facts["lora"]["modules"]
    assert engines(2, "tmpfs").facts["world_size"] == 2


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("tp", SERVERS)
def test_full_training(engines, tp, transport):
    engine = engines(tp, transport)
    s = policy.choose(train_type="full", rollout_lora=True, base_sync_done=True, sleep_level=0)
    report = sync_and_check(s, full_model(seed=10 + tp + 3 * TRANSPORTS.index(transport)), engine)
    assert type(s) is FullSync and report.engine_calls == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("tp", SERVERS)
def test_lora_merged(engines, tp, transport):
    engine = engines(tp, transport)
    sync_and_check(
        FullSync(lora="merge"), lora_model(seed=20 + tp + 3 * TRANSPORTS.index(transport)), engine
    )
    assert engine.served_adapter is None  # nothing applied on top of the merged weights


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("tp", SERVERS)
def test_lora_served_first_sync_then_adapter_only(engines, tp, transport):
    engine = engines(tp, transport)
    FullSync().sync(full_model(seed=5), engine)  # the server holds some other base
    model = lora_model(seed=30 + tp + 3 * TRANSPORTS.index(transport))
    s = policy.choose(train_type="lora", rollout_lora=True, base_sync_done=False, sleep_level=0)
    assert type(s) is FullSync and s.lora == "separate"
    report = sync_and_check(s, model, engine)
    assert report.engine_calls == 2 and engine.served_adapter is not None
    previous = T.compare(model, engine)["engine"]
    for step in range(2):
        T.perturb(model, seed=300 + step, scale=0.3)
        s = policy.choose(train_type="lora", rollout_lora=True, base_sync_done=True, sleep_level=0)
        assert type(s) is AdapterSync
        report = sync_and_check(s, model, engine)
        assert report.engine_calls == 1 and report.buckets == 0
        tokens = T.compare(model, engine)["engine"]
        assert tokens != previous, "the server did not follow the adapter update"
        previous = tokens
    versions = sorted(engine._adapter_root.glob("adapter-v*"))
    assert 1 <= len(versions) <= 2, f"old adapter folders kept: {versions}"


def one_per_bucket(model, engine):
    """The model's weights in checkpoint (module) order, one tensor a bucket."""
    state = model.state_dict()
    return [[(name, state[name].detach())] for name in state if name in engine.expected_weights]


def _bad_stream(model, engine, kind):
    """The model's buckets, failing part-way through layer 0: the trainer raises, or a tensor
    the engine cannot load (a name its model lacks) reaches the workers mid-reload."""
    stream = one_per_bucket(model, engine)
    yield from stream[:6]
    if kind == "trainer":
        raise RuntimeError("injected: the trainer failed producing the next bucket")
    yield [("model.layers.0.mlp.not_a_weight", torch.zeros(4))]


@pytest.mark.parametrize("kind", ["trainer", "engine"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("tp", SERVERS)
def test_failure_mid_update_leaves_a_working_server(engines, servers, tp, transport, kind):
    engine = engines(tp, transport)
    old = full_model(seed=40)
    FullSync().sync(old, engine)
    new = full_model(seed=41 + tp)
    with pytest.raises(RuntimeError) as failed:
        engine.load_weights(_bad_stream(new, engine, kind))
    assert not isinstance(failed.value, EngineBrokenError), failed.value  # recovered, resumed
    assert servers[tp].alive(), servers[tp].tail()
    engine.greedy_batch(T.PROMPTS, 4)  # still serving (a mix of old and new layers)
    assert engine.base_discarded, "a failed write must mark the base unsynced"
    with pytest.raises(BaseDiscardedError):
        AdapterSync().sync(lora_model(seed=42), engine)
    FullSync().sync(new, engine)  # the next full sync repairs it
    T.assert_matches(new, engine, atol=ATOL)
    assert not engine.base_discarded


def test_sleep_made_by_another_client_is_seen(engines, servers):
    engine = engines(1, "tmpfs")
    HTTPControl(servers[1].url).sleep(1)  # someone else; the level is not visible over HTTP
    try:
        assert engine.sleep_level == 2 and "weights" in engine.asleep
    finally:
        HTTPControl(servers[1].url).wake_up(None)
    assert not engine.asleep
    with pytest.raises(BaseDiscardedError):
        AdapterSync().sync(lora_model(seed=43), engine)
    FullSync().sync(full_model(seed=44), engine)
    assert engine.sleep_level == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_replica_fanout(engines, transport):
    """One call syncs the TP=1 and the TP=2 server: each bucket produced once, both match,
    and a check that fails on one replica writes nothing anywhere."""
    replicas = Replicas([engines(1, transport), engines(2, transport)])
    model = full_model(seed=50 + TRANSPORTS.index(transport))
    for e in replicas.engines:
        stale = T.compare(model, e)
        assert stale["engine"] != stale["trainer"]
    produced: list[str] = []

    def counted():
        for bucket in one_per_bucket(model, replicas):
            produced.extend(name for name, _ in bucket)
            yield bucket

    replicas.load_weights(counted())
    assert sorted(produced) == sorted(replicas.expected_weights)  # each once, for both replicas
    for e in replicas.engines:
        T.assert_matches(model, e, atol=ATOL)

    merged = lora_model(seed=52 + TRANSPORTS.index(transport))
    FullSync(lora="merge").sync(merged, replicas)  # the strategies take a fan-out as one engine
    for e in replicas.engines:
        T.assert_matches(merged, e, atol=ATOL)

    big = get_peft_model(T.tiny_model(ARCH), LoraConfig(**{**LORA, "r": 32}))
    before = [T.compare(merged, e)["engine"] for e in replicas.engines]
    with pytest.raises(Exception, match="max_lora_rank"):
        FullSync(lora="separate").sync(big, replicas)
    assert [T.compare(merged, e)["engine"] for e in replicas.engines] == before
