"""Exact by construction: nothing is skipped, and no sleep state assumed, that the engine itself
did not attest.

Each test here is a way the promise broke on real vLLM while the trainer trusted its own picture
of the engine (issue 19): skipping after a level-2 sleep the caller reported, change detection
that missed ``.data`` writes and PEFT's in-place merge, a framework's own weight write, a
replica slept on its own. Level-2 discards are simulated the way a GPU does them and vLLM-CPU
does not: the weights become garbage -- here written straight into the engine's parameter memory
(``apply_model``), a path no vLLM call sees, so only what the caller reports or the engine
attests can save the sync.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ATOL
from peft import LoraConfig, get_peft_model

from weightsync import FullSync, Syncer, policy
from weightsync import testing as T
from weightsync.engines import Replicas, VLLMEngine
from weightsync.errors import EngineChangedError
from weightsync.execute import execute

EMBED = ("model.embed_tokens",)
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return T.save_checkpoint(T.tiny_model("qwen2"), tmp_path_factory.mktemp("attested") / "ck")


@pytest.fixture(scope="module")
def llms(checkpoint):
    """Two plain engines (dense and merged LoRA; a fan-out of two) and one serving LoRA."""
    return {
        "a": T.make_llm(checkpoint),
        "b": T.make_llm(checkpoint),
        "lora": T.make_llm(checkpoint, enable_lora=True),
    }


@pytest.fixture
def engine(llms):
    return VLLMEngine(llms["a"])


@pytest.fixture
def lora_engine(llms):
    return VLLMEngine(llms["lora"])


def frozen_embeddings(seed=0):
    model = T.tiny_model("qwen2", seed=seed)
    model.model.embed_tokens.weight.requires_grad_(False)
    return model


def lora(seed=0):
    model = get_peft_model(T.tiny_model("qwen2", seed=seed), LoraConfig(**LORA))
    T.perturb(model, seed=seed + 100, scale=0.3)
    return model


@torch.no_grad()
def scribble(llm, seed=7):
    """A GPU's level-2 discard, which vLLM-CPU's sleep does not do: garbage straight into the
    engine's parameter memory, through no vLLM call."""
    gen = torch.Generator().manual_seed(seed)

    def write(model):
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))

    llm.apply_model(write)
    llm.reset_prefix_cache()


def synced_twice(model, engine):
    """Two syncs with a training step between: the second skips the frozen embeddings."""
    FullSync().sync(model, engine)
    T.perturb(model, seed=11)
    report = FullSync().sync(model, engine)
    assert "model.embed_tokens.weight" in report.plan.skipped  # the mechanism is on
    T.assert_matches(model, engine, atol=ATOL)


@pytest.mark.parametrize("entry", ["choose", "syncer"])
def test_a_reported_level_2_sleep_skips_nothing(llms, engine, entry):
    """Issue 19: the caller says level 2; FullSync must not skip the embeddings the engine's
    record says it holds. The discard went through no vLLM call (as a sleep made and undone
    where the adapter could not see it, or on an engine that cannot attest): only the caller's
    report tells."""
    model = frozen_embeddings()
    synced_twice(model, engine)
    scribble(llms["a"])  # a level-2 sleep no vLLM call showed: only the caller's word
    T.perturb(model, seed=12)
    if entry == "choose":
        strategy = policy.choose(
            train_type="full", rollout_lora=False, base_sync_done=True, sleep_level=2
        )
        report = strategy.sync(model, engine)
    else:
        report = Syncer(engine, train_type="full", base_sync_done=True).sync(model, sleep_level=2)
    assert report.plan.skipped == ()
    T.assert_matches(model, engine, atol=ATOL)


