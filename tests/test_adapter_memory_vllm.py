"""Adapters loaded into a real in-process ``vllm.LLM`` from memory (no file round trip) serve
exactly what the folder path serves, replace the adapter in place at every update, never touch
the trainer's tensors, and a request for an adapter vLLM dropped fails loudly.

One engine per architecture, switched between the two paths with ``adapter_from_memory``: the
same engine and base weights, so the outputs of the two paths must be identical, not just close.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import ATOL, differs, lora_model

from weightsync import AdapterSync, FullSync
from weightsync import testing as T
from weightsync.engines import VLLMEngine
from weightsync.engines.vllm.in_engine.lora import MEMORY_ROOT, install_adapter
from weightsync.trainer import tensors

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"r": 8, "lora_alpha": 16, "target_modules": MODULES}  # this module's: every projection


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("memlora")
    engines = {
        arch: VLLMEngine(
            T.make_llm(T.save_checkpoint(T.tiny_model(arch), root / arch), enable_lora=True)
        )
        for arch in ("qwen2", "llama")
    }
    engines["qwen2-bf16"] = VLLMEngine(
        T.make_llm(str(root / "qwen2"), enable_lora=True, dtype="bfloat16")
    )
    return engines


@pytest.fixture(autouse=True)
def _memory_path_by_default(engines):
    for engine in engines.values():
        engine.adapter_from_memory = True
    yield
    for engine in engines.values():
        engine.adapter_from_memory = True


def outputs(engine):
    return engine.greedy_batch(T.PROMPTS, 8)


def adapter_sync(model, engine, *, memory: bool):
    engine.adapter_from_memory = memory
    AdapterSync().sync(model, engine)
    path = engine.lora_request.lora_path
    assert path.startswith(MEMORY_ROOT) == memory, path
    assert not memory or not os.path.exists(path)


def assert_differs(model, engine):
    assert differs(model, engine), "engine already serves the update: test is void"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_memory_and_folder_paths_serve_identical_outputs(engines, arch):
    engine = engines[arch]
    model = lora_model(arch, seed=1, config=LORA)
    FullSync(lora="separate").sync(model, engine)
    T.assert_matches(model, engine, atol=ATOL)
    seen = []
    for seed in (2, 3, 4):
        T.perturb(model, seed=seed, scale=0.3)
        assert_differs(model, engine)
        adapter_sync(model, engine, memory=True)  # replaces the folder-loaded one: same id
        T.assert_matches(model, engine, atol=ATOL)
        from_memory = outputs(engine)
        adapter_sync(model, engine, memory=False)  # and the other way round
        assert outputs(engine) == from_memory  # tokens and logprobs, exactly
        seen.append(from_memory)
    assert len({str(s) for s in seen}) == len(seen), "adapter updates did not change the outputs"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_repeated_memory_loads_under_one_id_take_effect(engines, arch):
    engine = engines[arch]
    model = lora_model(arch, seed=10, config=LORA)
    FullSync(lora="separate").sync(model, engine)
    lora_id = engine.lora_request.lora_int_id
    for seed in (11, 12, 13):
        T.perturb(model, seed=seed, scale=0.3)
        assert_differs(model, engine)
        adapter_sync(model, engine, memory=True)
        assert engine.lora_request.lora_int_id == lora_id
        assert engine.llm.llm_engine.list_loras() == {lora_id}
        T.assert_matches(model, engine, atol=ATOL)


@pytest.mark.parametrize(
    "cfg",
    [
        {"use_rslora": True},
        {"rank_pattern": {"v_proj": 4, "down_proj": 12}, "alpha_pattern": {"o_proj": 40}},
        {"use_rslora": True, "rank_pattern": {"q_proj": 16}, "alpha_pattern": {"up_proj": 3}},
    ],
    ids=["rslora", "rank+alpha_pattern", "rslora+patterns"],
)
def test_scaling_options_match_trainer_and_folder(engines, cfg):
    engine = engines["llama"]
    model = lora_model("llama", seed=20, config=LORA, **cfg)
    FullSync(lora="separate").sync(model, engine)
    T.perturb(model, seed=21, scale=0.3)
    assert_differs(model, engine)
    adapter_sync(model, engine, memory=True)
    T.assert_matches(model, engine, atol=ATOL)
    from_memory = outputs(engine)
    adapter_sync(model, engine, memory=False)
    assert outputs(engine) == from_memory


def test_trainer_tensors_are_not_touched(engines):
    # vLLM scales lora_b in place when it installs an adapter: the engine must hold a copy.
    engine = engines["llama"]
    model = lora_model("llama", seed=30, config=LORA)
    FullSync(lora="separate").sync(model, engine)
    before = {k: v.clone() for k, v in tensors.adapter(model).tensors.items()}
    adapter_sync(model, engine, memory=True)
    after = tensors.adapter(model).tensors
    assert all(torch.equal(before[k], after[k]) for k in before)
    # and a later trainer step does not leak into what the engine serves until the next sync
    served = outputs(engine)
    T.perturb(model, seed=31, scale=0.3)
    assert outputs(engine) == served


def test_request_held_across_a_base_write_fails_loudly(engines):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = engines["llama"]
    model = lora_model("llama", seed=40, config=LORA)
    FullSync(lora="separate").sync(model, engine)
    assert engine.lora_request.lora_path.startswith(MEMORY_ROOT)
    held = engine.lora_request

    # Merged into the base: applying the old adapter on top would count LoRA twice.
    FullSync(lora="merge").sync(model, engine)
    assert engine.lora_request is None
    assert engine.llm.llm_engine.list_loras() == set()
    params = SamplingParams(temperature=0, max_tokens=4, detokenize=False, ignore_eos=True)
    with pytest.raises(Exception, match=f"No adapter found for {MEMORY_ROOT}"):
        engine.llm.generate(
            [TokensPrompt(prompt_token_ids=[1, 2, 3])], params, lora_request=held, use_tqdm=False
        )
    llm_engine = engine.llm.llm_engine
    llm_engine.abort_request(list(llm_engine.output_processor.request_states), internal=True)
    T.assert_matches(model, engine, atol=ATOL)  # merged weights, no adapter on top

    # The next adapter load serves again, under the same id.
    FullSync(lora="separate").sync(model, engine)
    assert engine.lora_request.lora_int_id == held.lora_int_id
    T.assert_matches(model, engine, atol=ATOL)


def test_a_rejected_adapter_leaves_the_served_one(engines):
    engine = engines["llama"]
    model = lora_model("llama", seed=50, config=LORA)
    FullSync(lora="separate").sync(model, engine)
    good = tensors.adapter(model)
    bad = dict(good.tensors)
    bad["base_model.model.model.layers.0.mlp.no_such_proj.lora_A.weight"] = torch.zeros(8, 128)
    with pytest.raises(ValueError, match="no_such_proj"):
        engine.llm.collective_rpc(
            install_adapter,
            kwargs={"tensors": bad, "config": good.config, "lora_int_id": engine.lora_id},
        )
    T.assert_matches(model, engine, atol=ATOL)


def _served(worker, lora_id):
    """The ``LoRAModel`` vLLM holds under ``lora_id`` (its id) and a copy of its slot."""
    inner = worker.model_runner.lora_manager._adapter_manager
    index = inner.lora_index_to_id.index(lora_id)
    slot = [
        t[index].clone()
        for module in inner.modules.values()
        for t in (*getattr(module, "lora_a_stacked", ()), *getattr(module, "lora_b_stacked", ()))
    ]
    return id(inner.get_adapter(lora_id)), slot


def _replayed(worker, lora_id):
    """Whether the slot of the adapter under ``lora_id`` is written by replayed copies."""
    from weightsync.engines.vllm.in_engine import lora as worker_lora

    inner = worker.model_runner.lora_manager._adapter_manager
    return inner.get_adapter(lora_id) in worker_lora._SLOTS


def _evict(worker, lora_id):
    """Free the adapter's slot, as vLLM's LRU does for another adapter, and scribble on it."""
    inner = worker.model_runner.lora_manager._adapter_manager
    index = inner.lora_index_to_id.index(lora_id)
    inner.deactivate_adapter(lora_id)
    for module in inner.modules.values():
        for t in (*getattr(module, "lora_a_stacked", ()), *getattr(module, "lora_b_stacked", ())):
            t[index] = 1.0


def test_a_new_version_written_in_place_is_what_a_fresh_install_builds(engines):
    # A new version of the adapter last installed under the id is written into vLLM's own
    # copy of it and its slot (no rebuild); the result must be a fresh install's, bit for bit,
    # and vLLM must re-activate the new version, not the first, once it evicted it.
    from weightsync.engines.vllm.in_engine import lora as worker_lora

    engine = engines["qwen2"]
    model = lora_model("qwen2", seed=60, config=LORA)
    FullSync(lora="separate").sync(model, engine)
    lora_id = engine.lora_request.lora_int_id
    built, _ = engine.llm.collective_rpc(_served, args=(lora_id,))[0]
    for seed in (61, 64):  # the first write into the slot records its copies, the next replays
        T.perturb(model, seed=seed, scale=0.3)
        assert_differs(model, engine)
        adapter_sync(model, engine, memory=True)
        kept, in_place = engine.llm.collective_rpc(_served, args=(lora_id,))[0]
        assert kept == built, "the new version was rebuilt, not written in place"
        T.assert_matches(model, engine, atol=ATOL)
    assert engine.llm.collective_rpc(_replayed, args=(lora_id,))[0]

    worker_lora._REFRESHABLE.clear()  # the next install builds anew
    adapter_sync(model, engine, memory=True)
    rebuilt, fresh = engine.llm.collective_rpc(_served, args=(lora_id,))[0]
    assert rebuilt != built
    assert len(fresh) == len(in_place)
    assert all(torch.equal(a, b) for a, b in zip(fresh, in_place, strict=True))

    T.perturb(model, seed=62, scale=0.3)
    assert_differs(model, engine)
    adapter_sync(model, engine, memory=True)  # in place again, into the rebuilt copy
    assert engine.llm.collective_rpc(_served, args=(lora_id,))[0][0] == rebuilt
    engine.llm.collective_rpc(_evict, args=(lora_id,))
    T.assert_matches(model, engine, atol=ATOL)  # re-activated from vLLM's copy

    # A sleep (here level 1, which keeps the base) may have discarded the slot's memory on a
    # GPU while vLLM still counts the adapter active: the next version is built anew.
    engine.sleep(1)
    engine.wake_up()
    T.perturb(model, seed=63, scale=0.3)
    assert_differs(model, engine)
    adapter_sync(model, engine, memory=True)
    assert engine.llm.collective_rpc(_served, args=(lora_id,))[0][0] != rebuilt
    T.assert_matches(model, engine, atol=ATOL)


def test_a_version_cast_into_a_bfloat16_engine_in_place_is_what_a_fresh_install_builds(engines):
    # The trainer's float32 factors are cast into vLLM's bfloat16 copy and the scaled ones
    # scaled after the cast (a fused multiply would round once, not twice): bit for bit a
    # fresh install's, through the recorded slot copies too.
    from weightsync.engines.vllm.in_engine import lora as worker_lora

    engine = engines["qwen2-bf16"]
    model = lora_model("qwen2", seed=65, config=LORA)
    FullSync(lora="separate").sync(model, engine)
    lora_id = engine.lora_request.lora_int_id
    built, _ = engine.llm.collective_rpc(_served, args=(lora_id,))[0]
    for seed in (66, 67):
        T.perturb(model, seed=seed, scale=0.3)
        adapter_sync(model, engine, memory=True)
    kept, in_place = engine.llm.collective_rpc(_served, args=(lora_id,))[0]
    assert kept == built, "the new version was rebuilt, not written in place"
    assert engine.llm.collective_rpc(_replayed, args=(lora_id,))[0]
    assert in_place[0].dtype == torch.bfloat16

    worker_lora._REFRESHABLE.clear()
    adapter_sync(model, engine, memory=True)
    rebuilt, fresh = engine.llm.collective_rpc(_served, args=(lora_id,))[0]
    assert rebuilt != built
    assert len(fresh) == len(in_place)
    assert all(torch.equal(a, b) for a, b in zip(fresh, in_place, strict=True))


def _break_a_layer(worker):
    inner = worker.model_runner.lora_manager._adapter_manager
    name = next(n for n in inner.modules if n.endswith("layers.1.self_attn.o_proj"))

    def fail(*args, **kwargs):
        raise RuntimeError("injected: set_lora failed")

    inner.modules[name].set_lora = fail
    return name


def _mend(worker, name):
    del worker.model_runner.lora_manager._adapter_manager.modules[name].set_lora


def test_a_write_in_place_that_fails_part_way_leaves_no_adapter_served(engines):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = engines["llama"]
    model = lora_model("llama", seed=70, config=LORA)
    FullSync(lora="separate").sync(model, engine)
    held = engine.lora_request
    T.perturb(model, seed=71, scale=0.3)
    name = engine.llm.collective_rpc(_break_a_layer)[0]
    try:  # vLLM's copy of the adapter is written, its slot is not: a mix if it were served
        with pytest.raises(Exception, match="injected: set_lora failed"):
            AdapterSync().sync(model, engine)
    finally:
        engine.llm.collective_rpc(_mend, args=(name,))
    assert engine.llm.llm_engine.list_loras() == set()
    params = SamplingParams(temperature=0, max_tokens=4, detokenize=False, ignore_eos=True)
    with pytest.raises(Exception, match=f"No adapter found for {MEMORY_ROOT}"):
        engine.llm.generate(
            [TokensPrompt(prompt_token_ids=[1, 2, 3])], params, lora_request=held, use_tqdm=False
        )
    llm_engine = engine.llm.llm_engine
    llm_engine.abort_request(list(llm_engine.output_processor.request_states), internal=True)
    FullSync(lora="separate").sync(model, engine)  # the restore a Syncer plans after a failure
    T.assert_matches(model, engine, atol=ATOL)
