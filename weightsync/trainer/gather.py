"""The whole of a trainer tensor, wherever its shards are.

A sharded parameter (an FSDP2 ``DTensor``) is gathered with ``full_tensor()``: a collective every
rank must make, in the same order (`weightsync.distributed` sees to that). Every place the trainer
side reads a parameter's values goes through `full`, and every merge through `summed`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def full(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: gathered if it is sharded, itself otherwise."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def is_sharded(t: torch.Tensor) -> bool:
    """Whether reading ``t`` whole needs a collective."""
    return hasattr(t, "full_tensor")


def summed(
    base: torch.Tensor, deltas: Callable[[], Iterable[torch.Tensor]]
) -> Callable[[torch.dtype], torch.Tensor]:
    """How to produce ``base`` plus every tensor ``deltas()`` yields: whole, in float32, out of
    place, cast once to the dtype asked for, when the stream reaches it (a merged LoRA weight)."""

    def produce(dtype: torch.dtype) -> torch.Tensor:
        out = full(base.detach()).float()
        for delta in deltas():
            out = out + delta.to(out.device)
        return out.to(dtype)

    return produce
