"""MoE models: transformers 5 holds experts fused, checkpoints and vLLM per expert.

Two families whose checkpoints name experts differently (Qwen3-MoE: ``mlp.experts.0.gate_proj``;
Mixtral: ``block_sparse_moe.experts.0.w1``), each through FullSync (dense, LoRA merged on
attention and on the fused experts) and ReloadWeights(snapshot) on a real vLLM engine; and the
layout itself against what ``save_pretrained`` writes. GLM-4-MoE, whose router holds a persistent
buffer the engine loads. Ernie 4.5 MoE in bfloat16, whose router vLLM and transformers hold in
float32 (``EngineFacts.held``). Every engine of the module is an MoE: vLLM's process-wide parallel
state lets an MoE engine start only beside MoE engines.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import moe_model
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers.core_model_loading import Interleave, WeightConverter

from weightsync import FullSync, ReloadWeights
from weightsync import testing as T
from weightsync.engines import VLLMEngine
from weightsync.errors import UnsupportedModelError
from weightsync.plan import Weight
from weightsync.trainer.layout import lora_parameters, merged_parameter, to_checkpoint
from weightsync.trainer.tensors import base_tensors
from weightsync.verify import check_engine
from weightsync.wire.checkpoint_names import Layout, checkpoint_layout

FAMILIES = ["qwen3_moe", "mixtral"]
# LoRA on attention and, through peft's target_parameters, on the fused experts themselves
LORA = {
    "r": 4,
    "target_modules": ["q_proj", "v_proj"],
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters()), "trainer modified"


# --- the layout, without an engine --------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_layout_is_what_save_pretrained_writes(family, tmp_path):
    model = moe_model(family)
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    sent = {t.name: t.produce(torch.float32) for t in base_tensors(model, merge_lora=False)}
    assert sorted(sent) == sorted(saved)
    assert all(torch.equal(sent[k], saved[k]) for k in saved)
    assert any(".experts.0." in k for k in sent) and not any("gate_up_proj" in k for k in sent)
    # per-expert tensors are views of the trainer's fused parameters: nothing is copied
    memory = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert all(t.untyped_storage().data_ptr() in memory for t in sent.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_planning_materialises_nothing_and_splits_are_not_twins(family):
    model = moe_model(family)

    def refuse(dtype):
        raise AssertionError("materialised while planning")

    planned = [Weight(n, tuple(p.shape), refuse, source=id(p)) for n, p in model.named_parameters()]
    pieces = to_checkpoint(planned, checkpoint_layout(model))
    assert len({t.source for t in pieces}) == len(pieces)  # no piece collapses into another
    # tied dedup keeps every expert (Mixtral: 2 layers x 4 experts x w1/w2/w3)
    names = [t.name for t in base_tensors(model, merge_lora=False)]
    assert sum(".experts." in n for n in names) == 2 * 4 * 3


def test_a_layout_that_is_not_a_view_runs_transformers_ops():
    """An op that reorders memory (Interleave) cannot be a view: transformers' op runs on the
    real tensor, once per parameter, and the result equals applying the op directly."""
    model = moe_model("mixtral")
    pattern = ".experts.gate_up_proj"
    rule = WeightConverter(pattern, pattern, operations=[Interleave(dim=1)])
    layout = Layout(model, [rule.reverse_transform()])
    name = "model.layers.0.mlp.experts.gate_up_proj"
    param = model.get_parameter(name)
    (piece,) = layout.split(name, tuple(param.shape))
    expected = Interleave(dim=1, inverse=True).convert({"x": param.detach()}, [], ["x"])["x"]
    assert piece.name == name and torch.equal(piece.take(param.detach()), expected)


def test_a_checkpoint_tensor_built_from_several_parameters_is_refused():
    model = moe_model("mixtral")
    rule = WeightConverter(
        [".experts.gate_up_proj", ".experts.down_proj"],
        ".experts.both",
        operations=[Interleave(dim=0)],
    )  # many in memory -> one on disk
    with pytest.raises(UnsupportedModelError, match="saved fused with other parameters"):
        Layout(model, [rule]).split("model.layers.0.mlp.experts.gate_up_proj", (4, 512, 128))


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_lora_delta_is_peft_delta(family):
    model = get_peft_model(moe_model(family), LoraConfig(**LORA))
    T.perturb(model, seed=1, scale=0.3)
    wrappers = {id(w): w for m in model.modules() for w in lora_parameters(m).values()}
    assert len(wrappers) == 2 * 2  # two layers, gate_up_proj and down_proj
    for w in wrappers.values():
        param = w.get_param()
        merged = merged_parameter(w, param, w.parameter_name)(torch.float32)
        assert torch.allclose(merged, param + w.get_delta_weight("default"), atol=1e-6, rtol=0)
        assert not torch.equal(merged, param)


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_expert_lora_equals_peft_merge(family):
    model = get_peft_model(moe_model(family), LoraConfig(**LORA))
    T.perturb(model, seed=1, scale=0.3)
    before = params(model)
    sent = {t.name: t.produce(torch.float32) for t in base_tensors(model, merge_lora=True)}
    assert_unchanged(model, before)
    merged = copy.deepcopy(model).merge_and_unload()
    expected = {t.name: t.produce(torch.float32) for t in base_tensors(merged, merge_lora=False)}
    assert sorted(sent) == sorted(expected)
    assert max((sent[k] - expected[k]).abs().max().item() for k in sent) < 1e-6
    unmerged = base_tensors(model.get_base_model(), merge_lora=False)
    base = {t.name: t.produce(torch.float32) for t in unmerged}
    changed = {k for k in sent if not torch.equal(sent[k], base[k])}
    assert {k for k in sent if ".experts.3." in k} <= changed  # LoRA reached every expert


# --- real vLLM engines, one per family ----------------------------------------------------------


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def engine(family, tmp_path_factory):
    return VLLMEngine(
        T.make_llm(T.save_checkpoint(moe_model(family), tmp_path_factory.mktemp(family)))
    )


def sync_and_check(model, engine, strategy):
    stale = T.compare(model, engine)
    assert stale["engine"] != stale["trainer"] or stale["max_logprob_diff"] > 0.1
    before = params(model)
    strategy.sync(model, engine)
    assert_unchanged(model, before)
    T.assert_matches(model, engine, atol=1e-3)


def test_full_sync_dense(family, engine):
    model = moe_model(family)
    T.perturb(model, seed=2, scale=0.05)
    sync_and_check(model, engine, FullSync())


def test_full_sync_lora_merged_on_attention(family, engine):
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj"])
    model = get_peft_model(moe_model(family), lora)
    T.perturb(model, seed=3, scale=0.3)
    sync_and_check(model, engine, FullSync(lora="merge"))


def test_full_sync_lora_merged_on_experts(family, engine):
    """LoRA on the fused experts (peft target_parameters) is merged exactly per expert."""
    model = get_peft_model(moe_model(family), LoraConfig(**LORA))
    T.perturb(model, seed=5, scale=0.3)
    sync_and_check(model, engine, FullSync(lora="merge"))


def test_reload_snapshot(family, engine, tmp_path):
    model = moe_model(family)
    T.perturb(model, seed=4, scale=0.05)
    sync_and_check(model, engine, ReloadWeights(snapshot_dir=tmp_path / "snapshot"))
    (shard,) = (tmp_path / "snapshot").glob("*.safetensors")
    assert any(".experts.0." in k for k in load_file(shard))  # per expert, as a checkpoint


def test_served_lora_refused_on_a_cpu_moe_engine(family, engine, monkeypatch):
    """vLLM-CPU cannot run LoRA on a MoE model (its MoE LoRA path is Triton-only; with
    enable_lora=True even a generate without an adapter fails in triton_moe.py), so the engine
    adapter refuses a served adapter while planning. The engine here was started without LoRA;
    its config is made to claim LoRA so the MoE check itself is what refuses."""
    from vllm.config import LoRAConfig

    from weightsync.errors import AdapterError
    from weightsync.trainer.tensors import adapter
    from weightsync.wire.protocol import LoraLimits

    assert engine._cpu_moe and not engine.keeps_unsent_layers
    monkeypatch.setattr(engine, "_lora_config", LoRAConfig(max_lora_rank=16))
    claimed = LoraLimits(max_rank=16, modules=("q_proj",))
    monkeypatch.setattr(engine, "_facts", dataclasses.replace(engine.facts, lora=claimed))
    model = get_peft_model(moe_model(family), LoraConfig(r=8, target_modules=["q_proj"]))
    with (
        T.count_writes(engine) as writes,
        pytest.raises(AdapterError, match="cannot apply LoRA to a MoE model"),
    ):
        engine.check_adapter(adapter(model))
    assert writes == []


# --- GLM-4-MoE: a router bias the trainer holds as a buffer -------------------------------------


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    folder = T.save_checkpoint(moe_model("glm4_moe"), tmp_path_factory.mktemp("glm4_moe"))
    return VLLMEngine(T.make_llm(folder))


def test_glm4_moe_router_bias_buffer_is_synced_also_after_a_level2_discard(glm):
    """GLM-4-MoE (``proven.ARCHITECTURES``): its router's ``e_score_correction_bias`` is a
    persistent buffer in transformers, and one parameter in vLLM that its experts module holds
    too (a name no checkpoint has, so not one the engine loads). A trainer that differs from the
    engine's checkpoint by that buffer alone changes the engine's tokens and is synced exactly;
    after a level-2 sleep (its discard simulated) a FullSync restores every weight and the
    buffer, exactly."""
    from conftest import discard

    engine = glm
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert [n for n in engine.expected_weights if "e_score" in n] == [name]
    assert not engine.shared_weights
    model = moe_model("glm4_moe")
    with torch.no_grad():  # picks experts 0 and 2 for every token (the scores are sigmoids)
        model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(
            torch.tensor([2.0, -2.0, 1.0, -1.0])
        )
    sync_and_check(model, engine, FullSync())
    T.perturb(model, seed=6, scale=0.05)
    engine.sleep(2)
    engine.wake_up()
    discard(engine)
    sync_and_check(model, engine, FullSync())


def test_online_fp8_linear_layers_with_bf16_experts_equal_a_fresh_engine(tmp_path_factory):
    """Quantized rollout (docs/quantized.md) on an MoE: vLLM quantizes the linear layers online
    (fp8 per channel) while the experts stay bf16 (vLLM-CPU has no quantized expert path). The
    engine reports the quantized modules; a full sync, and one after a level-2 sleep (simulated
    discard), serve bitwise what a fresh engine started from the trainer's weights serves; and
    verification passes. Here, not in test_quantized_vllm.py: vLLM's process-wide parallel state
    lets an MoE engine start only beside MoE engines (no expert group is made for a dense one)."""
    from conftest import discard

    from weightsync.verify import canary_prompts

    trained = moe_model("qwen3_moe", seed=1).to(torch.bfloat16)
    folder = T.save_checkpoint(trained, tmp_path_factory.mktemp("fp8moe"))
    engine = VLLMEngine(
        T.make_llm(
            folder,
            dtype="bfloat16",
            quantization="fp8_per_channel",
            quantization_config={"ignore": ["*experts*"]},
        )
    )

    def served():
        return engine.greedy_batch(T.PROMPTS, 8), engine.score_batch(canary_prompts(1024), 8)

    oracle = served()
    q = engine.facts.quantized
    assert q is not None and q.method == "fp8_per_channel" and not q.prequantized
    assert "model.layers.0.self_attn.q_proj" in q.modules
    assert not any("experts" in name for name in q.modules)
    FullSync().sync(moe_model("qwen3_moe", seed=0).to(torch.bfloat16), engine)
    assert served() != oracle
    FullSync().sync(trained, engine)
    assert served() == oracle
    engine.sleep(2)
    engine.wake_up()
    discard(engine)
    assert served() != oracle
    FullSync().sync(trained, engine)
    check_engine(trained, engine, strategy="FullSync")
    assert served() == oracle


# --- Ernie 4.5 MoE: a float32 router inside a bfloat16 model ------------------------------------


def ernie_bf16(folder) -> torch.nn.Module:
    """A tiny Ernie 4.5 MoE (layer 0 dense, layer 1 MoE) as a trainer loads it in bfloat16:
    transformers keeps its router (``gate.weight``, ``moe_statics``) in float32
    (``_keep_in_fp32_modules_strict``); the router's correction bias set off zero, to values
    bfloat16 cannot hold."""
    from transformers import AutoModelForCausalLM, Ernie4_5_MoeConfig

    torch.manual_seed(0)
    config = Ernie4_5_MoeConfig(
        moe_num_experts=4, moe_k=2, moe_intermediate_size=64, moe_layer_start_index=1, **T.TINY
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)  # float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        model.model.layers[1].mlp.gate.moe_statics.e_score_correction_bias.copy_(
            torch.randn(1, 4, generator=torch.Generator().manual_seed(7)) * 0.3
        )
    return model


ROUTER = {
    "model.layers.1.mlp.gate.weight": "float32",
    "model.layers.1.mlp.moe_statics.e_score_correction_bias": "float32",
}


def test_a_float32_router_travels_in_float32_without_a_copy(tmp_path):
    """Weights the engine holds in float32 (`EngineFacts.held`) travel in the dtype the trainer
    holds them in when the engine's holds it exactly (the trainer's float32 memory itself, or
    a bfloat16 weight of a model cast whole), else in the engine's; every other weight in the
    engine's dtype; a fact an older extension does not send reads as none."""
    from weightsync.trainer.tensors import as_engine_holds
    from weightsync.wire.protocol import EngineFacts

    model = ernie_bf16(tmp_path)
    tensors = as_engine_holds(base_tensors(model, merge_lora=False), ROUTER)
    sent = {t.name: t.sent for t in tensors if t.sent is not None}
    assert sent == dict.fromkeys(ROUTER, torch.float32)
    gate = model.model.layers[1].mlp.gate.weight
    (router,) = [t for t in tensors if t.name == "model.layers.1.mlp.gate.weight"]
    produced = router.produce(torch.bfloat16)  # the plan's dtype is ignored
    assert produced.dtype == torch.float32 and produced.data_ptr() == gate.data_ptr()
    # a trainer cast whole to bfloat16: its bfloat16 router reaches a float32 one unrounded
    cast = {
        t.name: t.sent
        for t in as_engine_holds(base_tensors(model.to(torch.bfloat16), merge_lora=False), ROUTER)
    }
    assert cast["model.layers.1.mlp.gate.weight"] == torch.bfloat16
    old = EngineFacts(dtype="bfloat16", weights={}).to_json()
    del old["held"]
    assert EngineFacts.from_json(old).held == {}


