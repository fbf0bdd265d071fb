"""Engines that frameworks hold: a bare vLLM ``LLMEngine`` (what ms-swift keeps inside its
``GRPOVllmEngine``, created with ``LLMEngine.from_engine_args``), not a ``vllm.LLM``.

`adapt` wraps it in `VLLMEngine` like an ``LLM``; the sleeps are made on the ``LLMEngine``
directly, behind weightsync's back, as ms-swift makes them, and must be seen through the
engine's own record. Each row of the decision table is then synced by a `Syncer` and the
engine's greedy tokens must equal the trainer's (a tied Qwen2 model, so a stale ``lm_head``
would show). The real ms-swift trainer is run in ``tests/test_swift.py``.
"""

from __future__ import annotations

import pytest
from conftest import full_model, lora_model, sync_and_check

from weightsync import Syncer
from weightsync import testing as T
from weightsync.engines import VLLMEngine, adapt

ARCH = "qwen2"  # tied embeddings


@pytest.fixture(scope="module")
def llm_engine(tmp_path_factory):
    """A real in-process ``LLMEngine`` serving LoRA, sized like ``T.make_llm``'s ``LLM``."""
    from vllm import EngineArgs, LLMEngine

    checkpoint = T.save_checkpoint(T.tiny_model(ARCH), tmp_path_factory.mktemp(ARCH) / "ck")
    engine = LLMEngine.from_engine_args(
        EngineArgs(**T.engine_options(checkpoint, enable_lora=True))
    )
    yield engine
    engine.engine_core.shutdown()


def sleep_behind_our_back(engine: VLLMEngine, level: int) -> None:
    """What ms-swift does between rollouts: sleep the ``LLMEngine`` itself and wake it, which
    ``engine`` must see (level 2 discards the weights, simulated on CPU by overwriting them)."""
    if level == 0:
        return
    engine.llm_engine.sleep(level)
    engine.llm_engine.wake_up()
    assert engine.sleep_level >= level and engine.base_discarded == (level == 2)
    if level == 2:
        T.discard_weights(engine)


def test_adapt_wraps_an_llm_engine_and_an_object_holding_one(llm_engine):
    engine = adapt(llm_engine)
    assert isinstance(engine, VLLMEngine)
    assert engine.llm is llm_engine and engine.llm_engine is llm_engine

    class Holder:  # the shape of ms-swift's GRPOVllmEngine: the LLMEngine as .engine
        def __init__(self, engine):
            self.engine = engine

    held = adapt(Holder(llm_engine))
    assert isinstance(held, VLLMEngine) and held.llm is llm_engine
    with pytest.raises(TypeError, match="no engine adapter accepts"):
        adapt(Holder(object()))


def test_full_training_through_every_sleep_level(llm_engine):
    engine = VLLMEngine(llm_engine)
    syncer = Syncer(engine, train_type="full")
    for step, level in enumerate([0, 1, 2, 0]):
        sleep_behind_our_back(engine, level)
        report = sync_and_check(syncer, full_model(ARCH, seed=200 + step), engine)
        assert report.strategy.startswith("FullSync"), report


def test_served_lora_through_every_sleep_level(llm_engine):
    """The decision table for a LoRA step into an engine that serves the adapter: the base
    first, then only the adapter while the base is kept (sleep 0 or 1), the base again after
    a level-2 sleep discarded it."""
    engine = VLLMEngine(llm_engine)
    syncer = Syncer(engine, train_type="lora", rollout_lora=True)
    chosen = []
    for step, level in enumerate([0, 0, 1, 2, 0]):
        sleep_behind_our_back(engine, level)
        model = lora_model(ARCH, seed=300 + step)
        chosen.append(sync_and_check(syncer, model, engine).strategy)
        assert engine.lora_request is not None
    assert [s.split("(")[0] for s in chosen] == [
        "FullSync",
        "AdapterSync",
        "AdapterSync",
        "FullSync",
        "AdapterSync",
    ], chosen
