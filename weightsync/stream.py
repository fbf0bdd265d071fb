"""The trainer side: which tensors the engine receives, under which names, in which order.

A trainer holds either a transformers causal LM or a ``peft.PeftModel`` wrapping one. The engine
loads *checkpoint* names (what ``save_pretrained`` writes: ``model.layers.0.self_attn.q_proj.weight``).
This module turns the first into the second without modifying or copying the trainer's model:

- PEFT wrappers are unwrapped: ``base_model.model.`` prefixes and ``.base_layer`` vanish, LoRA
  factors are never sent as base weights, and a ``modules_to_save`` wrapper contributes its
  *trained* copy under the original name (never ``original_module``).
- Merged LoRA is computed out of place, ``W + scale * (B @ A)`` in float32 and cast once to the
  engine's dtype, one tensor at a time when its bucket is reached. The trainer's own weights are
  never touched, so there is no merge/unmerge drift (trl#6688) and no whole-model copy.
- Tied parameters are one tensor with several names; each name the engine loads gets it.

The plan (names and shapes) is computed without materialising any tensor, so it can be checked
against the engine before anything is written.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from weakref import WeakKeyDictionary

import torch
from torch import nn

from .errors import UnsupportedModelError
from .plan import Adapter, Tensor, nbytes, numel

# vLLM's reload buffers whole layers until every tensor of a layer has arrived; sending tensors
# in module (= layer) order keeps that buffer to one layer. 512 MiB is the bucket size the
# peers converged on (verl, sglang): large enough that per-call overhead vanishes.
DEFAULT_BUCKET_BYTES = 512 << 20


def _is_peft(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def inner_model(model: nn.Module) -> nn.Module:
    """The transformers model under any PEFT wrapper (its names are checkpoint names)."""
    return model.get_base_model() if _is_peft(model) else model


def _plain(t: torch.Tensor) -> Callable[[torch.dtype], torch.Tensor]:
    # .detach() shares storage: with a matching dtype the engine reads the trainer's memory
    # directly and nothing is copied on this side.
    return lambda dtype: t.detach().to(dtype)


def _lora_delta(layer: nn.Module, adapter: str) -> torch.Tensor:
    """scale * (B @ A) for one adapter of one LoRA layer, in float32, in the base weight's layout."""
    if layer.use_dora.get(adapter, False):
        raise UnsupportedModelError(
            f"adapter {adapter!r} uses DoRA; merging DoRA out of place is not implemented. "
            "Serve it unmerged or train plain LoRA."
        )
    scale = layer.scaling[adapter]
    if adapter in getattr(layer, "lora_A", {}):
        a = layer.lora_A[adapter].weight.detach().float()
        b = layer.lora_B[adapter].weight.detach().float()
        if a.dim() == 2 and b.dim() == 2:
            delta = (b @ a) * scale
            return delta.T if getattr(layer, "fan_in_fan_out", False) else delta
    elif adapter in getattr(layer, "lora_embedding_A", {}):
        a = layer.lora_embedding_A[adapter].detach().float()
        b = layer.lora_embedding_B[adapter].detach().float()
        return (b @ a).T * scale
    # Any other LoRA layer type (convolutions, ...): peft's own delta, promoted to float32.
    return layer.get_delta_weight(adapter).detach().float()


def _merged_weight(layer: nn.Module, weight: torch.Tensor) -> Callable[[torch.dtype], torch.Tensor]:
    adapters = [a for a in layer.active_adapters if a in layer.scaling]

    def produce(dtype: torch.dtype) -> torch.Tensor:
        out = weight.detach().float()
        for adapter in adapters:
            out = out + _lora_delta(layer, adapter).to(out.device)
        return out.to(dtype)

    return produce


