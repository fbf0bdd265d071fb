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
- A persistent buffer (in ``state_dict``, so in what ``save_pretrained`` writes) that the engine
  loads is sent like a frozen weight: GLM-4-MoE's and DeepSeek-V3's router
  ``e_score_correction_bias``. Buffers the engine does not load (``rotary_emb.inv_freq``,
  non-persistent anyway) are not sent.
- A weight the engine holds in another dtype than it computes in (a float32 router in a bf16
  engine, reported in ``EngineFacts.held``) travels in that dtype, or in the trainer's own
  when the engine's holds it exactly (`as_engine_holds`).

The plan (names and shapes) is computed without materialising any tensor, so it can be checked
against the engine before anything is written.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, TypeGuard
from weakref import WeakKeyDictionary

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..plan import Adapter, Weight, itemsize, numel
from ..wire.checkpoint_names import checkpoint_layout
from . import peft_support
from .gather import full, summed
from .layout import lora_parameters, merged_parameter, to_checkpoint

if TYPE_CHECKING:
    # peft is untyped for mypy (skipped: Any); the names say what the code duck-types on.
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

# vLLM's reload buffers whole layers until every tensor of a layer has arrived; sending tensors
# in module (= layer) order keeps that buffer to one layer. 512 MiB is the bucket size the
# peers converged on (verl, sglang): large enough that per-call overhead vanishes.
DEFAULT_BUCKET_BYTES = 512 << 20


def uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped, else ``model`` itself.

    A compiled model is an ``OptimizedModule`` holding the original as ``_orig_mod``, so every
    name below it carries that prefix (``_orig_mod.model.layers.0...``): walked as it is, none
    is a checkpoint name. The weights are the original module's, shared, so syncing that one
    syncs what the compiled model computes (its forward is not run here)."""
    from torch._dynamo.eval_frame import OptimizedModule

    while isinstance(model, OptimizedModule):
        model = model._orig_mod
    return model


def is_peft(model: nn.Module) -> TypeGuard[PeftModel]:
    from peft import PeftModel

    return isinstance(uncompiled(model), PeftModel)


def inner_model(model: nn.Module) -> nn.Module:
    """The transformers model under any PEFT wrapper or ``torch.compile`` (its names are
    checkpoint names)."""
    model = uncompiled(model)
    return uncompiled(model.get_base_model()) if is_peft(model) else model


def _plain(t: torch.Tensor) -> Callable[[torch.dtype], torch.Tensor]:
    # .detach() shares storage: with a matching dtype the engine reads the trainer's memory
    # directly and nothing is copied on this side.
    return lambda dtype: full(t.detach()).to(dtype)


def _persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s own buffers that ``state_dict`` holds (a non-persistent one, such as
    ``rotary_emb.inv_freq``, is no checkpoint tensor)."""
    for name, b in module._buffers.items():
        if b is not None and name not in module._non_persistent_buffers_set:
            yield name, b


def _buffer(name: str, b: torch.Tensor) -> Weight:
    """A persistent buffer as a frozen weight, travelling in the dtype the trainer holds it in,
    as ``save_pretrained`` writes it: transformers keeps some in float32 in a half-precision
    model (``_keep_in_fp32_modules_strict``: the router's correction bias) and vLLM holds them
    so too, so one sent in the engine's dtype would arrive rounded. The engine's loader casts
    it to whatever it holds, as when it reads that checkpoint (a few bytes either way)."""
    return Weight(
        name,
        tuple(b.shape),
        lambda dtype: full(b.detach()),
        source=id(b),
        held=b.dtype,
        inputs=(b,),
        sent=b.dtype,
    )


def _lora_delta(layer: LoraLayer, adapter: str) -> torch.Tensor:
    """scale * (B @ A) for one adapter of one LoRA layer, in float32, in the base weight's layout.

    Only the layer types `weightsync.peft_support` allows reach here (checked when the
    plan is made): a linear layer (``fan_in_fan_out`` for GPT-2's Conv1D) or an embedding.
    """
    scale = layer.scaling[adapter]
    if adapter in layer.lora_A:
        a = full(layer.lora_A[adapter].weight.detach()).float()
        b = full(layer.lora_B[adapter].weight.detach()).float()
        delta = (b @ a) * scale
        return delta.T if layer.fan_in_fan_out else delta
    a = full(layer.lora_embedding_A[adapter].detach()).float()
    b = full(layer.lora_embedding_B[adapter].detach()).float()
    return (b @ a).T * scale


