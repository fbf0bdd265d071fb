"""The drift figure: how far the trainer's bf16 base weights move after many LoRA-merged syncs,
weightsync's against the in-place merge + unmerge of ms-swift/TRL (`benchmarks.anchors`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from weightsync import FullSync
from weightsync.engines import VLLMEngine
from weightsync.testing import make_llm
from weightsync.verify import TOP_K, canary_prompts, score_diffs, trainer_prompt_logprobs

from . import anchors
from .models import load_trainer, resolve, with_adapters


@torch.no_grad()
def drift(
    cycles: int,
    *,
    shape: str = "tiny",
    engine: Any = None,
    log: Callable[[str], None] = print,
    tick: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Max |W - W_start| of the trainer's base weights after ``cycles`` LoRA-merged syncs in bf16.

    weightsync: a real FullSync(lora="merge") into a bf16 engine every cycle. Anchor: peft's
    merge_adapter() + unmerge_adapter() in place every cycle (its push is irrelevant to the
    trainer's weights, so it is left out to keep the loop fast).
    """
    spec = resolve(shape, dtype=torch.bfloat16, log=log)
    marks = sorted(
        {c for c in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, cycles) if c <= cycles}
    )
    result: dict[str, Any] = {
        "model": spec.name,
        "dtype": "bfloat16",
        "cycles": cycles,
        "lora_rank": 16,
        "marks": marks,
    }
    if engine is None:
        engine = VLLMEngine(make_llm(spec.checkpoint, dtype="bfloat16"))
    for who in ("weightsync", "anchor_inplace_merge"):
        peft = with_adapters(load_trainer(spec), [16])
        base = [p for n, p in peft.named_parameters() if ".lora_" not in n]
        start = [p.detach().clone() for p in base]
        curve = []
        t = time.perf_counter()
        for i in range(1, cycles + 1):
            if who == "weightsync":
                FullSync(lora="merge").sync(peft, engine)
            else:
                anchors.inplace_merge_cycle(peft)
            if i in marks:
                curve.append(
                    max(
                        float((p.float() - s.float()).abs().max())
                        for p, s in zip(base, start, strict=True)
                    )
                )
            tick()
        result[who] = {
            "max_abs_diff": curve[-1],
            "curve": curve,
            "seconds_per_cycle": (time.perf_counter() - t) / cycles,
        }
        if who == "weightsync":
            result[who]["engine_check_logprob_diff"] = _engine_diff(peft, engine)
    return result


def _engine_diff(model: Any, engine: Any) -> float:
    """verify.check_engine's mean |d logprob| of ``engine`` against ``model``."""
    prompts = canary_prompts(model.get_base_model().config.vocab_size)
    return score_diffs(engine.score_batch(prompts, TOP_K), trainer_prompt_logprobs(model, prompts))[
        0
    ]
