"""FullSync's peak extra memory against its bound: one bucket + the largest tensor + 10%, at the
run's model size (from its merged-LoRA row) and at a second size (`memory_check`)."""

from __future__ import annotations

import functools
import gc
import math
from collections.abc import Callable
from typing import Any

import torch

from weightsync import FullSync
from weightsync.engines import VLLMEngine
from weightsync.testing import make_llm
from weightsync.trainer.tensors import DEFAULT_BUCKET_BYTES, base_tensors

from .measure import measure
from .models import load_trainer, resolve, with_adapters


def memory_bound(
    model: Any, engine: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> dict[str, int]:
    """The bound on FullSync(lora="merge")'s peak extra memory for ``model`` into ``engine``."""
    ts = base_tensors(model, merge_lora=True, expected=engine.expected_weights)
    itemsize = torch.empty((), dtype=engine.dtype).element_size()
    largest = max(itemsize * math.prod(t.shape) for t in ts)
    return {
        "bucket_bytes": bucket_bytes,
        "largest_tensor_bytes": largest,
        "bound_bytes": int(1.1 * (bucket_bytes + largest)),
        "model_bytes": sum(itemsize * math.prod(t.shape) for t in ts),
    }


def memory_check(
    shape_or_path: str,
    repeats: int,
    *,
    log: Callable[[str], None] = print,
    tick: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """FullSync(lora="merge") peak extra memory on another model size, against the bound."""
    spec = resolve(shape_or_path, log=log)
    peft = with_adapters(load_trainer(spec), [16])
    engine = VLLMEngine(make_llm(spec.checkpoint, dtype=spec.dtype_name))
    runs = measure(
        functools.partial(FullSync(lora="merge", skip_unchanged=False).sync, peft, engine),
        repeats,
        tick=tick,
    )
    out = {
        "model": spec.name,
        "params": spec.params,
        **memory_bound(peft, engine),
        **runs.summary(),
    }
    del engine, peft
    gc.collect()
    return out