def _merged_weight(layer: LoraLayer, weight: torch.Tensor) -> Callable[[torch.dtype], torch.Tensor]:
    adapters = [a for a in layer.active_adapters if a in layer.scaling]
    return summed(weight, lambda: (_lora_delta(layer, a) for a in adapters))


def _merge_inputs(layer: LoraLayer, base: torch.Tensor) -> tuple[torch.Tensor | float, ...]:
    """Everything a merged weight or bias of ``layer`` is computed from: the base tensor, each
    active adapter's factors (and lora_B bias) and its scale."""
    inputs: list[torch.Tensor | float] = [base]
    for a in layer.active_adapters:
        if a in layer.scaling:
            factors = [m for d in (layer.lora_A, layer.lora_B) if a in d for m in d[a].parameters()]
            factors += [d[a] for d in (layer.lora_embedding_A, layer.lora_embedding_B) if a in d]
            inputs += [*factors, float(layer.scaling[a])]
    return tuple(inputs)


def _merged_bias(layer: LoraLayer, bias: torch.Tensor) -> Callable[[torch.dtype], torch.Tensor]:
    adapters = [a for a in layer.active_adapters if getattr(layer, "lora_bias", {}).get(a)]
    return summed(
        bias,
        lambda: (full(layer.lora_B[a].bias.detach()).float() * layer.scaling[a] for a in adapters),
    )


def _require_floating(name: str, p: torch.Tensor) -> None:
    if not p.is_floating_point():
        raise UnsupportedModelError(
            f"{name} is stored as {p.dtype} (a quantized layer); weightsync streams "
            "floating-point weights only. Dequantize the model before syncing."
        )


