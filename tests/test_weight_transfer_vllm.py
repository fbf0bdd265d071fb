"""weightsync's vLLM weight-transfer backend against real ``vllm serve`` processes.

The servers run ``--weight-transfer-config '{"backend": "weightsync"}'`` (registered in every
worker by importing weightsync's worker extension) and are driven through vLLM's own
``HTTPVLLMWeightSyncClient``: ``VLLMServerEngine(url, transport=WeightTransferFiles(...))``,
bytes as files or over gloo. One server per tensor-parallel size, started when a test first
uses it (the TP=2 tests run alone, `conftest.TP2_ALONE`), on 127.0.0.1 and free ports
(`benchmarks.processes.VLLMServer`), stopped gracefully by PID even when a test fails; the
module fails if a stop left anything in ``/dev/shm``. Every sync is checked to change what the
server generates, then to make it generate exactly the trainer's greedy tokens (float32
logprobs within 1e-3). Commit or nothing (issue 31): a sync failing before its load (the
trainer's error, a name the engine lacks, a bucket altered after it was tagged) leaves exactly
the old tokens, and a load failing part-way fences the server (the middleware's 503) until a
full sync; a trainer process SIGKILLed mid-sync (``tests/lease_trainer.py``) leaves the old
weights or the new ones whole, never a mix (the servers' pause lease, `LEASE_S`, finishes a load
its trainer left unfinished when it covered every weight, and fences one that did not);
a gloo stage nobody commits is dropped after its expiry (`STAGE_EXPIRY_S`), and a commit that
comes later is refused on every worker. A trainer only slow after its load, whose update the
lease finished, is told so and counts its sync done, unless another write came since.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch
from conftest import (
    ATOL,
    ServersOnDemand,
    bad_stream,
    closed_leaving_nothing,
    forged_delta_is_refused,
    full_model,
    lora_model,
    moe_model,
    one_per_bucket,
    served,
    sparse_step,
    sync_and_check,
)
from lease_trainer import answered, kill_seeds, run, staged_bytes, watch_stage

from benchmarks import processes
from benchmarks.processes import VLLMServer
from weightsync import FullSync, errors
from weightsync import testing as T
from weightsync.engines import (
    HTTPControl,
    LLMWeightSyncClient,
    VLLMMultiprocEngine,
    VLLMServerEngine,
    WeightTransferFiles,
    WeightTransferGloo,
)
from weightsync.engines.vllm.control import UNKNOWN_BASE, attestation, base_label, version_label
from weightsync.engines.vllm.server_lease import FENCED_HEADER
from weightsync.errors import (
    BytesRejectedError,
    EngineFencedError,
    PauseExpiredError,
    StageExpiredError,
    WeightMismatchError,
)
from weightsync.wire import gloo
from weightsync.wire.files import bucket_name
from weightsync.wire.protocol import Outcome

ARCH = "qwen2"  # tied embeddings: both names of the shared tensor must reach the engine
TPS = (1, 2)
INNERS = ("files", "gloo")

#: The servers' pause lease: a trainer killed inside its pause (the weight-transfer API's load
#: runs in a pause the trainer holds) leaves a server that resumes this long after its last call.
LEASE_S = 3.0
#: How long the workers keep a completed stage nobody commits (``WEIGHTSYNC_STAGE_EXPIRY_S``).
STAGE_EXPIRY_S = 6.0

pytestmark = pytest.mark.timeout(900)


def wt_server(checkpoint: str, log, tp: int = 1) -> VLLMServer:
    """A server running weightsync's weight-transfer backend (and weightsync's extension)."""
    args = ["--weight-transfer-config", '{"backend": "weightsync"}']
    env = {
        "WEIGHTSYNC_PAUSE_LEASE_S": str(LEASE_S),
        "WEIGHTSYNC_STAGE_EXPIRY_S": str(STAGE_EXPIRY_S),
    }
    return VLLMServer(checkpoint, log, tp=tp, args=args, env=env)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return T.save_checkpoint(T.tiny_model(ARCH), tmp_path_factory.mktemp("served") / "ck")


@pytest.fixture(scope="module")
def servers(checkpoint, tmp_path_factory):
    """One server per TP size, each started when a test first uses it (`ServersOnDemand`: the
    TP=2 tests run alone, the others beside other modules)."""
    logs = tmp_path_factory.mktemp("logs")
    with ServersOnDemand(lambda tp: wt_server(checkpoint, logs / f"tp{tp}.log", tp)).stopped() as s:
        yield s


@pytest.fixture(scope="module")
def engines(servers):
    """One engine per (TP, inner transport), made once: a gloo engine keeps its group."""
    made: dict[tuple[int, str], VLLMServerEngine] = {}

    def engine(tp: int, inner: str) -> VLLMServerEngine:
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

        if (tp, inner) not in made:
            url = servers[tp].url
            carrier = WeightTransferFiles if inner == "files" else WeightTransferGloo
            transport = carrier(HTTPVLLMWeightSyncClient(url))
            made[tp, inner] = VLLMServerEngine(url, transport=transport)
        return made[tp, inner]

    with closed_leaving_nothing(made):
        yield engine


def seed_of(tp, inner, base):
    return base + tp + 3 * INNERS.index(inner)


PARAMS = [pytest.param(tp, inner, id=f"tp{tp}-{inner}") for tp in TPS for inner in INNERS]
# Merging happens on the trainer side: at TP=2 it would only repeat the dense test's transfer.
TP1_PARAMS = [p for p in PARAMS if p.values[0] == 1]


def test_registered_without_importing_vllm():
    """Importing weightsync leaves vLLM alone; the backend is registered once vLLM's factory
    is imported (as in every worker), and registering again is harmless."""
    code = (
        "import sys, weightsync\n"
        "assert 'vllm' not in sys.modules, 'importing weightsync imported vLLM'\n"
        "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F\n"
        "from weightsync.engines.vllm.in_engine import backend as wt\n"
        "wt.register(); wt.register()\n"
        "assert F._registry['weightsync']() is wt.WeightsyncTransferEngine\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize(("tp", "inner"), PARAMS)
def test_full_sync_dense(engines, tp, inner):
    engine = engines(tp, inner)
    report = sync_and_check(FullSync(), full_model(ARCH, seed=seed_of(tp, inner, 10)), engine)
    assert report.engine_calls == 1


@pytest.mark.parametrize(("tp", "inner"), TP1_PARAMS)
def test_lora_merged(engines, tp, inner):
    engine = engines(tp, inner)
    sync_and_check(FullSync(lora="merge"), lora_model(ARCH, seed=seed_of(tp, inner, 20)), engine)


def forge_one_bucket(engine, inner, buckets, monkeypatch):
    """Stage ``buckets`` and apply them with one bucket altered after the trainer tagged it:
    over files one byte of a staged file rewritten before the commit, over gloo one byte of
    the third frame flipped on the way."""
    if inner == "gloo":
        honest, sent = gloo.send_frame, []

        def forged(group, frame):
            sent.append(frame)
            if len(sent) == 3:
                payload = frame.payload.copy()
                payload[-1] ^= 1
                frame = frame._replace(payload=payload)
            honest(group, frame)

        monkeypatch.setattr(gloo, "send_frame", forged)
        try:
            return engine.load_weights(buckets)
        finally:
            monkeypatch.undo()
    staged = engine.stage_weights(buckets)
    try:
        (path,) = engine.transport.root.glob(f"update-*/{bucket_name(2)}")
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        return staged.apply()
    finally:
        staged.drop()


FAILURES = {
    "trainer": (RuntimeError, "injected"),  # the trainer fails producing a bucket
    "engine": (WeightMismatchError, "not_a_weight"),  # a name the engine does not load
    "forged": (BytesRejectedError, "not the ones the trainer sent"),
}


@pytest.mark.parametrize("kind", list(FAILURES))
@pytest.mark.parametrize(("tp", "inner"), PARAMS)
def test_a_sync_failing_before_its_load_leaves_the_old_weights(
    engines, servers, tp, inner, kind, monkeypatch
):
    """Stage, then commit: a trainer failing part-way, a bucket the engine does not load and a
    bucket altered after it was tagged are refused before the first byte is loaded (over gloo
    before the engine is even paused): the server answers at once with exactly the old
    weights, unfenced, its workers attest no harm, and the next honest sync is exact."""
    if kind == "forged" and tp > 1:
        pytest.skip("the tag check is per worker: TP=1 proves it (CI time)")
    engine = engines(tp, inner)
    FullSync().sync(full_model(ARCH, seed=40), engine)
    serving = served(engine)
    new = full_model(ARCH, seed=seed_of(tp, inner, 41))
    error, said = FAILURES[kind]
    with pytest.raises(error, match=said):
        if kind == "forged":
            forge_one_bucket(engine, inner, one_per_bucket(new, engine), monkeypatch)
        else:
            engine.load_weights(bad_stream(new, engine, kind))
    assert servers[tp].alive(), servers[tp].tail()
    assert served(engine) == serving  # old weights, whole; not fenced
    # ... and attested whole by the workers: the refused update's calls are no harm in their
    # ledgers; and by the trainer, for an update refused before the pause (an adapter on that
    # base stays named). A rewritten file is refused by the tag check of the load, inside the
    # pause, where the trainer no longer vouches for the base (docs/failure-modes.md row 66).
    assert engine._attest(engine._restored_at).harm == 0
    if not (inner == "files" and kind == "forged"):
        assert engine.attest().harm == 0
    sync_and_check(FullSync(), new, engine)


def test_a_files_update_for_another_model_is_refused_before_the_pause(engines, monkeypatch):
    """Over files the workers check every file's names and shapes while the engine serves,
    before the trainer pauses it (or unloads a served adapter): an update naming a tensor the
    engine does not load is refused there, the error says nothing reached the engine, and the
    engine is attested whole. (The tags are checked in the pause, by the load.)"""
    engine = engines(1, "files")
    FullSync().sync(full_model(ARCH, seed=40), engine)
    serving = served(engine)
    pauses: list[str] = []
    monkeypatch.setattr(engine.control, "pause", lambda: pauses.append("pause"))
    new = full_model(ARCH, seed=42)
    with pytest.raises(WeightMismatchError, match="not_a_weight") as refused:
        engine.load_weights(bad_stream(new, engine, "engine"))
    monkeypatch.undo()
    assert errors.left_untouched(refused.value) and not pauses
    assert served(engine) == serving
    assert engine.attest().harm == 0
    assert not list(engine.transport.root.glob("update-*"))  # the refused folder removed
    sync_and_check(FullSync(), new, engine)


@pytest.mark.parametrize("inner", INNERS)
def test_prefix_cache_is_not_stale_after_a_write(engines, inner):
    """``finish_weight_update`` leaves KV cached under the old weights; the engine's write
    resets the cache, so a long prompt cached before the sync is answered by the new weights."""
    engine = engines(1, inner)
    long_prompt = [[(7 * i + 3) % 1000 + 1 for i in range(200)]]
    FullSync().sync(full_model(ARCH, seed=60), engine)
    engine.greedy_batch(long_prompt, 4)  # now in the prefix cache

    # The weight-transfer calls alone, as a framework calling vLLM's API directly makes them:
    # the cached prefix keeps answering from the old weights.
    raw = full_model(ARCH, seed=61)
    engine.transport.send(engine.rpc, one_per_bucket(raw, engine))
    stale = T.compare(raw, engine, prompts=long_prompt)
    assert stale["engine"] != stale["trainer"], "no stale prefix cache: the check proves nothing"
    engine.control.reset_prefix_cache()
    assert T.compare(raw, engine, prompts=long_prompt)["engine"] == stale["trainer"]

    new = full_model(ARCH, seed=62 + INNERS.index(inner))
    engine.greedy_batch(long_prompt, 4)
    FullSync().sync(new, engine)
    result = T.compare(new, engine, prompts=long_prompt)
    assert result["engine"] == result["trainer"], "the write left a stale prefix cache"


@pytest.mark.parametrize("inner", INNERS)
def test_nan_the_server_served_does_not_outlive_the_next_sync(engines, inner):
    """A NaN ``v_proj`` reached the workers through the weight-transfer calls alone (no value
    check: a framework calling vLLM's API directly), and requests served from it filled
    KV-cache blocks with NaN; the next honest sync's completed load clears them, so each
    request after it, one at a time (each reusing blocks the NaN filled), is exact
    (docs/failure-modes.md, row 38)."""
    engine = engines(1, inner)
    model = full_model(ARCH, seed=63 + INNERS.index(inner))
    FullSync().sync(model, engine)
    # The whole fused q/k/v layer (a layer loaded in part is refused: row 63), v poisoned.
    own = dict(model.named_parameters())
    qkv = [f"model.layers.0.self_attn.{p}_proj.{k}" for p in "qkv" for k in ("weight", "bias")]
    poisoned = [
        (n, own[n].detach().clone().fill_(float("nan")) if ".v_proj." in n else own[n].detach())
        for n in qkv
    ]
    engine.transport.send(engine.rpc, [poisoned])
    engine.control.reset_prefix_cache()
    prompts = [[(11 * i + 7 * j) % 500 + 3 for j in range(40 + 13 * i)] for i in range(6)]
    # The server computes them, then cannot answer: NaN logprobs are no JSON.
    with pytest.raises(RuntimeError, match="not JSON compliant"):
        engine.greedy_batch(prompts, 8)
    FullSync().sync(model, engine)
    for prompt in prompts[::-1]:
        assert engine.greedy(prompt, 8)[0] == T.trainer_greedy(model, prompt, 8)


def test_an_update_a_dead_trainer_left_open_is_closed(engines, servers, caplog):
    """A trainer that died between start and finish left vLLM's update open (the layers it began
    wait on the meta device: no request may reach the server); the next sync closes it and
    writes. (Not paused here: vLLM reports a paused server as sleeping, which the engine then
    refuses to write into as asleep.)"""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    engine = engines(1, "files")
    model = full_model(ARCH, seed=70)
    stale = T.compare(model, engine)
    assert stale["engine"] != stale["trainer"]
    HTTPVLLMWeightSyncClient(servers[1].url).start_weight_update()  # ... and the trainer died
    with caplog.at_level("WARNING"):
        FullSync().sync(model, engine)
    assert "closing a weight update another trainer left open" in caplog.text
    T.assert_matches(model, engine, atol=ATOL)


def test_an_abandon_lets_the_stage_go(engines):
    """A trainer that staged over gloo and died in its pause before the commit: the expired
    lease's ``weightsync_abandon`` gives the update up, and each worker lets go of the staged
    bytes then, not when the next trainer comes (a commit of them now finds nothing); the
    server keeps the old weights and the next sync is exact."""
    engine = engines(1, "gloo")
    old, new = full_model(ARCH, seed=72), full_model(ARCH, seed=73)
    FullSync().sync(old, engine)
    serving = served(engine)
    staged = engine.stage_weights(one_per_bucket(new, engine))
    try:
        engine.rpc("weightsync_abandon", {})  # what the lease runs when it expires
        with pytest.raises(RuntimeError, match="nothing is staged"):
            staged.apply()
    finally:
        staged.drop()
    assert served(engine) == serving
    sync_and_check(FullSync(), new, engine)


#: Who leaves the stage uncommitted: a trainer that stays silent past the expiry, then commits
#: (TP=2: the workers' vote refuses it on both); by hand only (WEIGHTSYNC_KILL_SEEDS set), a
#: trainer process SIGKILLed once staged (TP=1: at TP>1 vLLM's refusal of the update it left
#: open puts the server's replies out of step, `WeightTransferTransport._start`).
UNCOMMITTED = [
    pytest.param(2, "silent", id="tp2-silent"),
    *(
        [pytest.param(1, "killed", id="tp1-killed")]
        if "WEIGHTSYNC_KILL_SEEDS" in os.environ
        else []
    ),
]


@pytest.mark.parametrize(("tp", "who"), UNCOMMITTED)
def test_a_stage_nobody_commits_is_dropped_after_its_expiry(engines, servers, tp, who, tmp_path):
    """A gloo stage complete and checked on every worker, then no commit: every worker holds it
    (``weightsync_staged_bytes``) until the expiry, then nothing, and a separate client gets the
    old weights throughout (the server never paused). A commit after the expiry is refused on
    every worker (`StageExpiredError`), nothing loaded; the next sync is exact."""
    url = servers[tp].url
    old, new = full_model(ARCH, seed=74), full_model(ARCH, seed=75)
    engine = engines(tp, "gloo")
    FullSync().sync(old, engine)
    serving = [T.trainer_greedy(old, p, 8) for p in T.PROMPTS[:2]]
    staged = None
    if who == "silent":
        staged = engine.stage_weights(one_per_bucket(new, engine))
        ended = time.time()
    else:  # its gloo group replaces the module's engines' in the server: a new one follows
        said, _ = run(url, T.save_checkpoint(new, tmp_path / "new"), "staged-wt-gloo")
        ended = float(said.split("STAGED ")[1].split()[0])
    try:
        readings = watch_stage(url, T.PROMPTS[:2], ended + STAGE_EXPIRY_S + 30.0)
        print([(round(when - ended, 1), held) for when, held, _ in readings])
        assert all(tokens == serving for _, _, tokens in readings)
        # ``ended``: when the stage was known complete here, a little after the workers' END
        held = [b for when, b, _ in readings if when < ended + STAGE_EXPIRY_S - 1.5]
        assert held and all(held), "the stage was not held until its expiry (or not read before)"
        assert readings[-1][1] == 0, "the stage outlived its expiry"
        if staged is not None:
            with pytest.raises(StageExpiredError, match="no commit claimed it within 6 s"):
                staged.apply()
    finally:
        if staged is not None:
            staged.drop()
    assert answered(url, T.PROMPTS[:2], 60.0)[0] == serving
    if who == "killed":
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

        transport = WeightTransferGloo(HTTPVLLMWeightSyncClient(url))
        engine = VLLMServerEngine(url, transport=transport)
    try:
        sync_and_check(FullSync(), new, engine)
        assert staged_bytes(url) == 0
    finally:
        if who == "killed":
            engine.close()


def test_a_load_failing_part_way_fences_the_server(servers):
    """A worker error while loading, after layers took their new weights (``stage=False``: the
    stream is loaded as it comes; a name the engine does not load reaches vLLM's loader after
    the embeddings): the workers report the mix, so every client gets 503 and the trainer
    `EngineFencedError` with the base marked lost, until a full sync, which is exact. Its gloo
    group replaces the module's gloo engines' in the server (the deltas test, next, makes its
    own)."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    url = servers[1].url
    transport = WeightTransferGloo(HTTPVLLMWeightSyncClient(url), stage=False)
    engine = VLLMServerEngine(url, transport=transport)
    try:
        FullSync().sync(full_model(ARCH, seed=90), engine)
        new = full_model(ARCH, seed=91)
        with pytest.raises(RuntimeError, match="not_a_weight"):
            engine.load_weights(bad_stream(new, engine, "engine"))
        assert engine.base_discarded
        label = requests.get(url + "/weight_info", timeout=60).json()["weight_version"]
        assert label == UNKNOWN_BASE, label  # on every output generated from it
        refused = requests.post(
            url + "/v1/completions",
            json={"model": engine.control.model, "prompt": T.PROMPTS[0], "max_tokens": 4},
            timeout=60,
        )
        assert refused.status_code == 503 and refused.headers.get(FENCED_HEADER) == "1"
        reason = refused.json()["error"]
        assert "mix of old and new layers" in reason and "model.embed_tokens" in reason, reason
        with pytest.raises(EngineFencedError, match="mix of old and new layers"):
            engine.greedy_batch(T.PROMPTS, 4)
        FullSync().sync(new, engine)  # a full sync lifts the fence
        T.assert_matches(new, engine, atol=ATOL)
        assert not engine.base_discarded
    finally:
        engine.close()


