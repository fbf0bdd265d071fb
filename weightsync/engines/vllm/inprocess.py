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
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ...errors import AdapterError
from ...plan import Adapter
from ..base import Engine, register
from ..scratch import scratch_dir
from . import checkpoint as ckpt
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


def _watch_sleeps(engine: VLLMEngine) -> None:
    """Record every sleep and wake of ``engine``'s vLLM, however it is made.

    ``LLM.sleep``, ``llm_engine.sleep`` and the engine core's own sleep all end in the model
    executor's ``sleep(level)`` / ``wake_up(tags)``, the one place that knows the level. The
    executor instance's two methods are wrapped to tell the adapter (held weakly, so an adapter
    that goes away does not keep recording). The sleep is recorded before it happens, so a sleep
    that fails part-way still counts.
    """
    executor = engine._executor
    ref = weakref.ref(engine)
    sleep, wake_up = executor.sleep, executor.wake_up

    def recorded_sleep(level: int = 1) -> Any:
        adapter = ref()
        if adapter is not None and level >= 1:
            adapter.mark_asleep(min(level, 2))
            adapter._sleep_seen = True
        return sleep(level)

    def recorded_wake_up(tags: list[str] | None = None) -> Any:
        adapter = ref()
        if adapter is not None:
            adapter._observe()  # a sleep it has not seen yet is recorded before the wake hides it
        result = wake_up(tags)
        if adapter is not None:
            # vLLM ignores a wake naming a tag that is not asleep: trust its tags, not ours.
            adapter.mark_awake(
                [t for t in ("weights", "kv_cache") if t not in executor.sleeping_tags]
            )
        return result

    executor.sleep = recorded_sleep
    executor.wake_up = recorded_wake_up


@register
class VLLMEngine(Engine):
    """An in-process ``vllm.LLM`` as a weightsync engine.

    Args:
        llm: the ``vllm.LLM`` the trainer created, with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``.
        checkpoint: folder of the checkpoint the engine was started from; defaults to the
            engine's model path. Its safetensors headers say which weights the engine loads.
        adapter_dir: where adapters are written for vLLM to load; defaults to a fresh folder
            on tmpfs (``/dev/shm``) where there is one.
        lora_id: the stable id of the served adapter.
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
        lora_id: int = 1,
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
        shapes = ckpt.shapes(self._files)
        # A tied engine shares one parameter between lm_head and embed_tokens, and the
        # checkpoint stores it once. vLLM's layerwise reload restores each module on its own,
        # so the twin left out of the stream keeps its old values: both names must be sent.
        shared, self._twins = tied_weights(llm.apply_model(shared_parameter_names)[0], shapes)
        self._shared: list[tuple[str, ...]] = [tuple(names) for names in shared]
        self._expected = shapes
        self._adapter_root = Path(adapter_dir) if adapter_dir else scratch_dir(self, "adapter")
        self.lora_id = lora_id
        self.lora_name = lora_name
        self._lora_request = None
        self._lora_modules: set[str] | None = None
        # A CPU MoE engine re-packs every MoE layer after a reload (see worker.repack_cpu_moe), so a
        # layer left out of a sync would be packed twice: every sync sends every layer.
        self._cpu_moe = bool(llm.apply_model(has_cpu_moe)[0])
        self.keeps_unsent_layers = not self._cpu_moe
        self._executor = llm.llm_engine.engine_core.engine_core.model_executor
        self._sleep_seen = False
        _watch_sleeps(self)
        self._observe()  # asleep already (TRL sleeps in its __init__): the level is unknown

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
        """The ``LoRARequest`` to pass to ``generate`` for the served adapter (None if none)."""
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
        files = self._files if path is None else ckpt.weight_files(folder, self._load_config)
        if self._twins and not set(self._expected) <= set(ckpt.shapes(files)):
            # vLLM's own reload from disk leaves a tied twin (lm_head) stale, because the
            # checkpoint stores the shared tensor once (measured on vLLM 0.32). Read the files
            # here instead and send each shared tensor under every name.
            return self.load_weights([ckpt.read_with_twins(files, self._twins)])
        self._forget_adapter()
        self._reload({"weights_path": folder})
        return 1

    def _supported_lora_modules(self) -> set[str]:
        if self._lora_modules is None:
            self._lora_modules = self.llm.apply_model(lora_modules)[0]
        return self._lora_modules

    def checkpoint_head(self, names: list[str]) -> dict[str, torch.Tensor]:
        return ckpt.heads(self._files, names)

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

    #: Load adapters from memory when this vLLM allows it (see ``lora.py``); False forces the
    #: folder path (vLLM's public ``add_lora``), the fallback, kept for parity tests.
    adapter_from_memory: bool = True

    def load_adapter(self, adapter: Adapter) -> int:
        from vllm.lora.request import LoRARequest

        self.check_adapter(adapter)
        # The config exactly as vLLM would read it back from adapter_config.json.
        config = json.loads(json.dumps(adapter.config, default=str))
        if self._memory_load_supported():
            from .lora import install_adapter, memory_lora_path

            # An older folder could otherwise be reloaded by a held request after eviction.
            shutil.rmtree(self._adapter_root / "adapter", ignore_errors=True)
            self.llm.collective_rpc(
                install_adapter,
                kwargs={"tensors": adapter.tensors, "config": config, "lora_int_id": self.lora_id},
            )
            path = memory_lora_path(self.lora_name, self.lora_id)
        else:
            path = str(self._write_adapter_folder(adapter, config))
            self.llm.llm_engine.add_lora(
                LoRARequest(self.lora_name, self.lora_id, path, load_inplace=True)
            )
        self._lora_request = LoRARequest(self.lora_name, self.lora_id, path)
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
        return greedy_generate(self.llm, prompts, max_tokens, self._lora_request)

    # --- lifecycle ----------------------------------------------------------------------------

    def mark_asleep(self, level: int) -> None:
        super().mark_asleep(level)
        if level == 2:  # the adapter's memory went with the weights: load it again to serve it
            self._forget_adapter()

    def _observe(self) -> None:
        # Sleeps go through the executor's sleep, which _watch_sleeps records with its level.
        # Sleeping tags the watch did not see (the engine was asleep before this adapter was
        # made, or a worker was slept through collective_rpc) have an unknown level: assume 2.
        tags = self._executor.sleeping_tags
        if not tags:
            self._sleep_seen = False
        elif not self._sleep_seen:
            self.mark_asleep(2)
            self._asleep &= set(tags)
            self._sleep_seen = True

    def _engine_sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def _engine_wake(self, tags: list[str] | None) -> None:
        self.llm.wake_up(tags=tags)

    # --- verification ---------------------------------------------------------------------------

    def score_batch(self, prompts: list[list[int]], top_k: int) -> list[list[dict[int, float]]]:
        return score_prompts(self.llm, prompts, top_k, self._lora_request)