def _walk(module: nn.Module, prefix: str, merge: bool, out: list[Weight]) -> None:
    """Append every weight below ``module`` to ``out``, under its checkpoint name."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    if isinstance(module, ModulesToSaveWrapper):
        # The trained copy is what the trainer runs; original_module is the frozen original.
        trained = (
            module.modules_to_save[module.active_adapter] if not module.disable_adapters else None
        )
        _walk(trained if trained is not None else module.original_module, prefix, merge, out)
        return
    if isinstance(module, LoraLayer):
        base = module.get_base_layer()
        # What peft's forward computes: the base alone when adapters are disabled or already
        # merged into it in place (merge_adapter()), else base + every active adapter.
        merging = merge and not module.disable_adapters and not module.merged
        has_lora_bias = any(getattr(module, "lora_bias", {}).get(a) for a in module.active_adapters)
        # peft target_parameters (fused experts): LoRA on a bare parameter, merged per expert
        wrapped = lora_parameters(module) if merging else {}
        for pname, p in base.named_parameters(recurse=False):
            _require_floating(prefix + pname, p)
            if pname in wrapped:
                merged = merged_parameter(wrapped[pname], p, prefix + pname)
                out.append(Weight(prefix + pname, tuple(p.shape), merged, True, id(p)))
            elif merging and pname == "weight":
                out.append(
                    Weight(
                        prefix + pname,
                        tuple(p.shape),
                        _merged_weight(module, p),
                        True,
                        id(p),
                        inputs=_merge_inputs(module, p),
                    )
                )
            elif merging and pname == "bias" and has_lora_bias:
                out.append(
                    Weight(
                        prefix + pname,
                        tuple(p.shape),
                        _merged_bias(module, p),
                        True,
                        id(p),
                        inputs=_merge_inputs(module, p),
                    )
                )
            else:
                out.append(
                    Weight(
                        prefix + pname,
                        tuple(p.shape),
                        _plain(p),
                        source=id(p),
                        held=p.dtype,
                        inputs=(p,),
                    )
                )
        out += [_buffer(prefix + bname, b) for bname, b in _persistent_buffers(base)]
        # The base's own children are weights too: LoRA on a router's parameter (peft
        # target_parameters) wraps the router, whose ``moe_statics`` child holds Ernie 4.5 MoE's
        # correction bias.
        for cname, child in base.named_children():
            _walk(child, f"{prefix}{cname}.", merge, out)
        return
    for pname, p in module.named_parameters(recurse=False):
        _require_floating(prefix + pname, p)
        out.append(
            Weight(
                prefix + pname, tuple(p.shape), _plain(p), source=id(p), held=p.dtype, inputs=(p,)
            )
        )
    out += [_buffer(prefix + bname, b) for bname, b in _persistent_buffers(module)]
    for cname, child in module.named_children():
        _walk(child, f"{prefix}{cname}.", merge, out)


def base_tensors(
    model: nn.Module, *, merge_lora: bool, expected: Mapping[str, tuple[int, ...]] | None = None
) -> list[Weight]:
    """Every base weight of ``model`` under its checkpoint name, in module (= layer) order.

    Args:
        model: a transformers model or a ``peft.PeftModel``.
        merge_lora: add each active LoRA adapter into the weights it targets (out of place,
            float32). False sends the base unmerged, as an engine serving the adapter needs it.
        expected: the names the engine loads. A tied tensor (``lm_head`` sharing
            ``embed_tokens``) is sent under every one of its names the engine expects, and under
            its first name when the engine expects none of them (so the mismatch is reported).
            A persistent buffer is sent only under names the engine expects (None: every
            persistent buffer, as ``save_pretrained`` writes them).
    """
    model = uncompiled(model)
    if is_peft(model):  # refuse what the walk would not reproduce (DoRA, unknown layers, ...)
        peft_support.check(model, "merge" if merge_lora else "serve")
    inner = inner_model(model)
    found: list[Weight] = []
    _walk(inner, "", merge_lora, found)
    # In-memory layout -> checkpoint layout (fused MoE experts -> one tensor per expert)
    found = to_checkpoint(found, checkpoint_layout(inner))
    buffers = {id(b) for b in inner.buffers()}
    found = [
        t for t in found if expected is None or t.name in expected or not _is_one_of(t, buffers)
    ]
    by_param: dict[int, list[Weight]] = {}
    for t in found:
        by_param.setdefault(t.source, []).append(t)
    result: list[Weight] = []
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


def _is_one_of(t: Weight, tensors: set[int]) -> bool:
    """Whether ``t`` is one of ``tensors`` (by id) sent as it is."""
    return len(t.inputs) == 1 and id(t.inputs[0]) in tensors


def as_engine_holds(tensors: list[Weight], held: Mapping[str, str]) -> list[Weight]:
    """``tensors``, each the engine holds in a dtype of its own (``held``: name -> dtype name,
    `EngineFacts.held`) made to travel in a dtype that reaches it unrounded.

    Why: vLLM builds some parameters in float32 inside a bfloat16 model (Ernie 4.5 MoE's router
    ``gate.weight``, which transformers keeps in float32 too). Sent in the engine's dtype, the
    router would hold the trainer's weights rounded to bfloat16 and pick other experts than the
    trainer, silently (docs/failure-modes.md, row 53). The dtype is the trainer's own when the
    engine's represents it exactly (``promote_types``: bfloat16 into float32; no copy, fewer
    bytes), else the engine's (a merged weight, computed in float32). A tensor that already has
    a dtype of its own (a quantized part, a persistent buffer) keeps it.
    """
    if not held:
        return tensors
    out = []
    for t in tensors:
        engine_dtype = getattr(torch, held[t.name]) if t.name in held else None
        if engine_dtype is None or t.sent is not None:
            out.append(t)
            continue
        exact = t.held is not None and torch.promote_types(t.held, engine_dtype) == engine_dtype
        sent = t.held if exact and t.held is not None else engine_dtype
        out.append(replace(t, produce=_in(t.produce, sent), sent=sent))
    return out


def _in(produce: Callable[[torch.dtype], torch.Tensor], dtype: torch.dtype) -> Callable:
    return lambda _plan_dtype: produce(dtype)


def trained_copies(model: nn.Module) -> list[Weight]:
    """The weights of PEFT ``modules_to_save`` copies (e.g. a trained ``lm_head``).

    They are full weights, not adapter factors: an engine serving the adapter holds them as base
    weights, so an adapter-only sync must still send them.
    """
    from peft.utils import ModulesToSaveWrapper

    out: list[Weight] = []
    for name, module in peft_support.modules_of_type(inner_model(model), ModulesToSaveWrapper):
        if not module.disable_adapters:
            trained = module.modules_to_save[module.active_adapter]
            for pname, p in trained.named_parameters():
                out.append(
                    Weight(
                        f"{name}.{pname}",
                        tuple(p.shape),
                        _plain(p),
                        source=id(p),
                        held=p.dtype,
                        inputs=(p,),
                    )
                )
    return out


_LAYER = re.compile(r"\.(\d+)\.")


def buckets(
    tensors: list[Weight], dtype: torch.dtype, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Materialise ``tensors`` a bucket at a time, keeping their order.

    A bucket closes when adding the next tensor would pass ``bucket_bytes``; a tensor larger
    than that travels alone. Only the current bucket is alive on this side, so the extra memory
    of a merged sync is one bucket, not one model.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    current: list[Weight] = []
    size = 0
    for t in tensors:
        nbytes = itemsize(t.sent or dtype) * numel(t.shape)
        if current and size + nbytes > bucket_bytes:
            yield [(c.name, c.produce(dtype)) for c in current]
            current, size = [], 0
        current.append(t)
        size += nbytes
    if current:
        yield [(c.name, c.produce(dtype)) for c in current]


# The adapter's parameters are found by walking the whole model, which costs more than writing
# the adapter (with peft's get_peft_model_state_dict it was most of an AdapterSync; see
# docs/benchmarks.md). So the walk is done once per model and adapter, and what is kept
# is where each factor lives (module path, attribute), never the parameter object: a parameter
# replaced since (``load_state_dict(..., assign=True)``, an optimizer that swaps tensors) is
# read where it is now. Resolving a path costs a few attribute lookups.
# (file key, module path, attribute), built by unpacking a str.rsplit: typed as tuple[str, ...].
_ADAPTER_PARAMETERS: WeakKeyDictionary[nn.Module, dict[str, list[tuple[str, ...]]]] = (
    WeakKeyDictionary()
)


def file_key(parameter: str, adapter: str) -> str | None:
    """The key ``get_peft_model_state_dict`` gives the LoRA parameter ``parameter`` of adapter
    ``adapter``, or None when it is not one of that adapter's factors.

    PEFT keys a factor by adapter inside a ``lora_*`` container: the adapter's name follows the
    container, last for a bare parameter (``embed_tokens.lora_embedding_A.<adapter>``) or before
    the parameter's own name (``q_proj.lora_A.<adapter>.weight``), and the file key drops it
    there. Only there: an adapter name is not a module path, and one such as ``"0"`` (one
    adapter per policy index) also spells ``layers.0.`` of every layer path."""
    parts = parameter.split(".")
    if len(parts) >= 2 and parts[-1] == adapter and parts[-2].startswith("lora_"):
        return ".".join(parts[:-1])
    if len(parts) >= 3 and parts[-2] == adapter and parts[-3].startswith("lora_"):
        return ".".join([*parts[:-2], parts[-1]])
    return None


def _adapter_parameters(model: nn.Module, name: str) -> list[tuple[str, torch.Tensor]]:
    """(PEFT file key, current tensor) of every LoRA factor of adapter ``name``: the parameter
    name without the adapter's name, as ``get_peft_model_state_dict`` keys it."""
    per_model = _ADAPTER_PARAMETERS.setdefault(model, {})
    if name not in per_model:
        per_model[name] = [
            (key, *n.rsplit(".", 1))
            for n, _ in model.named_parameters()
            if (key := file_key(n, name)) is not None
        ]
    module = _resolver(model)
    return [(key, getattr(module(path), attr).detach()) for key, path, attr in per_model[name]]