def attested_label(url: str) -> str:
    """The label a commit gives what the server's workers hold now: the base part of their
    attested version (`control.version_label`)."""
    answers = [Outcome.from_json(a) for a in HTTPControl(url).rpc("weightsync_attest", {})]
    return base_label(version_label(attestation([a.value for a in answers]).epoch))


def label_of(url: str) -> str:
    """vLLM's weight-version label of the tokens the server generates next."""
    return requests.get(url + "/weight_info", timeout=60).json()["weight_version"]


#: What a trainer that goes silent once its load call was answered had loaded, on which server:
#: every weight (``whole``: the lease finishes the update); the embeddings (with the head tied
#: to them) and the first decoder layer only, whole layers, in the call marked as the update's
#: last (``layers``: a sync that
#: skipped the rest, as the engine provably holds them -- the lease finishes it too); the same
#: in a call not so marked (``unfinished``: more may have been coming, so no error but not
#: whole); the first three tensors, which load part of the fused q/k/v layer (``partial``:
#: never whole); or a stream a worker failed on after the embeddings (``failed``: gloo
#: ``stage=False``, a name the engine does not load).
LEFT = [
    pytest.param(1, "whole", "files", id="tp1-whole-files"),
    pytest.param(2, "whole", "files", id="tp2-whole-files"),
    pytest.param(1, "whole", "gloo", id="tp1-whole-gloo"),
    pytest.param(1, "layers", "files", id="tp1-layers-files"),
    pytest.param(1, "unfinished", "files", id="tp1-unfinished-files"),
    pytest.param(1, "partial", "files", id="tp1-partial-files"),
    pytest.param(1, "failed", "gloo", id="tp1-failed-gloo"),
]


