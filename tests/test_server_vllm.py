"""The decision table against real ``vllm serve`` processes, TP=1 and TP=2, both transports.

Two servers per module (CPU is shared), each started when a test first uses it, both serving LoRA with weightsync's worker extension,
on 127.0.0.1 and free ports: TP=1 on a tied model (Qwen2), TP=2 on an untied one (Llama), so
both shapes are covered without a third process. Every row of ``policy.choose`` is driven through
a ``Syncer`` as a framework would, with the sleep levels made through the server's ``/sleep``
(a no-op on CPU: level 2's discard is simulated by overwriting the weights after it). Every sync
is checked to change what the server generates, then to make it generate exactly the trainer's
greedy tokens (float32 logprobs within 1e-3).

Servers are `benchmarks.processes.VLLMServer` processes, stopped gracefully by PID (vLLM then
unlinks its shared memory); the module fails if a stop left anything in ``/dev/shm``.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest
import torch
from conftest import (
    ATOL,
    LORA,
    LORA_ARGS,
    ServersOnDemand,
    bad_stream,
    closed_leaving_nothing,
    discard,
    enter_sleep,
    full_model,
    lora_model,
    one_per_bucket,
    sync_and_check,
    walk,
)
from peft import LoraConfig, get_peft_model

from benchmarks.processes import VLLMServer
from weightsync import AdapterSync, FullSync, ReloadWeights, Syncer
from weightsync import testing as T
from weightsync.engines import Replicas, TmpfsTransport, VLLMEngine, VLLMServerEngine
from weightsync.engines.vllm.control import HTTPControl, base_label
from weightsync.errors import (
    AuthError,
    BaseDiscardedError,
    BaseUnprovenError,
    EngineAsleepError,
    EngineBrokenError,
    EngineFencedError,
    WeightMismatchError,
)
from weightsync.wire import format as fmt
from weightsync.wire.files import SEALS, bucket_name

ARCH = {1: "qwen2", 2: "llama"}  # TP -> model: tied embeddings at TP=1, an untied head at TP=2

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        tp: T.save_checkpoint(T.tiny_model(arch), tmp_path_factory.mktemp(f"served-{arch}") / "ck")
        for tp, arch in ARCH.items()
    }


@pytest.fixture(scope="module")
def servers(checkpoints, tmp_path_factory):
    """The TP=1 and the TP=2 server, each started when a test first uses it (`ServersOnDemand`:
    the TP=2 tests run alone, the others beside other modules)."""
    logs = tmp_path_factory.mktemp("logs")

    def make(tp: int) -> VLLMServer:
        log = logs / f"tp{tp}.log"
        return VLLMServer(checkpoints[tp], log, tp=tp, max_model_len=512, args=LORA_ARGS)

    with ServersOnDemand(make).stopped() as started:
        yield started
    # A TP server's processes map shared memory (the workers' message queue, and on some CPUs
    # a ``cpushm`` communicator): the graceful stop was checked on whatever they mapped
    assert all(s.shm for s in started.values() if s.tp > 1), {s.tp: s.shm for s in started.values()}


@pytest.fixture(scope="module")
def engines(servers, tmp_path_factory):
    """One engine per (TP, transport), made once: a gloo engine keeps its process group.
    ``"tmpfs-folder"``: tmpfs with files in a folder (checked and loaded inside the commit)."""
    made: dict[tuple[int, str], VLLMServerEngine] = {}

    def engine(tp: int, transport: str) -> VLLMServerEngine:
        if (tp, transport) not in made:
            how: str | TmpfsTransport = transport
            if transport == "tmpfs-folder":
                how = TmpfsTransport(tmp_path_factory.mktemp("files"))
            made[tp, transport] = VLLMServerEngine(servers[tp].url, transport=how)
        return made[tp, transport]

    with closed_leaving_nothing(made):
        yield engine


TRANSPORTS = ["tmpfs", "gloo"]
#: Where the decision table runs: each server once, each transport once (the policy does not
#: depend on the transport).
TABLE = [pytest.param(1, "tmpfs", id="tp1-tmpfs"), pytest.param(2, "gloo", id="tp2-gloo")]
#: The other two (server, transport) pairs, synced by the failure tests (and TP=1 gloo by the
#: fan-out): every pair is synced, none twice through the same test.
CROSSED = [pytest.param(1, "gloo", id="tp1-gloo"), pytest.param(2, "tmpfs", id="tp2-tmpfs")]


def test_facts_come_from_the_workers_tied(engines):
    tied = engines(1, "tmpfs")
    assert tied.dtype == torch.float32 and tied.facts.world_size == 1
    assert tied.shared_weights == [("model.embed_tokens.weight", "lm_head.weight")]
    assert (
        tied.expected_weights["lm_head.weight"]
        == tied.expected_weights["model.embed_tokens.weight"]
    )
    assert tied.serves_lora and tied.facts.lora.max_rank == 16
    assert "q_proj" in tied.facts.lora.modules and tied.facts.attests


def test_the_server_labels_the_base_version(engines):
    """vLLM's weight-version label (what its token-in-token-out route returns as spans) names
    the base version after a write, and an adapter swap leaves it (issue 33)."""
    engine = engines(1, "tmpfs")
    model = lora_model("qwen2", seed=91)
    FullSync(lora="separate").sync(model, engine)
    label = engine.control._call("GET", "/weight_info")["weight_version"]
    assert label == base_label(engine.written_version) != "default"
    T.perturb(model, seed=92, scale=0.3)
    AdapterSync().sync(model, engine)
    assert engine.control._call("GET", "/weight_info")["weight_version"] == label


def test_a_token_for_a_server_without_the_guard_is_refused(servers):
    """These servers run no token middleware: a trainer that means to authenticate is told
    the token would protect nothing, before it sends anything (docs/security.md)."""
    with pytest.raises(AuthError, match="does not run weightsync's guard"):
        VLLMServerEngine(servers[1].url, token="t" * 32)


@pytest.mark.parametrize("tp", [pytest.param(2, id="tp2")])
def test_facts_come_from_the_workers_untied(engines, tp):
    untied = engines(tp, "tmpfs")
    assert untied.facts.world_size == 2 and untied.shared_weights == []
    # No tied name the files lack: every expected weight is stored under its own name.
    assert "lm_head.weight" in fmt.shapes(untied.facts.files)
    assert set(fmt.shapes(untied.facts.files)) >= set(untied.expected_weights)
    with pytest.raises(ValueError, match="differs from replica 0"):
        Replicas([engines(1, "tmpfs"), untied])  # not one model: one sync cannot fit both


# --- the decision table, through a Syncer ---------------------------------------------------


@pytest.mark.parametrize("tp,transport", TABLE)
def test_full_training(engines, tp, transport):
    """train_type='full': FullSync at every sleep level, the served adapter dropped."""
    engine = engines(tp, transport)
    model = full_model(ARCH[tp], seed=10 + tp + 3 * TRANSPORTS.index(transport))
    syncer = Syncer(engine, train_type="full", base_sync_done=True)
    chosen = walk(syncer, model, engine, [0, 1, 2], train=lambda step: T.perturb(model, seed=step))
    assert chosen == ["FullSync"] * 3 and engine.served_adapter is None


def test_a_request_in_flight_survives_a_sync(engines, servers):
    """A write pauses the server with ``mode=keep``: generations running when the sync starts are
    held, then finished on the new weights, not dropped.

    The proof is in the tokens, not in timing: each completion starts with what the old weights
    generate (the sync starts once the first tokens have streamed back) and, for the requests
    still running when the weights changed, ends differently, because the new weights wrote the
    tail. If every completion is exactly the old weights' (all finished before the pause), this
    attempt tested nothing and is repeated on fresh weights; three such attempts fail the test.
    """
    import json
    import threading

    import requests

    engine = engines(1, "tmpfs")
    # The server's --max-model-len is 512, so a request decodes at most ~500 tokens; 48 of them
    # decode for a few seconds here, long enough that the sync pauses them mid-way even when
    # the trainer's process is slowed by other load (16 decoded in ~1 s, and a full CI run
    # beside another test run saw every attempt finish before the pause).
    prompts = [[1, 2, 3, 4, 5 + i] for i in range(48)]
    max_tokens = 500

    def stream(out: dict[int, list[int]], finish: dict[int, str], first: threading.Event) -> None:
        body = {
            "model": engine.control.model,
            "prompt": prompts,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        with requests.post(
            servers[1].url + "/v1/completions", json=body, stream=True, timeout=600
        ) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                for c in json.loads(line[len(b"data: ") :])["choices"]:
                    out.setdefault(c["index"], []).extend(c["token_ids"])
                    if c["finish_reason"]:
                        finish[c["index"]] = c["finish_reason"]
                first.set()

    # A prompt of several KV blocks, cached before the sync: after it the prefix cache must not
    # answer it from the old weights' KV, though the held requests keep blocks in use.
    cached = [(7 * i) % 1000 + 3 for i in range(64)]
    for attempt in range(3):
        model = full_model(ARCH[1], seed=60 + attempt)
        old = [t for t, _ in engine.control.generate(prompts, max_tokens, None)]
        engine.control.generate([cached], 8, None)
        out: dict[int, list[int]] = {}
        finish: dict[int, str] = {}
        first = threading.Event()
        thread = threading.Thread(target=stream, args=(out, finish, first), daemon=True)
        thread.start()
        assert first.wait(120), "no tokens streamed back"
        FullSync().sync(model, engine)
        thread.join(600)
        assert not thread.is_alive(), "the held generation never finished"
        T.assert_matches(model, engine, atol=ATOL)
        assert engine.control.generate([cached], 8, None)[0][0] == T.trainer_greedy(
            model, cached, 8
        )
        assert sorted(out) == list(range(len(prompts)))
        assert all(finish[i] == "length" for i in out), finish
        assert all(len(out[i]) == max_tokens for i in out), {i: len(t) for i, t in out.items()}
        assert any(out[i][:1] == old[i][:1] for i in out), "no completion began on the old weights"
        if any(out[i] != old[i] for i in out):
            return  # held across the weight change, finished on the new weights, all tokens
    pytest.fail("every generation finished before the sync paused the server: nothing was tested")


@pytest.mark.parametrize("tp,transport", TABLE)
def test_lora_merged(engines, tp, transport):
    """LoRA, the engine not serving it (rollout_lora=False): merged, at every sleep level."""
    engine = engines(tp, transport)
    model = lora_model(ARCH[tp], seed=20 + tp + 3 * TRANSPORTS.index(transport))
    syncer = Syncer(engine, train_type="lora", rollout_lora=False)
    train = lambda step: T.perturb(model, seed=200 + step, scale=0.3)  # noqa: E731
    chosen = walk(syncer, model, engine, [0, 1, 2], train=train)
    assert chosen == ["FullSync(lora=merge)"] * 3
    assert engine.served_adapter is None  # nothing applied on top of the merged weights


@pytest.mark.parametrize("tp,transport", TABLE)
def test_lora_served(engines, tp, transport):
    """LoRA served: base + adapter first and after a level-2 sleep, the adapter alone after
    levels 0 and 1; every adapter update is followed."""
    engine = engines(tp, transport)
    FullSync().sync(full_model(ARCH[tp], seed=5), engine)  # the server holds some other base
    model = lora_model(ARCH[tp], seed=30 + tp + 3 * TRANSPORTS.index(transport))
    syncer = Syncer(engine, train_type="lora")
    train = lambda step: T.perturb(model, seed=300 + step, scale=0.3)  # noqa: E731
    chosen = walk(syncer, model, engine, [0, 1, 0, 2, 1], train=train)
    assert chosen == [
        "FullSync(lora=separate)",
        "AdapterSync",
        "AdapterSync",
        "FullSync(lora=separate)",
        "AdapterSync",
    ]
    assert engine.served_adapter is not None
    folder = Path(engine.adapter_path).parent
    # over gloo the adapter went through the server's workers, as it would to another host
    assert (folder == engine._adapter_root) == (transport == "tmpfs"), folder
    versions = sorted(folder.glob("adapter-v*"))
    assert 1 <= len(versions) <= 2, f"old adapter folders kept: {versions}"


@pytest.mark.parametrize("tp,transport", TABLE)
def test_prefer_reload(engines, tp, transport):
    """prefer_reload: the base is restored from the server's own checkpoint (first sync and
    after a level-2 sleep), then the adapter; the adapter alone after level 1."""
    engine = engines(tp, transport)
    FullSync().sync(
        full_model(ARCH[tp], seed=6), engine
    )  # the server's base differs from its checkpoint
    model = lora_model(ARCH[tp], seed=60 + tp + 3 * TRANSPORTS.index(transport))
    syncer = Syncer(engine, train_type="lora", prefer_reload=True)
    train = lambda step: T.perturb(model, seed=600 + step, scale=0.3)  # noqa: E731
    chosen = walk(syncer, model, engine, [0, 1, 2], train=train)
    assert chosen == ["ReloadWeights(checkpoint)", "AdapterSync", "ReloadWeights(checkpoint)"]


@pytest.mark.parametrize("served", [False, True], ids=["merged", "served"])
@pytest.mark.parametrize("tp,transport", TABLE)
def test_reload_from_snapshot(engines, tp, transport, served, tmp_path):
    """ReloadWeights(snapshot) after a level-2 sleep: the server reads the trainer's snapshot."""
    engine = engines(tp, transport)
    model = lora_model(ARCH[tp], seed=70 + tp + 3 * TRANSPORTS.index(transport) + 10 * served)
    if not served:
        model = model.merge_and_unload()  # a plain model: its snapshot holds merged weights
    enter_sleep(engine, 2)
    snapshot = ReloadWeights(snapshot_dir=tmp_path / "snap")
    sync_and_check(snapshot, model, engine)
    assert not engine.base_discarded and (engine.served_adapter is not None) == served


