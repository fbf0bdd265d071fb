"""Adapter for an in-process ``vllm.LLM`` (the engine a colocated trainer already created).

Why these engine calls and not others (see also ``docs/engines.md``):

- Weights go through ``collective_rpc("reload_weights", weights_iterator=...)``. That path takes
  checkpoint names (unfused q/k/v, gate/up), loads them layer by layer and re-runs the engine's
  post-load processing. A raw ``model.load_weights`` does not: it corrupts weights that processing
  reshaped (vllm#42821, #17429) and on the CPU backend fails outright, because the repacked linear
  parameters have shape ``(0,)``.
- The iterator is passed by reference, so this adapter needs the engine core in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` before the ``LLM`` is created).
- Adapters are built from the trainer's tensors inside the worker (``lora.py``: vLLM's own
  validation and ``LoRAModel.from_lora_tensors``, replacing the adapter under one stable id), with
  no file round trip. Where this vLLM lacks a piece that path needs, the adapter is written to
  tmpfs and added with vLLM's public ``add_lora(load_inplace=True)`` instead (re-adding a loaded
  id without ``load_inplace`` keeps the old one).
- ``reload_weights`` resets vLLM's LoRA state, and a request carrying a ``LoRARequest`` reloads the
  adapter from its path on demand. The in-memory adapter's path never exists, and after a base
  write the folder is removed until the next adapter load, so a stale request fails loudly
  instead of applying an old adapter on top of merged weights (LoRA counted twice,
  ms-swift#8233). A level-2 sleep forgets the adapter too.
- The prefix cache is reset after every write, or prompts cached under old weights are answered
  from old KV.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Hashable, Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import torch

from ...errors import AdapterError, NoCheckpointError
from ...plan import Adapter
from ..base import Attestation, Engine, register
from ..scratch import scratch_dir
from . import checkpoint as ckpt
from . import ledger
from .worker import (
    abandon_layerwise_reload,
    has_cpu_moe,
    lora_modules,
    repack_cpu_moe,
    shared_parameter_names,
    tied_weights,
)


def greedy_generate(
    llm: Any, prompts: list[list[int]], max_tokens: int, lora_request: Any
) -> list[tuple[list[int], list[float]]]:
    """Greedy-decode ``max_tokens`` for each prompt on a ``vllm.LLM`` (in or out of process),
    in one call; the tokens and their logprobs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logprobs=0, detokenize=False, ignore_eos=True
    )
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
        params,
        lora_request=lora_request,
        use_tqdm=False,
    )
    results = []
    for out in outputs:
        tokens = list(out.outputs[0].token_ids)
        logprobs = [
            step[tok].logprob for tok, step in zip(tokens, out.outputs[0].logprobs, strict=True)
        ]
        results.append((tokens, logprobs))
    return results


def score_prompts(
    llm: Any, prompts: list[list[int]], top_k: int, lora_request: Any
) -> list[list[dict[int, float]]]:
    """For each prompt, each position after the first: the logprobs vLLM gives the prompt's
    token and its ``top_k`` most likely tokens (``prompt_logprobs``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # prompt_logprobs makes vLLM skip reading the prefix cache, so every position is computed
    # under the weights served now. One token is generated because vLLM must.
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=top_k, detokenize=False)
    # With LoRA enabled, vLLM 0.32's CPU LoRA logits path indexes adapters per request, not per
    # prompt position: two prompts in one batch with prompt_logprobs fail ("einsum(): subscript b
    # has size 2 ... 63"). One prompt per call is exact.
    lora_enabled = llm.llm_engine.vllm_config.lora_config is not None
    groups = [[p] for p in prompts] if lora_enabled else [prompts]
    outputs = [
        out
        for group in groups
        for out in llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in group],
            params,
            lora_request=lora_request,
            use_tqdm=False,
        )
    ]
    return [
        [{tok: lp.logprob for tok, lp in pos.items()} for pos in out.prompt_logprobs[1:]]
        for out in outputs
    ]


def attestation(reports: list[dict[str, Any]]) -> Attestation:
    """The engine's attestation from its workers' ledger reports (one per rank, see
    ``ledger.Ledger.report``): its epoch is every rank's (boot, epoch), its harm the worst."""
    return Attestation(
        epoch=tuple((r["boot"], int(r["epoch"])) for r in reports),
        asleep=frozenset(tag for r in reports for tag in r["asleep"]),
        harm=max(int(r["harm"]) for r in reports),
    )


