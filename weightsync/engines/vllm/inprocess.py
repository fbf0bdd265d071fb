"""Adapter for an in-process vLLM engine (the one a colocated trainer already created).

The engine is a ``vllm.LLM`` (TRL, verl, most scripts) or the ``LLMEngine`` inside one, which
frameworks also hold directly (ms-swift's ``GRPOVllmEngine`` keeps it as ``.engine``, built with
``LLMEngine.from_engine_args``). Every call weightsync makes exists on ``LLMEngine`` under the
same name as on ``LLM`` (``collective_rpc``, ``reset_prefix_cache``, ``sleep``, ``wake_up``),
and generation goes through its public ``add_request`` / ``step`` (``control.run_requests``),
so the adapter needs nothing of ``LLM.__init__``.

Why these engine calls and not others (see also ``docs/engines.md``):

- Weights go through ``collective_rpc(model_ops.reload, ...)``: vLLM's layerwise
  ``reload_weights`` with the recovery every weightsync write has (``in_engine/model_ops.py``
  says why each), the same code a worker process runs. The iterator is passed by reference, so
  this adapter needs the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
  before the ``LLM`` is created).
- Adapters are built from the trainer's tensors inside the worker (``lora.py``: vLLM's own
  validation and ``LoRAModel.from_lora_tensors``, replacing the adapter under one stable id, or,
  with ``adapter_versions=N``, each version under an id of its own, the last N kept loaded), with
  no file round trip. Where this vLLM lacks a piece that path needs, the adapter is written to
  tmpfs and added with vLLM's public ``add_lora(load_inplace=True)`` instead (re-adding a loaded
  id without ``load_inplace`` keeps the old one).
- ``reload_weights`` resets vLLM's LoRA state, and a request carrying a ``LoRARequest`` reloads the
  adapter from its path on demand. The in-memory adapter's path never exists, and after a base
  write the folder is removed until the next adapter load, so a stale request fails loudly
  instead of applying an old adapter on top of merged weights (LoRA counted twice,
  ms-swift#8233). A level-2 sleep forgets the adapter too.
- The prefix cache is reset after every base write, requests in flight included (their KV is
  recomputed), or prompts cached under old weights are answered from old KV: vLLM's block hash
  covers the tokens and the adapter's name and path, not the weights. Each adapter version has
  a path of its own, so its blocks are never those of another version.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Hashable, Iterable
from pathlib import Path
from typing import Any

import torch

from ... import errors, timing
from ...errors import AdapterError, NoCheckpointError
from ...plan import Adapter
from ...wire import format as fmt
from ...wire.protocol import EngineFacts, Outcome
from ...wire.scratch import scratch_dir
from ..base import Attestation, Engine, register
from .control import (
    UNKNOWN_BASE,
    WeightsSpan,
    adapter_ids,
    adapter_window,
    attestation,
    greedy_generate,
    score_prompts,
    since_arg,
    version_label,
    weights_spans,
)
from .in_engine import checkpoint as ckpt
from .in_engine import ledger, model_ops

#: Held by every in-process reload. vLLM shares modules between the LLMs of one process
#: (``get_rope`` caches a ``RotaryEmbedding`` by its parameters) and its layerwise reload keeps
#: per-module state (as does its current-config global), so two in-process engines reloading at
#: once (``Replicas`` writes from threads) break each other's reload (seen: vLLM's
#: ``info.kernel_tensors is not None`` assertion on ``RotaryEmbedding``).
_RELOADING = threading.Lock()


def llm_engine_of(obj: Any) -> Any:
    """The vLLM ``LLMEngine`` ``obj`` is or holds (as ``.llm_engine``: ``vllm.LLM``; as
    ``.engine``: ms-swift's ``VllmEngine`` / ``GRPOVllmEngine``), or None."""
    from vllm.v1.engine.llm_engine import LLMEngine

    for candidate in (obj, getattr(obj, "llm_engine", None), getattr(obj, "engine", None)):
        if isinstance(candidate, LLMEngine):
            return candidate
    return None


@register
class VLLMEngine(Engine):
    """An in-process vLLM engine as a weightsync engine.

    Args:
        llm: the engine the trainer created, with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (or
            ``distributed_executor_backend="external_launcher"``): a ``vllm.LLM``, a vLLM
            ``LLMEngine``, or an object holding one as ``.engine`` (ms-swift's
            ``GRPOVllmEngine``). Held as ``llm`` (the ``LLM``, else the ``LLMEngine``): every
            weightsync call on it has the same name and meaning on both.
        checkpoint: folder of the checkpoint the engine was started from; defaults to the
            engine's model path. What `reload_checkpoint` reloads; the weights the engine loads
            are those of the model its config builds, as these files hold them (all of that
            model's weights for an engine that read no files: ``load_format="dummy"``).
        adapter_dir: where adapters are written for vLLM to load; defaults to a fresh folder
            on tmpfs (``/dev/shm``) where there is one.
        lora_id: the stable id of the served adapter; None (the default) picks one no other
            adapter of the engine uses. An id given here that another adapter holds (the
            user's own, under vLLM's usual example id 1) is refused, never replaced.
        lora_name: the stable name of the served adapter (with ``adapter_versions`` above 1,
            version k is named ``<lora_name>-v<k>``).
        adapter_versions: how many adapter versions stay loaded: the newest, which
            `lora_request` names, and the ones before it that rollouts still in flight were
            admitted under (`adapter_requests`), each under an id of its own, so a request
            admitted under version k finishes on k; older versions are unloaded. Set it to the
            framework's staleness bound + 1. The default, 1, replaces the adapter in place
            under one id. Above 1 the engine needs ``max_loras >= N`` and
            ``max_cpu_loras >= N + 1`` (`control.adapter_window`), refused here otherwise.
        stage: produce every bucket of a weight write (casts, merges, a sharded trainer's
            gathers) before vLLM loads the first, so a failure while producing them (a rank
            that died mid-gather, memory a merge could not get) leaves the engine serving
            exactly what it had, its base kept, instead of a mix of old and new layers that
            only a full restore mends. Costs, for the length of the write, the produced
            tensors that are not the trainer's own (casts to the engine's dtype, merged LoRA
            weights) where the trainer holds them: up to one copy of the model in the engine's
            dtype; nothing for a trainer that holds the engine's dtype and merges nothing. Off
            by default: colocated on one device, that memory is what sleep mode frees. A
            failure inside vLLM's own reload leaves a mix either way (marked lost, labelled
            `UNKNOWN_BASE`).
    """

    name = "vllm"
    #: In-process engines load one at a time (`_RELOADING`).
    loads_concurrently = False

    @classmethod
    def accepts(cls, obj: Any) -> bool:
        # An LLMEngine, or a framework's object holding one; only vLLM's module is imported
        # here (adapt() must not import vLLM for objects of other engines). A multiprocess
        # engine core is the remote adapter's.
        if not any(
            type(o).__module__.startswith("vllm")
            for o in (obj, getattr(obj, "llm_engine", None), getattr(obj, "engine", None))
        ):
            return False
        core = getattr(llm_engine_of(obj), "engine_core", None)
        return type(core).__name__ == "InprocClient"

    def __init__(
        self,
        llm: Any,
        *,
        checkpoint: str | None = None,
        adapter_dir: str | None = None,
        lora_id: int | None = None,
        lora_name: str = "weightsync",
        adapter_versions: int = 1,
        stage: bool = False,
    ) -> None:
        super().__init__()
        from vllm.v1.engine.core_client import InprocClient

        #: Produce every bucket before the first write (see the ``stage`` argument).
        self.stage = stage

        llm_engine = llm_engine_of(llm)
        if llm_engine is None:
            raise TypeError(
                f"VLLMEngine wraps a vllm.LLM, a vLLM LLMEngine, or an object holding one as "
                f".engine (ms-swift's GRPOVllmEngine); got {type(llm).__module__}."
                f"{type(llm).__name__}"
            )
        if not isinstance(llm_engine.engine_core, InprocClient):
            raise ValueError(
                "VLLMEngine needs vLLM's engine core in this process, so that weights pass by "
                "reference: set VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating the engine."
            )
        #: The ``vllm.LLM`` if one was given, else the ``LLMEngine``: the object every
        #: weightsync call goes to (both have them under the same names).
        self.llm = llm if llm_engine is getattr(llm, "llm_engine", None) else llm_engine
        #: The ``LLMEngine`` (generation, adapters, config).
        self.llm_engine = llm_engine
        config = llm_engine.vllm_config
        self._model_config = config.model_config
        self._lora_config = config.lora_config
        self._load_config = config.load_config
        self._executor = llm_engine.engine_core.engine_core.model_executor
        # What the engine loads and serves, read as a worker process reads it. vLLM repoints
        # model_config.model at any folder it reloads from: the facts keep the original.
        self._facts: EngineFacts = self._executor.collective_rpc(
            model_ops.read_facts, kwargs={"checkpoint": checkpoint or ""}
        )[0]
        self.checkpoint = self._facts.checkpoint
        self._reads_files = ckpt.loads_files(self._load_config)
        self._adapter_root = Path(adapter_dir) if adapter_dir else scratch_dir(self, "adapter")
        #: The id the served adapter is loaded under (picked at the first adapter check when
        #: the caller gave none).
        self.lora_id: int | None = lora_id
        self._lora_id_given = lora_id is not None
        self._lora_id_loaded = False  # weightsync loaded an adapter under lora_id
        self.lora_name = lora_name
        self.adapter_versions = adapter_window(adapter_versions, self._facts.lora)
        self._adapter_loads = 0  # adapter versions loaded so far: the last one's number
        #: (version, LoRARequest) of each adapter version kept loaded, oldest first.
        self._resident: list[tuple[int, Any]] = []
        self._next_id: int | None = None  # adapter_versions > 1: the next version's id
        # Only a CPU MoE engine re-processes layers a write left out (model_ops.read_facts).
        self._cpu_moe = not self._facts.keeps_unsent_layers
        # Install the workers' ledger now. Asleep already (TRL sleeps in its __init__): the
        # level is unknown, the ledger logs harm 2.
        self._attest(None)
        self._label_base()

    # --- what the engine holds -------------------------------------------------------------

    @property
    def facts(self) -> EngineFacts:
        return self._facts

    @property
    def lora_request(self) -> Any:
        """The ``LoRARequest`` to pass to ``generate`` for the served adapter, its newest
        version (None if none, or if the base may be gone since it was loaded: a level-2 sleep
        discards the adapter's memory too, and a request kept from before must not come
        back)."""
        held = self.adapter_requests
        return held[max(held)] if held else None

    @property
    def adapter_version(self) -> int | None:
        """The version of the served adapter (adapter loads counted by this engine adapter;
        the key of `adapter_requests`); None: none."""
        return max(self.adapter_requests, default=None)

    @property
    def adapter_requests(self) -> dict[int, Any]:
        """The ``LoRARequest`` of each adapter version kept loaded (see ``adapter_versions``),
        by version, oldest first; empty as `lora_request` is None."""
        if self._resident and self.attest().harm >= 2:
            self._forget_adapter()
        return dict(self._resident)

    # --- writing ------------------------------------------------------------------------------

    # Any iterable of pairs is a bucket here (reload_checkpoint streams one from disk lazily).
    def load_weights(self, buckets: Iterable[Iterable[tuple[str, torch.Tensor]]]) -> int:
        if self.stage:
            try:
                buckets = [list(bucket) for bucket in buckets]
            except BaseException as error:
                errors.untouched(error)
                raise
        self._forget_adapter()
        self._reload(weights=(pair for bucket in buckets for pair in bucket))
        return 1

    def _reload(self, **kwargs: Any) -> None:
        """`model_ops.reload` (vLLM's layerwise reload, recovered when it fails part-way: the
        engine then serves a mix of old and new layers, and the error is re-raised so the caller
        resyncs everything), then a prefix-cache reset whatever happened."""
        try:
            with _RELOADING:
                outcome: Outcome = self.llm.collective_rpc(model_ops.reload, kwargs=kwargs)[0]
        finally:
            # vLLM's block hash does not cover the base weights, and it keeps its prefix cache
            # (returns False) while any request holds blocks: requests in flight (a rollout
            # stepping this engine) are preempted to recompute their KV under the new weights.
            reset = self.llm.reset_prefix_cache(reset_running_requests=True)
        if not outcome.ok:
            raise outcome.exception or RuntimeError(outcome.error)
        if not reset:
            raise RuntimeError(
                "the vLLM engine did not reset its prefix cache after a weight write: prompts "
                "could be answered from KV computed with the previous weights"
            )
        self._label_base()

    def _label_base(self) -> None:
        """Label vLLM's weight version (the spans of every output) with the base version the
        engine attests now: at the start, and after each completed base write, before anything
        generates again (the caller's thread is the one that steps the engine). Adapter loads
        leave it: each request's adapter is its own (`weights_spans`)."""
        label = version_label(self.attest().epoch)
        if label is not None:
            self.llm_engine.set_weight_version(label)

    def mark_lost(self) -> None:
        """The base may be a mix of old and new layers: the tokens generated until the next
        completed base write are labelled `UNKNOWN_BASE`."""
        super().mark_lost()
        self.llm_engine.set_weight_version(UNKNOWN_BASE)

    @staticmethod
    def weights_spans(output: Any, index: int = 0) -> list[WeightsSpan] | None:
        """The base and adapter versions that produced each token of a finished
        ``RequestOutput`` of this engine (`control.weights_spans`). With one adapter version
        kept (the default) the adapter is replaced in place: a request stepped across an
        adapter load continues on the new one, which its spans cannot show; keep two or more
        (``adapter_versions``) for rollouts in flight."""
        return weights_spans(output, index)

    def reload_checkpoint(self, path: str | None = None) -> int:
        folder = path or self.checkpoint
        files = (
            self._reloadable_files()
            if path is None
            else ckpt.weight_files(folder, self._load_config)
        )
        twins = model_ops.checkpoint_twins(files, self.shared_weights)
        if twins or not self._reads_files:
            # vLLM's own reload from disk leaves a tied twin (lm_head) stale, because the
            # checkpoint stores the shared tensor once (measured on vLLM 0.32), and an engine
            # whose loader reads no files (dummy) cannot reload from disk at all. Read the
            # files here instead and send each shared tensor under every name.
            stream = fmt.read(files, twins)
            return self.load_weights([timing.spanned(stream, "serialize")])
        self._forget_adapter()
        self._reload(path=folder)
        return 1

    def checkpoint_head(self, names: list[str]) -> dict[str, torch.Tensor]:
        return fmt.heads(self._reloadable_files(), names)

    def _reloadable_files(self) -> list[str]:
        """The files `reload_checkpoint` reloads; raises `NoCheckpointError` when there are none
        (a dummy engine on a folder without weights). ReloadWeights of the original checkpoint
        reads their heads while planning, so it is refused there, before anything is written."""
        if not self._facts.files:
            raise NoCheckpointError(
                f"this engine was started with load_format={self._load_config.load_format!r} from "
                f"{self.checkpoint}, which holds no weight files: there is no checkpoint to "
                "reload. Use FullSync, or ReloadWeights(snapshot_dir=...) to reload the trainer's "
                "current weights."
            )
        return list(self._facts.files)

    def describe(self) -> str:
        lora = (
            f", serves LoRA up to rank {self._lora_config.max_lora_rank}"
            if self.serves_lora
            else ""
        )
        return (
            f"in-process vLLM on {self.checkpoint} "
            f"({str(self.dtype).removeprefix('torch.')}{lora}{self.quantized})"
        )

    def check_adapter(self, adapter: Adapter) -> None:
        if not self.serves_lora:
            raise AdapterError(
                "this vLLM engine was created without enable_lora=True, so it cannot serve an "
                "adapter; merge it instead (FullSync(lora='merge')) or recreate the LLM with "
                "enable_lora=True"
            )
        assert self._facts.lora is not None  # serves_lora
        limit = self._facts.lora.max_rank
        if adapter.rank > limit:
            raise AdapterError(
                f"adapter {adapter.name!r} has rank {adapter.rank}, above this engine's "
                f"max_lora_rank={limit}; create the LLM with max_lora_rank>={adapter.rank}"
            )
        if self._cpu_moe:
            raise AdapterError(
                "vLLM's CPU backend cannot apply LoRA to a MoE model (its MoE LoRA kernels are "
                "Triton-only; with enable_lora=True even a generate fails). Merge the adapter: "
                "FullSync(lora='merge') into an engine created without enable_lora."
            )
        # vLLM's own validation of the adapter config, run now rather than inside add_lora
        # after the base was written (it refuses DoRA, lora_bias, some init values, ...).
        from vllm.lora.peft_helper import PEFTHelper

        try:
            PEFTHelper.from_dict(adapter.config).validate_legal(self._lora_config)
        except (ValueError, TypeError) as err:
            raise AdapterError(f"vLLM refuses adapter {adapter.name!r}: {err}") from err
        targets = {key.split(".lora_")[0].rsplit(".", 1)[-1] for key in adapter.tensors}
        unsupported = sorted(targets - self._lora_modules())
        if unsupported:
            raise AdapterError(
                f"adapter {adapter.name!r} targets {unsupported}, which this vLLM model cannot "
                f"apply LoRA to (it can: {sorted(self._lora_modules())}); merge the "
                "adapter instead (FullSync(lora='merge'))"
            )
        if self.adapter_versions == 1:
            self._claim_lora_id()

    #: Ids weightsync picks itself start here: far above the ones users number their own
    #: adapters with (1, 2, ...: vLLM's examples), so that a user's adapter added *after* ours,
    #: under a small id, does not meet ours either (vLLM would serve whichever holds the id).
    FIRST_OWN_LORA_ID = 1 << 20

    def _claim_lora_id(self) -> None:
        """Make ``lora_id`` an id no adapter weightsync did not load holds.

        An adapter loaded under an id replaces whatever the engine holds under it, so an id
        another adapter holds (one the user loaded) is never used: the caller's own id is
        refused, naming it; a picked one is picked again among the free ids. vLLM forgets
        every adapter on a base write, so an id weightsync loaded and vLLM no longer lists is
        free again and is kept (stable across syncs).
        """
        loaded = self.llm_engine.list_loras()
        if self.lora_id is not None and (self.lora_id not in loaded or self._lora_id_loaded):
            return
        if self._lora_id_given:
            raise AdapterError(
                f"lora_id={self.lora_id} is held by an adapter weightsync did not load (the "
                f"engine serves ids {sorted(loaded)}); loading the trained adapter under it "
                "would replace that adapter without a word. Pass another lora_id to "
                "VLLMEngine, or none to have a free one picked."
            )
        self.lora_id = next(i for i in range(self.FIRST_OWN_LORA_ID, 1 << 31) if i not in loaded)
        self._lora_id_loaded = False

    #: Load adapters from memory when this vLLM allows it (see ``lora.py``); False forces the
    #: folder path (vLLM's public ``add_lora``), the fallback, kept for parity tests.
    adapter_from_memory: bool = True

    def load_adapter(self, adapter: Adapter) -> int:
        """Load the adapter as the next version: in place under ``lora_id`` (one version
        kept), or under an id of its own, then unload the version that fell out of the window.

        Each version has a path of its own (in memory: `memory_lora_path`, never created; or a
        folder ``adapter-v<k>``): vLLM's prefix-cache block hash covers the adapter's name and
        path, not its id or weights, so KV computed under one version is never reused under
        another, even while requests in flight keep the prefix cache from being reset."""
        from vllm.lora.request import LoRARequest

        self.check_adapter(adapter)
        version = self._adapter_loads + 1
        lora_id = self._version_id()
        name = self.lora_name if self.adapter_versions == 1 else f"{self.lora_name}-v{version}"
        # The config exactly as vLLM would read it back from adapter_config.json.
        config = json.loads(json.dumps(adapter.config, default=str))
        if self._memory_load_supported():
            from .in_engine.lora import install_adapter, memory_lora_path

            self.llm.collective_rpc(
                install_adapter,
                kwargs={"tensors": adapter.tensors, "config": config, "lora_int_id": lora_id},
            )
            path = memory_lora_path(name, lora_id, version)
        else:
            folder = self._adapter_folder(version)
            with timing.span("serialize"):
                fmt.write_adapter(folder, adapter.tensors.items(), config)
            path = str(folder)
            self.llm_engine.add_lora(LoRARequest(name, lora_id, path, load_inplace=True))
        self._lora_id_loaded = True
        self._adapter_loads = version
        self._resident.append((version, LoRARequest(name, lora_id, path)))
        while len(self._resident) > self.adapter_versions:
            old, request = self._resident.pop(0)
            if request.lora_int_id != lora_id:  # one version: replaced in place, same id
                self.llm_engine.remove_lora(request.lora_int_id)
            # A request held from before could otherwise reload the old version from it.
            shutil.rmtree(self._adapter_folder(old), ignore_errors=True)
        self.llm.reset_prefix_cache()
        return 1

    def _adapter_folder(self, version: int) -> Path:
        return self._adapter_root / f"adapter-v{version:06d}"

    def _version_id(self) -> int:
        """The id the next adapter version loads under: ``lora_id`` with one version kept;
        else an id above every earlier version's that no adapter holds, so a request held
        from a version that was unloaded never meets a newer one under its id (it fails
        loudly instead: vLLM finds no adapter at its path)."""
        if self.adapter_versions == 1:
            assert self.lora_id is not None  # claimed by check_adapter
            return self.lora_id
        loaded = self.llm_engine.list_loras()
        start = self._next_id if self._next_id is not None else self.lora_id
        lora_id = start if start is not None else self.FIRST_OWN_LORA_ID
        while lora_id in loaded:
            lora_id += 1
        self.lora_id, self._next_id = lora_id, lora_id + 1
        return lora_id

    def _memory_load_supported(self) -> bool:
        if not self.adapter_from_memory:
            return False
        if getattr(self, "_memory_load_ok", None) is None:
            from .in_engine.lora import supports_memory_load

            self._memory_load_ok = all(self.llm.collective_rpc(supports_memory_load))
        return self._memory_load_ok

    def _lora_modules(self) -> set[str]:
        assert self._facts.lora is not None  # checked by check_adapter first
        return set(self._facts.lora.modules)

    def _forget_adapter(self) -> None:
        for version, _ in self._resident:
            shutil.rmtree(self._adapter_folder(version), ignore_errors=True)
        self._resident.clear()

    def greedy_batch(
        self, prompts: list[list[int]], max_tokens: int
    ) -> list[tuple[list[int], list[float]]]:
        return greedy_generate(self.llm_engine, prompts, max_tokens, self.lora_request)

    # --- lifecycle ----------------------------------------------------------------------------

    @property
    def weights_version(self) -> str | None:
        """The version of the weights the engine serves now, from its worker's ledger: the
        epoch, the adapter ids vLLM holds and the adapter writes the worker counted (an adapter
        is replaced in memory under one id here, so the ids alone would not move); equal
        versions, the same weights. Asked anew at every read."""
        now = self.attest()
        ids = adapter_ids(self._executor.collective_rpc("list_loras")) if self.serves_lora else ()
        return version_label(now.epoch, ids, now.adapters)

    def _attest(self, since: Hashable | None) -> Attestation:
        # Straight to the executor, as LLM.collective_rpc would (in process), so that tests
        # counting writes at LLM.collective_rpc do not count this read.
        reports = self._executor.collective_rpc(
            ledger.attest,
            kwargs={"since": since_arg(since), "asleep": bool(self._executor.sleeping_tags)},
        )
        return attestation(reports)

    def _engine_sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def _engine_wake(self, tags: list[str] | None) -> None:
        self.llm.wake_up(tags=tags)

    # --- verification ---------------------------------------------------------------------------

    def score_batch(self, prompts: list[list[int]], top_k: int) -> list[list[dict[int, float]]]:
        return score_prompts(self.llm_engine, prompts, top_k, self.lora_request)