# --- failures --------------------------------------------------------------------------------


def test_kept_files_change_layout_and_fresh_files(engines, servers):
    """The tmpfs transport's kept files when the buckets change (other sizes, fewer: files
    replaced and let go, the workers map them again), sealed and in a folder, and
    ``keep=False`` (fresh sealed files per sync, let go after); every sync exact."""
    sealed, folder = engines(1, "tmpfs"), engines(1, "tmpfs-folder")
    assert sealed.transport.sealed and not folder.transport.sealed
    for step, bucket_bytes in enumerate([64 << 10, 1 << 20, 64 << 10]):
        for engine in (sealed, folder):
            model = full_model(ARCH[1], seed=70 + step)
            FullSync(bucket_bytes=bucket_bytes, skip_unchanged=False).sync(model, engine)
            T.assert_matches(model, engine, atol=ATOL)
        kept = sealed.transport._kept
        assert sorted(kept._maps) == [bucket_name(i) for i in range(len(kept._maps))]
        assert all(fcntl.fcntl(fd, fcntl.F_GET_SEALS) == SEALS for _, _, fd in kept._maps.values())
        assert not list(sealed.transport.root.iterdir())  # nothing in any folder
        kept = folder.transport._kept
        assert sorted(p.name for p in kept.folder.iterdir()) == sorted(kept._maps)
    fresh = VLLMServerEngine(servers[1].url, transport=TmpfsTransport(keep=False))
    try:
        model = full_model(ARCH[1], seed=73)
        FullSync().sync(model, fresh)
        T.assert_matches(model, fresh, atol=ATOL)
        assert fresh.transport._kept is None and not list(fresh.transport.root.iterdir())
    finally:
        fresh.close()
    assert not fresh.transport.root.exists()