def _merged_bias(layer: nn.Module, bias: torch.Tensor) -> Callable[[torch.dtype], torch.Tensor]:
    adapters = [a for a in layer.active_adapters if getattr(layer, "lora_bias", {}).get(a)]

    def produce(dtype: torch.dtype) -> torch.Tensor:
        out = bias.detach().float()
        for a in adapters:
            out = out + layer.lora_B[a].bias.detach().float() * layer.scaling[a]
        return out.to(dtype)

    return produce


def _walk(module: nn.Module, prefix: str, merge: bool, out: list[Tensor]) -> None:
    """Append every weight below ``module`` to ``out``, under its checkpoint name."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    if isinstance(module, ModulesToSaveWrapper):
        # The trained copy is what the trainer runs; original_module is the frozen original.
        trained = module.modules_to_save[module.active_adapter] if not module.disable_adapters else None
        _walk(trained if trained is not None else module.original_module, prefix, merge, out)
        return
    if isinstance(module, LoraLayer):
        base = module.get_base_layer()
        merging = merge and not module.disable_adapters
        has_lora_bias = any(getattr(module, "lora_bias", {}).get(a) for a in module.active_adapters)
        for pname, p in base.named_parameters(recurse=False):
            if not p.is_floating_point():
                raise UnsupportedModelError(
                    f"{prefix}{pname} is stored as {p.dtype} (a quantized base layer); weightsync "
                    "streams floating-point weights only. Dequantize the base before syncing."
                )
            if merging and pname == "weight":
                out.append(Tensor(prefix + pname, tuple(p.shape), _merged_weight(module, p), True, id(p)))
            elif merging and pname == "bias" and has_lora_bias:
                out.append(Tensor(prefix + pname, tuple(p.shape), _merged_bias(module, p), True, id(p)))
            else:
                out.append(Tensor(prefix + pname, tuple(p.shape), _plain(p), source=id(p)))
        return
    for pname, p in module.named_parameters(recurse=False):
        out.append(Tensor(prefix + pname, tuple(p.shape), _plain(p), source=id(p)))
    for cname, child in module.named_children():
        _walk(child, f"{prefix}{cname}.", merge, out)


def base_tensors(
    model: nn.Module, *, merge_lora: bool, expected: Mapping[str, tuple[int, ...]] | None = None
) -> list[Tensor]:
    """Every base weight of ``model`` under its checkpoint name, in module (= layer) order.

    Args:
        model: a transformers model or a ``peft.PeftModel``.
        merge_lora: add each active LoRA adapter into the weights it targets (out of place,
            float32). False sends the base unmerged, as an engine serving the adapter needs it.
        expected: the names the engine loads. A tied tensor (``lm_head`` sharing
            ``embed_tokens``) is sent under every one of its names the engine expects, and under
            its first name when the engine expects none of them (so the mismatch is reported).
    """
    found: list[Tensor] = []
    _walk(inner_model(model), "", merge_lora, found)
    by_param: dict[int, list[Tensor]] = {}
    for t in found:
        by_param.setdefault(t.source, []).append(t)
    result: list[Tensor] = []
    for names in by_param.values():
        wanted = [t for t in names if expected is not None and t.name in expected] or names[:1]
        if len({t.merged for t in names}) > 1 and len(wanted) < len(names):
            # LoRA on one name of a tied tensor (say embed_tokens) leaves its twin (lm_head)
            # on the unmerged weight: one engine tensor cannot be both.
            raise UnsupportedModelError(
                f"{[t.name for t in names]} share one tensor in the trainer and LoRA modifies it "
                f"under {[t.name for t in names if t.merged]} only, but the engine loads "
                f"{[t.name for t in wanted]} alone (tied embeddings), so it cannot hold both "
                "versions. Untie the weights (tie_word_embeddings=False) or serve the adapter "
                "unmerged."
            )
        result += wanted
    return result


def trained_copies(model: nn.Module) -> list[Tensor]:
    """The weights of PEFT ``modules_to_save`` copies (e.g. a trained ``lm_head``).

    They are full weights, not adapter factors: an engine serving the adapter holds them as base
    weights, so an adapter-only sync must still send them.
    """
    from peft.utils import ModulesToSaveWrapper

    out: list[Tensor] = []
    for name, module in inner_model(model).named_modules():
        if isinstance(module, ModulesToSaveWrapper) and not module.disable_adapters:
            trained = module.modules_to_save[module.active_adapter]
            for pname, p in trained.named_parameters():
                out.append(Tensor(f"{name}.{pname}", tuple(p.shape), _plain(p), source=id(p)))
    return out


_LAYER = re.compile(r"\.(\d+)\.")


def buckets(
    tensors: list[Tensor], dtype: torch.dtype, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Materialise ``tensors`` a bucket at a time, keeping their order.

    A bucket closes when adding the next tensor would pass ``bucket_bytes``; a tensor larger
    than that travels alone. Only the current bucket is alive on this side, so the extra memory
    of a merged sync is one bucket, not one model.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    current: list[Tensor] = []
    size = 0
    for t in tensors:
        nbytes = itemsize * numel(t.shape)
        if current and size + nbytes > bucket_bytes:
            yield [(c.name, c.produce(dtype)) for c in current]
            current, size = [], 0
        current.append(t)
        size += nbytes
    if current:
        yield [(c.name, c.produce(dtype)) for c in current]


# The adapter's parameters are found by walking the whole model, which costs more than writing
# the adapter (measured: 67 ms of a 95 ms AdapterSync on a 0.5B model with peft's
# get_peft_model_state_dict). Parameters are stable objects across optimizer steps, so the walk
# is done once per model and adapter; ``p.detach()`` then reads each one's current data.
_ADAPTER_PARAMETERS: WeakKeyDictionary[nn.Module, dict[str, list[tuple[str, nn.Parameter]]]] = (
    WeakKeyDictionary()
)


def _adapter_parameters(model: nn.Module, name: str) -> list[tuple[str, nn.Parameter]]:
    """(PEFT file key, parameter) of every LoRA factor of adapter ``name``: the parameter name
    without the adapter's name, as ``get_peft_model_state_dict`` keys it."""
    per_model = _ADAPTER_PARAMETERS.setdefault(model, {})
    if name not in per_model:
        # lora_A.<name>.weight for linear layers, lora_embedding_A.<name> for embeddings
        inner, last = f".{name}.", f".{name}"
        per_model[name] = [
            (n.replace(inner, ".", 1) if inner in n else n.removesuffix(last), p)
            for n, p in model.named_parameters()
            if ".lora_" in n and (inner in n or n.endswith(last))
        ]
    return per_model[name]


