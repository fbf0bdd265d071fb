"""From the trainer's in-memory parameters to the checkpoint tensors the engine loads, lazily.

The names and shapes come from ``weightsync.wire.checkpoint_names`` (transformers' own conversion rules,
which both sides share); this module applies them to the trainer's tensors as the stream reaches
them (`to_checkpoint`), and merges LoRA on parameters peft wraps directly
(``LoraConfig(target_parameters=...)``, the way peft adapts fused experts): out of place, in
float32, the fused result then split like the parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..errors import UnsupportedModelError
from ..plan import Weight
from ..wire.checkpoint_names import Layout
from .gather import full, summed


def to_checkpoint(tensors: list[Weight], layout: Layout) -> list[Weight]:
    """``tensors`` (in-memory names) as the checkpoint tensors the engine loads, in order.

    A parameter saved as several checkpoint tensors is materialised once, when the stream
    reaches its first piece, and kept until every piece was produced (its pieces are adjacent,
    so that is at most one parameter at a time). Each piece gets its own ``source``: pieces of
    one parameter are different tensors, not tied twins.
    """
    if layout.is_identity:
        return tensors
    out: list[Weight] = []
    for t in tensors:
        pieces = layout.split(t.name, t.shape)
        if pieces is None:
            out.append(t)
            continue
        full = _Shared(t.produce, len(pieces))
        for i, piece in enumerate(pieces):
            # A view of a tensor the trainer holds is held too (produce(held) reads it in
            # place); everything else (merged, inputs) is the parameter's.
            out.append(
                replace(
                    t,
                    name=piece.name,
                    shape=piece.shape,
                    produce=full.piece(i, piece.take),
                    source=hash((t.source, i)),
                    held=t.held if piece.view else None,
                )
            )
    return out


class _Shared:
    """One materialisation of a parameter shared by its pieces, released after the last one."""

    def __init__(self, produce: Callable[[torch.dtype], torch.Tensor], count: int) -> None:
        self._produce = produce
        self._count = count
        self._full: torch.Tensor | None = None
        self._dtype: torch.dtype | None = None
        self._done: set[int] = set()

    def piece(
        self, i: int, take: Callable[[torch.Tensor], torch.Tensor]
    ) -> Callable[[torch.dtype], torch.Tensor]:
        def produce(dtype: torch.dtype) -> torch.Tensor:
            if self._full is None or self._dtype != dtype:
                self._full, self._dtype, self._done = self._produce(dtype), dtype, set()
            out = take(self._full)
            self._done.add(i)
            if len(self._done) == self._count:
                self._full = None
            return out

        return produce


# --- LoRA on parameters (peft ``target_parameters``: fused experts) ---------------------------


def lora_parameters(layer: Any) -> dict[str, Any]:
    """{parameter name: the peft ``ParamWrapper`` adapting it} along ``layer``'s wrapper chain.

    peft adapts a bare parameter (fused experts have no ``nn.Linear``) with a ``ParamWrapper``;
    several parameters of one module are wrapped in a chain, outermost first.
    """
    from peft.tuners.lora.layer import ParamWrapper

    found: dict[str, Any] = {}
    while isinstance(layer, ParamWrapper):
        found[layer.parameter_name] = layer
        layer = layer.base_layer
    return found


def merged_parameter(
    wrapper: Any, param: torch.Tensor, name: str
) -> Callable[[torch.dtype], torch.Tensor]:
    """``param + scale * B @ A`` for every active adapter of ``wrapper``, per expert, in float32.

    The same math as peft's ``ParamWrapper.get_delta_weight`` (checked against peft's own merge
    in the tests), but in float32 and out of place: the trainer's weights are never touched.

    Raises:
        UnsupportedModelError: the delta's shape does not match the parameter (a layout this
            code does not know); checked now, on meta tensors, before anything is written.
    """
    adapters = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    for a in adapters:
        meta = _param_delta(wrapper, a, device="meta")
        if tuple(meta.shape) != tuple(param.shape):
            raise UnsupportedModelError(
                f"LoRA on parameter {name} (LoraConfig(target_parameters=...)) has a delta of "
                f"shape {list(meta.shape)} for a parameter of shape {list(param.shape)}; "
                "weightsync cannot merge it. Serve the adapter unmerged or target modules instead."
            )

    return summed(param, lambda: (_param_delta(wrapper, a) for a in adapters))


def _param_delta(wrapper: Any, adapter: str, device: str | None = None) -> torch.Tensor:
    a = wrapper.lora_A[adapter].weight.detach()
    b = wrapper.lora_B[adapter].weight.detach()
    if device == "meta":  # shapes only (the global shapes of sharded factors)
        a, b = torch.empty(a.shape, device="meta"), torch.empty(b.shape, device="meta")
    else:
        a, b = full(a), full(b)
    a, b = a.float(), b.float()
    scale = wrapper.scaling[adapter]
    experts = wrapper.num_experts
    if experts == 1:  # a 2-d parameter: the plain linear delta (peft refuses fan_in_fan_out)
        return (b @ a) * scale
    a = a.reshape(experts, -1, a.shape[-1])  # (experts, rank, in)
    b = b.reshape(b.shape[0], -1, experts)  # (out, rank, experts)
    # peft stores (experts, in, out) unless the module holds its experts as (experts, out, in)
    order = "e o i" if wrapper._did_swap_in_out_features else "e i o"
    return torch.einsum(f"o r e, e r i -> {order}", b, a) * scale