def overwritten(model: torch.nn.Module, buckets: list) -> torch.nn.Module:
    """A copy of ``model`` with the tensors of ``buckets`` written over its own."""
    written = copy.deepcopy(model)
    own = dict(written.named_parameters(remove_duplicate=False))  # a tied head too
    with torch.no_grad():
        for name, t in (pair for bucket in buckets for pair in bucket):
            own[name].copy_(t)
    return written


@pytest.mark.parametrize(("tp", "left", "inner"), LEFT)
def test_a_load_its_trainer_left_unfinished_is_finished_or_fenced_by_the_lease(
    servers, tp, left, inner, caplog
):
    """The server's side of a trainer killed once its load call was sent, without a kill:
    this trainer pauses, opens the update, makes the load call and is never heard from
    again (no finish, no outcome read, no label, no resume). When the pause's lease expires
    the server settles the update alone: a load that is whole without an error on every
    worker (TP=2: both) -- every weight of the engine, or the trainer's call marked as the
    update's last (``final``), with no layer loaded in part -- is finished by vLLM's own
    finish, so a separate client gets exactly what the trainer wrote (the new weights; for
    ``layers``, the layers sent over the old rest), labelled with the version the workers attest (what the trainer's
    commit would have labelled), and the next trainer finds the update closed; a load that is
    not whole, or failed, is abandoned and the server refuses every client (503, labelled
    `UNKNOWN_BASE`) rather than serve the mix, until the next full sync, which is exact. Its
    gloo group replaces the module's gloo engines' in the server (the tests after it make
    their own)."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    url = servers[tp].url
    old, new, newer = (full_model(ARCH, seed=120 + 3 * tp + i) for i in range(3))
    carrier = WeightTransferFiles if inner == "files" else WeightTransferGloo
    stream = {"stage": False} if left == "failed" else {}
    transport = carrier(HTTPVLLMWeightSyncClient(url), **stream)
    engine = VLLMServerEngine(url, transport=transport)
    try:
        FullSync().sync(old, engine)
        before = label_of(url)
        buckets = one_per_bucket(new, engine)
        written = new
        if left in ("layers", "unfinished"):
            buckets = [
                b
                for b in buckets
                if b[0][0].startswith(("model.embed_tokens.", "lm_head.", "model.layers.0."))
            ]
            written = overwritten(old, buckets)
        elif left == "partial":
            buckets = buckets[:3]
        elif left == "failed":
            buckets = bad_stream(new, engine, "engine")
        if left == "unfinished":  # the same call, not marked as the update's last
            update = transport._update
            transport._update = lambda info: update(dataclasses.replace(info, final=False))
        transport._commit = lambda rpc, load: load()  # the load call, then nothing
        staged = transport.prepare(engine.rpc, buckets)
        try:
            engine.control.pause()  # the trainer's pause: only the lease ends it
            staged.apply()
        finally:
            staged.drop()
        tokens, waited = answered(url, T.PROMPTS[:2], LEASE_S + 30.0)
        if left in ("whole", "layers"):
            assert tokens == [T.trainer_greedy(written, p, 8) for p in T.PROMPTS[:2]], tokens
            assert label_of(url) == attested_label(url) != before
        else:
            assert tokens == "fenced", tokens
            assert label_of(url) == UNKNOWN_BASE
        assert waited < LEASE_S + 30.0, waited
    finally:
        engine.close()
    honest = VLLMServerEngine(url, transport=carrier(HTTPVLLMWeightSyncClient(url)))
    try:
        with caplog.at_level("WARNING"):  # the update was closed: nothing left open to close
            FullSync().sync(newer, honest)  # lifts any fence
        T.assert_matches(newer, honest, atol=ATOL)
        assert "left open" not in caplog.text
    finally:
        honest.close()


def test_an_update_that_loads_part_of_a_layer_is_refused_not_finished(servers):
    """A trainer that finishes an update which loaded some weights of a layer but not all (the
    q projection and its bias without k and v: one fused q/k/v layer in vLLM): vLLM's finish
    would process that layer with k and v freshly allocated and never written, and the server
    would serve the garbage without an error (it did, before the backend checked). Refused at
    the finish instead: the layer keeps its old weights, the embeddings the update had finished
    keep their new ones -- a mix, so the server refuses every client until a full sync, which
    is exact."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    url = servers[1].url
    old, new, newer = (full_model(ARCH, seed=140 + i) for i in range(3))
    transport = WeightTransferFiles(HTTPVLLMWeightSyncClient(url))
    engine = VLLMServerEngine(url, transport=transport)
    try:
        FullSync().sync(old, engine)
        buckets = one_per_bucket(new, engine)[:3]
        assert [n for b in buckets for n, _ in b][1:] == [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.q_proj.bias",
        ]
        staged = transport.prepare(engine.rpc, buckets)
        with pytest.raises(Exception, match=r"some weights of .*qkv_proj but not all"):
            try:
                engine.control.pause()
                staged.apply()
            finally:
                staged.drop()
                with contextlib.suppress(Exception):
                    engine.control.resume()
        tokens, _ = answered(url, T.PROMPTS[:2], 30.0)
        assert tokens == "fenced", tokens
        FullSync().sync(newer, engine)  # lifts the fence
        T.assert_matches(newer, engine, atol=ATOL)
    finally:
        engine.close()