@pytest.fixture(scope="module")
def ernie(tmp_path_factory):
    """(trainer before a step, trainer after it, a bfloat16 engine started from the latter)."""
    base = ernie_bf16(tmp_path_factory.mktemp("ernie_fp32"))
    trained = copy.deepcopy(base)
    T.perturb(trained, seed=1, scale=0.05)
    with torch.no_grad():  # moved apart from the optimizer, as auxiliary-loss-free balancing does
        trained.model.layers[1].mlp.gate.moe_statics.e_score_correction_bias.add_(
            torch.randn(1, 4, generator=torch.Generator().manual_seed(8)) * 0.1
        )
    folder = T.save_checkpoint(trained, tmp_path_factory.mktemp("ernie4_5_moe"))
    return base, trained, VLLMEngine(T.make_llm(folder, dtype="bfloat16"))


def test_ernie4_5_moe_bf16_float32_router_synced_exactly_after_a_level2_discard(ernie, caplog):
    """Ernie 4.5 MoE in bfloat16: vLLM builds its router in float32 (``gate.weight``, and
    ``e_score_correction_bias``, which its loader renames from ``moe_statics``), as
    transformers keeps it. The engine reports both (`EngineFacts.held`); a FullSync sends them
    in float32, so after a level-2 sleep (its discard simulated) the engine holds the trainer's
    router bitwise and serves bitwise what it served fresh from the trainer's checkpoint. Sent
    in bfloat16 (docs/failure-modes.md row 53), the router held rounded weights and the
    canary's logprobs moved by up to 0.2, with no error.

    Ernie stays unproven, and this shows why: vLLM-CPU's router ignores the correction bias
    (``CPURouter``'s softmax path), so an engine whose bias is not zero computes other
    logprobs than transformers even fresh from its checkpoint, and the first sync's canary
    says so. In bfloat16 that is not told from rounding: the sync scores as vLLM's own load of
    the trainer's checkpoint does, so the first sync passes with a warning naming the
    architecture and the gap (in float32 it raises `UnprovenEngineError`;
    docs/failure-modes.md)."""
    from conftest import discard

    from weightsync.verify import TOLERANCE, canary_prompts

    base, trained, engine = ernie
    assert dict(engine.facts.held) == ROUTER

    def served():
        return engine.greedy_batch(T.PROMPTS, 8), engine.score_batch(canary_prompts(1024), 8)

    def bias(model=None):  # the router's weight itself is repacked by vLLM-CPU (shape (0,))
        if model is None:
            (held,) = engine.llm.apply_model(
                lambda m: m.model.layers[1].mlp.gate.e_score_correction_bias.detach().clone()
            )
            return held
        return model.model.layers[1].mlp.gate.moe_statics.e_score_correction_bias.detach()[0]

    oracle = served()
    with caplog.at_level("WARNING", logger="weightsync.proven"):
        first = FullSync().sync(base, engine)  # the first sync of an unproven engine is verified
    assert first.verified_logprob_diff > TOLERANCE[torch.bfloat16].mean
    assert "Ernie4_5_MoeForCausalLM" in caplog.text and "vLLM's own load" in caplog.text
    assert served() != oracle
    engine.sleep(2)
    engine.wake_up()
    discard(engine)
    FullSync().sync(trained, engine, verify=False)
    assert served() == oracle
    held = bias()
    assert held.dtype == torch.float32 and torch.equal(held, bias(trained))
    plan = FullSync().plan(trained, engine)
    assert {t.name: t.sent for t in plan.weights if t.sent} == dict.fromkeys(ROUTER, torch.float32)
