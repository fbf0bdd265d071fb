"""Checkpoint names and shapes of a transformers model, from transformers' own conversion rules.

Every byte weightsync sends travels under a *checkpoint* name (what ``save_pretrained`` writes,
what vLLM's loaders take), and both sides need to know them: the trainer to name its tensors,
the engine to learn what it loads. transformers 5 holds some weights in another layout than its
checkpoints store them: a MoE layer keeps its experts fused (``mlp.experts.gate_up_proj`` of
shape [E, 2I, H]) where the checkpoint has one tensor per expert and projection
(``mlp.experts.0.gate_proj.weight``, or ``block_sparse_moe.experts.0.w1.weight`` for Mixtral).

The translation is transformers' own: the conversion rules ``from_pretrained`` applied to the
checkpoint (``transformers.conversion_mapping``), reversed the way ``save_pretrained`` reverses
them (``transformers.core_model_loading.revert_weight_conversion``). A model family transformers
converts therefore syncs without any code here; a model without rules passes through unchanged.

Nothing is materialised: the rules run once per parameter on a ``meta`` tensor, which yields
every checkpoint name and shape. When a checkpoint tensor is a view of the fused parameter (as
in Qwen3-MoE and Mixtral: expert ``e``'s gate projection is ``gate_up_proj[e, :I]``), it is
taken as that view (`Piece.view`), so a sync in the trainer's dtype copies nothing; otherwise
(an op that permutes or concatenates) transformers' ops run on the real tensor, once per
parameter, when the stream reaches it.
"""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor cut from one in-memory parameter.

    ``take(full)`` turns the full in-memory tensor (the parameter, or its LoRA-merged version,
    in any dtype) into this checkpoint tensor: a view of it when ``view`` (no copy).
    """

    name: str
    shape: tuple[int, ...]
    take: Callable[[torch.Tensor], torch.Tensor]
    view: bool = True


class _ViewsOnly(TorchFunctionMode):
    """Make ``.contiguous()`` a no-op, so that ops which only slice return views of their input
    (transformers' ``Chunk`` copies each chunk to contiguous memory; a view is what we want)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.contiguous:
            return args[0]
        return func(*args, **(kwargs or {}))


class Layout:
    """How a model's in-memory parameters map to checkpoint tensors (see the module docstring).

    Built by `checkpoint_layout`; `split` answers for one parameter.
    """

    def __init__(self, model: Any, transforms: list[Any]) -> None:
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        self._model = model
        self._renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self._converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._by_pattern = {p: c for c in self._converters for p in c.source_patterns}
        self._splits: dict[tuple[str, tuple[int, ...]], list[Piece] | None] = {}

    @property
    def is_identity(self) -> bool:
        """Whether every parameter keeps its name and layout (no conversion rules)."""
        return not (self._renamings or self._converters)

    def split(self, name: str, shape: tuple[int, ...]) -> list[Piece] | None:
        """The checkpoint tensors parameter ``name`` (of ``shape``) is saved as, in order.

        Returns None when the parameter is saved unchanged, under its own name. Nothing is
        materialised: shapes come from running the conversion on a ``meta`` tensor.

        Raises:
            UnsupportedModelError: the checkpoint tensor is built from several in-memory
                parameters (a conversion weightsync cannot stream one parameter at a time).
        """
        if self.is_identity:
            return None
        key = (name, tuple(shape))
        if key not in self._splits:
            self._splits[key] = self._split(name, tuple(shape))
        return self._splits[key]

    def _split(self, name: str, shape: tuple[int, ...]) -> list[Piece] | None:
        from transformers.core_model_loading import rename_source_key

        renamed, pattern = rename_source_key(name, self._renamings, self._converters, reverse=True)
        if pattern is None:
            return None if renamed == name else [Piece(renamed, tuple(shape), _identity)]
        converter = self._by_pattern[pattern]
        if len(converter.source_patterns) > 1:
            raise UnsupportedModelError(
                f"{name} is saved fused with other parameters ({converter.source_patterns} -> "
                f"{converter.target_patterns}, transformers' conversion rules for "
                f"{type(self._model).__name__}); weightsync streams one parameter at a time and "
                "cannot build that checkpoint tensor. Please report this model family."
            )
        meta = torch.empty(shape, device="meta")
        try:
            with _ViewsOnly():
                planned = self._convert(renamed, name, pattern, meta)
            views = all(t is meta or t._base is meta for t in planned.values())
        except (RuntimeError, ValueError):  # an op needs real contiguity: plan without views
            planned, views = self._convert(renamed, name, pattern, meta), False
        if views:
            return [
                Piece(key, tuple(t.shape), _strided(t.shape, t.stride(), int(t.storage_offset())))
                for key, t in planned.items()
            ]
        convert = _Memo(lambda full: self._convert(renamed, name, pattern, full))
        return [Piece(k, tuple(t.shape), convert.getter(k), view=False) for k, t in planned.items()]

    def _convert(
        self, renamed: str, name: str, pattern: str, tensor: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        # One key's share of revert_weight_conversion: a fresh converter per target, as there.
        converter = deepcopy(self._by_pattern[pattern])
        converter.add_tensor(renamed, name, pattern, tensor)
        with torch.no_grad():
            out = converter.convert(renamed, model=self._model, config=self._model.config)
        return {key: t[0] if isinstance(t, list) else t for key, t in out.items()}


# Planning a layout runs every fused parameter's conversion on a meta tensor (noticeable for a
# large MoE model); a model keeps its layout, so that is done once per model.
_LAYOUTS: WeakKeyDictionary[nn.Module, Layout] = WeakKeyDictionary()


def checkpoint_layout(model: nn.Module) -> Layout:
    """The layout of ``model``'s checkpoint, from transformers' own conversion rules (computed
    once per model).

    The rules are those ``save_pretrained`` reverses: the ones the model was loaded with, or,
    for a model built from a config, its family's default rules (without prefix changes, as
    ``revert_weight_conversion`` does). A model with none, or one that is not a transformers
    model, gets the identity layout.
    """
    if model not in _LAYOUTS:
        _LAYOUTS[model] = _layout(model)
    return _LAYOUTS[model]


def _layout(model: nn.Module) -> Layout:
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return Layout(None, [])
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    transforms = getattr(model, "_weight_conversions", None)
    if transforms is None:
        transforms = get_model_conversion_mapping(model, add_legacy=False)
        transforms = [t for t in transforms if not isinstance(t, PrefixChange)]
    try:
        # Reversed order, so that a sub-model's conversions apply first (as transformers does).
        reverse = [t.reverse_transform() for t in transforms[::-1]]
    except ValueError as e:  # transformers cannot reverse quantization or TP conversions
        raise UnsupportedModelError(
            f"transformers cannot convert {type(model).__name__}'s weights back to checkpoint "
            f"layout ({e}); weightsync streams checkpoint layout only."
        ) from e
    return Layout(model, reverse)


def checkpoint_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of ``model`` a checkpoint holds, in checkpoint layout.

    Every parameter and persistent buffer (``state_dict``: a non-persistent buffer such as
    ``rotary_emb.inv_freq`` is not a checkpoint tensor), a tied tensor under each of its names
    (an engine loads each), a fused in-memory parameter as the tensors ``save_pretrained``
    splits it into. Nothing is materialised: a model on the meta device will do.
    """
    layout = checkpoint_layout(model)
    out: dict[str, tuple[int, ...]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        pieces = layout.split(name, tuple(tensor.shape))
        if pieces is None:
            out[name] = tuple(tensor.shape)
        else:
            out.update((piece.name, piece.shape) for piece in pieces)
    return out


class _Memo:
    """Run ``convert`` once per full tensor and hand out its outputs by name."""

    def __init__(self, convert: Callable[[torch.Tensor], dict[str, torch.Tensor]]) -> None:
        self._convert = convert
        self._last: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None

    def getter(self, key: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def take(full: torch.Tensor) -> torch.Tensor:
            if self._last is None or self._last[0] is not full:
                self._last = (full, self._convert(full))
            return self._last[1][key]

        return take


def _identity(full: torch.Tensor) -> torch.Tensor:
    return full


def _strided(
    shape: torch.Size, stride: tuple[int, ...], offset: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    def take(full: torch.Tensor) -> torch.Tensor:
        full = full.contiguous()  # the layout was planned on a contiguous tensor
        return full.as_strided(shape, stride, full.storage_offset() + offset)

    return take
