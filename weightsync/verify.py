"""Verification after a sync: does the engine now compute what the trainer computes?

The engine scores two fixed canary prompts (vLLM prompt logprobs: one prefill, no decoding),
reporting at each position the logprob of the prompt's next token and of its own top 8; the
trainer scores the same prompts in one forward pass. Two statistics of ``|engine - trainer|``
must stay within the engine dtype's tolerance (`TOLERANCE`): the **mean**, which sees a small
error that touches every position (a one-step-stale tied ``lm_head`` in bfloat16), and the
**largest**, which sees a large error at a few positions. Any NaN fails. Distributions over many
positions rather than a few greedy tokens, because rounding noise averages out over positions
while a weight left behind does not. Quantized engines: the trainer's side is computed as the
engine computes it (`reference_logprobs`, docs/quantized.md).

How the tolerances were set, what stays below them, and what a check costs:
docs/failure-modes.md ("Verification: what it sees", "Cost of verification").
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .engines.base import Engine
from .errors import EngineAsleepError, VerificationError
from .trainer import quantize
from .trainer.tensors import DEFAULT_BUCKET_BYTES, base_tensors, inner_model, is_peft
from .wire import format as fmt

CANARY_LENGTH = 64
CANARY_PROMPTS = 2
TOP_K = 8


@dataclass(frozen=True)
class Tolerance:
    """Bounds on ``|engine logprob - trainer logprob|`` over the canary positions."""

    mean: float
    max: float


# Engines and trainers run different kernels, and a half-precision engine rounds every weight
# and activation: the bounds sit between a correct sync and a one-step-stale tied head, as
# measured (module docstring, docs/failure-modes.md). float16 has 3 more mantissa bits than
# bfloat16; its band is measured too.
TOLERANCE: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(mean=1e-3, max=1e-2),
    torch.bfloat16: Tolerance(mean=0.12, max=2.0),
    torch.float16: Tolerance(mean=0.03, max=0.5),
}


#: Quantized bfloat16 engines, by the arithmetic they run (`weightsync.trainer.quantize.arithmetic`:
#: a scheme of ``SCHEMES``, vLLM's online ``fp8_per_channel`` being "FP8 per-channel", or a
#: torchao config), for the engine-like reference (`reference_logprobs`); other weight-only
#: schemes use the dtype's (`tolerance_for`). Measured like the
#: dtypes (``python -m benchmarks.verification --quantization fp8_per_channel "W8A8-INT8
#: per-channel" "FP8 per-channel" "W4A16 group 32" --seeds 5 --trainer-dtypes bfloat16``, tiny
#: tied Qwen2; docs/quantized.md has the table), mean |d logprob| of a correct sync / of the
#: smallest one-step-stale case (the last ``down_proj`` left out): FP8 per channel, online or
#: pre-quantized (the same numbers: the same arithmetic) 0.071-0.077 / 0.139-0.147; W8A8-INT8
#: 0.030-0.033 / 0.116-0.124. A correct FP8 sync of tests/test_quantized_vllm.py's LoRA-merged
#: model (larger weights) scores 0.104, so the FP8 band is narrow: 0.13 is 1.25x above the
#: largest correct mean seen and 1.07x below the smallest stale one. One flipped e4m3 rounding is
#: a 6% change of an activation, so the kernels' bf16 differences that cost 0.012 on a bf16
#: engine cost more here, and how much depends on the weights: on FP8 engines verification is a
#: coarse check (garbage and a stale head score 6-7 and 0.19); a larger model may need
#: ``tolerance=`` (measure a correct sync, take ~1.3x).
#: torchao (``--quantization torchao:Float8WeightOnlyConfig
#: torchao:Int8DynamicActivationInt8WeightConfig``; the reference runs torchao's own code):
#: Int8DynamicActivationInt8Weight 0.033-0.035 / 0.114-0.124, as W8A8-INT8 above (8-bit
#: activations: kernel rounding flips grid roundings); Float8WeightOnly 0.012-0.013 (a bf16
#: engine's noise) / 0.116-0.123: weight-only, but the bf16 tolerance (0.12) passed 3 of 5 stale
#: ``down_proj`` (a step partly lost in e4m3's rounding), so it gets the 0.06 of the 8-bit schemes
#: -- which a large model's bf16 noise (0.08 at 0.5B, module docstring) may exceed: there pass
#: ``tolerance=`` measured on that model.
#: The same engines serving LoRA (``--lora``; `reference_logprobs` adds the adapter as vLLM does)
#: score as without it, so they share these: correct / stale ``down_proj`` / skipped adapter
#: sync, FP8 0.074-0.081 / 0.132-0.150 / 0.31-0.37, W4A16 0.014-0.017 / 0.126-0.142 / 0.29-0.33,
#: torchao int8 dynamic 0.034-0.036 / 0.109-0.123 / 0.30-0.35 (an adapter far larger than the
#: base hides a stale base weight: docs/quantized.md).
QUANTIZED_TOLERANCE: dict[str, Tolerance] = {
    "FP8 per-channel": Tolerance(mean=0.13, max=2.0),
    "W8A8-INT8 per-channel": Tolerance(mean=0.06, max=2.0),
    "torchao Int8DynamicActivationInt8WeightConfig": Tolerance(mean=0.06, max=2.0),
    "torchao Float8WeightOnlyConfig": Tolerance(mean=0.06, max=2.0),
}

#: Schemes whose CPU kernels compute as the reference only on some instruction sets, and those
#: sets (torch's names, by prefix). vLLM-CPU's oneDNN int8 GEMM on an AVX2-only CPU rounds
#: differently from the exact int32 product the reference computes: a correct sync of the tests'
#: model scored 0.35 there against the tolerance of 0.06 (docs/quantized.md).
MEASURED_ON_CPU: dict[str, tuple[str, ...]] = {"W8A8-INT8 per-channel": ("AVX512", "AMX")}


def tolerance_for(engine: Engine) -> Tolerance:
    """The tolerance `check_engine` applies to ``engine`` by default: its quantization's, else
    its dtype's.

    Raises:
        VerificationError: the engine quantizes in a way no tolerance was measured for (the
            bf16 one would fail correct syncs, a looser guess could pass stale ones); pass
            ``tolerance=`` measured as ``benchmarks/verification.py`` does.
    """
    q = engine.facts.quantized
    if q is None or (q.method == "none" and q.kv_cache == "auto"):
        return TOLERANCE.get(engine.dtype, TOLERANCE[torch.bfloat16])
    # An fp8 KV cache (weights unquantized) has no tolerance, by measurement
    # (``--kv-cache-dtype fp8``; docs/quantized.md): a correct sync scores 0.080-0.090 on the
    # benchmark's tiny model but 0.154 on tests/test_quantized_vllm.py's LoRA-merged one (larger
    # activations, more e4m3 rounding of keys and values), a one-step-stale tied head 0.194-0.203:
    # no fixed bound holds both, and simulating the cache would mean rounding the rotated keys
    # inside attention.
    scheme = quantize.arithmetic(q)
    cpu = engine.facts.cpu
    if scheme is not None and cpu and not cpu.startswith(MEASURED_ON_CPU.get(scheme.name, (cpu,))):
        raise VerificationError(
            f"cannot verify this engine: its {scheme.name} kernels on this CPU ({cpu}) do not "
            "compute as weightsync's reference does (measured only on "
            f"{'/'.join(MEASURED_ON_CPU[scheme.name])} CPUs); pass tolerance= from a "
            "measurement of correct and stale syncs on this CPU (python -m "
            "benchmarks.verification --quantization ...)"
        )
    if q.kv_cache == "auto" and scheme is not None and scheme.name in QUANTIZED_TOLERANCE:
        return QUANTIZED_TOLERANCE[scheme.name]
    if q.kv_cache == "auto" and scheme is not None and scheme.weight_only:
        # weight-only: the engine-like reference is exact up to kernel rounding, as for an
        # unquantized engine (W4A16 group 32: correct 0.014-0.015, stale down_proj 0.14-0.145)
        return TOLERANCE.get(engine.dtype, TOLERANCE[torch.bfloat16])
    raise VerificationError(
        "no verification tolerance is measured for this engine's quantization "
        f"({quantize.named(q)}); measured: {sorted(QUANTIZED_TOLERANCE)} with a model-dtype KV "
        "cache. Pass tolerance= from a "
        "measurement of correct and stale syncs (python -m benchmarks.verification "
        "--quantization ...)."
    )


def reference_logprobs(
    model: nn.Module, engine: Engine, prompts: list[list[int]], *, strict: bool = True
) -> list[torch.Tensor]:
    """What ``engine`` should give ``prompts`` if it serves ``model``: the trainer's logprobs
    (`trainer_prompt_logprobs`), computed, for a quantized engine, as that engine computes them.

    Why: an 8-bit engine rounds every weight (and, W8A8, every activation), so a correct sync
    scores far from the bf16 trainer -- and how far depends on the weights (0.14 on one tiny
    model, 0.27 on a LoRA-merged one, both FP8), too far for a fixed tolerance to separate from a
    one-step-stale weight. Run through the engine's arithmetic
    (`weightsync.trainer.quantize.simulated`: the weight the engine received quantized in its
    scheme, each input quantized per token for a W8A8 scheme), the trainer is as close to a
    correct weight-only (W4A16) engine as a bf16 trainer to a bf16 engine, and about half as far
    from a W8A8 one as before (docs/quantized.md). Cost: each quantized weight is produced
    (merged, cast, quantized) again for each canary prompt's forward pass.

    Args:
        strict: raise when the engine's quantization cannot be simulated; False returns the
            plain trainer's logprobs then (for a caller that measured its own tolerance).

    Raises:
        VerificationError: (``strict``) the engine quantizes in a way weightsync does not
            simulate (an unknown method, a stock server that does not say which modules, an
            fp8 KV cache beside quantized weights).
    """
    q = engine.facts.quantized
    if q is None or q.method == "none":
        # Unquantized weights -- the trainer as it is. With an fp8 KV cache its rounding is not
        # simulated: `tolerance_for` refuses it, a caller's measured ``tolerance=`` holds it.
        return trainer_prompt_logprobs(model, prompts)
    scheme = quantize.arithmetic(q)
    modules = set(q.modules) or quantize.quantized_modules(engine.expected_weights)
    if scheme is None or not modules or q.kv_cache != "auto":
        if not strict:
            return trainer_prompt_logprobs(model, prompts)
        raise VerificationError(
            f"cannot verify this engine: it quantizes ({quantize.named(q)}) in a way weightsync "
            "does not simulate on the trainer side (known: "
            f"{sorted(quantize.SCHEMES)}, online {sorted(quantize.ONLINE)}, online torchao "
            f"{sorted(quantize.TORCHAO)} at their defaults with torchao installed beside the "
            "trainer; a model-dtype KV cache, the quantized modules reported by the engine's "
            "workers); "
            "use check_engine(..., tolerance=...) measured as benchmarks/verification.py does"
        )
    peft = is_peft(model)
    # An engine serving LoRA holds the base unmerged and adds the adapter at run time, on the
    # layer's unquantized input (vLLM's LoRA layers: ``quant_method.apply`` of the base, then
    # punica's shrink in float32 and expand in the engine's dtype, added to the base's output),
    # as PEFT computes ``base_layer(x) + scale * B(A(x))``: the hooks replace the base layers'
    # output, PEFT adds its LoRA term in the model's dtype. An engine not serving LoRA holds
    # the merged weight, quantized: the hooks use it, and PEFT's adapters must not add again.
    served = peft and engine.serves_lora
    weights = {
        t.name.removesuffix(".weight"): t
        for t in base_tensors(
            model, merge_lora=peft and not served, expected=engine.expected_weights
        )
        if t.name.endswith(".weight") and t.name.removesuffix(".weight") in modules
    }
    inner = inner_model(model)
    peft_model: Any = model  # a peft.PeftModel when peft (untyped)
    off = peft_model.disable_adapter() if peft and not served else contextlib.nullcontext()
    with off, quantize.simulated(inner, scheme, weights, engine.dtype):
        return trainer_prompt_logprobs(inner, prompts)


def canary_prompt(vocab_size: int, length: int = CANARY_LENGTH, index: int = 0) -> list[int]:
    """A fixed prompt of valid token ids for any vocabulary (distinct ids within a prompt)."""
    return [(7919 * i + 17 + 104729 * index) % vocab_size for i in range(length)]


def canary_prompts(vocab_size: int) -> list[list[int]]:
    """The prompts `check_engine` scores."""
    return [canary_prompt(vocab_size, CANARY_LENGTH, j) for j in range(CANARY_PROMPTS)]


@torch.no_grad()
def trainer_logprobs(model: nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """Logprob the trainer gives each of ``tokens`` after ``prompt`` (eval mode, no dropout)."""
    lp = trainer_prompt_logprobs(model, [prompt + tokens])[0]
    start = len(prompt) - 1
    return [lp[start + i, tok].item() for i, tok in enumerate(tokens)]


@torch.no_grad()
def trainer_prompt_logprobs(model: nn.Module, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, the trainer's float32 next-token logprobs at every position (shape
    ``(len(prompt), vocab)``), one forward pass per prompt, in eval mode."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        out = []
        for p in prompts:
            logits = model(input_ids=torch.tensor([p], device=device)).logits[0].float()
            out.append(torch.log_softmax(logits, dim=-1).cpu())
        return out
    finally:
        model.train(was_training)


def max_abs_diff(a: list[float], b: list[float]) -> float:
    """Largest ``|a[i] - b[i]|``, NaN if any difference is NaN (a bare ``max`` skips a NaN
    that is not first, so NaN logprobs from a broken engine would pass)."""
    diffs = [abs(x - y) for x, y in zip(a, b, strict=False)]
    return float("nan") if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)


def score_diffs(
    engine_scores: list[list[dict[int, float]]], trainer: list[torch.Tensor]
) -> tuple[float, float]:
    """(mean, largest) ``|engine - trainer|`` over every position and token the engine scored;
    (NaN, NaN) if any difference is NaN, wherever it is.

    ``engine_scores`` is `Engine.score_batch`'s answer; ``trainer`` is
    `trainer_prompt_logprobs` of the same prompts (row ``i`` predicts token ``i + 1``).
    """
    diffs = [
        abs(value - lp[i, token].item())
        for positions, lp in zip(engine_scores, trainer, strict=True)
        for i, scored in enumerate(positions)
        for token, value in scored.items()
    ]
    if not diffs or any(math.isnan(d) for d in diffs):
        return float("nan"), float("nan")
    return sum(diffs) / len(diffs), max(diffs)


def canary_gap(model: nn.Module, engine: Engine, *, strict: bool = True) -> tuple[float, float]:
    """(mean, largest) ``|engine - trainer|`` on the canary prompts: the two statistics
    `check_engine` holds against the tolerance (`score_diffs` of the engine's scores and
    `reference_logprobs`; ``strict`` as there). For a caller that reports the figures whether
    or not they pass (``python -m weightsync.selfcheck``); the engine's KV cache must be awake.
    """
    peft_or_plain: Any = model  # a transformers model, or a peft.PeftModel around one
    config = getattr(model, "config", None) or peft_or_plain.get_base_model().config
    prompts = canary_prompts(config.vocab_size)
    return score_diffs(
        engine.score_batch(prompts, TOP_K),
        reference_logprobs(model, engine, prompts, strict=strict),
    )


#: Bound on ``|engine after weightsync's sync - the same engine after vLLM's own load of the
#: trainer's checkpoint|`` over the canary (`own_load_gap`): the same kernels on the same weights
#: score the same, so this sees a layout fault and no rounding. Measured bitwise equal (0.0) on
#: bfloat16 Falcon-H1 and GraniteMoeHybrid engines whose trainer gap is 0.33 and 1.35
#: (docs/failure-modes.md); a forged permutation of one weight scores far above it.
SAME_WEIGHTS = Tolerance(mean=1e-4, max=1e-3)


def compare_scores(
    a: list[list[dict[int, float]]], b: list[list[dict[int, float]]]
) -> tuple[float, float]:
    """(mean, largest) ``|a - b|`` of two `Engine.score_batch` answers on the same prompts,
    over the tokens both scored at each position; (NaN, NaN) on a NaN or nothing in common."""
    diffs = [
        abs(value - theirs[token])
        for ours_p, theirs_p in zip(a, b, strict=True)
        for ours, theirs in zip(ours_p, theirs_p, strict=True)
        for token, value in ours.items()
        if token in theirs
    ]
    if not diffs or any(math.isnan(d) for d in diffs):
        return float("nan"), float("nan")
    return sum(diffs) / len(diffs), max(diffs)


def in_buckets(
    pairs: Iterable[tuple[str, torch.Tensor]], limit: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``pairs`` in lists of about ``limit`` bytes (one tensor more than fits ends a list)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in pairs:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= limit:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def own_load_gap(model: nn.Module, engine: Engine) -> tuple[float, float]:
    """(mean, largest) difference between what ``engine`` scores on the canary prompts now and
    what it scores after vLLM loads ``model``'s checkpoint as transformers writes it.

    ``model.save_pretrained`` (the format vLLM's loaders are written for, produced by
    transformers' code, not by weightsync's stream) into a temporary folder; its tensors, as
    stored (a tied tensor also under the names the checkpoint leaves out, as
    `Engine.reload_checkpoint` sends them), go to `Engine.load_weights`: vLLM's own
    ``load_weights`` of checkpoint names, through whatever carries the engine's writes, so an
    engine on another host or in a Ray actor is reached as its syncs are. Not the engine's
    reload of the folder: vLLM repoints its ``model_config.model`` at any folder it reloads
    from, which would leave the engine naming a deleted folder. The engine then holds that
    load: the caller writes its sync again, or marks the engine lost.
    """
    transformers_model: Any = model  # a transformers PreTrainedModel (untyped)
    prompts = canary_prompts(transformers_model.config.vocab_size)
    synced = engine.score_batch(prompts, TOP_K)
    with tempfile.TemporaryDirectory(prefix="weightsync-own-load-") as folder:
        transformers_model.save_pretrained(folder, safe_serialization=True)
        files = sorted(str(f) for f in Path(folder).glob("*.safetensors"))
        stored = set(fmt.shapes(files))
        twins: dict[str, list[str]] = {}
        for group in engine.shared_weights:
            kept = [name for name in group if name in stored]
            if kept:
                twins.setdefault(kept[0], []).extend(n for n in group if n not in stored)
        engine.load_weights(in_buckets(fmt.read(files, twins), DEFAULT_BUCKET_BYTES))
    return compare_scores(synced, engine.score_batch(prompts, TOP_K))


def check_engine(
    model: nn.Module,
    engine: Engine,
    *,
    strategy: str,
    step: int | None = None,
    tolerance: Tolerance | None = None,
) -> float:
    """Compare engine and trainer on the canary prompts; return the mean logprob difference.

    Raises:
        VerificationError: the mean or the largest difference from `reference_logprobs` is
            above ``tolerance`` (default: `tolerance_for` the engine: by its dtype, or by its
            quantization), or a logprob is NaN; or the engine's quantization is not simulated
            and no ``tolerance`` was given.
        EngineAsleepError: the engine's KV cache is asleep, so it cannot generate (vLLM keeps
            its scheduler paused until every tag is awake: the canary would wait forever).
    """
    if "kv_cache" in engine.asleep:
        raise EngineAsleepError(
            f"{strategy}: cannot verify while the engine's KV cache is asleep (vLLM's scheduler "
            "stays paused until every tag is awake, so the canary would never run); call "
            "wake_up(tags=['kv_cache']) before verifying. With the trl#5142 order (wake "
            "'weights', sync, wake 'kv_cache') sync without verify and call check_engine after."
        )
    limit = tolerance or tolerance_for(engine)
    mean, largest = canary_gap(model, engine, strict=tolerance is None)
    if not (mean <= limit.mean and largest <= limit.max):  # NaN fails too
        # The engine does not serve what was sent: keep no record of it, so that the next sync
        # restores every weight instead of skipping the ones it believes unchanged.
        engine.mark_lost()
        at = f" at step {step}" if step is not None else ""
        raise VerificationError(
            f"{strategy}{at}: the engine's logprobs on the canary prompts differ from the "
            f"trainer's by {mean:.4g} on average and up to {largest:.4g} (tolerance {limit.mean:g} "
            f"and {limit.max:g} for {engine.dtype}{engine.quantized}); the engine is not serving "
            "the trainer's weights. The next sync should resend everything.",
            mean=mean,
            largest=largest,
        )
    return mean
