"""vLLM's ``AsyncLLM``, as async RL frameworks drive it, synced by weightsync (issue 16, part 3).

One real AsyncLLM for the module (its engine core in its own process, weightsync's worker
extension in its worker), created on an event loop that runs in a thread of its own, as a
framework's rollout loop would; the tests call the synchronous API from the main thread and
the async one (`Syncer.async_sync`) from a coroutine on that very loop. Every process the
AsyncLLM started is stopped by PID at the end, also after a failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import (
    ATOL,
    discard,
    full_model,
    loop_in_thread,
    lora_model,
    on,
    running_async_llm,
    sync_and_check,
)

from weightsync import AdapterSync, FullSync, Syncer
from weightsync import testing as T
from weightsync.engines import AsyncLLMEngine, adapt
from weightsync.engines.vllm.control import base_label

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running in a thread of its own: the AsyncLLM's."""
    with loop_in_thread() as running:
        yield running


@pytest.fixture(scope="module")
def async_llm(loop, tmp_path_factory) -> Iterator[Any]:
    """A real AsyncLLM on the tiny Qwen2 checkpoint, serving one adapter up to rank 16."""
    checkpoint = T.save_checkpoint(T.tiny_model("qwen2"), tmp_path_factory.mktemp("al") / "ck")
    with running_async_llm(loop, checkpoint, enable_lora=True) as llm:
        yield llm


@pytest.fixture(scope="module")
def engine(async_llm) -> Iterator[AsyncLLMEngine]:
    made = AsyncLLMEngine(async_llm)
    yield made
    made.close()


def test_adapt_and_a_full_sync(async_llm, engine):
    other = adapt(async_llm)
    try:
        assert isinstance(other, AsyncLLMEngine) and other.serves_lora
    finally:
        other.close()
    assert engine.facts.world_size == 1
    syncer = Syncer(engine, train_type="full")
    before = engine.weights_version
    report = sync_and_check(syncer, full_model("qwen2", seed=1), engine)
    assert report.strategy == "FullSync"
    assert report.weights_version == engine.weights_version != before


def test_lora_merged_and_served(engine):
    merged = lora_model("qwen2", 2)
    v0 = engine.weights_version
    sync_and_check(FullSync(lora="merge"), merged, engine)
    v1 = engine.weights_version
    served = lora_model("qwen2", 3)
    syncer = Syncer(engine, train_type="lora")
    base = sync_and_check(syncer, served, engine)
    assert base.strategy == "FullSync(lora=separate)" and engine.lora_request is not None
    T.perturb(served, seed=4, scale=0.3)
    adapter = sync_and_check(syncer, served, engine)
    assert adapter.strategy == "AdapterSync" and adapter.tensors < base.tensors
    assert len({v0, v1, base.weights_version, adapter.weights_version}) == 4
    assert f"+lora{engine.lora_request.lora_int_id}/a" in adapter.weights_version


def test_someone_elses_sleep_and_write_move_the_version(loop, async_llm, engine):
    """A level-2 sleep and a reload made on the AsyncLLM directly, not through weightsync:
    the version moves with each, and the Syncer restores the base after them."""
    model = lora_model("qwen2", 5)
    syncer = Syncer(engine, train_type="lora")
    synced = syncer.sync(model).weights_version
    assert syncer.choose().name == "AdapterSync"

    async def admitting() -> Any:  # a rollout coroutine on the loop reads it as it admits
        return engine.lora_request

    served = engine.lora_request
    assert served is not None and on(loop, admitting()) == served
    on(loop, async_llm.sleep(level=2))
    assert engine.asleep and engine.weights_version != synced
    on(loop, async_llm.wake_up())
    slept = engine.weights_version
    assert slept != synced and engine.sleep_level == 2
    # Attested from this thread: no adapter named on the discarded base. On the loop, where
    # the workers cannot be asked and waited for, the read answers from what this adapter knows.
    assert engine.lora_request is None
    on(loop, admitting())
    assert syncer.choose().label == "FullSync(lora=separate)"
    discard(engine)  # what the level-2 sleep does on a GPU
    T.perturb(model, seed=6, scale=0.3)
    restored = sync_and_check(syncer, model, engine)
    assert restored.strategy == "FullSync(lora=separate)"

    on(loop, async_llm.collective_rpc("reload_weights"))  # vLLM re-reads its checkpoint
    assert engine.weights_version not in (restored.weights_version, slept)
    assert engine.base_discarded and syncer.choose().label == "FullSync(lora=separate)"
    T.perturb(model, seed=7, scale=0.3)  # the reload restored the very base this model trains
    assert sync_and_check(syncer, model, engine).strategy == "FullSync(lora=separate)"


def test_async_sync_on_the_engines_own_loop_keeps_a_generation_in_flight(loop, async_llm, engine):
    """From a coroutine on the loop the AsyncLLM runs on: a blocking sync is refused (it would
    deadlock the loop), ``await syncer.async_sync`` is not, and a generation running meanwhile
    is kept: it finishes, its tokens before the sync are the old model's and after it the new
    model's (vLLM's weight-version spans say where), and later generations match the trainer."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    old, new = full_model("qwen2", seed=7), full_model("qwen2", seed=8)
    prompt = T.PROMPTS[0]
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, detokenize=False)
    syncer = Syncer(engine, train_type="full")

    async def scenario() -> tuple[Any, Any, Any, int]:
        first = await syncer.async_sync(old)
        with pytest.raises(RuntimeError, match="own event loop"):
            syncer.sync(new)
        tokens_seen = 0
        started = asyncio.Event()

        async def rollout() -> Any:
            nonlocal tokens_seen
            last = None
            async for out in async_llm.generate(
                TokensPrompt(prompt_token_ids=prompt), params, "rollout-in-flight"
            ):
                last, tokens_seen = out, len(out.outputs[0].token_ids)
                started.set()
            return last

        task = asyncio.create_task(rollout())
        await started.wait()
        second = await syncer.async_sync(new)
        at_sync_end = tokens_seen
        return first, second, await task, at_sync_end

    first, second, rollout, at_sync_end = on(loop, scenario())
    out = rollout.outputs[0]
    tokens = list(out.token_ids)
    assert len(tokens) == 200 and at_sync_end < 200, "the rollout was not in flight"
    spans = [(s.version, s.start, s.end) for s in out.weight_versions]
    # vLLM's label names the base (each request's adapter is its own: weights_spans).
    versions = [base_label(first.weights_version), base_label(second.weights_version)]
    assert [v for v, _, _ in spans] == versions, spans
    k = spans[0][2]
    assert 0 < k < 200
    head = min(k, 8)
    assert tokens[:head] == T.trainer_greedy(old, prompt, head)
    assert tokens[k : k + 8] == T.trainer_greedy(new, prompt + tokens[:k], 8)
    T.assert_matches(new, engine, atol=ATOL)
    assert second.weights_version == engine.weights_version


def test_adapter_only_after_a_served_base_in_the_loop(loop, engine):
    """``AdapterSync`` awaited from the loop, with the adapter the engine then serves."""
    model = lora_model("qwen2", 9)
    syncer = Syncer(engine, train_type="lora")
    syncer.sync(model)
    T.perturb(model, seed=10, scale=0.3)
    report = on(loop, syncer.async_sync(model))
    assert report.strategy == AdapterSync().label
    T.assert_matches(model, engine, atol=ATOL)
