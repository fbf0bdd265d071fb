"""A ``vllm.LLM`` with vLLM's default multiprocess engine core at tensor_parallel_size=2.

Its workers live in other processes, so tensors cannot go by reference (in ``collective_rpc``
arguments they arrive as lists): :class:`VLLMMultiprocEngine` controls it through
``LLM.collective_rpc`` and moves bytes through a transport, like a server. One LLM per module;
every process it started is stopped by PID at the end (`benchmarks.processes.multiproc_llm`).
"""

from __future__ import annotations

import pytest
from conftest import ATOL, discard, full_model, lora_model, sparse_step, sync_and_check

from benchmarks.processes import multiproc_llm
from weightsync import AdapterSync, FullSync, Syncer
from weightsync import testing as T
from weightsync.engines import GlooTransport, VLLMMultiprocEngine, adapt
from weightsync.engines.vllm.control import WeightsSpan, base_label

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    checkpoint = T.save_checkpoint(T.tiny_model("qwen2"), tmp_path_factory.mktemp("mp") / "ck")
    lora = dict(enable_lora=True, max_lora_rank=16, max_loras=1)
    with multiproc_llm(checkpoint, tp=2, **lora) as engine:
        yield engine


@pytest.fixture(scope="module")
def engines(llm):
    """One engine per transport; gloo sends deltas (each of the two workers keeps its copy)."""
    made = {
        "tmpfs": VLLMMultiprocEngine(llm, transport="tmpfs"),
        "gloo": VLLMMultiprocEngine(llm, transport=GlooTransport(delta=True)),
    }
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
        (AdapterSync(), lora),  # written in place into the slot, by the copies the first recorded
    ]:
        if strategy.name == "AdapterSync":
            seed += 3
            T.perturb(lora, seed=seed, scale=0.3)
        stale = T.compare(trained, engine)
        assert stale["engine"] != stale["trainer"], f"{strategy.label}: engine already matched"
        strategy.sync(trained, engine)
        T.assert_matches(trained, engine, atol=ATOL)


def test_deltas_reach_both_tensor_parallel_workers(engines):
    """After a sparse step only the changed words go over gloo; both workers patch their own
    copy and check the whole bucket's tag, and the engine serves the trainer exactly."""
    engine = engines["gloo"]
    sync = FullSync(bucket_bytes=256 << 10, skip_unchanged=False)
    model = full_model("qwen2", seed=71)
    sync_and_check(sync, model, engine)
    sparse_step(model, seed=72)
    sync_and_check(sync, model, engine)
    count = engine.transport.last_sync
    assert count.full_buckets == 0 and count.delta_buckets > 2, count
    assert count.wire_bytes <= 0.10 * count.bucket_bytes, count


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


def test_outputs_are_labelled_with_the_base_version(llm, engines):
    """vLLM's weight-version spans of a multiprocess LLM name the base version each write
    left, not vLLM's "default" (issue 33)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = engines["tmpfs"]
    FullSync().sync(full_model("qwen2", seed=51), engine)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)[0]
    label = base_label(engine.written_version)
    assert engine.weights_spans(out) == [WeightsSpan(label, None, 0, 4)]


def test_the_weights_version_is_the_engines_own(llm, engines):
    """Issue 16 part 3: the version comes from the workers, not from a trainer-side count. A
    sync moves it and its report carries it (taken from the write's own attestation: one LoRA
    listing per write, none more for the report); reading it again or generating leaves it;
    an adapter swap moves it without moving the epoch; a sleep and a reload made on the LLM by
    someone else move it."""
    engine = engines["tmpfs"]
    model = lora_model("qwen2", 41)
    syncer = Syncer(engine, train_type="lora")
    before = engine.weights_version
    assert before is not None
    base = syncer.sync(model)
    assert base.strategy == "FullSync(lora=separate)"
    assert base.weights_version == engine.weights_version != before
    T.assert_matches(model, engine, atol=ATOL)  # generating does not move it
    assert engine.weights_version == base.weights_version

    calls: list[str] = []
    rpc = engine.control.rpc
    engine.control.rpc = lambda method, kwargs=None: calls.append(method) or rpc(method, kwargs)  # type: ignore[method-assign]
    try:
        T.perturb(model, seed=42, scale=0.3)
        adapter = syncer.sync(model)
    finally:
        del engine.control.rpc
    assert adapter.strategy == "AdapterSync" and calls.count("list_loras") == 1, calls
    assert adapter.weights_version == engine.weights_version != base.weights_version
    assert adapter.weights_version.split("+")[0] == base.weights_version.split("+")[0]
    T.assert_matches(model, engine, atol=ATOL)

    llm.sleep(level=1)  # the framework, behind weightsync's back
    llm.wake_up()
    slept = engine.weights_version
    assert slept != adapter.weights_version
    llm.collective_rpc("reload_weights")  # vLLM re-reads its checkpoint (and drops adapters)
    reloaded = engine.weights_version
    assert reloaded not in (slept, adapter.weights_version) and "+lora" not in reloaded
    assert engine.weights_version == reloaded
    T.perturb(model, seed=43, scale=0.3)
    restored = syncer.sync(model)
    assert restored.strategy == "FullSync(lora=separate)"
    assert restored.weights_version == engine.weights_version != reloaded
    T.assert_matches(model, engine, atol=ATOL)
