"""Verification after a sync: does the engine now compute what the trainer computes?

The engine greedy-decodes a few tokens from a fixed canary prompt; the trainer scores the same
tokens (teacher forcing). If the largest logprob difference passes a dtype-aware tolerance the
engine is not serving the trainer's weights: gibberish after a level-2 wake, a stale adapter, a
dropped lm_head. Cost: one short generation on the engine and one forward pass of the trainer
(measured in docs/failure-modes.md).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .engines.base import Engine
from .errors import EngineAsleepError, VerificationError

# Engines and trainers run different kernels, and a half-precision engine rounds every weight
# and activation. Measured on a tiny random Qwen2 (tests/test_dtypes_vllm.py): a correct float32
# engine differs by ~1e-5; a correct bfloat16 engine by up to 0.37 nats (fp32 or bf16 trainer),
# while a stale adapter differs by 5.5 and discarded weights by 8.9. float16 has 3 more mantissa
# bits than bfloat16, so its band is about 8x narrower.
TOLERANCE = {torch.float32: 1e-2, torch.bfloat16: 1.0, torch.float16: 0.25}


def canary_prompt(vocab_size: int, length: int = 8) -> list[int]:
    """A fixed prompt of valid token ids for any vocabulary."""
    return [(7919 * i + 17) % vocab_size for i in range(length)]


@torch.no_grad()
def trainer_logprobs(model: nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """Logprob the trainer gives each of ``tokens`` after ``prompt`` (eval mode, no dropout)."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        ids = torch.tensor([prompt + tokens], device=device)
        logits = model(input_ids=ids).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        start = len(prompt) - 1
        return [logprobs[start + i, tok].item() for i, tok in enumerate(tokens)]
    finally:
        model.train(was_training)


def max_abs_diff(a: list[float], b: list[float]) -> float:
    """Largest ``|a[i] - b[i]|``, NaN if any difference is NaN (a bare ``max`` skips a NaN
    that is not first, so NaN logprobs from a broken engine would pass)."""
    diffs = [abs(x - y) for x, y in zip(a, b)]
    return float("nan") if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)


def check_engine(
    model: nn.Module,
    engine: Engine,
    *,
    strategy: str,
    step: int | None = None,
    max_tokens: int = 8,
    tolerance: float | None = None,
) -> float:
    """Compare engine and trainer on the canary; return the largest logprob difference.

    Raises:
        VerificationError: the difference is above ``tolerance`` (default: by engine dtype).
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
    config = getattr(model, "config", None) or model.get_base_model().config
    prompt = canary_prompt(config.vocab_size)
    tokens, engine_lp = engine.greedy(prompt, max_tokens)
    ours = trainer_logprobs(model, prompt, tokens)
    diff = max_abs_diff(engine_lp, ours)
    limit = tolerance if tolerance is not None else TOLERANCE.get(engine.dtype, 1.0)
    if not diff <= limit:  # NaN fails too
        at = f" at step {step}" if step is not None else ""
        raise VerificationError(
            f"{strategy}{at}: the engine's logprobs on the canary prompt differ from the "
            f"trainer's by up to {diff:.4g} (tolerance {limit:g} for {engine.dtype}); the engine "
            "is not serving the trainer's weights. The next sync should resend everything."
        )
    return diff