def _resolver(model: nn.Module) -> Callable[[str], nn.Module]:
    """``path -> model.get_submodule(path)``, through the modules' own child dicts, each prefix
    resolved once per resolver: ``get_submodule`` walks from the root through ``__getattr__``
    for every path, which was about half of an AdapterSync's plan on a 0.5B model (hundreds of
    factors, each about ten levels deep). Paths come from ``named_parameters`` names, so every
    prefix is a registered child."""
    found: dict[str, nn.Module] = {"": model}

    def resolve(path: str) -> nn.Module:
        module = found.get(path)
        if module is None:
            parent, _, atom = path.rpartition(".")
            child = resolve(parent)._modules.get(atom)
            if child is None:
                raise AttributeError(f"{type(model).__name__} has no submodule {path!r}")
            module = found[path] = child
        return module

    return resolve


def adapter(model: nn.Module) -> Adapter:
    """The active adapter of a ``peft.PeftModel``, as an engine serving LoRA loads it.

    Raises:
        UnsupportedModelError: ``model`` is not a PEFT model, or its set-up cannot be served
            exactly (see `weightsync.peft_support.check`).
    """
    model = uncompiled(model)
    if not is_peft(model):
        raise UnsupportedModelError(
            f"an adapter sync needs a peft.PeftModel, got {type(model).__name__}; "
            "with train_type='full' use FullSync"
        )
    (name,) = peft_support.check(model, "serve").adapters
    cfg = model.peft_config[name]
    tensors = dict(_adapter_parameters(model, name))
    rank = max([cfg.r, *getattr(cfg, "rank_pattern", {}).values()])
    return Adapter(name=name, config=peft_support.served_config(cfg), tensors=tensors, rank=rank)
