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
On a half-precision engine a failed canary is first compared with vLLM's own load of the same
weights (`check_after_sync`): vLLM's kernels may compute an architecture farther from
transformers' than the dtype's tolerance although the sync is exact (bfloat16 hybrids).
``verify=False`` (on `Syncer`, or a strategy's ``sync``) opts out explicitly; ``verify=True``
verifies every sync. docs/failure-modes.md lists what each architecture gave on vLLM-CPU.

A proof is per architecture and per quantization apart, not per pair: a quantized MoE engine
counts as proven when both its MoE architecture and its quantization are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

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
    rewrite: Callable[[], object] | None = None,
) -> float | None:
    """After a completed sync: verify it as ``verify`` asks; the mean canary difference, or
    None when nothing was checked.

    ``verify=True``: every sync (`check_engine`). ``False``: never. ``None`` (the default): the
    first sync of an `unproven` engine, once per engine record; a check that cannot run now
    (the engine's KV cache asleep: TRL's and ms-swift's sleep mode wake it only after the sync)
    is logged and left for the next sync; one that cannot run at all (a quantization no
    tolerance was measured for, a trainer forward vLLM broke in its process) is logged, not
    retried.

    A first-sync canary that fails on a half-precision engine is put to vLLM's own load of the
    trainer's checkpoint (`_computed_differently`): if weightsync's sync scores as that load
    does, the layout is right, the difference is vLLM's arithmetic for this architecture (logged,
    returned), and ``rewrite`` (the same sync, planned and written again) leaves the engine
    holding weightsync's write.

    Raises:
        UnprovenEngineError: (``None``) the first sync of an unproven engine does not
            reproduce the trainer, and (half precision) does not score as vLLM's own load of
            the trainer's checkpoint either; the base is marked lost.
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
        diff = _computed_differently(model, engine, err, why=why, rewrite=rewrite)
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


#: Engine dtypes whose kernels may round differently from transformers' by more than the
#: canary's tolerance on an exact sync (bfloat16 hybrids: docs/failure-modes.md): there a
#: failed first-sync canary is put to vLLM's own load of the same weights (`_computed_differently`).
#: In float32 every architecture vLLM computes as transformers does agrees to ~1e-6, so a failed
#: canary there is a real difference and raises.
HALF = (torch.bfloat16, torch.float16)


def _computed_differently(
    model: nn.Module,
    engine: Engine,
    failed: VerificationError,
    *,
    why: str,
    rewrite: Callable[[], object] | None,
) -> float:
    """The first-sync canary of an unproven engine failed (``failed``; the base is marked lost):
    tell "vLLM computes this architecture differently from transformers in this dtype" from
    "weightsync's sync wrote a wrong layout", where the engine's dtype allows the first.

    The engine's canary scores after weightsync's sync are compared with its scores after vLLM's
    own load of the trainer's checkpoint (`weightsync.verify.own_load_gap`). Within
    `weightsync.verify.SAME_WEIGHTS`, weightsync wrote what vLLM itself loads: ``rewrite`` writes
    the sync again (so the engine holds, and its record and version name, weightsync's write),
    the trainer gap is logged as the architecture's difference in this dtype, and returned.

    What this cannot see: a fault transformers' checkpoint format shares with weightsync's
    stream (both come from the model's conversion rules), or a vLLM model computing another
    function than transformers (vLLM-CPU's Ernie router ignoring its bias) -- a fresh engine on
    the trainer's checkpoint serves the same, and in half precision that is not told from
    rounding. Both still raise in float32.

    Raises:
        UnprovenEngineError: the two differ (a layout fault), the engine is float32, the
            comparison cannot run (a PEFT model, whose checkpoint would be its adapter; a
            quantized engine; no ``rewrite``) or fails (the engine refused the checkpoint's
            tensors). The base stays marked lost.
        Exception: whatever ``rewrite`` raises (the base is then unsynced, as after any failed
            write).
    """
    from .trainer.tensors import is_peft
    from .verify import SAME_WEIGHTS, own_load_gap

    arch = engine.facts.architecture

    def unproven_error(finding: str, cause: BaseException = failed) -> UnprovenEngineError:
        error = UnprovenEngineError(
            f"{arch}: weightsync has not proven this engine exact ({why}), so its first sync "
            f"was verified, and the engine does not serve the trainer's weights: {failed} "
            f"{finding} The base is marked lost: the next sync restores every weight. Nothing "
            "is skipped until a sync passes; please report it (docs/failure-modes.md).",
            architecture=arch,
        )
        error.__cause__ = cause
        return error

    q = engine.facts.quantized
    if engine.dtype not in HALF:
        cannot = "the engine is float32, where kernels agree with transformers to ~1e-6"
    elif is_peft(model):
        cannot = "the trainer is a PEFT model, whose save_pretrained writes its adapter only"
    elif q is not None and (q.method != "none" or q.kv_cache != "auto"):
        cannot = "the engine is quantized"
    elif rewrite is None:
        cannot = "the caller gave no way to write the sync again"
    else:
        cannot = ""
    if cannot or rewrite is None:
        raise unproven_error(
            "The layout weightsync sends may not be the one this vLLM loads for this "
            f"architecture (not compared with vLLM's own load: {cannot})."
        )
    try:
        mean, largest = own_load_gap(model, engine)
    except Exception as err:
        engine.mark_lost()  # a load that failed part-way leaves a mix
        raise unproven_error(
            "Comparing with vLLM's own load of the trainer's checkpoint failed "
            f"({type(err).__name__}: {err}).",
            err,
        ) from err
    if not (mean <= SAME_WEIGHTS.mean and largest <= SAME_WEIGHTS.max):  # NaN fails too
        engine.mark_lost()  # it holds vLLM's own load now, not a completed weightsync sync
        raise unproven_error(
            "vLLM's own load of the trainer's checkpoint (save_pretrained) into this engine "
            f"scores the canary differently from weightsync's sync (by {mean:.3g} on average, up "
            f"to {largest:.3g}; tolerance {SAME_WEIGHTS.mean:g} and {SAME_WEIGHTS.max:g}): the "
            "layout weightsync sends is not the one this vLLM loads for this architecture."
        )
    rewrite()
    logger.warning(
        "weightsync: %s (%s) computes other logprobs than the trainer's in %s: %s; "
        "weightsync's sync scores the canary as vLLM's own load of the trainer's checkpoint "
        "does (by %.3g on average, up to %.3g), so its layout is right and the difference is "
        "this vLLM's arithmetic for this architecture (a fresh engine on the trainer's "
        "checkpoint serves the same). The first sync passes; the synced weights are written "
        "again.",
        arch,
        why,
        engine.dtype,
        failed,
        mean,
        largest,
    )
    return failed.mean
