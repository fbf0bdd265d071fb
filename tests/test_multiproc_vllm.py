"""A ``vllm.LLM`` with vLLM's default multiprocess engine core at tensor_parallel_size=2.

Its workers live in other processes, so tensors cannot go by reference (in ``collective_rpc``
arguments they arrive as lists): :class:`VLLMMultiprocEngine` controls it through
``LLM.collective_rpc`` and moves bytes through a transport, like a server. One LLM per module;
every process it started is stopped by PID at the end (`weightsync.testing.multiproc_llm`).
"""

from __future__ import annotations

import pytest
from conftest import ATOL, discard, full_model, lora_model

from weightsync import AdapterSync, FullSync, Syncer
from weightsync import testing as T
from weightsync.engines import VLLMMultiprocEngine, adapt

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    checkpoint = T.save_checkpoint(T.tiny_model("qwen2"), tmp_path_factory.mktemp("mp") / "ck")
    lora = dict(enable_lora=True, max_lora_rank=16, max_loras=1)
    with T.multiproc_llm(checkpoint, tp=2, **lora) as engine:
        yield engine


@pytest.fixture(scope="module")
def engines(llm):
    made = {t: VLLMMultiprocEngine(llm, transport=t) for t in ("tmpfs", "gloo")}
    yield made
    for e in made.values():
        e.close()


def test_adapt_routes_a_multiprocess_llm_here(llm, engines):
    engine = engines["tmpfs"]
    assert engine.facts.world_size == 2 and engine.serves_lora
    assert engine.shared_weights == [("model.embed_tokens.weight", "lm_head.weight")]
    assert isinstance(adapt(llm), VLLMMultiprocEngine)


@pytest.mark.parametrize("transport", ["tmpfs", "gloo"])
def test_full_merged_served_and_adapter_only(engines, transport):
    engine = engines[transport]
    seed = 10 * (1 + ["tmpfs", "gloo"].index(transport))
    model = full_model("qwen2", seed=seed)
    for strategy, trained in [
        (FullSync(), model),
        (FullSync(lora="merge"), lora_model("qwen2", seed + 1)),
        (FullSync(lora="separate"), lora := lora_model("qwen2", seed + 2)),
        (AdapterSync(), lora),
    ]:
        if strategy.name == "AdapterSync":
            T.perturb(lora, seed=seed + 3, scale=0.3)
        stale = T.compare(trained, engine)
        assert stale["engine"] != stale["trainer"], f"{strategy.label}: engine already matched"
        strategy.sync(trained, engine)
        T.assert_matches(trained, engine, atol=ATOL)


def test_a_framework_sleep_already_over_is_seen(llm, engines):
    """Issue 19: the framework sleeps the LLM at level 2 and wakes it (``llm.sleep(level=2);
    llm.wake_up()``) between two syncs. Awake when the trainer looks; the workers' epoch shows
    the level-2 sleep, so the Syncer restores the base instead of sending the adapter alone."""
    engine = engines["tmpfs"]
    model = lora_model("qwen2", 31)
    syncer = Syncer(engine, train_type="lora")
    syncer.sync(model)
    assert syncer.choose().name == "AdapterSync"
    llm.sleep(level=2)
    llm.wake_up()
    assert not engine.asleep and engine.sleep_level == 2
    assert syncer.choose().label == "FullSync(lora=separate)"
    discard(engine)  # what the level-2 sleep does on a GPU
    T.perturb(model, seed=32, scale=0.3)
    assert syncer.sync(model).strategy == "FullSync(lora=separate)"
    T.assert_matches(model, engine, atol=ATOL)