def since_arg(epoch: Hashable | None) -> list[list[Any]] | None:
    """An attested vLLM epoch as the workers' ``since`` argument (JSON: lists)."""
    return None if epoch is None else [list(rank) for rank in cast("tuple", epoch)]


@register
class VLLMEngine(Engine):
    """An in-process ``vllm.LLM`` as a weightsync engine.

    Args:
        llm: the ``vllm.LLM`` the trainer created, with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``.
        checkpoint: folder of the checkpoint the engine was started from; defaults to the
            engine's model path. What `reload_checkpoint` reloads; the weights the engine loads
            are those of the model its config builds, as these files hold them (all of that
            model's weights for an engine that read no files: ``load_format="dummy"``).
        adapter_dir: where adapters are written for vLLM to load; defaults to a fresh folder
            on tmpfs (``/dev/shm``) where there is one.
        lora_id: the stable id of the served adapter; None (the default) picks one no other
            adapter of the engine uses. An id given here that another adapter holds (the
            user's own, under vLLM's usual example id 1) is refused, never replaced.
        lora_name: the stable name of the served adapter.
    """

    name = "vllm"

    @classmethod
    def accepts(cls, obj: Any) -> bool:
        core = getattr(getattr(obj, "llm_engine", None), "engine_core", None)  # else: multiproc
        return type(obj).__module__.startswith("vllm") and type(core).__name__ == "InprocClient"

    def __init__(
        self,
        llm: Any,
        *,
        checkpoint: str | None = None,
        adapter_dir: str | None = None,
        lora_id: int | None = None,
        lora_name: str = "weightsync",
    ) -> None:
        super().__init__()
        from vllm.v1.engine.core_client import InprocClient

        if not isinstance(llm.llm_engine.engine_core, InprocClient):
            raise ValueError(
                "VLLMEngine needs vLLM's engine core in this process, so that weights pass by "
                "reference: set VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating the LLM."
            )
        self.llm = llm
        config = llm.llm_engine.vllm_config
        self._model_config = config.model_config
        self._lora_config = config.lora_config
        # vLLM repoints model_config.model at any folder it reloads from: remember the original.
        self.checkpoint = checkpoint or ckpt.local_folder(
            self._model_config.model, self._model_config.revision
        )
        self._load_config = config.load_config
        self._files = ckpt.weight_files(self.checkpoint, self._load_config)
        # What the engine loads: the weights of the model its config builds, as the files it
        # read hold them; with no files read (load_format="dummy"), that model's own layout.
        self._reads_files = ckpt.loads_files(self._load_config)
        shapes = ckpt.loaded_shapes(
            ckpt.config_model(self._model_config.hf_config, self._model_config.trust_remote_code),
            self._files if self._reads_files else None,
        )
        # A tied engine shares one parameter between lm_head and embed_tokens, and the
        # checkpoint stores it once. vLLM's layerwise reload restores each module on its own,
        # so the twin left out of the stream keeps its old values: both names must be sent.
        shared, _ = tied_weights(llm.apply_model(shared_parameter_names)[0], shapes)
        self._shared: list[tuple[str, ...]] = [tuple(names) for names in shared]
        self._expected = shapes
        self._adapter_root = Path(adapter_dir) if adapter_dir else scratch_dir(self, "adapter")
        #: The id the served adapter is loaded under (picked at the first adapter check when
        #: the caller gave none).
        self.lora_id: int | None = lora_id
        self._lora_id_given = lora_id is not None
        self._lora_id_loaded = False  # weightsync loaded an adapter under lora_id
        self.lora_name = lora_name
        self._lora_request = None
        self._lora_modules: set[str] | None = None
        # A CPU MoE engine re-packs every MoE layer after a reload (see worker.repack_cpu_moe), so a
        # layer left out of a sync would be packed twice: every sync sends every layer.
        self._cpu_moe = bool(llm.apply_model(has_cpu_moe)[0])
        self.keeps_unsent_layers = not self._cpu_moe
        self._executor = llm.llm_engine.engine_core.engine_core.model_executor
        # Install the workers' ledger now. Asleep already (TRL sleeps in its __init__): the
        # level is unknown, the ledger logs harm 2.
        self._attest(None)

    # --- what the engine holds -------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self._model_config.dtype

    @property
    def expected_weights(self) -> Mapping[str, tuple[int, ...]]:
        return self._expected

    @property
    def serves_lora(self) -> bool:
        return self._lora_config is not None

    @property
    def shared_weights(self) -> list[tuple[str, ...]]:
        return list(self._shared)

    @property
    def lora_request(self) -> Any:
        """The ``LoRARequest`` to pass to ``generate`` for the served adapter (None if none,
        or if the base may be gone since it was loaded: a level-2 sleep discards the adapter's
        memory too, and a request kept from before must not come back)."""
        if self._lora_request is not None and self.attest().harm >= 2:
            self._forget_adapter()
        return self._lora_request

    # --- writing ------------------------------------------------------------------------------

    # Any iterable of pairs is a bucket here (reload_checkpoint streams one from disk lazily).
    def load_weights(self, buckets: Iterable[Iterable[tuple[str, torch.Tensor]]]) -> int:
        self._forget_adapter()
        pairs = (pair for bucket in buckets for pair in bucket)
        self._reload({"weights_iterator": pairs, "is_checkpoint_format": True})
        return 1

    def _reload(self, kwargs: dict[str, Any]) -> None:
        """``reload_weights`` that leaves vLLM usable when it fails part-way.

        vLLM 0.32's reload has no cleanup: if the weights iterator (or a loader) raises, every
        layer not yet finished stays on the meta device with its loaders wrapped, so generation
        fails ("Tensor on device meta") and leaves the scheduler stuck, and every later reload
        fails ("'Parameter' object has no attribute 'weight_loader'"). On error this drops
        what layers cut mid-way had buffered -- vLLM would process them with their missing
        parts left uninitialised, NaN that then also poisons the KV cache -- and finishes the
        reload as vLLM does, which gives every layer not completed its previous tensors back.
        The engine then works, serving a mix of old and new layers, so the error is re-raised
        and the caller must resync everything (Syncer does).
        """
        try:
            self.llm.collective_rpc("reload_weights", kwargs=kwargs)
            if self._cpu_moe:
                self.llm.apply_model(repack_cpu_moe)
        except BaseException:
            config = self._model_config
            self.llm.apply_model(lambda model: abandon_layerwise_reload(model, config))
            raise
        finally:
            self.llm.reset_prefix_cache()

    def reload_checkpoint(self, path: str | None = None) -> int:
        folder = path or self.checkpoint
        files = (
            self._reloadable_files()
            if path is None
            else ckpt.weight_files(folder, self._load_config)
        )
        _, twins = tied_weights([list(g) for g in self._shared], dict(ckpt.shapes(files)))
        if twins or not self._reads_files:
            # vLLM's own reload from disk leaves a tied twin (lm_head) stale, because the
            # checkpoint stores the shared tensor once (measured on vLLM 0.32), and an engine
            # whose loader reads no files (dummy) cannot reload from disk at all. Read the
            # files here instead and send each shared tensor under every name.
            return self.load_weights([ckpt.read_with_twins(files, twins)])
        self._forget_adapter()
        self._reload({"weights_path": folder})
        return 1

    def _supported_lora_modules(self) -> set[str]:
        if self._lora_modules is None:
            self._lora_modules = self.llm.apply_model(lora_modules)[0]
        return self._lora_modules

    def checkpoint_head(self, names: list[str]) -> dict[str, torch.Tensor]:
        return ckpt.heads(self._reloadable_files(), names)

    def _reloadable_files(self) -> list[str]:
        """The files `reload_checkpoint` reloads; raises `NoCheckpointError` when there are none
        (a dummy engine on a folder without weights). ReloadWeights of the original checkpoint
        reads their heads while planning, so it is refused there, before anything is written."""
        if not self._files:
            raise NoCheckpointError(
                f"this engine was started with load_format={self._load_config.load_format!r} from "
                f"{self.checkpoint}, which holds no weight files: there is no checkpoint to "
                "reload. Use FullSync, or ReloadWeights(snapshot_dir=...) to reload the trainer's "
                "current weights."
            )
        return self._files

    def describe(self) -> str:
        lora = (
            f", serves LoRA up to rank {self._lora_config.max_lora_rank}"
            if self.serves_lora
            else ""
        )
        return (
            f"in-process vLLM on {self.checkpoint} ({str(self.dtype).removeprefix('torch.')}{lora})"
        )

    def check_adapter(self, adapter: Adapter) -> None:
        if not self.serves_lora:
            raise AdapterError(
                "this vLLM engine was created without enable_lora=True, so it cannot serve an "
                "adapter; merge it instead (FullSync(lora='merge')) or recreate the LLM with "
                "enable_lora=True"
            )
        limit = self._lora_config.max_lora_rank
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
        unsupported = sorted(targets - self._supported_lora_modules())
        if unsupported:
            raise AdapterError(
                f"adapter {adapter.name!r} targets {unsupported}, which this vLLM model cannot "
                f"apply LoRA to (it can: {sorted(self._supported_lora_modules())}); merge the "
                "adapter instead (FullSync(lora='merge'))"
            )
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
        loaded = self.llm.llm_engine.list_loras()
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
        from vllm.lora.request import LoRARequest

        self.check_adapter(adapter)
        lora_id = self.lora_id
        assert lora_id is not None  # claimed by check_adapter
        # The config exactly as vLLM would read it back from adapter_config.json.
        config = json.loads(json.dumps(adapter.config, default=str))
        if self._memory_load_supported():
            from .lora import install_adapter, memory_lora_path

            # An older folder could otherwise be reloaded by a held request after eviction.
            shutil.rmtree(self._adapter_root / "adapter", ignore_errors=True)
            self.llm.collective_rpc(
                install_adapter,
                kwargs={"tensors": adapter.tensors, "config": config, "lora_int_id": lora_id},
            )
            path = memory_lora_path(self.lora_name, lora_id)
        else:
            path = str(self._write_adapter_folder(adapter, config))
            self.llm.llm_engine.add_lora(
                LoRARequest(self.lora_name, lora_id, path, load_inplace=True)
            )
        self._lora_id_loaded = True
        self._lora_request = LoRARequest(self.lora_name, lora_id, path)
        self.llm.reset_prefix_cache()
        return 1

    def _memory_load_supported(self) -> bool:
        if not self.adapter_from_memory:
            return False
        if getattr(self, "_memory_load_ok", None) is None:
            from .lora import supports_memory_load

            self._memory_load_ok = all(self.llm.collective_rpc(supports_memory_load))
        return self._memory_load_ok

    def _write_adapter_folder(self, adapter: Adapter, config: dict) -> Path:
        from safetensors.torch import save_file

        folder = self._adapter_root / "adapter"
        staging = self._adapter_root / "adapter.new"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        save_file(
            {k: v.contiguous() for k, v in adapter.tensors.items()},
            str(staging / "adapter_model.safetensors"),
        )
        (staging / "adapter_config.json").write_text(json.dumps(config))
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
        return folder

    def _forget_adapter(self) -> None:
        self._lora_request = None
        shutil.rmtree(self._adapter_root / "adapter", ignore_errors=True)

    def greedy_batch(
        self, prompts: list[list[int]], max_tokens: int
    ) -> list[tuple[list[int], list[float]]]:
        return greedy_generate(self.llm, prompts, max_tokens, self.lora_request)

    # --- lifecycle ----------------------------------------------------------------------------

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
        return score_prompts(self.llm, prompts, top_k, self.lora_request)