@pytest.mark.parametrize("how", ["full", "served"])
def test_a_write_no_vllm_call_saw_is_attested_by_content(llms, engine, lora_engine, how):
    """Garbage straight into the engine's parameter memory (``apply_model``: no vLLM call, no
    report): the worker's seal of its weights changed without an event, so the engine attests
    harm 2 by itself -- a full sync skips nothing, a served adapter's base is restored -- and
    the sync is exact."""
    if how == "full":
        model = frozen_embeddings()
        synced_twice(model, engine)
        scribble(llms["a"])
        T.perturb(model, seed=13)
        report = FullSync().sync(model, engine)
        assert report.plan.skipped == ()
        T.assert_matches(model, engine, atol=ATOL)
        return
    model = lora()
    syncer = Syncer(lora_engine, train_type="lora")
    syncer.sync(model)
    T.perturb(model, seed=14, scale=0.3)
    assert syncer.sync(model).strategy == "AdapterSync"  # nothing happened: adapter alone
    scribble(llms["lora"])
    T.perturb(model, seed=15, scale=0.3)
    report = syncer.sync(model)
    assert report.strategy == "FullSync(lora=separate)", report.reason
    T.assert_matches(model, lora_engine, atol=ATOL)


def test_a_reported_level_2_sleep_skips_no_merged_base(llms, engine):
    """The same with LoRA merged: the untargeted frozen base (embeddings, norms, k_proj...)."""
    model = lora()
    FullSync(lora="merge").sync(model, engine)
    scribble(llms["a"])
    strategy = policy.choose(
        train_type="lora", rollout_lora=False, base_sync_done=True, sleep_level=2
    )
    assert strategy.sync(model, engine).plan.skipped == ()
    T.assert_matches(model, engine, atol=ATOL)


def test_a_reported_level_2_sleep_restores_a_served_base(llms, lora_engine):
    """And with LoRA served: the whole base is frozen, so a second FullSync(separate) would
    skip all of it."""
    model = lora()
    syncer = Syncer(lora_engine, train_type="lora")
    syncer.sync(model)
    scribble(llms["lora"])
    report = syncer.sync(model, sleep_level=2)
    assert report.strategy == "FullSync(lora=separate)" and report.plan.skipped == ()
    T.assert_matches(model, lora_engine, atol=ATOL)