def test_a_tied_tensor_sent_under_one_name_updates_every_layer_that_holds_it(servers):
    """A push of ``named_parameters()`` (TRL's, ms-swift's) sends the tied embedding once,
    under the embedding's name. vLLM's finish gives the head, which it did not load, its
    previous tensors back -- the shared weight, which holds the new values -- but vLLM-CPU's
    packed copy of the head (float32: a copy on AVX-512 and AVX2 alike, docs/benchmarks.md)
    stayed the old weight's, served without an error, before the backend re-ran the head's
    processing (``model_ops.unwritten_twins``). The server now serves exactly what was sent."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    url = servers[1].url
    old, new = (full_model(ARCH, seed=150 + i) for i in range(2))
    transport = WeightTransferFiles(HTTPVLLMWeightSyncClient(url))
    engine = VLLMServerEngine(url, transport=transport)
    try:
        FullSync().sync(old, engine)
        buckets = [
            kept
            for bucket in one_per_bucket(new, engine)
            if (kept := [(n, t) for n, t in bucket if n != "lm_head.weight"])
        ]
        assert (
            sum(len(b) for b in buckets)
            == len(dict(new.named_parameters()))
            < len(dict(new.named_parameters(remove_duplicate=False)))
        )  # every parameter once: the tied one under the embedding's name
        staged = transport.prepare(engine.rpc, buckets)
        try:
            engine.control.pause()
            staged.apply()
        finally:
            staged.drop()
            engine.control.resume()
        T.assert_matches(new, engine, atol=ATOL)
    finally:
        engine.close()


def test_a_trainer_slow_after_its_load_counts_the_update_the_lease_finished(servers, monkeypatch):
    """A trainer alive but silent between its load and its finish for longer than the lease,
    driven through vLLM's own HTTP client: the lease finishes the update (the load covered
    every weight) and resumes; the trainer's late finish is refused, never run (unleased, it
    would have finished whatever update was open then), and told what the lease did, so its
    sync completes, exact, with the version the workers attest. When another trainer wrote in
    the meantime, the late trainer raises instead, naming it, and the server serves the other
    trainer's weights, whole; the next sync is exact."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    from weightsync.engines.vllm.transports import weight_transfer

    url = servers[1].url
    old, new, other, newest = (full_model(ARCH, seed=140 + i) for i in range(4))
    engine = VLLMServerEngine(url, transport=WeightTransferFiles(HTTPVLLMWeightSyncClient(url)))
    intruder = VLLMServerEngine(url)
    meanwhile: list = []  # what another trainer does while this one is slow
    real = weight_transfer._call

    def slow_finish(client, method, *args):
        if method == "finish_weight_update":
            time.sleep(LEASE_S + 4.0)  # the lease expires (its tick: a quarter of it)
            for do in meanwhile:
                do()
        return real(client, method, *args)

    try:
        FullSync().sync(old, engine)
        assert engine.transport.client is engine.control  # calls carry the pause's lease
        monkeypatch.setattr(weight_transfer, "_call", slow_finish)
        FullSync().sync(new, engine)
        T.assert_matches(new, engine, atol=ATOL)
        assert engine.written_version == engine.weights_version
        assert label_of(url) == attested_label(url) == base_label(engine.written_version)

        meanwhile.append(lambda: FullSync().sync(other, intruder))
        with pytest.raises(PauseExpiredError, match="another write came since"):
            FullSync().sync(newest, engine)
        T.assert_matches(other, engine, atol=ATOL)
        monkeypatch.setattr(weight_transfer, "_call", real)
        FullSync().sync(newest, engine)
        T.assert_matches(newest, engine, atol=ATOL)
    finally:
        intruder.close()
        engine.close()


