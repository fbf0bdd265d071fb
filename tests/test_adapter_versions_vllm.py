"""Adapters for rollouts in flight (issue 33): an in-process ``vllm.LLM`` that keeps the last N
adapter versions loaded, each under an id and path of its own.

A request admitted under version k finishes on k while newer versions load (its tokens are
exactly those of version k's peft model); the version that falls out of the window is unloaded;
over 1000 adapter swaps the adapters loaded and the process's memory stay flat. No prefix-cache
entry outlives its weights: none is reused under another adapter version, nor after a base write
with a request in flight, and the labels of each token name the weights that produced it. One
engine for the module (N = 3, so ``max_loras=3`` and ``max_cpu_loras=4``; KV blocks of 32
tokens, so that the prompts here fill whole blocks the prefix cache keeps).
"""

from __future__ import annotations

import copy
import gc
import importlib.util
from pathlib import Path

import psutil
import pytest
from conftest import ATOL, full_model, lora_model

from weightsync import AdapterSync, FullSync
from weightsync import testing as T
from weightsync.engines import VLLMEngine
from weightsync.trainer import tensors

N = 3
PROMPT = [5, 17, 99, 3, 250]
TOKENS = 12
#: Two full KV blocks and a bit.
LONG = [(7 * i + 3) % 1000 + 1 for i in range(70)]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    checkpoint = T.save_checkpoint(T.tiny_model("qwen2"), tmp_path_factory.mktemp("av") / "ck")
    return T.make_llm(checkpoint, enable_lora=True, max_loras=N, max_cpu_loras=N + 1, block_size=32)


@pytest.fixture(scope="module")
def engine(llm):
    return VLLMEngine(llm, adapter_versions=N)


def run_to_end(llm_engine, request_ids):
    """Step the engine until every one of ``request_ids`` finished; their outputs by id."""
    done = {}
    while set(request_ids) - set(done):
        done.update({o.request_id: o for o in llm_engine.step() if o.finished})
    return done


def admit(llm_engine, request_id, lora_request, prompt=PROMPT):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=TOKENS, detokenize=False, ignore_eos=True)
    llm_engine.add_request(
        request_id, TokensPrompt(prompt_token_ids=prompt), params, lora_request=lora_request
    )
    for _ in range(3):  # the prefill and two tokens under version k
        llm_engine.step()


def test_more_versions_than_vllm_keeps_are_refused(llm):
    with pytest.raises(ValueError, match=r"adapter_versions=4 .* max_loras=3, max_cpu_loras=4"):
        VLLMEngine(llm, adapter_versions=4)
    with pytest.raises(ValueError, match="1 or more"):
        VLLMEngine(llm, adapter_versions=0)


def test_a_request_admitted_under_version_k_finishes_on_k(engine):
    model = lora_model("qwen2", seed=1)
    FullSync(lora="separate").sync(model, engine)
    T.assert_matches(model, engine, atol=ATOL)
    llm_engine = engine.llm_engine
    admitted = {}  # request id -> (version, the peft model of that version)
    seen = set()
    for step in range(2 * N):
        k = engine.adapter_version
        assert k is not None
        admit(llm_engine, f"r{step}", engine.lora_request)
        admitted[f"r{step}"] = (k, copy.deepcopy(model))
        T.perturb(model, seed=100 + step, scale=0.3)
        AdapterSync().sync(model, engine)  # version k + 1 while r<step> is in flight
        held = engine.adapter_requests
        assert list(held) == list(range(max(1, k + 2 - N), k + 2)), held
        assert llm_engine.list_loras() == {r.lora_int_id for r in held.values()}
        if step % (N - 1) == N - 2:  # every request admitted so far is still in the window
            outs = run_to_end(llm_engine, list(admitted))
            for request_id, (version, trained) in admitted.items():
                out = outs[request_id]
                assert out.lora_request.lora_int_id == held[version].lora_int_id
                expected = T.trainer_greedy(trained, PROMPT, TOKENS)
                assert list(out.outputs[0].token_ids) == expected, (request_id, version)
                seen.add(tuple(expected))
            admitted.clear()
    # The versions generate differently: a request that switched adapters would be caught.
    assert len(seen) > N, seen
    T.assert_matches(model, engine, atol=ATOL)


def test_a_thousand_swaps_keep_adapters_and_memory_flat(engine):
    model = lora_model("qwen2", seed=2)
    FullSync(lora="separate").sync(model, engine)
    adapter = tensors.adapter(model)
    process = psutil.Process()
    rss = {}
    for step in range(1, 1001):
        engine.load_adapter(adapter)
        assert len(engine.llm_engine.list_loras()) == min(step + 1, N)
        if step in (100, 1000):
            gc.collect()
            rss[step] = process.memory_info().rss
    assert len(engine.adapter_requests) == N
    grown = (rss[1000] - rss[100]) / 2**20
    # One adapter version here is ~0.1 MiB: 900 leaked would be ~90 MiB.
    assert grown < 24, f"RSS grew {grown:.1f} MiB over 900 adapter swaps"
    T.assert_matches(model, engine, atol=ATOL)