@pytest.mark.parametrize("write", ["copy_", "add_"])
def test_data_writes_on_a_frozen_tensor_are_sent(engine, write):
    """``.data`` writes change neither the version counter nor the address: only the content
    tells."""
    model = frozen_embeddings()
    synced_twice(model, engine)
    emb = model.model.embed_tokens.weight
    if write == "copy_":
        emb.data.copy_(torch.roll(emb.data, 1, dims=0))
    else:
        emb.data[: emb.shape[0] // 2] += 0.5
    report = FullSync().sync(model, engine)
    assert "model.embed_tokens.weight" not in report.plan.skipped
    T.assert_matches(model, engine, atol=ATOL)


def test_in_place_merge_and_unmerge_around_each_sync(engine):
    """TRL's and ms-swift's loop: merge_adapter(), sync, unmerge_adapter(), every step. PEFT
    writes the base through ``.data``; every merged layer must be sent every time."""
    model = lora()
    for step in range(3):
        T.perturb(model, seed=step, scale=0.3)
        model.merge_adapter()
        try:
            report = FullSync(lora="merge").sync(model, engine)
            T.assert_matches(model, engine, atol=ATOL)
        finally:
            model.unmerge_adapter()
        assert not any(".q_proj." in n for n in report.plan.skipped), step


def test_a_framework_weight_write_is_seen(llms, engine):
    """TRL, verl, OpenRLHF and NeMo-RL write through the model's own ``load_weights``: the
    engine's epoch moves, so nothing recorded before it is skipped."""
    model = frozen_embeddings()
    synced_twice(model, engine)
    # The embedding only: vLLM-CPU's repacked linear layers cannot take a raw load_weights.
    name = "model.embed_tokens.weight"
    garbage = [(name, torch.randn(engine.expected_weights[name]))]
    llms["a"].apply_model(lambda m: m.load_weights(iter(garbage)))
    llms["a"].reset_prefix_cache()
    T.perturb(model, seed=13)
    report = FullSync().sync(model, engine)
    assert report.plan.skipped == ()
    assert "epoch moved" in str(report.plan)
    T.assert_matches(model, engine, atol=ATOL)


def test_a_sleep_of_one_replica_is_that_replicas_own(llms):
    """Replicas keep one record each: a level-2 sleep of one makes the fan-out send everything
    (one stream feeds both), and both end exact."""
    a, b = VLLMEngine(llms["a"]), VLLMEngine(llms["b"])
    fan = Replicas([a, b])
    model = frozen_embeddings()
    synced_twice(model, fan)
    llms["b"].sleep(level=2)  # seen by b's own epoch, not through the fan-out
    scribble(llms["b"])
    llms["b"].wake_up()
    assert fan.sleep_level == 2 and a.sleep_level == 0 and b.sleep_level == 2
    T.perturb(model, seed=14)
    report = FullSync().sync(model, fan)  # FullSync as is: replica b's own record decides
    assert report.plan.skipped == ()
    assert "replica 1" in report.plan.skip_note
    for e in (a, b):
        T.assert_matches(model, e, atol=ATOL)
    assert Syncer(fan, train_type="full", base_sync_done=True).choose().name == "FullSync"


def test_a_sleep_between_plan_and_write_refuses_the_skip(llms, engine):
    """A plan that skips records the epoch it was decided on; if the engine moved before the
    write, nothing is written and the error says to plan again."""
    model = frozen_embeddings()
    synced_twice(model, engine)
    T.perturb(model, seed=15)
    plan = FullSync().plan(model, engine)
    assert plan.skipped
    llms["a"].sleep(level=1)
    llms["a"].wake_up()
    with T.count_writes(engine) as writes, pytest.raises(EngineChangedError):
        execute(plan, engine)
    assert writes == []
    assert FullSync().sync(model, engine).plan.skipped == ()  # planned again: sends all
    T.assert_matches(model, engine, atol=ATOL)


def test_the_in_process_version_is_the_workers_own(llms, lora_engine, tmp_path):
    """The in-process engine's version comes from its worker's ledger (issue 16 part 3): a sync
    moves it and its report carries it; reading it or generating leaves it; an adapter
    replaced in memory under the id it had (weightsync's AdapterSync) moves it, and so does
    another client's in-place ``add_lora`` under that id, which no id listing would show."""
    from vllm.lora.request import LoRARequest

    syncer = Syncer(lora_engine, train_type="lora")
    model = get_peft_model(T.tiny_model("qwen2"), LoraConfig(**LORA))
    T.perturb(model, seed=81, scale=0.3)
    before = lora_engine.weights_version
    assert before is not None
    base = syncer.sync(model)
    assert base.weights_version == lora_engine.weights_version != before
    lora_engine.greedy_batch(T.PROMPTS, 4)
    assert lora_engine.weights_version == base.weights_version
    T.perturb(model, seed=82, scale=0.3)
    adapter = syncer.sync(model)
    assert adapter.strategy == "AdapterSync"
    assert adapter.weights_version == lora_engine.weights_version != base.weights_version
    served = lora_engine.lora_request
    model.save_pretrained(tmp_path / "theirs")  # another client's adapter, same name and id
    theirs = LoRARequest(
        served.lora_name, served.lora_int_id, str(tmp_path / "theirs"), load_inplace=True
    )
    assert llms["lora"].llm_engine.add_lora(theirs)
    assert lora_engine.weights_version != adapter.weights_version


def test_print_plan_says_why_each_group_is_unchanged(engine):
    model = frozen_embeddings()
    FullSync().sync(model, engine)
    T.perturb(model, seed=16)
    text = str(FullSync().plan(model, engine))
    assert "model.embed_tokens" in text and "xxh3-128" in text and "attests" in text, text