#: Where the trainer is killed (`tests/lease_trainer.py`): at a random moment of a sync over
#: each carrier (one seed each; more with WEIGHTSYNC_KILL_SEEDS=a-b), and, in those runs by hand
#: only, as the load is asked (the random seeds reach that point too: files 12, gloo 9; CI's
#: time goes to the random ones, about a minute each).
KILLS = [
    *(f"random-wt-{inner}:{seed}" for seed in kill_seeds() for inner in INNERS),
    *(f"loading-wt-{inner}" for inner in INNERS if "WEIGHTSYNC_KILL_SEEDS" in os.environ),
]


def serves_after(said: str) -> tuple[str, ...]:
    """What a separate client may get after the kill `tests/lease_trainer.py` reports in
    ``said``: before the pause, or inside it before the load call (``/pause``,
    ``/start_weight_update``), the old weights; with the load call in flight, the old ones
    (it had not reached the server) or the new ones (it had: the load covers every weight,
    and the lease finishes it); once the load was sent (``LOADING``) or answered, the new
    ones. Never a fenced server: every load of these syncs is a full restore."""
    if "SYNCED" in said or "LOADING" in said or "AT after" in said:
        return ("new",)
    if "AT staging" in said or "(/pause " in said or "(/start_weight_update " in said:
        return ("old",)
    if "(/update_weights in flight)" in said:
        return ("old", "new")
    return ("new",)


