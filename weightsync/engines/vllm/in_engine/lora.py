"""Worker-side LoRA loading from memory: an adapter built from tensors, no file round trip.

These functions run where vLLM's model runner lives: in this process through
``llm.collective_rpc(install_adapter, kwargs=...)`` (tensors pass by reference), or inside a vLLM
worker process through a worker extension (tensors arrive pickled). So they take only plain
data -- a dict of tensors keyed as in ``adapter_model.safetensors``, the ``adapter_config.json``
dict, ids -- and import nothing from the trainer side of weightsync.

vLLM 0.32 has no public call for this: ``add_lora`` reads a folder. `build_lora_model`
therefore does what ``WorkerLoRAManager._load_adapter`` does after reading the files (PEFTHelper
from the config, the same legality checks, ``LoRAModel.from_lora_tensors``), and
`install_adapter` does what the LRU manager's ``add_adapter`` does for
``load_inplace=True``: build first (a bad adapter leaves the served one alone), then remove the
adapter with that id, add, activate. Both follow vLLM private internals of that version; a
version without them is detected by `supports_memory_load`, and the caller falls back to
the folder.

Serving and staleness. Requests name the adapter with a ``LoRARequest`` whose ``lora_path`` is
`memory_lora_path`: an absolute path that never exists. While the adapter is loaded vLLM
finds it by id and never reads the path. When it is not -- vLLM dropped every adapter after a
base weight reload (``reset_lora_state``), or the LRU cache evicted it -- vLLM tries to load it
from that path and the request fails with "No adapter found for /weightsync-in-memory/...",
instead of serving an older adapter on top of new base weights (LoRA counted twice,
ms-swift#8233). The fix is the caller's: sync the adapter again. The request must not carry
``load_inplace=True``, or every request would reload from the (absent) path.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from . import ledger

MEMORY_ROOT = "/weightsync-in-memory"


def memory_lora_path(lora_name: str, lora_int_id: int, version: int = 0) -> str:
    """``lora_path`` for a ``LoRARequest`` of an adapter installed from memory.

    Absolute (so vLLM never takes it for a hub id to download) and never created, so a request
    for an adapter vLLM no longer holds fails loudly instead of loading anything. It names the
    adapter's ``version`` too: vLLM's prefix-cache block hash covers an adapter's name and
    path (not its id), so two versions replaced in place under one id must differ here.
    """
    return f"{MEMORY_ROOT}/{lora_name}/{lora_int_id}/v{version}"


def _lora_manager(worker: Any) -> Any:
    manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    if manager is None:
        raise RuntimeError(
            "this vLLM worker has no LoRA manager: create the engine with enable_lora=True"
        )
    return manager


# What install_adapter uses of vLLM's private LoRA internals (as of vLLM 0.32).
_MANAGER_ATTRS = ("lora_config", "vocab_size", "max_position_embeddings", "_adapter_manager")
_INNER_ATTRS = (
    "model",
    "supported_lora_modules",
    "packed_modules_mapping",
    "capacity",
    "remove_adapter",
    "add_adapter",
    "activate_adapter",
    "_validate_moe_lora_format",
    "_validate_modules_to_save",
    "_validate_token_classification_lora",
)


def supports_memory_load(worker: Any) -> bool:
    """Whether this worker's vLLM has the internals `install_adapter` relies on; if not,
    the caller loads the adapter from a folder instead."""
    from vllm.lora import lora_model
    from vllm.lora.peft_helper import PEFTHelper

    manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    return (
        manager is not None
        and all(hasattr(manager, attr) for attr in _MANAGER_ATTRS)
        and all(hasattr(manager._adapter_manager, attr) for attr in _INNER_ATTRS)
        and hasattr(lora_model.LoRAModel, "from_lora_tensors")
        and hasattr(lora_model, "_is_remote_expert_key")
        and hasattr(PEFTHelper, "from_dict")
    )


def _expected_modules(inner: Any) -> set[str]:
    """Module names vLLM accepts LoRA for, packed ones expanded (``_load_adapter``'s list)."""
    expected: set[str] = set()
    for module in inner.supported_lora_modules:
        expected.update(inner.packed_modules_mapping.get(module, [module]))
        if module == "experts":
            expected.add(module)
    return expected


def _check_modules(
    tensors: dict[str, torch.Tensor],
    expected: set[str],
    peft_helper: Any,
    mapper: Any,
    skip_prefixes: list[str] | None,
) -> None:
    """The check vLLM runs on the safetensors keys before loading: every tensor must target a
    module this model applies LoRA to, or it would be silently dropped."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

    unexpected = []
    for key in tensors:
        if is_base_embedding_weights(key) or "base_layer" in key:
            continue
        if skip_prefixes and LoRAModel._should_skip_module(key, skip_prefixes):
            continue
        module, _ = parse_fine_tuned_lora_name(key, mapper)
        if ".experts" in module:
            ok = module[module.find(".experts") + 1 :] in expected
        else:
            leaf = module.rsplit(".", 1)[-1]
            ok = leaf in expected or leaf in (peft_helper.modules_to_save or ())
        if not ok:
            unexpected.append(module)
    if unexpected:
        raise ValueError(
            f"adapter targets modules this vLLM model has no LoRA layer for: {unexpected} "
            f"(it has: {sorted(expected)}); train the adapter on those, or merge it instead"
        )


def build_lora_model(
    worker: Any, tensors: dict[str, torch.Tensor], config: dict, lora_int_id: int
) -> tuple[Any, dict[str, torch.Tensor] | None]:
    """A vLLM ``LoRAModel`` from an adapter in PEFT's on-disk form, checked as vLLM checks one
    read from a folder.

    Every tensor is copied once (`_copies`), to CPU in the engine's LoRA dtype, as vLLM's
    folder loader leaves it: vLLM later scales ``lora_b`` in place
    (``LoRALayerWeights.optimize``), and the LRU cache re-activates an adapter from these
    tensors, so sharing storage with the trainer would both corrupt the trainer's adapter and
    serve later, unsynced values. Returns the model and, by key, the tensor it holds for each
    (`_held`).
    """
    from vllm.lora.lora_model import LoRAModel, _is_remote_expert_key
    from vllm.lora.peft_helper import PEFTHelper

    manager = _lora_manager(worker)
    inner = manager._adapter_manager
    peft_helper = PEFTHelper.from_dict(
        {**config, "vllm_max_position_embeddings": manager.max_position_embeddings}
    )
    peft_helper.validate_legal(manager.lora_config)
    model = inner.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    skip_prefixes = getattr(model, "lora_skip_prefixes", None)
    _check_modules(tensors, _expected_modules(inner), peft_helper, mapper, skip_prefixes)

    dtype = manager.lora_config.lora_dtype
    ep_spec = getattr(inner, "moe_ep_load_spec", None)
    owned = _copies(
        {
            key: t.detach()
            for key, t in tensors.items()
            if ep_spec is None or not _is_remote_expert_key(key, ep_spec)
        },
        dtype,
    )
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=lora_int_id,
        tensors=owned,
        peft_helper=peft_helper,
        device="cpu",
        dtype=dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=skip_prefixes,
    )
    inner._validate_moe_lora_format(lora)
    inner._validate_modules_to_save(lora)
    inner._validate_token_classification_lora(lora)
    return lora, _held(lora, owned, mapper)


def _held(lora: Any, keys: Iterable[str], mapper: Any) -> dict[str, torch.Tensor] | None:
    """Key -> the tensor ``lora`` holds for it (the copy above, or vLLM's pinned copy of it on
    a GPU host), found as ``from_lora_tensors`` placed it; None if a key has none (an
    embedding, a skipped module, a ``modules_to_save`` weight)."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    held = {}
    for key in keys:
        module, is_lora_a = parse_fine_tuned_lora_name(key, mapper)
        weights = lora.loras.get(module)
        t = None if weights is None else weights.lora_a if is_lora_a else weights.lora_b
        if not isinstance(t, torch.Tensor):
            return None
        held[key] = t
    return held


def _copies(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each tensor copied to CPU in ``dtype``: on CPU, views of one new buffer filled by one
    ``torch._foreach_copy_`` (an adapter is hundreds of small factors: one allocation and one
    call, not one of each per factor)."""
    if any(t.device.type != "cpu" for t in tensors.values()):  # one copy each, off the device
        return {key: t.to(device="cpu", dtype=dtype, copy=True) for key, t in tensors.items()}
    sources = list(tensors.values())
    buffer = torch.empty(sum(t.numel() for t in sources), dtype=dtype)
    parts = buffer.split([t.numel() for t in sources])
    copies = [part.view(t.shape) for part, t in zip(parts, sources, strict=True)]
    torch._foreach_copy_(copies, sources)
    return dict(zip(tensors, copies, strict=True))


def install_adapter(
    worker: Any, tensors: dict[str, torch.Tensor], config: dict, lora_int_id: int
) -> bool:
    """Build the adapter and make it the one served under ``lora_int_id``, replacing any
    adapter with that id (a re-add takes effect). Call through ``collective_rpc``.

    Requests then use it with ``LoRARequest(name, lora_int_id, memory_lora_path(...))``.
    Returns True once installed; raises, leaving the engine's adapters unchanged, if the
    adapter is not one this engine can serve. A new version of the adapter this call last
    installed under that id, with the same config, keys and shapes, is written into it in
    place (`_refresh`).
    """
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed

    manager = _lora_manager(worker)
    inner = manager._adapter_manager
    with gpu_sync_allowed():
        if not _refresh(worker, inner, tensors, config, lora_int_id):
            lora, held = build_lora_model(worker, tensors, config, lora_int_id)
            scales = _scales(lora)
            inner.remove_adapter(lora_int_id)
            if len(inner) + 1 > inner.capacity and hasattr(inner, "remove_oldest_adapter"):
                inner.remove_oldest_adapter()
            inner.add_adapter(lora)
            inner.activate_adapter(lora_int_id)
            _remember(worker, lora, held, scales, config)
    ledger.note_adapter(worker)
    return True


@dataclass(frozen=True)
class _Refreshable:
    """Where each key of an installed adapter lives in vLLM's ``LoRAModel``: the tensor vLLM
    serves from (and re-activates the adapter from) and the scaling folded into it."""

    config: dict
    epoch: tuple[Any, int]  # the worker's, as the adapter was installed (`ledger.epoch`)
    keys: tuple[str, ...]
    targets: tuple[torch.Tensor, ...]
    scales: tuple[float, ...]  # 1 for lora_a and for a lora_b vLLM did not scale


# Adapters installed by `install_adapter` that a next version may be written into in place.
_REFRESHABLE: weakref.WeakKeyDictionary[Any, _Refreshable] = weakref.WeakKeyDictionary()


def _scales(lora: Any) -> dict[int, float] | None:
    """The scaling of each ``lora_b`` of ``lora`` by the tensor's id, read before
    ``add_adapter`` folds it into the tensor (``LoRALayerWeights.optimize``); None if any is
    not one plain number."""
    out = {}
    for weights in lora.loras.values():
        if not isinstance(weights.lora_b, torch.Tensor) or type(weights.scaling) not in (
            float,
            int,
        ):
            return None
        out[id(weights.lora_b)] = weights.scaling
    return out


def _served_tensors(lora: Any) -> Iterator[torch.Tensor]:
    for weights in lora.loras.values():
        for part in (weights.lora_a, weights.lora_b):
            for t in part if isinstance(part, list) else [part]:
                if t is not None:
                    yield t


def _remember(
    worker: Any,
    lora: Any,
    held: dict[str, torch.Tensor] | None,
    scales: dict[int, float] | None,
    config: dict,
) -> None:
    """Record ``lora`` as refreshable if, once added, vLLM serves it from exactly the tensors
    ``held`` (one per key, none dropped or copied again: packing q/k/v keeps them as they are,
    an MoE stack does not), so that writing a new version into them is what a fresh install
    would build."""
    if held is None or scales is None or lora.modules_to_save:
        return
    served = {id(t) for t in _served_tensors(lora)}
    if len(served) != len(held) or any(id(t) not in served for t in held.values()):
        return
    _REFRESHABLE[lora] = _Refreshable(
        config=config,
        epoch=ledger.epoch(worker),
        keys=tuple(held),
        targets=tuple(held.values()),
        scales=tuple(scales.get(id(t), 1) for t in held.values()),
    )


def _refresh(
    worker: Any, inner: Any, tensors: dict[str, torch.Tensor], config: dict, lora_int_id: int
) -> bool:
    """Write a new version of the adapter installed under ``lora_int_id`` into vLLM's copy of
    it and into its slot, if that adapter is the one `install_adapter` built (the same
    ``LoRAModel``: a load by anyone else replaced it) with the same config, keys and shapes,
    and the worker saw no sleep, wake or base write since (its ledger's epoch: a level-2 sleep
    may discard the slot's memory while vLLM still counts the adapter active). Returns False,
    having written nothing, otherwise.

    The result is what a fresh install builds, bit for bit: each key copied into the tensor it
    was built into, then scaled in place as vLLM's ``optimize`` scaled it, then the slot
    rewritten as each layer's own ``set_lora`` writes it (`_write_slot`). The slot is not
    zeroed first, as ``set_lora`` does: while the adapter stays active its slot was last
    written by ``set_lora``'s copies from tensors of these very shapes, so the new write covers
    every element the old one did and the rest is still zero. Skipped are the parse of every key, the checks of a build, the
    allocation, the packing and the zeroing of the max-rank slot: most of an install.
    """
    lora = inner.get_adapter(lora_int_id)
    record = _REFRESHABLE.get(lora) if lora is not None else None
    if (
        record is None
        or record.epoch != ledger.epoch(worker)
        or record.config != config
        or tuple(tensors) != record.keys
    ):
        return False
    sources = [tensors[key].detach() for key in record.keys]
    if any(s.shape != t.shape for s, t in zip(sources, record.targets, strict=True)):
        return False
    try:
        _write_in_place(inner, lora, record, sources, lora_int_id)
    except BaseException:
        inner.remove_adapter(lora_int_id)  # part-written: served by no request, never a mix
        raise
    inner.add_adapter(lora)  # already registered: marks it recently used, as a re-add does
    inner.activate_adapter(lora_int_id)  # active: the same; evicted: activated from the copy
    return True


def _write_in_place(
    inner: Any, lora: Any, record: _Refreshable, sources: list[torch.Tensor], lora_int_id: int
) -> None:
    """`_refresh`'s writes: vLLM's copy of the adapter, then its slot if it is active.

    A factor vLLM scaled (``lora_b`` by ``alpha / r``) is written scaled in one pass
    (``torch.mul(..., out=)``) when it arrives in the dtype and on the device vLLM holds it:
    the product is then rounded once either way, so it is bitwise the copy-then-scale of a
    fresh build, for one pass over the factor instead of two (a per-call cost on the hot path
    of every adapter sync; docs/benchmarks.md). Any other factor is copied as it is (one
    ``_foreach_copy_`` per device pair) and then scaled in place, as ``optimize`` does."""
    copies: dict[tuple[torch.device, torch.device], tuple[list, list]] = {}
    scaled: dict[float, list[torch.Tensor]] = {}
    for s, t, scale in zip(sources, record.targets, record.scales, strict=True):
        if scale != 1 and s.dtype == t.dtype and s.device == t.device:
            torch.mul(s, scale, out=t)
            continue
        into, source = copies.setdefault((s.device, t.device), ([], []))
        into.append(t)
        source.append(s)
        if scale != 1:
            scaled.setdefault(scale, []).append(t)
    for (source_device, target_device), (into, source) in copies.items():
        if source_device == target_device:
            torch._foreach_copy_(into, source)
        else:
            for s, t in zip(source, into, strict=True):
                t.copy_(s)
    for scale, group in scaled.items():
        torch._foreach_mul_(group, scale)  # as optimize() scaled the fresh copy
    if lora_int_id in inner.lora_index_to_id:
        _write_slot(inner, lora, inner.lora_index_to_id.index(lora_int_id), record.targets)


# The layers' own ``set_lora`` whose only effect is copies of (views of) the adapter's tensors
# into (views of) the layer's ``lora_a_stacked`` / ``lora_b_stacked``: the slicing of each
# packed or tensor-parallel layout, ``reset_lora`` (skipped here), ``copy_`` (read in vLLM 0.32).
_PURE_SET_LORA = frozenset(
    {
        "BaseLinearLayerWithLoRA.set_lora",
        "MergedColumnParallelLinearWithLoRA.set_lora",
        "MergedColumnParallelLinearVariableSliceWithLoRA.set_lora",
    }
)


@dataclass(frozen=True)
class _SlotCopies:
    """The copies the layers' ``set_lora`` made into one slot, as recorded (`_write_slot`): each
    from a view of a tensor vLLM's copy of the adapter holds into a view of a layer's stack."""

    index: int
    layers: tuple[tuple[Any, Any, Any], ...]  # (layer, its lora_a_stacked, its lora_b_stacked)
    into: tuple[torch.Tensor, ...]
    source: tuple[torch.Tensor, ...]

    def current(self, index: int) -> bool:
        """Whether the copies still reach this slot: the same index, and every layer still holds
        the stacks they were recorded into."""
        return index == self.index and all(
            layer.lora_a_stacked is a and layer.lora_b_stacked is b for layer, a, b in self.layers
        )

    def replay(self) -> None:
        if all(d.device == s.device for d, s in zip(self.into, self.source, strict=True)):
            torch._foreach_copy_(list(self.into), list(self.source))
            return
        for d, s in zip(self.into, self.source, strict=True):
            d.copy_(s, non_blocking=True)


# vLLM's copy of an adapter (``LoRAModel``) -> the copies that write it into its slot.
_SLOTS: weakref.WeakKeyDictionary[Any, _SlotCopies] = weakref.WeakKeyDictionary()


def _write_slot(inner: Any, lora: Any, index: int, held: Iterable[torch.Tensor]) -> None:
    """Write ``lora`` into slot ``index`` of every layer it has weights for, as each layer's own
    ``set_lora`` does (without zeroing the slot first: `_refresh`).

    ``set_lora`` is called per layer: about a hundred Python calls of slicing and copies, most
    of an adapter sync's time in vLLM, for a few megabytes. So the first write records the
    copies it makes (`_Copies`) and a later one into the same slot replays them in one
    ``_foreach_copy_``: the same copies from the same views, bitwise the same slot. Recorded
    only when every layer's ``set_lora`` is one read to slice and copy, nothing else
    (`_PURE_SET_LORA`), no call under it wrote a tensor but by ``copy_``, and every copy read a
    view of the adapter's ``held`` tensors (a slice vLLM assembled anew, as ``torch.cat`` of
    tensor-parallel q/k/v shards, is not one) into a view of that layer's stacks; else
    ``set_lora`` is called every time."""
    kept = _SLOTS.get(lora)
    if kept is not None and kept.current(index):
        kept.replay()
        return
    _SLOTS.pop(lora, None)
    layers = []
    pure = True
    with _Copies() as copies:
        for name, module in inner.modules.items():
            weights = inner._get_lora_layer_weights(lora, name)
            if weights:
                pure = pure and type(module).set_lora.__qualname__ in _PURE_SET_LORA
                layers.append(
                    (
                        module,
                        getattr(module, "lora_a_stacked", ()),
                        getattr(module, "lora_b_stacked", ()),
                    )
                )
                with _slot_not_zeroed(module):
                    module.set_lora(index, weights.lora_a, weights.lora_b)
    sources = {t.untyped_storage().data_ptr() for t in held}
    slots = {t.untyped_storage().data_ptr() for _, a, b in layers for t in (*a, *b)}
    if (
        pure
        and not copies.other
        and all(
            d.untyped_storage().data_ptr() in slots and s.untyped_storage().data_ptr() in sources
            for d, s in copies.made
        )
    ):
        into, source = zip(*copies.made, strict=True) if copies.made else ((), ())
        _SLOTS[lora] = _SlotCopies(index, tuple(layers), tuple(into), tuple(source))


class _Copies(torch.overrides.TorchFunctionMode):
    """Records every ``Tensor.copy_`` made under it (``made``: (into, source)) and the name of
    every other call that may write a tensor (``other``: an in-place op, an item assignment, an
    ``out=``), running them all as they are."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.other: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func is torch.Tensor.copy_:
            self.made.append((args[0], args[1]))
        elif (
            "out" in kwargs
            or (name.endswith("_") and not name.startswith("__"))
            or (name.startswith("__") and name not in _READS)
        ):
            self.other.append(name)
        return func(*args, **kwargs)


# Dunder calls ``set_lora`` makes that only read (the rest count as writes).
_READS = frozenset({"__getitem__", "__get__", "__len__", "__bool__", "__index__", "__int__"})


@contextmanager
def _slot_not_zeroed(module: Any) -> Iterator[None]:
    """``module.set_lora`` without its ``reset_lora`` of the whole max-rank slot."""
    module.reset_lora = lambda index: None
    try:
        yield
    finally:
        del module.reset_lora
