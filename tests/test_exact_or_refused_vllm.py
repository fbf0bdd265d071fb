"""The promise, against a real vLLM engine: after a sync the engine generates exactly what the
trainer generates, or an error was raised while planning, nothing was written (counted at vLLM's
own boundary) and the engine still serves what it had.

Each test is a set-up a user brings that broke the promise before the plan/allowlist mechanism:
the framework sleeping vLLM itself, an adapter merged in place, base-rewriting LoRA inits, two
active adapters, DoRA, options vLLM refuses, options weightsync has never heard of.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import ATOL, lora_model, sync_and_check
from peft import IA3Config, LoraConfig, get_peft_model

from weightsync import AdapterSync, FullSync, ReloadWeights, Syncer
from weightsync import testing as T
from weightsync.engines import VLLMEngine
from weightsync.errors import (
    AdapterError,
    BadArgumentError,
    BadValuesError,
    UnsupportedModelError,
)

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
LORA = {"r": 8, "lora_alpha": 16, "target_modules": TARGETS}  # this module's, not conftest's


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """What conftest's ``lora_engine`` and ``plain_engine`` serve."""
    return T.save_checkpoint(T.tiny_model("llama"), tmp_path_factory.mktemp("promise") / "ck")


@pytest.fixture(autouse=True)
def _awake(request):
    """Leave every engine awake for the next test, even when this one failed mid-sleep."""
    yield
    for name in ("lora_engine", "plain_engine"):
        if name in request.fixturenames:
            engine = request.getfixturevalue(name)
            if engine.asleep:
                engine.llm.wake_up()


def refused(strategy, model, engine, error, match, *, reference=None) -> None:
    """``strategy`` is refused with ``error`` naming ``match``, writing nothing, and the engine
    still serves what it served before (its greedy tokens; ``reference``: the model compared
    with, when ``model`` itself cannot run)."""
    reference = model if reference is None else reference
    before = T.compare(reference, engine)["engine"]
    with T.count_writes(engine) as writes, pytest.raises(error, match=match):
        strategy.sync(model, engine)
    assert writes == [], f"refused, but the engine was written: {writes}"
    assert T.compare(reference, engine)["engine"] == before


# --- sleeps the framework makes itself ------------------------------------------------------


def test_framework_sleeps_vllm_directly_and_syncer_restores_the_base(lora_engine):
    """TRL sleeps the LLM itself, already before weightsync sees it; the level is never told."""
    llm = lora_engine.llm
    model = lora_model("llama", seed=1, config=LORA)
    syncer = Syncer(lora_engine, train_type="lora")
    assert syncer.sync(model).strategy == "FullSync(lora=separate)"
    T.assert_matches(model, lora_engine, atol=ATOL)
    for step, level in enumerate([1, 2, 1, 2]):
        T.perturb(model, seed=100 + step, scale=0.3)
        llm.sleep(level=level)  # the framework's own call: weightsync is not told
        if level == 2:
            T.discard_weights(lora_engine)  # what level 2 does to the weights on a GPU
        llm.wake_up()
        want = "AdapterSync" if level == 1 else "FullSync(lora=separate)"
        assert syncer.choose().label == want, f"after llm.sleep(level={level})"
        syncer.sync(model)
        T.assert_matches(model, lora_engine, atol=ATOL)


def test_sleep_before_the_adapter_existed_counts_as_level_2(checkpoint):
    llm = T.make_llm(checkpoint, enable_lora=True, max_lora_rank=16)
    llm.sleep(level=1)  # a level this adapter never saw: it must assume the worst
    engine = VLLMEngine(llm)
    llm.wake_up()
    assert engine.sleep_level == 2 and engine.base_discarded
    syncer = Syncer(engine, train_type="lora", base_sync_done=True)
    assert syncer.choose().label == "FullSync(lora=separate)"
    refused(
        AdapterSync(), lora_model("llama", seed=2, config=LORA), engine, Exception, "level-2 sleep"
    )


# --- options served exactly ---------------------------------------------------------------------


def test_scale_options_served_exactly(lora_engine, plain_engine):
    """rsLoRA, rank_pattern and alpha_pattern: vLLM computes the scale from the config we write."""
    model = lora_model(
        "llama",
        seed=19,
        config=LORA,
        use_rslora=True,
        rank_pattern={"v_proj": 4},
        alpha_pattern={"o_proj": 32},
    )
    sync_and_check(FullSync(lora="separate"), model, lora_engine)
    T.perturb(model, seed=20, scale=0.3)
    sync_and_check(AdapterSync(), model, lora_engine)
    sync_and_check(FullSync(lora="merge"), model, plain_engine)


# --- adapters merged in place by the caller -------------------------------------------------