@pytest.mark.parametrize("kind", ["trainer", "engine"])
@pytest.mark.parametrize(
    "tp,transport", [*CROSSED, pytest.param(2, "tmpfs-folder", id="tp2-tmpfs-folder")]
)
def test_failure_mid_update_leaves_a_working_server(engines, servers, tp, transport, kind):
    engine = engines(tp, transport)
    old = full_model(ARCH[tp], seed=40)
    FullSync().sync(old, engine)
    new = full_model(ARCH[tp], seed=41 + tp)
    # gloo and sealed tmpfs files are staged whole, every tensor checked to be one the engine
    # loads, at its shape, before loading any: a name the model lacks is refused with nothing
    # loaded. Files in a folder are checked and loaded inside the commit.
    refused = transport in ("gloo", "tmpfs") and kind == "engine"
    with pytest.raises(WeightMismatchError if refused else RuntimeError) as failed:
        engine.load_weights(bad_stream(new, engine, kind))
    assert not isinstance(failed.value, EngineBrokenError), failed.value  # recovered, resumed
    assert servers[tp].alive(), servers[tp].tail()
    if kind == "trainer" or refused:
        # tmpfs and gloo stage the whole stream before the pause: the trainer failed (or the
        # workers refused) while staging, so the server was never touched and serves exactly
        # the old weights, its base intact.
        T.assert_matches(old, engine, atol=ATOL)
        assert not engine.base_discarded
    else:
        # The embeddings and layer 0's attention took their new weights, the rest kept the old:
        # the server refuses to generate from that mix, for every client (server_lease.py).
        with pytest.raises(EngineFencedError, match="mix of old and new layers"):
            engine.greedy_batch(T.PROMPTS, 4)
        assert engine.base_discarded, "a failed write must mark the base unsynced"
        with pytest.raises(BaseDiscardedError):
            AdapterSync().sync(lora_model(ARCH[tp], seed=42), engine)
    FullSync().sync(new, engine)  # the next full sync repairs it
    T.assert_matches(new, engine, atol=ATOL)
    assert not engine.base_discarded