def test_the_folder_path_keeps_only_the_window_on_disk(engine):
    model = lora_model("qwen2", seed=3)
    engine.adapter_from_memory = False
    try:
        FullSync(lora="separate").sync(model, engine)
        first = engine.adapter_version  # the first version loaded from a folder
        for seed in range(2 * N):
            T.perturb(model, seed=200 + seed, scale=0.3)
            AdapterSync().sync(model, engine)
            kept = [f"adapter-v{k:06d}" for k in engine.adapter_requests if k >= first]
            assert sorted(p.name for p in engine._adapter_root.iterdir()) == kept
        assert len(kept) == N
        T.assert_matches(model, engine, atol=ATOL)
        FullSync(lora="merge").sync(model, engine)  # a base write: no adapter, no folder
        assert engine.adapter_requests == {} and not list(engine._adapter_root.iterdir())
    finally:
        engine.adapter_from_memory = True


def generate(engine, prompt, lora_request):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=TOKENS, detokenize=False, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=prompt)]
    return engine.llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)[0]


def test_no_prefix_cache_entry_is_reused_under_another_adapter_version(engine):
    model = lora_model("qwen2", seed=5)
    FullSync(lora="separate").sync(model, engine)
    v1 = engine.lora_request
    first = generate(engine, LONG, v1)
    again = generate(engine, LONG, v1)
    assert again.num_cached_tokens >= 64, "the prefix cache is off: the test proves nothing"
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    T.perturb(model, seed=6, scale=0.3)
    AdapterSync().sync(model, engine)
    new = generate(engine, LONG, engine.lora_request)
    assert new.num_cached_tokens == 0  # v2 never reads v1's blocks
    assert list(new.outputs[0].token_ids) == T.trainer_greedy(model, LONG, TOKENS)
    assert list(new.outputs[0].token_ids) != list(first.outputs[0].token_ids)
    old = generate(engine, LONG, v1)  # v1 is still loaded, with its own blocks
    assert list(old.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    spans = engine.weights_spans(old)
    assert [(s.adapter, s.start, s.end) for s in spans] == [(engine.adapter_version - 1, 0, TOKENS)]


def test_a_base_write_with_a_request_in_flight_leaves_no_stale_kv_and_labels_true(engine):
    """A rollout stepping the engine while a dense write lands: it is preempted and recomputes
    its KV under the new weights (vLLM keeps its prefix cache while a request holds blocks
    unless told to reset running requests too), its tokens before the write are the old
    model's and after it the new model's, and the spans say where; a new request on the
    same prompt reads no block of the old weights."""
    old, new = full_model("qwen2", seed=8), full_model("qwen2", seed=9)
    FullSync().sync(old, engine)
    base_old = engine.llm_engine.get_weight_version()
    llm_engine = engine.llm_engine
    warm = generate(engine, LONG, None)  # the prompt's blocks cached under the old weights
    assert list(warm.outputs[0].token_ids) == T.trainer_greedy(old, LONG, TOKENS)
    admit(llm_engine, "in-flight", None, LONG)
    FullSync().sync(new, engine)
    base_new = engine.llm_engine.get_weight_version()
    assert base_new != base_old and "default" not in (base_old, base_new)
    admit(llm_engine, "after", None, LONG)
    outs = run_to_end(llm_engine, ["in-flight", "after"])
    models = {base_old: old, base_new: new}
    for out in outs.values():
        tokens = list(out.outputs[0].token_ids)
        for span in engine.weights_spans(out):
            assert span.adapter is None
            regenerated = T.trainer_greedy(
                models[span.base], LONG + tokens[: span.start], span.end - span.start
            )
            assert tokens[span.start : span.end] == regenerated, (out.request_id, span)
    assert [s.base for s in engine.weights_spans(outs["in-flight"])] == [base_old, base_new]
    assert [s.base for s in engine.weights_spans(outs["after"])] == [base_new]


def test_the_async_rl_recipe_runs(engine):
    path = Path(__file__).resolve().parent.parent / "docs" / "recipes" / "async_rl.py"
    spec = importlib.util.spec_from_file_location("async_rl_recipe", path)
    assert spec is not None and spec.loader is not None
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    results = recipe.rollouts_across_syncs(engine, lora_model("qwen2", seed=10))
    newest = engine.adapter_version
    assert [[(s.adapter, s.start, s.end) for s in spans] for _, spans in results] == [
        [(newest - 2, 0, 8)],
        [(newest - 1, 0, 8)],
    ]