@pytest.mark.parametrize("point", KILLS)
def test_a_trainer_killed_mid_sync_leaves_no_mix_served(servers, point, tmp_path):
    """A trainer process SIGKILLed in a sync through the weight-transfer API: at a random
    moment (staging, inside the pause that holds the load, or after) or as it asks for the load
    (which the server carries out alone, with nobody left to finish the update): a separate
    client then gets, within a bounded time, exactly the old weights' tokens, or the new
    weights' where the load call reached the server (the pause's lease finishes an update
    whose load covered every weight, `serves_after`), labelled with the version the workers
    attest -- never a fenced server, never a mix. The next honest
    sync (from this process) is exact and lifts any fence, and nothing of the dead trainer
    stays in /dev/shm. Its gloo group replaces the module's gloo engines' in the server's
    backend (the deltas test, next, makes its own)."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    url = servers[1].url
    inner = point.split(":")[0].rsplit("-", 1)[1]
    seed = int(point.partition(":")[2] or 0)
    old, new, newer = (full_model(ARCH, seed=110 + 3 * seed + i) for i in range(3))
    prompts = T.PROMPTS[:2]
    first = VLLMServerEngine(url, transport=WeightTransferFiles(HTTPVLLMWeightSyncClient(url)))
    try:
        FullSync().sync(old, first)
    finally:
        first.close()
    expected = {
        "old": [T.trainer_greedy(old, p, 8) for p in prompts],
        "new": [T.trainer_greedy(new, p, 8) for p in prompts],
    }
    assert expected["old"] != expected["new"], "the new weights answer as the old: proves nothing"

    old_folder = T.save_checkpoint(old, tmp_path / "old") if "random" in point else ""
    said, pid = run(url, T.save_checkpoint(new, tmp_path / "new"), point, old_folder)
    bound_s = LEASE_S + 30.0  # the lease, its tick, the recovery calls; slack for 2 loaded cores
    tokens, waited = answered(url, prompts, bound_s)
    served = next((k for k, v in expected.items() if v == tokens), tokens)
    print(f"{point}: {said.splitlines()[1:]}: {served}, answered in {waited:.1f} s")
    assert served in serves_after(said), f"{served} served after a kill: {said}"
    assert waited < bound_s, f"answered after {waited:.1f} s"
    if "AT staging" in said:  # never paused, nothing loaded: the old weights, at once
        assert waited < LEASE_S, said
    if served == "new":  # labelled as the trainer's commit would have, whoever finished it
        assert label_of(url) == attested_label(url), said

    carrier = WeightTransferFiles if inner == "files" else WeightTransferGloo
    honest = VLLMServerEngine(url, transport=carrier(HTTPVLLMWeightSyncClient(url)))
    try:  # a new trainer: its scratch folders sweep the dead's, its update closes the dead's
        FullSync().sync(newer, honest)
        T.assert_matches(newer, honest, atol=ATOL)  # unfenced: it generates
    finally:
        honest.close()
    assert not list(Path("/dev/shm").glob(f"weightsync-{pid}-*"))


@pytest.mark.parametrize("tp", TPS, ids=[f"tp{tp}" for tp in TPS])
def test_deltas_through_the_weight_transfer_api(servers, tp, monkeypatch):
    """``WeightTransferGloo(client, delta=True)``: after a sparse step only the
    changed words cross, every worker's backend patches its kept copy (which then holds what
    a full sync sends) and the server serves the trainer exactly; a forged delta is refused
    before anything is loaded and the next sync is whole. Last of the module's gloo users: its
    group replaces theirs in the server's backend."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    url = servers[tp].url
    transport = WeightTransferGloo(HTTPVLLMWeightSyncClient(url), delta=True)
    engine = VLLMServerEngine(url, transport=transport)
    sync = FullSync(bucket_bytes=256 << 10, skip_unchanged=False)
    try:
        model = full_model(ARCH, seed=100 + tp)
        sync_and_check(sync, model, engine)
        first = transport.last_sync
        assert first.delta_buckets == 0 and first.full_buckets > 2, first
        sparse_step(model, seed=tp)
        sync_and_check(sync, model, engine)
        count = transport.last_sync
        assert count.full_buckets == 0 and count.delta_buckets == first.full_buckets, count
        assert count.wire_bytes <= 0.10 * count.bucket_bytes, count
        kept = [o.value for o in engine.rpc("weightsync_delta_digests", {"backend": True})]
        assert len(kept) == tp and all(k == kept[0] for k in kept)
        assert set(kept[0]) >= set(engine.expected_weights)
        state = model.state_dict()  # a full sync sends the trainer's float32 tensors as they are
        for name, digest in kept[0].items():
            sent = state[name].detach().contiguous().view(-1).view(torch.uint8).numpy()
            assert hashlib.sha256(sent).hexdigest() == digest, f"{name}: not what a full sync sends"

        sparse_step(model, seed=10 + tp)
        forged_delta_is_refused(sync, model, engine, transport, monkeypatch)
    finally:
        engine.close()
    left = HTTPControl(url).rpc("weightsync_delta_state", {"backend": True})
    assert [Outcome.from_json(r).value for r in left] == [None] * tp  # closing dropped them