def test_sleep_made_by_another_client_is_seen(engines, servers):
    """Another client's level-1 sleep: the workers' ledger attests it with its level (the base
    kept, an adapter-only sync may follow once awake)."""
    engine = engines(1, "tmpfs")
    FullSync().sync(full_model(ARCH[1], seed=42), engine)
    HTTPControl(servers[1].url).sleep(1)  # someone else
    try:
        assert engine.sleep_level == 1 and "weights" in engine.asleep
        with pytest.raises(EngineAsleepError):
            FullSync().sync(full_model(ARCH[1], seed=43), engine)
    finally:
        HTTPControl(servers[1].url).wake_up(None)
    assert not engine.asleep and engine.sleep_level == 1 and not engine.base_discarded
    FullSync().sync(full_model(ARCH[1], seed=44), engine)
    assert engine.sleep_level == 0


def test_a_write_right_after_a_commit_is_not_taken_for_the_trainers(engines, servers, caplog):
    """Another client's sync lands between a trainer's commit (which attested the workers'
    epoch while paused) and the trainer's record of that write: the trainer does not record
    the base as its own, so the adapter alone is refused (it would land on the other client's
    base) and the base is restored with it, exactly."""
    engine = engines(1, "tmpfs")
    other = VLLMServerEngine(servers[1].url)
    try:
        model = lora_model(ARCH[1], seed=48)
        FullSync().sync(full_model(ARCH[1], seed=49), engine)
        forward = engine.control.commit

        def commit_then_another_write(commit):
            answer = forward(commit)
            del engine.control.commit  # once
            FullSync().sync(full_model(ARCH[1], seed=50), other)
            return answer

        engine.control.commit = commit_then_another_write  # type: ignore[method-assign]
        with caplog.at_level("WARNING"):
            FullSync(lora="separate").sync(model, engine)
        assert "written by someone else right after this sync committed" in caplog.text
        T.perturb(model, seed=51, scale=0.3)
        with pytest.raises((BaseDiscardedError, BaseUnprovenError)):
            AdapterSync().sync(model, engine)
        FullSync(lora="separate").sync(model, engine)
        T.assert_matches(model, engine, atol=ATOL)
    finally:
        other.close()


