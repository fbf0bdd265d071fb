"""The trainer-side weight stream, without an engine: names, merge math, memory, no mutation."""

import copy
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors import safe_open

from weightsync import plan
from weightsync.errors import UnsupportedModelError
from weightsync.testing import perturb, save_checkpoint, tiny_model
from weightsync.trainer import tensors as stream


def checkpoint_names(model, tmp_path):
    save_checkpoint(model, tmp_path / "ck")
    names = set()
    for f in (tmp_path / "ck").glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            names |= set(h.keys())
    return names


def materialize(tensors, dtype=torch.float32):
    return {n: t for bucket in stream.buckets(tensors, dtype) for n, t in bucket}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_names_are_checkpoint_names(arch, tmp_path):
    model = tiny_model(arch)
    expected = checkpoint_names(model, tmp_path)
    plain = [t.name for t in stream.base_tensors(model, merge_lora=False)]
    assert set(plain) == expected and len(plain) == len(expected)
    peft = get_peft_model(
        model,
        LoraConfig(
            r=4,
            target_modules="all-linear",
            modules_to_save=["lm_head"] if arch == "llama" else None,
        ),
    )
    for merge in (False, True):
        names = [t.name for t in stream.base_tensors(peft, merge_lora=merge, expected=expected)]
        assert set(names) == expected, set(names) ^ expected
        assert not any(
            "lora_" in n or "base_layer" in n or "modules_to_save" in n or "original_module" in n
            for n in names
        )


def test_tied_head_sent_under_every_expected_name():
    model = tiny_model("qwen2")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    names = [t.name for t in stream.base_tensors(model, merge_lora=False)]
    assert "lm_head.weight" not in names
    expected = {t.name: t.shape for t in stream.base_tensors(model, merge_lora=False)}
    expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    both = {t.name: t for t in stream.base_tensors(model, merge_lora=False, expected=expected)}
    assert torch.equal(both["lm_head.weight"].produce(torch.float32), model.lm_head.weight)


LORA_SETUPS = {
    "all-linear+rslora+rank_pattern": (
        "qwen2",
        dict(
            r=8,
            lora_alpha=16,
            target_modules="all-linear",
            use_rslora=True,
            rank_pattern={"q_proj": 4},
        ),
    ),
    "embedding+attn": (
        "llama",
        dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj", "k_proj"]),
    ),
    "mlp+modules_to_save": (
        "llama",
        dict(
            r=16,
            lora_alpha=32,
            target_modules=["gate_proj", "up_proj", "down_proj"],
            modules_to_save=["lm_head"],
        ),
    ),
    "lora_bias": ("qwen2", dict(r=4, target_modules=["q_proj"], lora_bias=True)),
    "bias=all+alpha_pattern": (
        "qwen2",
        dict(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "v_proj"],
            alpha_pattern={"v_proj": 4},
            bias="all",
        ),
    ),
}


@pytest.mark.parametrize("setup", list(LORA_SETUPS))
def test_merged_equals_peft_merge_and_trainer_untouched(setup):
    arch, cfg = LORA_SETUPS[setup]
    model = get_peft_model(tiny_model(arch), LoraConfig(**cfg))
    perturb(model, seed=1, scale=0.2)  # lora_B starts at zero: make the delta real
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reference = copy.deepcopy(model).merge_and_unload().state_dict()

    ours = materialize(stream.base_tensors(model, merge_lora=True))

    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)
    merged_any = [t for t in stream.base_tensors(model, merge_lora=True) if t.merged]
    assert merged_any, "no tensor was merged"
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "trainer weights changed"


def test_gpt2_conv1d_fan_in_fan_out():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(
        GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=128, n_positions=64)
    ).eval()
    model = get_peft_model(
        base, LoraConfig(r=4, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    )
    perturb(model, seed=2, scale=0.2)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    ours = materialize(stream.base_tensors(model, merge_lora=True))
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)


def test_bf16_merge_is_fp32_cast_once():
    model = get_peft_model(
        tiny_model("llama", dtype=torch.bfloat16), LoraConfig(r=8, target_modules=["q_proj"])
    )
    perturb(model, seed=3, scale=0.2)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    w = layer.base_layer.weight.float()
    want = (
        w
        + layer.scaling["default"]
        * (layer.lora_B["default"].weight.float() @ layer.lora_A["default"].weight.float())
    ).to(torch.bfloat16)
    got = materialize(stream.base_tensors(model, merge_lora=True), torch.bfloat16)[
        "model.layers.0.self_attn.q_proj.weight"
    ]
    assert torch.equal(got, want)


