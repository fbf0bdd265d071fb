"""What weightsync does to the model vLLM built, inside the process that holds it.

Every function takes a vLLM worker (or the wrapper ``collective_rpc`` hands a callable), so the
same code runs in a worker process (through the worker extension and the weight-transfer
backend) and in the trainer's process for an in-process ``LLM``
(``llm.collective_rpc(model_ops.reload, ...)``, tensors by reference):

- `reload`: vLLM's layerwise reload, which leaves the engine serving when it fails part-way;
- `abandon_layerwise_reload`: the recovery itself;
- `claim_staged`: a staged sync claimed for its commit on every worker of the engine, or on none;
- `repack_cpu_moe`: the CPU expert prepack vLLM-CPU's reload skips;
- `unwritten_twins` / `refresh`: a tied head an update wrote under the embedding's name only;
- `onednn_scales_kept`: keeps alive what vLLM-CPU's INT8 (oneDNN) kernel points at across a reload;
- `read_facts`: what the engine loads and serves (`EngineFacts`), from the model it built;
- `held_dtypes`: the weights it holds in another dtype than it computes in (float32 routers);
- `tied_parameter_names` / `fold_tied`: tied names, which a checkpoint stores once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any

import torch

from ....errors import (
    StageExpiredError,
    UnsupportedModelError,
    WeightMismatchError,
    WeightSyncError,
)
from ....wire import format as fmt
from ....wire.checkpoint_names import checkpoint_shapes
from ....wire.protocol import RELOAD_REPORT, EngineFacts, LoraLimits, Outcome, Quantization
from ....wire.stage import Held
from . import checkpoint as ckpt
from .heap import keep_freed_memory
from .ledger import kv_cache_awake, worker_of


def reload(
    obj: Any,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    path: str = "",
    expected: Collection[str] = (),
) -> Outcome:
    """Load checkpoint-format ``weights`` (or vLLM's own read of the folder ``path``) with vLLM's
    layerwise reload (``reload_weights``), re-running the engine's post-load processing, and
    leave the engine serving if it fails.

    Why this path: it takes checkpoint names (unfused q/k/v, gate/up), loads layer by layer and
    re-processes each layer; a raw ``model.load_weights`` corrupts weights that processing
    reshaped (vllm#42821, #17429) and fails outright on the CPU backend (repacked linear
    parameters have shape ``(0,)``).

    Why the recovery: vLLM 0.32's reload has no cleanup. If the iterator (or a loader) raises,
    every unfinished layer stays on the meta device with its loaders wrapped, so the next
    generate fails ("Tensor on device meta") and kills the engine core, and every later reload
    fails too. On failure `abandon_layerwise_reload` gives every unfinished layer its previous
    tensors back: the layers the reload had finished keep their new weights, a mix of old and
    new, and the returned outcome says so (the caller must resync everything).

    The outcome's value is a `RELOAD_REPORT` of what the reload did to the weights, which the
    server's middleware reads (``server_lease.py``): on failure ``{"written": [...]}``, the
    layers it had finished (empty: the weights are the old ones, whole); on success
    ``{"complete": ...}``, whether every name of ``expected`` (the engine's weights) was
    loaded: a full restore.

    After a completed reload the KV cache is cleared (`clear_kv_cache`): blocks filled under the
    weights it replaced may hold NaN.

    Returns the outcome instead of raising (see ``wire.protocol``); an interrupt
    (``KeyboardInterrupt``) is re-raised after the recovery."""
    worker = worker_of(obj)
    rank = int(getattr(worker, "rank", 0) or 0)
    seen: set[str] = set()
    keep_freed_memory(worker)  # the next reload reuses this one's memory (``heap.py``)
    try:
        model = worker.model_runner.get_model()
        with onednn_scales_kept(model):
            if path:
                worker.reload_weights(weights_path=path)
            else:
                worker.reload_weights(
                    weights_iterator=_noting(weights or (), seen), is_checkpoint_format=True
                )
        if has_cpu_moe(model):
            repack_cpu_moe(model)
        clear_kv_cache(worker)
    except BaseException as e:
        written = finished_layers(worker)
        abandon(worker)
        if not isinstance(e, Exception):
            raise
        failed = Outcome.failed(e, rank=rank)
        return dataclasses.replace(failed, value={RELOAD_REPORT: {"written": written}})
    complete = bool(expected) and all(name in seen for name in expected)
    return Outcome(rank=rank, value={RELOAD_REPORT: {"complete": complete}})


def clear_kv_cache(obj: Any) -> None:
    """Zero every KV-cache block of this worker, if its cache is in memory (`kv_cache_awake`);
    if it sleeps, at its wake (the ledger's ``at_kv_wake``).

    Why: weights weightsync did not write (another client's, a wake without restore) may have
    made NaN, and their requests' keys and values stay in the blocks: a prefix-cache reset
    forgets which prompt a block held but not what it holds, and an attention kernel that
    reads the unwritten slots of a reused block multiplies them by weight 0 -- NaN again. A
    reload is where the weights change, so every completed one leaves no block from before
    (docs/failure-modes.md, row 38); requests in flight recompute theirs after it (the prefix
    cache reset every write makes). Cost: one pass over the cache's memory
    (docs/benchmarks.md).

    A cache asleep is not touched (a GPU's is unmapped memory) but is not trusted either: RL
    frameworks sync between the weights' wake and the cache's, and a cache that slept may keep
    its contents (vLLM-CPU's sleep frees nothing), so it is cleared when it wakes."""
    worker = worker_of(obj)
    ledger = getattr(worker, "_weightsync_ledger", None)
    if not kv_cache_awake(worker):
        if ledger is not None:
            ledger.at_kv_wake = functools.partial(clear_kv_cache, worker)
        return
    if ledger is not None:
        ledger.at_kv_wake = None
    with torch.no_grad():
        for cache in _tensors(getattr(worker.model_runner, "kv_caches", None)):
            cache.zero_()


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value``, which may nest them in lists and tuples (per layer, per
    virtual engine)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


def _noting(
    weights: Iterable[tuple[str, torch.Tensor]], seen: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        seen.add(name)
        yield name, tensor


def finished_layers(obj: Any) -> list[str]:
    """The layers (module names) a pending layerwise reload on this worker's model has already
    finished: their new weights are in place, and abandoning the reload keeps them. Empty when
    no reload is pending (none started, or it completed)."""
    try:
        model = worker_of(obj).model_runner.get_model()
    except Exception:  # noqa: BLE001 (no model: nothing was written)
        return []
    return finished_in(model)


def finished_in(model: torch.nn.Module) -> list[str]:
    """`finished_layers` of ``model`` itself (the weight-transfer backend holds the model, not
    the worker)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    pending, finished = False, []
    for name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None:
            continue
        if info.can_load():  # initialized by this reload and not processed yet
            pending = True
        elif any(p is not None for p in layer._parameters.values()):
            finished.append(name)  # processed (its info reset): its new tensors are in place
    return finished if pending else []


def check_loadable(
    pairs: Iterable[tuple[str, Any]], expected: Mapping[str, tuple[int, ...]]
) -> None:
    """Refuse staged ``(name, tensor or shape)`` pairs holding a tensor this engine does not
    load, or of another shape: vLLM's reload would fail on it part-way, after the layers before
    it were written.

    Raises:
        WeightMismatchError: naming the first such tensor.
    """
    for name, tensor in pairs:
        shape, want = tuple(getattr(tensor, "shape", tensor)), expected.get(name)
        if want is None:
            raise WeightMismatchError(
                f"{name!r} is not a weight this engine loads: nothing of the stream was loaded"
            )
        if shape != tuple(want):
            raise WeightMismatchError(
                f"{name!r} has shape {shape}, the engine loads {tuple(want)}: "
                "nothing of the stream was loaded"
            )


def claim_staged(
    stage: Held | None, refusal: BaseException | None = None
) -> list[tuple[str, torch.Tensor]]:
    """The pairs ``stage`` holds, claimed for the commit that loads them (`Held.claim`:
    they no longer expire) -- on every worker of the engine or on none. Each worker's stage
    expires by its own clock (``WEIGHTSYNC_STAGE_EXPIRY_S``), so a commit that comes as they
    expire could find one TP rank's stage claimed and another's dropped: loaded, that would be
    a mix across ranks. Every worker claims, then all vote (`every_worker`); one refusal
    refuses the commit everywhere. Every worker of the engine must call this, whatever it
    holds (a ``collective_rpc`` method runs on all): ``stage`` None votes no, as does a
    ``refusal`` (this worker's reason, raised here: the commit named another stage).

    Raises:
        StageExpiredError: this worker's stage, or another worker's, expired.
        Exception: this worker's own reason to refuse (``nothing is staged``, a failed stage).
    """
    pairs: list[tuple[str, torch.Tensor]] = []
    error: BaseException | None = None
    try:
        if refusal is not None:
            raise refusal
        if stage is None:
            raise RuntimeError("nothing is staged")
        pairs = stage.claim()
    except Exception as e:  # noqa: BLE001 (voted, then raised)
        error = e
    if every_worker(error is None):
        return pairs
    if error is None:  # claimed here; the caller lets this worker's stage go
        error = StageExpiredError(
            "another worker of this engine no longer holds its stage of this sync (its expiry "
            "ran out, or its stage failed): no worker loads it; nothing of it was loaded"
        )
    raise error


def every_worker(yes: bool) -> bool:
    """Whether every worker of this engine says ``yes``: the minimum over its tensor-,
    context- and pipeline-parallel groups (vLLM's CPU groups; the three span the engine's
    workers, not other data-parallel replicas). A collective: every worker must call it."""
    from vllm.distributed import parallel_state

    vote = torch.tensor([int(yes)])
    for group in (
        parallel_state.get_tp_group(),
        parallel_state.get_pcp_group(),
        parallel_state.get_pp_group(),
    ):
        if group.world_size > 1:
            torch.distributed.all_reduce(
                vote, op=torch.distributed.ReduceOp.MIN, group=group.cpu_group
            )
    return bool(vote.item())


def part_loaded(model: torch.nn.Module) -> list[str]:
    """The layers (module names) a pending layerwise reload of ``model`` loaded some weights of
    but not all: vLLM's finish would process them with the rest of their tensors freshly
    allocated and never written (garbage, served without an error; an update that sends q_proj
    but not k_proj and v_proj of a fused qkv_proj is one). Empty when none, or no reload is
    pending."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    return [
        name
        for name, layer in model.named_modules()
        if (info := LAYERWISE_INFO.get(layer)) is not None and info.can_load() and info.load_numel
    ]


def tied_modules(model: torch.nn.Module) -> list[list[tuple[str, torch.nn.Module]]]:
    """Groups of different modules (name, module) that hold one parameter between them (a
    tied ``lm_head`` and the embedding). Read while no reload is pending: a pending layerwise
    reload gives each module tensors of its own on the meta device."""
    holders: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():  # each module once, under its first name
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), []).append((name, module))
    return [group for group in holders.values() if len(group) > 1]


def unwritten_twins(
    groups: Iterable[list[tuple[str, torch.nn.Module]]],
) -> list[tuple[str, torch.nn.Module]]:
    """The modules of tied ``groups`` (`tied_modules`) a pending layerwise reload has not
    loaded although another module of their group was loaded: an update that sent the shared
    tensor under one of its names (as a push of ``named_parameters()`` does). vLLM's finish
    gives them their previous tensors back -- the shared parameter, which now holds the new
    values -- but what their post-load processing derived from it is the old value's:
    vLLM-CPU's packed copy of a tied head stays stale, served without an error."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    def loaded(module: torch.nn.Module) -> bool:
        info = LAYERWISE_INFO.get(module)
        # processed once whole (its info reset), or loaded in part
        return info is not None and (not info.can_load() or info.load_numel > 0)

    stale: list[tuple[str, torch.nn.Module]] = []
    for group in groups:
        marks = [loaded(m) for _, m in group]
        if any(marks):
            stale += [twin for twin, mark in zip(group, marks, strict=True) if not mark]
    return stale


def refreshable(module: torch.nn.Module) -> bool:
    """Whether re-running ``module``'s post-load processing on its current parameters is what
    a load of them would have done: proven for vLLM's unquantized embedding and head (their
    processing only derives kernel copies from the weight), which is what a tied head is;
    another method may transform the tensors it is given, so running it twice is not."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return type(getattr(module, "quant_method", None)) is UnquantizedEmbeddingMethod


def refresh(twins: Iterable[tuple[str, torch.nn.Module]]) -> None:
    """Re-run the post-load processing of ``twins`` (`unwritten_twins`, each `refreshable`)
    after vLLM's finish, so what they derive from the shared parameter is its new value's."""
    for _, module in twins:
        module.quant_method.process_weights_after_loading(module)  # type: ignore[union-attr,operator]


def abandon(obj: Any) -> dict[str, Any]:
    """`abandon_layerwise_reload` on this worker's model: a `RELOAD_REPORT` whether a reload
    was pending and which layers it had finished (`finished_layers`: they keep their new
    weights)."""
    worker = worker_of(obj)
    written = finished_layers(worker)
    pending = abandon_layerwise_reload(
        worker.model_runner.get_model(), worker.vllm_config.model_config
    )
    return {RELOAD_REPORT: {"pending": pending, "written": written}}


def abandon_layerwise_reload(model: torch.nn.Module, model_config: Any) -> bool:
    """Undo an interrupted vLLM layerwise reload: drop what layers cut mid-way had buffered
    (vLLM would process them with their missing parts uninitialised: NaN, which then also
    poisons the KV cache) and finish the reload as vLLM does, which gives every unfinished
    layer its previous tensors back. Safe when nothing is pending; returns whether anything
    was."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        finalize_layerwise_reload,
    )

    pending = False
    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is not None and info.can_load():
            pending = True
            info.loaded_weights = []
            info.load_numel = 0
    if pending:
        finalize_layerwise_reload(model, model_config)
    return pending


def _cpu_experts(module: torch.nn.Module) -> Any:
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    return getattr(kernel, "fused_experts", None)


def has_cpu_moe(model: torch.nn.Module) -> bool:
    """Whether the model has MoE layers running on vLLM's CPU expert kernel."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    return any(isinstance(_cpu_experts(m), CPUUnquantizedExperts) for m in model.modules())


def repack_cpu_moe(model: torch.nn.Module) -> None:
    """Prepack the experts of every MoE layer for vLLM's CPU kernel.

    vLLM-CPU 0.32's reload copies new expert weights in but skips the experts' own
    ``process_weights_after_loading`` (the CPU prepack), so after any reload -- vLLM's own from
    disk included -- the experts hold the checkpoint layout and the engine silently computes
    wrong outputs (measured on Qwen3-MoE and Mixtral after reloading identical weights; see
    docs/failure-modes.md). Run after every complete reload.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for module in model.modules():
        experts = _cpu_experts(module)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)


def _onednn_kernels(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """(layer, kernel) of every linear layer running on vLLM-CPU's INT8 oneDNN kernel."""
    try:
        from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel
    except ImportError:  # a vLLM build without the CPU kernels: nothing to keep
        return []

    found = []
    for layer in model.modules():
        kernel = getattr(getattr(layer, "scheme", None), "kernel", None)
        if isinstance(kernel, CPUInt8ScaledMMLinearKernel):
            found.append((layer, kernel))
    return found


@contextlib.contextmanager
def onednn_scales_kept(model: torch.nn.Module) -> Iterator[None]:
    """Keep alive, after a reload, the ``weight_scale`` tensor vLLM-CPU's INT8 oneDNN kernel
    points at (compressed-tensors W8A8-INT8 engines).

    Why: the kernel's post-load processing builds a oneDNN handler that stores the *address*
    of the layer's ``weight_scale`` (``create_onednn_scaled_mm``; ``csrc/cpu/dnnl_kernels.cpp``
    keeps ``b_scales.data_ptr()``). vLLM's layerwise reload runs that processing on fresh
    tensors, copies their values into the layer's previous tensors and drops the fresh ones
    (``model_loader/reload/layerwise.py``, ``_copy_and_restore_kernel_tensors``): the new
    handler then reads freed memory. Measured: after any reload, even of identical weights, NaN
    logprobs and token 0 everywhere (tests/test_quantized_vllm.py shows it with vLLM's own
    reload). Holding the tensor the handler was built on, on the kernel object, until the next
    processing replaces both, makes the reload exact (bitwise equal to a fresh engine).

    During the reload each such kernel's ``process_weights_for_onednn`` is wrapped (on the
    instance, removed afterwards) to take that reference right after the handler is built.

    A layer the reload sent nothing for gets its previous tensors back, but not the ``weight``
    attribute the kernel set to None once the handler held the weight (vLLM restores tensors
    only), and its next forward fails ("no attribute 'weight'"); the attribute is put back, so
    such a layer serves what it held (its handler and scale are untouched).
    """
    kernels = _onednn_kernels(model)
    for _, kernel in kernels:
        kernel.process_weights_for_onednn = _keeping(kernel)
    try:
        yield
    finally:
        for layer, kernel in kernels:
            del kernel.process_weights_for_onednn  # the class's method again
            weight_name = kernel.layer_param_names[0]
            if not hasattr(layer, weight_name):
                layer.register_parameter(weight_name, None)


def _keeping(kernel: Any) -> Any:
    build = type(kernel).process_weights_for_onednn
    scale_name = kernel.layer_param_names[1]

    def process_weights_for_onednn(layer: torch.nn.Module) -> None:
        build(kernel, layer)
        # the tensor the handler just stored the address of (replaced on the layer after this)
        kernel.weightsync_handler_scale = getattr(layer, scale_name)

    return process_weights_for_onednn


def quantization(config: Any, model: torch.nn.Module) -> Quantization | None:
    """The engine's `Quantization` from its vLLM config (None: unquantized), with the modules
    it holds quantized (`quantized_module_names`)."""
    model_config = config.model_config
    found = Quantization.read(
        model_config.quantization,
        getattr(model_config.hf_config, "quantization_config", None),
        getattr(config.cache_config, "cache_dtype", None),
        quantized_module_names(model),
    )
    # Online torchao takes its config from hf_overrides (a JSON or a file), not the checkpoint:
    # report the config vLLM runs, as torchao serializes it, so verification runs the same one.
    torchao_config = getattr(getattr(config, "quant_config", None), "torchao_config", None)
    if found is not None and not found.prequantized and torchao_config is not None:
        from torchao.core.config import config_to_dict  # type: ignore[import-untyped, unused-ignore]

        found = dataclasses.replace(found, config={"torchao": config_to_dict(torchao_config)})
    if found is not None and found.modules:
        found = dataclasses.replace(found, unrunnable=kernel_failure(model, model_config.dtype))
    return found


@torch.no_grad()
def kernel_failure(model: torch.nn.Module, dtype: torch.dtype) -> str:
    """Why this worker cannot run the model's quantized linear layers ("" if it can): one token
    through one layer of each quantization method and scheme, as a forward would call it.

    vLLM starts an engine whose scheme needs a kernel its CPU build lacks (W4A16's
    ``cpu_gemm_wna16`` exists only for some ISAs) and fails at its first forward. A sync into it
    would write, then leave an engine that cannot generate; asked here once, with the facts,
    a plan refuses it before any write, naming the kernel."""
    from vllm.model_executor.layers.linear import LinearBase

    tried = set()
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(module, LinearBase) or method is None:
            continue
        kind = (type(method), type(getattr(module, "scheme", None)))
        if type(method).__name__.startswith("Unquantized") or kind in tried:
            continue
        tried.add(kind)
        device = next(module.parameters()).device
        token = torch.zeros(1, module.input_size_per_partition, dtype=dtype, device=device)
        try:
            method.apply(module, token)
        except (AttributeError, NotImplementedError, RuntimeError) as error:
            return f"{name.removesuffix('.base_layer')} ({type(method).__name__}): {error}"
    return ""


def quantized_module_names(model: torch.nn.Module) -> tuple[str, ...]:
    """Checkpoint names of the modules whose quantization method is not one of vLLM's
    ``Unquantized*`` methods; a fused module (``qkv_proj``) expands to the checkpoint modules
    it packs (``packed_modules_mapping``: q/k/v_proj), LoRA's ``.base_layer`` is dropped."""
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    names = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or type(method).__name__.startswith("Unquantized"):
            continue
        path, _, leaf = name.removesuffix(".base_layer").rpartition(".")
        names += [f"{path}.{part}" if path else part for part in packed.get(leaf, [leaf])]
    return tuple(dict.fromkeys(names))


def quantized_entries(
    files: Iterable[str], layout: dict[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """The quantized tensors a pre-quantized checkpoint's ``files`` hold (``weight_scale``,
    ``weight_packed``, ``weight_shape``, ...): every entry of a module the model has
    (``layout``: its checkpoint names) that the unquantized model does not. The transformers
    model a config builds knows only ``<module>.weight``; vLLM loads these instead or beside it,
    so they are part of the contract a sync is checked against."""
    modules = {name.rsplit(".", 1)[0] for name in layout}
    return {
        name: shape
        for name, shape in fmt.shapes(list(files)).items()
        if name not in layout and name.rsplit(".", 1)[0] in modules
    }


def tied_parameter_names(model: torch.nn.Module) -> list[list[str]]:
    """Groups of names under which one parameter of the model is registered (tied embeddings),
    in checkpoint form (LoRA's ``.base_layer`` removed).

    One module registered twice (Qwen3-MoE's router is both ``mlp.gate`` and
    ``mlp.experts.gate``) is not a twin: its parameter is loaded once, under the module's first
    name. Only different modules sharing a parameter (a tied ``lm_head``) are.
    """
    by_param: dict[int, dict[tuple[int, str], str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        path, _, leaf = name.rpartition(".")
        owner = model.get_submodule(path) if path else model
        names = by_param.setdefault(id(p), {})
        names.setdefault((id(owner), leaf), name.replace(".base_layer.", "."))
    return [list(names.values()) for names in by_param.values() if len(names) > 1]


def fold_tied(
    groups: Iterable[Iterable[str]], shapes: dict[str, Any]
) -> tuple[list[tuple[str, ...]], dict[str, list[str]]]:
    """Fold tied-name ``groups`` into a checkpoint's ``shapes`` (name -> shape, updated in place):
    a name of a group the checkpoint lacks (it stores a tied tensor once) gets the shape of the
    name it has. Returns the groups the checkpoint knows and its twins (stored name -> the
    group's other names): the names a load from those files must also send the stored tensor
    under, or vLLM's layerwise reload leaves the twin (``lm_head``) as it was."""
    twins: dict[str, list[str]] = {}
    shared = []
    for group in groups:
        names = tuple(group)
        known = [n for n in names if n in shapes]
        if not known:
            continue
        for name in names:
            if name not in shapes:
                shapes[name] = shapes[known[0]]
                twins.setdefault(known[0], []).append(name)
        shared.append(names)
    return shared, twins


def lora_modules(model: torch.nn.Module) -> set[str]:
    """The module names vLLM's LoRA manager accepts, as its adapter loader expands them: every
    linear layer, named by its last path component (the parent's name once LoRA wrapped it as
    ``.base_layer``), packed layers expanded (``qkv_proj`` -> q/k/v), plus embedding modules."""
    from vllm.model_executor.layers.linear import LinearBase

    packed = getattr(model, "packed_modules_mapping", {}) or {}
    names = set(getattr(model, "embedding_modules", {}) or {})
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            leaf = name.removesuffix(".base_layer").rsplit(".", 1)[-1]
            names.update(packed.get(leaf, [leaf]))
    return names


def read_facts(obj: Any, checkpoint: str = "") -> EngineFacts:
    """What this engine loads and serves, from the model vLLM built and the files its loader
    picked (``checkpoint.py``); ``checkpoint``: the folder it was started from, when vLLM's
    config no longer names it (it repoints ``model_config.model`` at any folder it reloads).

    Raises:
        WeightSyncError: anything that stops the reading, as a weightsync error naming the
            engine's architecture (`UnsupportedModelError` for an error of another library):
            an engine weightsync cannot read is refused before anything is written.
    """
    worker = worker_of(obj)
    config = worker.vllm_config
    try:
        return _read_facts(worker, config, checkpoint)
    except WeightSyncError:
        raise
    except Exception as err:
        raise UnsupportedModelError(
            f"{architecture_of(config.model_config.hf_config)} engine: weightsync cannot read "
            f"what it loads ({type(err).__name__}: {err}); nothing was written"
        ) from err


def architecture_of(hf_config: Any) -> str:
    """The architecture an engine's model config names (``Qwen2ForCausalLM``): its first
    ``architectures`` entry, else its ``model_type``."""
    names = getattr(hf_config, "architectures", None) or []
    return str(names[0]) if names else str(getattr(hf_config, "model_type", "unknown"))


def _read_facts(worker: Any, config: Any, checkpoint: str) -> EngineFacts:
    model = worker.model_runner.get_model()
    model_config = config.model_config
    folder = checkpoint or ckpt.local_folder(model_config.model, model_config.revision)
    files = ckpt.weight_files(folder, config.load_config)
    meta_model = ckpt.config_model(
        model_config.hf_config, model_config.trust_remote_code, vllm_config=config
    )
    read = ckpt.loads_files(config.load_config)
    shapes = dict(ckpt.loaded_shapes(meta_model, files if read else None))
    layout = checkpoint_shapes(meta_model)
    quant = quantization(config, model)
    if quant is not None and quant.prequantized and read:
        shapes.update(quantized_entries(files, layout))
    # A name vLLM registers a tensor under that no checkpoint of the model holds is no name the
    # engine loads: GLM-4-MoE's and DeepSeek-V3's experts module holds the gate's
    # ``e_score_correction_bias`` too, and DeepSeek-V3's loader refuses that name (KeyError).
    groups = [[n for n in group if n in layout] for group in tied_parameter_names(model)]
    tied, _ = fold_tied([group for group in groups if len(group) > 1], shapes)
    lora = None
    if config.lora_config is not None:
        limits = config.lora_config
        lora = LoraLimits(
            limits.max_lora_rank,
            tuple(sorted(lora_modules(model))),
            limits.max_loras,
            limits.max_cpu_loras or limits.max_loras,
        )
    return EngineFacts(
        dtype=str(model_config.dtype).removeprefix("torch."),
        architecture=architecture_of(model_config.hf_config),
        weights=shapes,
        tied=tuple(tied),
        lora=lora,
        quantization=model_config.quantization,
        quantized=quant,
        attests=True,
        # A CPU MoE engine re-packs every MoE layer after a load, so a layer left out of a
        # sync would be packed twice: every sync must send every layer.
        keeps_unsent_layers=not has_cpu_moe(model),
        checkpoint=folder,
        files=tuple(files),
        world_size=config.parallel_config.world_size,
        cpu=cpu_capability(),
        held=held_dtypes(model, shapes, model_config.dtype),
    )


#: The floating dtypes a weight can be held in unquantized; a quantized one (float8, int8,
#: packed int32) is the quantization's business (``trainer/quantize.py``), not reported here.
_FLOATING = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_LAYER = re.compile(r"^(.*?\.\d+)\.")


def held_dtypes(
    model: torch.nn.Module, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype
) -> dict[str, str]:
    """Checkpoint name -> dtype name of every weight of ``shapes`` (the names the engine loads)
    that ``model`` holds in a floating dtype other than ``dtype``, read from its parameters.

    vLLM's name for a parameter is usually the checkpoint's. Where a model's loader renames
    (Ernie 4.5 MoE holds ``mlp.moe_statics.e_score_correction_bias`` as
    ``mlp.gate.e_score_correction_bias``), the parameter stands for every loaded name of the
    same decoder layer (or, outside layers, of no layer) with the same last component and
    number of elements; reporting one too many costs a few bytes (a weight sent in float32 into
    a bfloat16 parameter is rounded by the engine as the trainer would have), one too few a
    rounded router. A fused parameter (``qkv_proj``, ``w13_weight``) is built in the engine's
    dtype by vLLM's linear and expert layers, but its processing may convert part of it after
    the load (vLLM-CPU's small-GEMM kernel keeps a linear's bias in float32, so a Qwen2
    ``qkv_proj.bias`` ends float32 in a bfloat16 engine): it stands for the checkpoint names it
    packs (``packed_modules_mapping``), so they are sent unrounded, as vLLM's own load of the
    trainer's checkpoint into the running engine writes them.
    """
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    by_scope: dict[tuple[str, str, int], list[str]] = {}
    for name, shape in shapes.items():
        layer = _LAYER.match(name)
        key = (layer.group(1) if layer else "", name.rsplit(".", 1)[-1], _numel(shape))
        by_scope.setdefault(key, []).append(name)
    held: dict[str, str] = {}
    for vllm_name, p in model.named_parameters():
        if p.dtype == dtype or p.dtype not in _FLOATING:
            continue
        name = vllm_name.replace(".base_layer.", ".")
        path, _, leaf = name.rpartition(".")
        module_path, _, module = path.rpartition(".")
        parts = [
            f"{module_path}.{part}.{leaf}" if module_path else f"{part}.{leaf}"
            for part in packed.get(module, ())
        ]
        if name in shapes:
            names = [name]
        elif parts and all(part in shapes for part in parts):
            names = parts
        else:
            layer = _LAYER.match(name)
            names = by_scope.get(
                (layer.group(1) if layer else "", name.rsplit(".", 1)[-1], p.numel()), []
            )
        for found in names:
            held[found] = str(p.dtype).removeprefix("torch.")
    return held


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def cpu_capability() -> str:
    """The instruction set this worker's CPU kernels run on ("" off a CPU platform): which
    kernels vLLM-CPU picks, and so how a quantized layer rounds, depends on it."""
    from vllm.platforms import current_platform

    return torch.backends.cpu.get_cpu_capability() if current_platform.is_cpu() else ""


def checkpoint_twins(files: Iterable[str], tied: Iterable[Iterable[str]]) -> dict[str, list[str]]:
    """The names checkpoint ``files`` store a tied tensor under (one header read), each with the
    names of its group they lack: a load from them must send the tensor under those too (see
    `fold_tied`); ``format.read(files, twins)`` does."""
    _, twins = fold_tied(tied, dict(fmt.shapes(files)))
    return twins