def adapter(model: nn.Module) -> Adapter:
    """The active adapter of a ``peft.PeftModel``.

    Raises:
        UnsupportedModelError: ``model`` is not a PEFT LoRA model, or uses DoRA.
    """
    if not _is_peft(model):
        raise UnsupportedModelError(
            f"an adapter sync needs a peft.PeftModel, got {type(model).__name__}; "
            "with train_type='full' use FullSync"
        )
    name = model.active_adapter
    cfg = model.peft_config[name]
    if getattr(cfg, "peft_type", None) is None or str(cfg.peft_type.value) != "LORA":
        raise UnsupportedModelError(f"adapter {name!r} is {cfg.peft_type}, only LoRA is supported")
    if getattr(cfg, "use_dora", False):
        raise UnsupportedModelError(f"adapter {name!r} uses DoRA, which vLLM does not serve")
    tensors = {key: p.detach() for key, p in _adapter_parameters(model, name)}
    config = cfg.to_dict()
    # modules_to_save travel as base weights; an engine given them in the adapter would either
    # reject them or apply them twice.
    config["modules_to_save"] = None
    for key, value in config.items():
        if isinstance(value, set):
            config[key] = sorted(value)
    rank = max([cfg.r, *getattr(cfg, "rank_pattern", {}).values()])
    return Adapter(name=name, config=config, tensors=tensors, rank=rank)
