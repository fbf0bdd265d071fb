"""A stock ``vllm serve`` (no weightsync worker extension), synced with ``transport="tmpfs"``.

Bytes go through vLLM's own ``/collective_rpc`` ``reload_weights(weights_path=...)``; the
engine's facts come from the server's dev-mode ``/server_info`` and the model folder it serves.
One TP=1 server on a tied model (Qwen2), the case vLLM's own reload gets wrong: it restores
``lm_head`` apart from ``embed_tokens``, so a tied checkpoint reloaded as it is (the tensor
stored once) leaves the head stale. Every sync is checked to change what the server generates,
then to make it generate exactly the trainer's greedy tokens (float32 logprobs within 1e-3).

Beside it, started with it, a server halfway: weightsync's worker extension without its pause
lease middleware, the last test's.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import (
    ATOL,
    LORA_ARGS,
    closed_leaving_nothing,
    enter_sleep,
    full_model,
    lora_model,
    one_per_bucket,
    sync_and_check,
    walk,
)

from benchmarks.processes import VLLMServer, serving
from weightsync import FullSync, ReloadWeights, Syncer
from weightsync import testing as T
from weightsync.engines import StockServerEngine, VLLMServerEngine
from weightsync.engines.vllm.control import LEASE_MIDDLEWARE
from weightsync.errors import EngineBrokenError
from weightsync.wire import format as fmt

ARCH = "qwen2"

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return T.save_checkpoint(T.tiny_model(ARCH), tmp_path_factory.mktemp("stock") / "ck")


@pytest.fixture(scope="module")
def servers(checkpoint, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    stock = VLLMServer(checkpoint, logs / "stock.log", extension=False, args=LORA_ARGS)
    unleased = VLLMServer(checkpoint, logs / "unleased.log", lease=False)
    with serving(stock, unleased) as started:
        yield started


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def engine(server):
    """The tests own this server: ``exclusive`` lets its sleeps made through the adapter stand
    for all there were (a stock server attests no epoch; see test_a_server_not_owned_...)."""
    e = StockServerEngine(server.url, transport="tmpfs", exclusive=True)
    with closed_leaving_nothing([e]):
        yield e


def test_facts_come_from_the_server(engine, checkpoint):
    assert "stock server" in engine.describe()
    assert engine.dtype == torch.float32 and engine.facts.world_size == 1
    assert engine.shared_weights == [("model.embed_tokens.weight", "lm_head.weight")]
    # The files store the tied tensor once; a reload must send it under the other name too.
    stored = fmt.shapes(engine.facts.files)
    assert "model.embed_tokens.weight" in stored and "lm_head.weight" not in stored
    assert not engine.facts.attests
    # What vLLM's loader reads from the folder it serves, plus the tied name it registers.
    shapes = T.tiny_model(ARCH).state_dict()
    assert dict(engine.expected_weights) == {k: tuple(v.shape) for k, v in shapes.items()}
    assert engine.serves_lora and engine.facts.lora.max_rank == 16
    assert {"q_proj", "v_proj", "down_proj"} <= set(engine.facts.lora.modules)
    assert "lm_head" not in engine.facts.lora.modules


def test_gloo_needs_the_extension(server):
    with pytest.raises(ValueError, match="worker extension"):
        StockServerEngine(server.url, transport="gloo")


def test_a_stock_server_is_not_taken_for_one_with_the_extension(server):
    """A server without the extension is named as such: the caller chooses StockServerEngine
    (full syncs through vLLM's reload) or restarts the server with the extension."""
    with pytest.raises(
        RuntimeError, match=r"(?s)do not answer weightsync_facts.*StockServerEngine"
    ):
        VLLMServerEngine(server.url)


def test_vllm_reload_of_a_tied_checkpoint_leaves_the_head_stale(engine, tmp_path):
    """Why the engine writes a tied tensor under every name: vLLM's own reload of a tied
    checkpoint (the tensor stored once, as ``save_pretrained`` does) changes the embedding but
    keeps the old head. Measured: greedy tokens differ, logprobs off by ~1.4."""
    model = full_model(ARCH, seed=1)
    folder = T.save_checkpoint(model, tmp_path / "ck")
    engine.control.pause()
    engine.control.rpc("reload_weights", {"weights_path": folder, "is_checkpoint_format": True})
    engine.control.reset_prefix_cache()
    engine.control.resume()
    stale = T.compare(model, engine)
    assert stale["engine"] != stale["trainer"] and stale["max_logprob_diff"] > 0.1, stale
    FullSync().sync(model, engine)  # the same weights, the tied tensor under both names
    T.assert_matches(model, engine, atol=ATOL)


# --- the decision table, through a Syncer ---------------------------------------------------


def test_full_training(engine):
    model = full_model(ARCH, seed=10)
    syncer = Syncer(engine, train_type="full", base_sync_done=True)
    chosen = walk(syncer, model, engine, [0, 1, 2], train=lambda step: T.perturb(model, seed=step))
    assert chosen == ["FullSync"] * 3


def test_lora_merged(engine):
    model = lora_model(ARCH, seed=20)
    syncer = Syncer(engine, train_type="lora", rollout_lora=False)
    train = lambda step: T.perturb(model, seed=200 + step, scale=0.3)  # noqa: E731
    assert walk(syncer, model, engine, [0, 1, 2], train=train) == ["FullSync(lora=merge)"] * 3
    assert engine.served_adapter is None


def test_lora_served(engine):
    FullSync().sync(full_model(ARCH, seed=5), engine)  # the server holds some other base
    model = lora_model(ARCH, seed=30)
    syncer = Syncer(engine, train_type="lora")
    train = lambda step: T.perturb(model, seed=300 + step, scale=0.3)  # noqa: E731
    assert walk(syncer, model, engine, [0, 1, 0, 2, 1], train=train) == [
        "FullSync(lora=separate)",
        "AdapterSync",
        "AdapterSync",
        "FullSync(lora=separate)",
        "AdapterSync",
    ]


def test_prefer_reload(engine):
    """The server's own checkpoint stores the tied tensor once: the engine reloads it with the
    head written too (a plain reload of that folder would leave the head of the last sync)."""
    FullSync().sync(full_model(ARCH, seed=6), engine)  # the server's base, head included, differs
    model = lora_model(ARCH, seed=60)
    syncer = Syncer(engine, train_type="lora", prefer_reload=True)
    train = lambda step: T.perturb(model, seed=600 + step, scale=0.3)  # noqa: E731
    assert walk(syncer, model, engine, [0, 1, 2], train=train) == [
        "ReloadWeights(checkpoint)",
        "AdapterSync",
        "ReloadWeights(checkpoint)",
    ]


@pytest.mark.parametrize("served", [False, True], ids=["merged", "served"])
def test_reload_from_snapshot(engine, served, tmp_path):
    model = lora_model(ARCH, seed=70 + served)
    if not served:
        model = model.merge_and_unload()
    enter_sleep(engine, 2)
    snapshot = ReloadWeights(snapshot_dir=tmp_path / "snap")
    sync_and_check(snapshot, model, engine)
    assert (engine.served_adapter is not None) == served


def test_a_server_not_owned_is_synced_in_full_every_time(server):
    """Issue 19: a stock server keeps no epoch, so whatever another client did to it between
    two syncs cannot be ruled out: by default its base counts as lost at every sync, the
    Syncer restores it every time, and nothing is skipped."""
    engine = StockServerEngine(server.url, transport="tmpfs")
    try:
        assert engine.attest().epoch is None and engine.base_discarded
        model = lora_model(ARCH, seed=35)
        syncer = Syncer(engine, train_type="lora")
        train = lambda step: T.perturb(model, seed=350 + step, scale=0.3)  # noqa: E731
        for step in range(3):
            train(step)
            report = sync_and_check(syncer, model, engine)
            assert report.strategy == "FullSync(lora=separate)" and not report.plan.skipped
            assert engine.base_discarded  # still: nothing attests it since
        frozen = full_model(ARCH, seed=36)
        frozen.model.embed_tokens.requires_grad_(False)
        FullSync().sync(frozen, engine)
        plan = FullSync().plan(frozen, engine)
        assert not plan.skipped and "cannot attest" in str(plan)
    finally:
        engine.close()


# --- failures: last, the final one leaves the server broken ------------------------------------


def test_trainer_failure_touches_nothing(engine):
    """Every byte is on tmpfs before the server is touched: a trainer failing part-way leaves
    the server exactly as it was, its base still synced."""
    old = full_model(ARCH, seed=40)
    FullSync().sync(old, engine)

    def failing():
        yield from one_per_bucket(full_model(ARCH, seed=41), engine)[:6]
        raise RuntimeError("injected: the trainer failed producing the next bucket")

    with pytest.raises(RuntimeError, match="injected") as failed:
        engine.load_weights(failing())
    assert not isinstance(failed.value, EngineBrokenError)
    assert not engine.base_discarded
    T.assert_matches(old, engine, atol=ATOL)
    assert not list(engine.transport.root.iterdir()), "staged files left behind"


def test_failed_reload_leaves_the_server_paused(engine, server):
    """A reload that fails inside vLLM (a name its model lacks, which a plan would have
    refused) cannot be undone without the extension: EngineBrokenError, server left paused.
    Runs last: the server is not used again."""
    stream = one_per_bucket(full_model(ARCH, seed=42), engine)[:6]
    stream.append([("model.layers.0.mlp.not_a_weight", torch.zeros(4))])
    with pytest.raises(EngineBrokenError, match="left paused"):
        engine.load_weights(stream)
    assert server.alive(), server.tail()


# --- the extension without the pause lease ----------------------------------------------------


def test_without_the_lease_the_commit_runs_from_the_trainer_with_a_warning(servers, caplog):
    """A server with weightsync's extension but not its ``PauseLease`` middleware has no
    commit route (HTTP 404): the trainer runs the commit's steps one call each, which a trainer
    killed inside them leaves paused (docs/fail-closed.md). The syncs are still exact, and the
    first one says so once, naming the middleware to add."""
    engine = VLLMServerEngine(servers[1].url, transport="tmpfs")
    with closed_leaving_nothing([engine]):
        with caplog.at_level(logging.WARNING, logger="weightsync.engines.vllm.control"):
            for seed in (40, 41):
                model = full_model(ARCH, seed=seed)
                sync_and_check(FullSync(), model, engine)
        warned = [r.getMessage() for r in caplog.records if "has no pause lease" in r.getMessage()]
        assert len(warned) == 1 and LEASE_MIDDLEWARE in warned[0], warned