def test_dora_merge_refused():
    model = get_peft_model(
        tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)
    )
    with pytest.raises(UnsupportedModelError, match="DoRA"):
        materialize(stream.base_tensors(model, merge_lora=True))
    with pytest.raises(UnsupportedModelError, match="DoRA"):
        stream.adapter(model)


def test_buckets_bound_size_and_keep_order():
    model = tiny_model("llama")
    tensors = stream.base_tensors(model, merge_lora=False)
    limit = 200_000
    seen = []
    for bucket in stream.buckets(tensors, torch.float32, limit):
        size = sum(t.numel() * 4 for _, t in bucket)
        assert size <= limit or len(bucket) == 1
        seen += [n for n, _ in bucket]
    assert seen == [t.name for t in tensors]
    assert plan.nbytes(tensors, torch.float32) == sum(p.numel() * 4 for p in model.parameters())
    with pytest.raises(ValueError, match="bucket_bytes"):
        next(stream.buckets(tensors, torch.float32, 0))


def test_dense_same_dtype_shares_memory():
    model = tiny_model("llama")
    t = stream.base_tensors(model, merge_lora=False)[0]
    assert t.produce(torch.float32).data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_adapter_payload():
    model = get_peft_model(
        tiny_model("llama"),
        LoraConfig(
            r=8,
            target_modules=["q_proj", "v_proj"],
            rank_pattern={"v_proj": 12},
            modules_to_save=["lm_head"],
        ),
    )
    a = stream.adapter(model)
    assert a.rank == 12
    assert a.config["modules_to_save"] is None
    assert all(".lora_A." in k or ".lora_B." in k for k in a.tensors)
    assert len(a.tensors) == 2 * 2 * 2  # 2 layers x 2 modules x (A, B)
    assert [t.name for t in stream.trained_copies(model)] == ["lm_head.weight"]
    with pytest.raises(UnsupportedModelError, match="PeftModel"):
        stream.adapter(tiny_model("llama"))


def test_lora_on_one_name_of_a_tied_tensor():
    # LoRA on embed_tokens of a tied model changes the embedding but not the lm_head that
    # shares its base weight: an engine holding both names gets each its own tensor, an engine
    # that ties them cannot represent the trainer, and is told so.
    model = get_peft_model(tiny_model("qwen2"), LoraConfig(r=4, target_modules=["embed_tokens"]))
    perturb(model, seed=4, scale=0.2)
    untied = {"model.embed_tokens.weight": None, "lm_head.weight": None}
    tensors = {t.name: t for t in stream.base_tensors(model, merge_lora=True, expected=untied)}
    inner = model.get_base_model()
    assert torch.equal(tensors["lm_head.weight"].produce(torch.float32), inner.lm_head.weight)
    assert tensors["model.embed_tokens.weight"].merged
    with pytest.raises(UnsupportedModelError, match="tied"):
        stream.base_tensors(model, merge_lora=True, expected={"model.embed_tokens.weight": None})


@pytest.mark.parametrize("setup", list(LORA_SETUPS))
def test_adapter_tensors_match_peft_state_dict(setup):
    from peft import get_peft_model_state_dict

    arch, cfg = LORA_SETUPS[setup]
    model = get_peft_model(tiny_model(arch), LoraConfig(**cfg))
    perturb(model, seed=5, scale=0.2)
    if cfg.get("lora_bias") or cfg.get("bias", "none") != "none":  # merged exactly, not served
        with pytest.raises(UnsupportedModelError, match="bias"):
            stream.adapter(model)
        return
    reference = {k: v for k, v in get_peft_model_state_dict(model).items() if ".lora_" in k}
    ours = stream.adapter(model).tensors
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[k], reference[k]) for k in ours)
    perturb(model, seed=6, scale=0.2)  # an optimizer step after the first call is seen
    again = stream.adapter(model).tensors
    fresh = {k: v for k, v in get_peft_model_state_dict(model).items() if ".lora_" in k}
    assert all(torch.equal(again[k], fresh[k]) for k in again)