def test_a_write_between_two_base_commits_of_one_sync_is_seen(engines, servers, caplog):
    """A checkpoint reload with a trained ``modules_to_save`` copy commits twice into the base
    (the reload, then the copy sent after it). Another client's sync landing between the two:
    the second commit's own write moves the epoch, so only what it read once paused, before
    its steps, shows the other write; the base is not recorded as the trainer's."""
    engine = engines(1, "tmpfs")
    other = VLLMServerEngine(servers[1].url)
    try:
        model = lora_model(ARCH[1], seed=52, modules_to_save=["model.norm"])
        forward = engine.control.commit
        reloads = []

        def reload_then_another_write(commit):
            answer = forward(commit)
            if any(step[1] == "weightsync_reload_checkpoint" for step in commit.steps):
                reloads.append(commit.what)
                del engine.control.commit  # once
                FullSync().sync(full_model(ARCH[1], seed=53), other)
            return answer

        engine.control.commit = reload_then_another_write  # type: ignore[method-assign]
        with caplog.at_level("WARNING"):
            report = ReloadWeights().sync(model, engine)
        assert reloads and report.tensors > 0, "no second base commit: the test is void"
        assert "written by someone else right after this sync committed" in caplog.text
        T.perturb(model, seed=54, scale=0.3)
        with pytest.raises((BaseDiscardedError, BaseUnprovenError)):
            AdapterSync().sync(model, engine)
        FullSync(lora="separate").sync(model, engine)
        T.assert_matches(model, engine, atol=ATOL)
        # The trained copy differs from the checkpoint, and is sent after the reload: exact.
        FullSync().sync(full_model(ARCH[1], seed=55), engine)
        ReloadWeights().sync(model, engine)
        T.assert_matches(model, engine, atol=ATOL)
    finally:
        other.close()