def test_adapter_merged_in_place_merged_sync_is_exact(plain_engine):
    model = lora_model("llama", seed=3, config=LORA)
    model.merge_adapter()  # as TRL does around its own sync
    sync_and_check(FullSync(lora="merge"), model, plain_engine)
    model.unmerge_adapter()
    T.perturb(model, seed=4, scale=0.3)
    sync_and_check(FullSync(lora="merge"), model, plain_engine)


def test_adapter_merged_in_place_is_refused_when_served(lora_engine):
    FullSync(lora="separate").sync(lora_model("llama", seed=5, config=LORA), lora_engine)
    model = lora_model("llama", seed=6, config=LORA)
    model.merge_adapter()
    for strategy in (FullSync(lora="separate"), AdapterSync()):
        refused(strategy, model, lora_engine, UnsupportedModelError, "unmerge_adapter")


# --- LoRA inits that rewrite the base ---------------------------------------------------------


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_base_rewriting_init_through_all_three_lora_paths(init, lora_engine, plain_engine):
    model = lora_model("llama", seed=7, config=LORA, init_lora_weights=init)
    # merged into an engine without LoRA
    sync_and_check(FullSync(lora="merge"), model, plain_engine)
    # base + adapter: the rewritten base is sent, the adapter config says init=True for vLLM
    sync_and_check(FullSync(lora="separate"), model, lora_engine)
    # adapter only, after an update
    T.perturb(model, seed=8, scale=0.3)
    sync_and_check(AdapterSync(), model, lora_engine)
    # reloading the original checkpoint would restore a base the trainer no longer has
    refused(ReloadWeights(), model, lora_engine, UnsupportedModelError, init)


def test_reload_refused_when_the_base_differs_without_a_known_cause(lora_engine):
    """No option says so, but the base was changed before wrapping: the sampled rows catch it."""
    base = T.tiny_model("llama")
    T.perturb(base, seed=9, scale=0.01)
    model = get_peft_model(base, LoraConfig(r=8, target_modules=TARGETS))
    T.perturb(model, seed=10, scale=0.3)
    FullSync(lora="separate").sync(model, lora_engine)
    refused(
        ReloadWeights(), model, lora_engine, UnsupportedModelError, "differs from the checkpoint"
    )


# --- several active adapters ------------------------------------------------------------------


def two_adapters(seed: int):
    model = lora_model("llama", seed=seed, config=LORA)
    model.add_adapter(
        "second", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj"])
    )
    model.base_model.set_adapter(["default", "second"])
    T.perturb(model, seed=seed + 1, scale=0.3)
    return model


def test_two_active_adapters_merged_exactly(plain_engine):
    sync_and_check(FullSync(lora="merge"), two_adapters(seed=11), plain_engine)


def test_two_active_adapters_refused_when_served(lora_engine):
    model = two_adapters(seed=13)
    for strategy in (FullSync(lora="separate"), AdapterSync()):
        refused(strategy, model, lora_engine, UnsupportedModelError, "2 active adapters")


# --- what cannot be reproduced is refused before any write -------------------------------------


def test_dora_refused_with_zero_writes(lora_engine, plain_engine):
    model = lora_model("llama", seed=14, config=LORA, use_dora=True)
    refused(FullSync(lora="merge"), model, plain_engine, UnsupportedModelError, "DoRA")
    for strategy in (FullSync(lora="separate"), AdapterSync(), ReloadWeights()):
        refused(strategy, model, lora_engine, UnsupportedModelError, "DoRA")


def test_lora_bias_on_layers_without_a_bias_is_refused(lora_engine, plain_engine):
    """Llama's projections have no bias: the bias peft adds on lora_B has nowhere to go in the
    engine, merged or served (merging it where a bias exists is tested in test_tensors.py)."""
    model = lora_model("llama", seed=15, config=LORA, lora_bias=True)
    refused(FullSync(lora="merge"), model, plain_engine, UnsupportedModelError, "without a bias")
    refused(FullSync(lora="separate"), model, lora_engine, UnsupportedModelError, "lora_bias")


def test_vllm_own_adapter_validation_runs_while_planning(lora_engine):
    """An adapter config vLLM's PEFTHelper refuses fails in plan(), not in add_lora after the
    base was written."""
    model = lora_model("llama", seed=16, config=LORA)
    adapter = FullSync(lora="separate").plan(model, lora_engine).adapter
    bad = dataclasses.replace(adapter, config={**adapter.config, "bias": "all"})
    with T.count_writes(lora_engine) as writes, pytest.raises(AdapterError, match="vLLM refuses"):
        lora_engine.check_adapter(bad)
    assert writes == []


def test_an_option_weightsync_does_not_know_is_refused(lora_engine, plain_engine):
    """The allowlist, not a denylist: a LoraConfig option from a newer peft is refused."""

    @dataclasses.dataclass
    class NewerLoraConfig(LoraConfig):
        shiny_new_knob: int = 0

    model = get_peft_model(
        T.tiny_model("llama"), NewerLoraConfig(r=8, target_modules=TARGETS, shiny_new_knob=3)
    )
    T.perturb(model, seed=17, scale=0.3)
    refused(FullSync(lora="merge"), model, plain_engine, UnsupportedModelError, "shiny_new_knob=3")
    refused(FullSync(lora="separate"), model, lora_engine, UnsupportedModelError, "does not know")