@pytest.mark.parametrize("held", [torch.float32, torch.bfloat16, torch.float16])
def test_values_check_finds_every_non_finite_and_what_the_cast_overflows(held):
    """`values.check_plan` without an engine: one bad value anywhere is found, in every dtype
    the trainer holds (16-bit ones are read through their bits); a finite value the engine's
    dtype cannot hold is refused; a merged weight whose bound overflows is produced and
    checked exactly."""
    from weightsync.errors import BadValuesError
    from weightsync.trainer.values import check_plan

    def planned(model, dtype, merge=False):
        weights = tuple(stream.base_tensors(model, merge_lora=merge))
        return plan.Plan(strategy="t", reason="t", engine="t", dtype=dtype, weights=weights)

    model = tiny_model("llama", dtype=held)
    check_plan(planned(model, torch.float16))  # a fresh model: nothing to refuse
    p = model.model.layers[1].mlp.up_proj.weight
    for value, found in ((float("nan"), "1 NaN and 0 inf"), (float("-inf"), "0 NaN and 1 inf")):
        with torch.no_grad():
            saved = p.view(-1)[-1].item()
            p.view(-1)[-1] = value
        with pytest.raises(BadValuesError, match=rf"layers\.1\.mlp\.up_proj\.weight holds {found}"):
            check_plan(planned(model, held))
        with torch.no_grad():
            p.view(-1)[-1] = saved
    if held != torch.float16:
        with torch.no_grad():
            p.view(-1)[7] = -7e4  # finite here, inf in float16
        with pytest.raises(BadValuesError, match=r"up_proj\.weight: .* magnitude 7(\.\d+)?e\+04"):
            check_plan(planned(model, torch.float16))
        check_plan(planned(model, held))
    lora = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["down_proj"]))
    down = lora.base_model.model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        down.lora_B["default"].weight.fill_(300.0)
        down.lora_A["default"].weight.fill_(300.0)  # bound 4*300*300: beyond float16
    with pytest.raises(BadValuesError, match=r"layers\.0\.mlp\.down_proj\.weight: computed"):
        check_plan(planned(lora, torch.float16, merge=True))
    check_plan(planned(lora, torch.float32, merge=True))  # the same merge fits float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_tensors_peak_is_read_exactly_from_its_bits(dtype):
    """The value check reads a 16-bit float's magnitude bits a chunk at a time: its peak is
    max |t| exactly, wherever it sits (in the last chunk, past a chunk's end), and any NaN or
    inf, of either sign, anywhere, reads as NaN."""
    from weightsync.trainer.values import _CHUNK, _largest

    g = torch.Generator().manual_seed(0)
    t = torch.randn(_CHUNK + 3, generator=g).to(dtype)
    t[_CHUNK + 1] = -9.5  # the peak, negative, past the first chunk
    assert _largest(t) == 9.5 == float(t.float().abs().max())
    assert _largest(t[::2]) == float(t[::2].float().abs().max())  # strided: made contiguous
    for at in (0, 5, _CHUNK, _CHUNK + 2):
        for bad in (float("nan"), float("inf"), float("-inf"), -float("nan")):
            u = t.clone()
            u[at] = bad
            assert math.isnan(_largest(u)), (at, bad)