def test_a_level_2_sleep_by_another_client_already_over_is_seen(engines, servers):
    """Issue 19: slept at level 2 and woken by another client between two syncs. When the
    trainer looks, the server is awake; only the engine's own epoch shows the level-2 sleep,
    so the Syncer restores the base instead of sending the adapter alone."""
    engine = engines(1, "tmpfs")
    model = lora_model(ARCH[1], seed=45)
    syncer = Syncer(engine, train_type="lora")
    syncer.sync(model)
    assert syncer.choose().name == "AdapterSync"
    other = HTTPControl(servers[1].url)
    other.sleep(2)
    other.wake_up(None)
    assert not engine.asleep and engine.sleep_level == 2 and engine.base_discarded
    # The adapter loaded on the discarded base is no longer named, as in process.
    assert engine.served_adapter is None and engine.resident_adapters == {}
    assert syncer.choose().label == "FullSync(lora=separate)"
    with pytest.raises(BaseDiscardedError):
        AdapterSync().sync(model, engine)
    discard(engine)  # what the level-2 sleep did on a GPU
    T.perturb(model, seed=46, scale=0.3)
    report = sync_and_check(syncer, model, engine)
    assert report.strategy == "FullSync(lora=separate)" and engine.sleep_level == 0
    assert engine.served_adapter is not None


# --- several engines at once -----------------------------------------------------------------


@pytest.fixture(scope="module")
def colocated(checkpoints):
    """A second replica of the TP=1 server's model: an in-process ``vllm.LLM`` (no process)."""
    return VLLMEngine(T.make_llm(checkpoints[1], enable_lora=True, max_lora_rank=16))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_replica_fanout(engines, colocated, transport):
    """One call syncs the TP=1 server and an in-process replica of its model: each bucket
    produced once, both match, and a check that fails on one replica writes nothing anywhere."""
    replicas = Replicas([engines(1, transport), colocated])
    model = full_model(ARCH[1], seed=50 + TRANSPORTS.index(transport))
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

    merged = lora_model(ARCH[1], seed=52 + TRANSPORTS.index(transport))
    FullSync(lora="merge").sync(merged, replicas)  # the strategies take a fan-out as one engine
    for e in replicas.engines:
        T.assert_matches(merged, e, atol=ATOL)

    big = get_peft_model(T.tiny_model(ARCH[1]), LoraConfig(**{**LORA, "r": 32}))
    before = [T.compare(merged, e)["engine"] for e in replicas.engines]
    with pytest.raises(Exception, match="max_lora_rank"):
        FullSync(lora="separate").sync(big, replicas)
    assert [T.compare(merged, e)["engine"] for e in replicas.engines] == before