def test_other_peft_tuners_are_refused(plain_engine):
    model = get_peft_model(
        T.tiny_model("llama"),
        IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
    )
    refused(FullSync(lora="merge"), model, plain_engine, UnsupportedModelError, "only LoRA")


def test_plan_reads_like_an_explanation(lora_engine):
    model = lora_model("llama", seed=18, config=LORA, init_lora_weights="pissa")
    text = str(FullSync(lora="separate", reason="first sync").plan(model, lora_engine))
    for part in (
        "FullSync(lora=separate)",
        "why: first sync",
        "stream:",
        "load adapter 'default'",
        "rewrote the base",
    ):
        assert part in text, text


# --- values no engine can serve, and objects that are not a model, refused before any write ----


def _poison(model, name: str, value: float) -> None:
    with torch.no_grad():
        dict(model.named_parameters())[name].view(-1)[5] = value


def test_a_non_finite_value_is_refused_by_every_strategy(lora_engine, plain_engine, tmp_path):
    """One NaN or inf anywhere the sync reads -- a dense weight, a LoRA factor merged or served
    -- is refused while planning, naming the weight, with zero writes and the engine's greedy
    tokens unchanged; the next honest sync is exact."""
    dense = T.tiny_model("llama")
    T.perturb(dense, seed=30)
    FullSync().sync(dense, plain_engine)
    bad = copy.deepcopy(dense)
    _poison(bad, "model.layers.1.mlp.down_proj.weight", float("nan"))
    where = r"model\.layers\.1\.mlp\.down_proj\.weight holds"
    refused(FullSync(), bad, plain_engine, BadValuesError, where)
    refused(ReloadWeights(snapshot_dir=tmp_path / "snap"), bad, plain_engine, BadValuesError, where)
    assert not (tmp_path / "snap").exists()  # not even the snapshot was written
    T.perturb(dense, seed=31)
    sync_and_check(FullSync(), dense, plain_engine)

    lora = lora_model("llama", seed=32, config=LORA)
    FullSync(lora="separate").sync(lora, lora_engine)
    bad = copy.deepcopy(lora)
    factor = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.default.weight"
    _poison(bad, factor, float("-inf"))
    merged = r"model\.layers\.0\.self_attn\.v_proj\.weight \(one of its LoRA factors\) holds"
    refused(FullSync(lora="merge"), bad, plain_engine, BadValuesError, merged)
    served = r"adapter 'default' tensor .*layers\.0\.self_attn\.v_proj\.lora_B\.weight holds"
    for strategy in (FullSync(lora="separate"), AdapterSync(), ReloadWeights()):
        refused(strategy, bad, lora_engine, BadValuesError, served)
    T.perturb(lora, seed=33)
    sync_and_check(AdapterSync(), lora, lora_engine)


def test_a_tensor_without_data_is_refused(plain_engine):
    """A parameter on the meta device (offloaded, or never loaded) failed inside vLLM's reload
    after the write began; one whose storage was freed read garbage. Both are refused now."""
    model = T.tiny_model("llama")
    T.perturb(model, seed=34)
    FullSync().sync(model, plain_engine)
    meta = copy.deepcopy(model)
    proj = meta.model.layers[0].self_attn.o_proj
    proj.weight = torch.nn.Parameter(torch.empty(proj.weight.shape, device="meta"))
    where = r"model\.layers\.0\.self_attn\.o_proj\.weight is on the meta device"
    refused(FullSync(), meta, plain_engine, BadValuesError, where)
    freed = copy.deepcopy(model)
    freed.model.layers[1].mlp.gate_proj.weight.untyped_storage().resize_(0)
    where = r"gate_proj\.weight has no data"
    refused(FullSync(), freed, plain_engine, BadValuesError, where, reference=model)
    T.perturb(model, seed=35)
    sync_and_check(FullSync(), model, plain_engine)


def test_what_is_not_a_model_or_an_engine_is_refused_naming_the_argument(plain_engine):
    model = T.tiny_model("llama")
    with T.count_writes(plain_engine) as writes:
        for wrong in (None, model.state_dict(), "Qwen/Qwen2-0.5B"):
            with pytest.raises(BadArgumentError, match="model must be the trainer's"):
                FullSync().sync(wrong, plain_engine)
            with pytest.raises(BadArgumentError, match="model must be the trainer's"):
                Syncer(plain_engine, train_type="full").sync(wrong)
        with pytest.raises(BadArgumentError, match=r"engine: no engine adapter accepts .*NoneType"):
            FullSync().sync(model, None)
    assert writes == []