@pytest.mark.parametrize("held", [torch.float32, torch.bfloat16, torch.float16])
def test_the_adapters_one_pass_check_never_passes_a_bad_factor(held):
    """An adapter's factors are checked by one fused 2-norm per dtype (`values._all_fit`);
    whatever that test cannot vouch for goes to the exact check, which names the factor: a
    NaN, +inf and -inf in one factor (a sum would cancel them), squares that overflow float32
    although every value is finite (fooling the norm: the exact check then accepts what fits),
    a value the engine's dtype cannot hold, a factor without data."""
    from weightsync.errors import BadValuesError
    from weightsync.trainer.values import _all_fit, check_plan

    model = get_peft_model(
        tiny_model("llama", dtype=held), LoraConfig(r=4, target_modules=["q_proj", "down_proj"])
    )
    perturb(model, seed=1)
    factor = model.base_model.model.model.layers[1].mlp.down_proj.lora_B["default"].weight
    key = r"adapter 'default' tensor .*layers\.1\.mlp\.down_proj\.lora_B\.weight"

    def planned(dtype=held):
        served = stream.adapter(model)
        p = plan.Plan(strategy="t", reason="t", engine="t", dtype=dtype, adapter=served)
        return p, list(served.tensors.values())

    def poisoned(values, dtype=held):
        saved = factor.detach().clone()
        with torch.no_grad():
            factor.view(-1)[: len(values)] = torch.tensor(values, dtype=factor.dtype)
        try:
            p, tensors = planned(dtype)
            assert not _all_fit(tensors, dtype)
            check_plan(p)
        finally:
            with torch.no_grad():
                factor.copy_(saved)

    p, tensors = planned()
    assert _all_fit(tensors, held)  # a healthy adapter: the one pass decides
    check_plan(p)
    inf = float("inf")
    for values, found in (([float("nan")], "1 NaN and 0 inf"), ([inf, -inf], "0 NaN and 2 inf")):
        with pytest.raises(BadValuesError, match=rf"{key} holds {found}"):
            poisoned(values)
    big = torch.finfo(held).max / 2  # its square is beyond float32 (but for float16)
    poisoned([big, -big, big])  # every value finite and held: accepted by the exact check
    if held != torch.float16:
        with pytest.raises(BadValuesError, match=rf"{key} holds a value of magnitude"):
            poisoned([big], dtype=torch.float16)  # beyond float16
    with torch.no_grad():
        model.base_model.model.model.layers[0].self_attn.q_proj.lora_A[
            "default"
        ].weight = torch.nn.Parameter(torch.empty(4, 64, device="meta", dtype=held))
    with pytest.raises(BadValuesError, match=r"q_proj\.lora_A\.weight is on the meta device"):
        check_plan(planned()[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_what_fits_a_dtype_is_what_torch_casts_finite(dtype):
    """The values check decides "fits the engine's dtype" by arithmetic, not a cast per tensor:
    it must agree with torch's own cast (from float64 and from float32, as trainer tensors are
    cast) at the edge of overflow, where a 16-bit cast rounds through float32."""
    import math
    import random

    from weightsync.trainer.values import _fits

    def finite(value, via):
        cast = torch.tensor([value], dtype=torch.float64).to(via).to(dtype)
        return bool(torch.isfinite(cast).all())

    top = torch.finfo(dtype).max
    lo, hi = top, top * 2  # torch's own edge, by bisection: finite at lo, inf at hi
    while math.nextafter(lo, hi) < hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if finite(mid, torch.float64) else (lo, mid)
    rng = random.Random(0)
    near = [top * (1 + rng.uniform(-1e-2, 1e-2)) for _ in range(1000)]
    near += [hi * (1 + rng.uniform(-1e-6, 1e-6)) for _ in range(2000)]
    edges = [0.0, 1.0, top, lo, hi, math.nextafter(top, math.inf), math.inf, math.nan]
    for value in near + edges:
        for via in (torch.float64, torch.float32):
            assert _fits(value, dtype) == finite(value, via), (value, via)


def test_a_persistent_buffer_the_engine_loads_is_sent_as_a_frozen_weight():
    """GLM-4-MoE's router keeps ``e_score_correction_bias`` as a persistent buffer (float32 in a
    bfloat16 model, as ``from_pretrained`` loads it), which the engine loads. It is sent in
    float32 from the trainer's memory, keyed by content like a frozen weight, checked for
    values, and found by the adapter's base proof; a buffer the engine does not load is not
    sent, nor is a non-persistent one (``rotary_emb.inv_freq``)."""
    from conftest import moe_model

    from weightsync.errors import BadValuesError
    from weightsync.strategies.proof import unmerged_base
    from weightsync.trainer.values import check_plan
    from weightsync.wire.checkpoint_names import checkpoint_shapes

    model = moe_model("glm4_moe").to(torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    gate.e_score_correction_bias = torch.randn(4, dtype=torch.float64).float()  # not bf16-exact
    bias = gate.e_score_correction_bias
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    expected = checkpoint_shapes(model)
    assert name in expected and not any("inv_freq" in n for n in expected)
    assert any("inv_freq" in n for n, _ in model.named_buffers())
    tensors = stream.base_tensors(model, merge_lora=False, expected=expected)
    assert [t.name for t in tensors if "e_score" in t.name] == [name]
    assert {t.name for t in tensors} == set(expected) and len(tensors) == len(expected)
    (sent,) = [t for t in tensors if t.name == name]
    assert plan.content_key(sent) is not None  # frozen: skipped when unchanged, like a weight
    value = materialize(tensors, torch.bfloat16)[name]
    assert value.dtype == torch.float32 and torch.equal(value, bias)
    assert value.data_ptr() == bias.data_ptr()  # read in place, not copied
    # an engine that does not load it: neither sent nor missed
    without = {n: s for n, s in expected.items() if n != name}
    names = [t.name for t in stream.base_tensors(model, merge_lora=False, expected=without)]
    assert set(names) == set(without)
    # the values check reads it like any weight
    with torch.no_grad():
        bias[2] = float("nan")
    planned = plan.Plan(
        strategy="t", reason="t", engine="t", dtype=torch.bfloat16, weights=tuple(tensors)
    )
    with pytest.raises(BadValuesError, match=r"gate\.e_score_correction_bias holds 1 NaN"):
        check_plan(planned)

    class Contract:  # what the adapter's base proof reads of an engine
        expected_weights = expected

    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
    base = dict(unmerged_base(peft, Contract(), set()))  # type: ignore[arg-type]
    assert base[name] is bias
