"""Bad input gets a clear error before anything is written, and the engine keeps serving."""

from __future__ import annotations

import pytest
import torch
from conftest import lora_model

from weightsync import AdapterSync, FullSync, ReloadWeights, Syncer
from weightsync import testing as T
from weightsync.errors import AdapterError, UnsupportedModelError, WeightMismatchError

ARCH = "llama"
LORA = {"r": 8, "target_modules": ["q_proj", "v_proj"]}  # this module's (conftest's is larger)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """What conftest's ``lora_engine`` and ``plain_engine`` serve."""
    return T.save_checkpoint(T.tiny_model(ARCH), tmp_path_factory.mktemp("err") / "ck")


@pytest.fixture
def served(lora_engine):
    """The LoRA engine serving a known adapter; tests check it still does after their error."""
    model = lora_model(ARCH, seed=1, config=LORA)
    FullSync(lora="separate").sync(model, lora_engine)
    T.assert_matches(model, lora_engine)
    return model


def still_serving(model, engine):
    T.assert_matches(model, engine)


def test_weight_the_engine_does_not_have(served, lora_engine):
    model = T.tiny_model(ARCH)
    model.model.layers[0].mlp.register_parameter("extra_scale", torch.nn.Parameter(torch.ones(4)))
    with pytest.raises(
        WeightMismatchError, match=r"does not have: model\.layers\.0\.mlp\.extra_scale"
    ):
        FullSync().sync(model, lora_engine)
    still_serving(served, lora_engine)


def test_missing_weights_are_listed(served, lora_engine):
    model = T.tiny_model(ARCH, num_hidden_layers=1)
    with pytest.raises(
        WeightMismatchError,
        match=r"engine loads but the trainer did not send: .*model\.layers\.1\.",
    ) as err:
        FullSync().sync(model, lora_engine)
    assert "nothing was written" in str(err.value)
    still_serving(served, lora_engine)


def test_shape_mismatch_names_both_shapes(served, lora_engine):
    model = T.tiny_model(ARCH, intermediate_size=384)
    with pytest.raises(
        WeightMismatchError,
        match=r"model\.layers\.0\.mlp\.gate_proj\.weight: trainer \(384, 128\), engine \(256, 128\)",
    ):
        FullSync().sync(model, lora_engine)
    still_serving(served, lora_engine)


@pytest.mark.parametrize("strategy", [AdapterSync(), FullSync(lora="separate"), ReloadWeights()])
def test_adapter_rank_above_engine_limit(served, lora_engine, strategy):
    model = lora_model(ARCH, seed=2, config=LORA, r=32)
    with pytest.raises(AdapterError, match=r"rank 32, above this engine's max_lora_rank=16"):
        strategy.sync(model, lora_engine)
    still_serving(served, lora_engine)


def test_rank_pattern_counts(served, lora_engine):
    model = lora_model(ARCH, seed=3, config=LORA, r=8, rank_pattern={"v_proj": 24})
    with pytest.raises(AdapterError, match="rank 24"):
        AdapterSync().sync(model, lora_engine)
    still_serving(served, lora_engine)


def test_adapter_sync_of_a_model_without_adapter(served, lora_engine):
    with pytest.raises(UnsupportedModelError, match=r"needs a peft\.PeftModel"):
        AdapterSync().sync(T.tiny_model(ARCH), lora_engine)
    still_serving(served, lora_engine)


def test_reload_checkpoint_with_a_trained_base(served, lora_engine):
    model = T.tiny_model(ARCH)
    T.perturb(model, seed=4)
    with pytest.raises(UnsupportedModelError, match="stale weights"):
        ReloadWeights().sync(model, lora_engine)
    still_serving(served, lora_engine)


def test_separate_adapter_into_engine_without_lora(plain_engine):
    base = T.tiny_model(ARCH)
    T.perturb(base, seed=5)
    FullSync().sync(base, plain_engine)
    with pytest.raises(AdapterError, match="enable_lora"):
        FullSync(lora="separate").sync(lora_model(ARCH, seed=6, config=LORA), plain_engine)
    with pytest.raises(AdapterError, match="enable_lora"):
        AdapterSync().sync(lora_model(ARCH, seed=6, config=LORA), plain_engine)
    still_serving(base, plain_engine)


def test_bad_strategy_and_syncer_arguments(lora_engine):
    with pytest.raises(ValueError, match="lora must be"):
        FullSync(lora="merged")
    with pytest.raises(ValueError, match="bucket_bytes"):
        FullSync(bucket_bytes=0)
    with pytest.raises(ValueError, match="train_type"):
        Syncer(lora_engine, train_type="qlora")
    with pytest.raises(ValueError, match="prefer_reload"):
        Syncer(lora_engine, train_type="full", prefer_reload=True)
    with pytest.raises(TypeError, match="no engine adapter accepts"):
        FullSync().sync(T.tiny_model(ARCH), object())