def trained_moe(seed):
    """A tiny Qwen3-MoE, trained: vLLM-CPU needs its experts re-packed after every reload."""
    model = moe_model("qwen3_moe")
    T.perturb(model, seed=seed)
    return model


@pytest.fixture(scope="module")
def multiproc_llm(tmp_path_factory):
    """A ``vllm.LLM`` on a MoE model with vLLM's default multiprocess engine core, running the
    backend."""
    checkpoint = T.save_checkpoint(moe_model("qwen3_moe"), tmp_path_factory.mktemp("moe") / "ck")
    with processes.multiproc_llm(
        checkpoint, weight_transfer_config={"backend": "weightsync"}
    ) as llm:
        yield llm


def test_multiprocess_llm_through_its_own_methods(multiproc_llm):
    """An ``LLM``'s four weight-transfer methods as the client (its engine core and worker are
    forked from this process, which imported weightsync before vLLM: registration follows), on
    a MoE model whose experts vLLM-CPU computes wrongly unless re-packed after the reload."""
    transport = WeightTransferFiles(LLMWeightSyncClient(multiproc_llm))
    engine = VLLMMultiprocEngine(multiproc_llm, transport=transport)
    try:
        sync_and_check(FullSync(), trained_moe(seed=80), engine)
        with pytest.raises(WeightMismatchError, match="not_a_weight"):  # refused, not loaded
            engine.load_weights(bad_stream(trained_moe(seed=81), engine, "engine"))
        sync_and_check(FullSync(), trained_moe(seed=82), engine)
    finally:
        engine.close()
    assert not transport.root.exists() and not engine._adapter_root.exists()
