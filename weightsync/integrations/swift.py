"""ms-swift: make a GRPO trainer that generates with vLLM in colocate mode sync through weightsync.

weightsync's decision rule is ms-swift's own (``move_full_model`` in its ``rollout_mixin``), and
swift's decision is right; its write path is not: a tied ``lm_head`` is never sent (vLLM then
serves a stale head), vLLM scales the trainer's own ``lora_B`` in place at every adapter-only
sync on a CPU, and LoRA is merged into the trainer's base in place and back around every sync
(the frozen base drifts). `use_weightsync` replaces the trainer's one sync method on the
instance, so all of that goes through `Syncer` instead::

    trainer = ...  # swift's GRPOTrainer, use_vllm=True, vllm_mode='colocate'
    syncer = use_weightsync(trainer)  # before trainer.train()
    trainer.train()

From swift's CLI (``swift rlhf``), a plugin that calls `register_callback` and ``--callbacks
weightsync`` make the same call when training begins. Only what was checked exact is accepted
(GRPO in colocate mode without async generation, one engine rank per process, ``tuner_type``
full or lora, no sharded parameters); everything else is refused with the option named, before
anything is replaced. What it changes and why each piece is needed, the command, and what each
option costs: docs/recipes.md, "ms-swift".
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch

from ..alarm import RolloutAlarm, trainer_alarm
from ..engines.vllm.inprocess import VLLMEngine
from ..syncer import Syncer

#: ``tuner_type`` values whose trained weights weightsync knows how to send: every weight, or a
#: peft LoRA adapter on a frozen base. Others (longlora, adalora, reft, vera, boft, ...) train
#: weights or modules weightsync's PEFT allowlist does not cover.
TUNER_TYPES = ("full", "lora")


def use_weightsync(
    trainer: Any,
    *,
    verify: bool | None = None,
    alarm: Literal["log", "raise", "off"] | RolloutAlarm = "log",
) -> Syncer:
    """Route ms-swift ``trainer``'s vLLM weight sync through a weightsync `Syncer`.

    Call it once, after creating the trainer and before ``trainer.train()`` (from the CLI:
    `register_callback`).

    Args:
        trainer: ms-swift's ``GRPOTrainer`` with ``use_vllm=True, vllm_mode='colocate'``.
        verify: True: check every sync against the trainer on a canary prompt. Verification
            generates, so it needs the KV cache awake: it cannot run with ``sleep_level`` > 0,
            where swift wakes the KV cache only after the sync.
            None (the default): only the first sync of an engine weightsync has not proven
            exact (`weightsync.proven`; with the KV cache asleep at that sync, the next one
            made awake). False: never.
        alarm: check every rollout batch (`weightsync.alarm`): the engine's logprobs of the
            tokens it sampled (swift asks vLLM for them whenever it generates with it) against
            the trainer's of the same tokens, where swift computes its off-policy metrics
            (turned on, ``log_rollout_offpolicy_metrics``). ``"log"``: a warning on an alarm
            and the metrics ``weightsync_rollout_logp_gap`` / ``weightsync_rollout_alarm``
            among swift's ``rollout_correction`` ones; ``"raise"``: `StaleRolloutError`; a
            `RolloutAlarm`: that one (its own bound). Off, with a warning, when the trainer's
            forward has dropout (swift's default ``lora_dropout=0.05``:
            `weightsync.alarm.trainer_dropout`), or the engine quantizes and no `RolloutAlarm`
            with a measured bound is given (`weightsync.alarm.trainer_alarm`).

    Returns:
        The `Syncer` now used by every sync (``.engine`` is the `VLLMEngine` on swift's
        ``LLMEngine``; ``.engine.lora_request`` the served adapter). Also kept as
        ``trainer.weightsync``.

    Raises:
        ValueError: a trainer or option weightsync does not sync exactly (named in the
            message), or the trainer was already integrated.
    """
    _check_supported(trainer, verify)
    if getattr(trainer, "weightsync", None) is not None:
        raise ValueError(
            "use_weightsync was already called on this trainer; use the Syncer it returned "
            "(trainer.weightsync)"
        )
    args = trainer.args
    engine = VLLMEngine(trainer.engine)
    served = bool(trainer.rollout_enable_lora)
    syncer = Syncer(
        engine,
        train_type="lora" if args.tuner_type == "lora" else "full",
        rollout_lora=served,
        verify=verify,
    )

    def move_model_to_vllm(skip_async_check: bool = False) -> None:
        # swift's signature; skip_async_check only matters with async_generate (refused).
        syncer.sync(trainer.accelerator.unwrap_model(trainer.model))
        trainer.base_sync_done = True
        trainer._reset_vllm_cache()

    trainer._move_model_to_vllm = move_model_to_vllm
    if served:
        _generate_with_adapter(trainer.engine, engine)
    trainer.weightsync = syncer
    checker = trainer_alarm(trainer.model, engine, alarm)
    if checker is not None:
        _check_rollouts(trainer, checker)
    return syncer


def _check_rollouts(trainer: Any, alarm: RolloutAlarm) -> None:
    """Run ``alarm`` where swift compares its rollout logprobs with the trainer's
    (``_compute_rollout_offpolicy_metrics``, on for every batch from now on)."""
    offpolicy_metrics = trainer._compute_rollout_offpolicy_metrics

    @functools.wraps(offpolicy_metrics)
    def checked(
        old_per_token_logps: torch.Tensor, rollout_per_token_logps: torch.Tensor, mask: Any
    ) -> dict[str, torch.Tensor]:
        metrics = offpolicy_metrics(old_per_token_logps, rollout_per_token_logps, mask)
        gap = alarm.check(old_per_token_logps, rollout_per_token_logps, mask)
        device = old_per_token_logps.device
        metrics["weightsync_rollout_logp_gap"] = torch.tensor(gap.mean, device=device)
        metrics["weightsync_rollout_alarm"] = torch.tensor(float(gap.alarm), device=device)
        return metrics

    trainer._compute_rollout_offpolicy_metrics = checked
    trainer.log_rollout_offpolicy_metrics = True


def register_callback(name: str = "weightsync", *, verify: bool | None = None) -> None:
    """Make ``--callbacks <name>`` call `use_weightsync` on swift's trainer when training begins.

    For swift's CLI, from a file given to ``--external_plugins``::

        from weightsync.integrations.swift import register_callback
        register_callback()

    swift creates its callbacks before the trainer creates its vLLM engine, so the callback
    waits for ``on_train_begin`` (after the engine exists, before the first rollout syncs).
    """
    from swift.callbacks import (
        TrainerCallback,
        callbacks_map,
    )

    class WeightsyncCallback(TrainerCallback):
        """``use_weightsync(trainer, verify=...)`` at ``on_train_begin``."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            use_weightsync(self.trainer, verify=verify)

    callbacks_map[name] = WeightsyncCallback


def _check_supported(trainer: Any, verify: bool | None) -> None:
    """Refuse, naming the option, every set-up weightsync's swift integration is not exact in."""
    from swift.rlhf_trainers import GRPOTrainer

    if not isinstance(trainer, GRPOTrainer):
        raise ValueError(
            f"{type(trainer).__name__}: weightsync's ms-swift integration syncs swift's "
            "GRPOTrainer (rlhf_type='grpo') only"
        )
    args = trainer.args
    if not args.use_vllm or trainer.vllm_mode != "colocate":
        raise ValueError(
            f"use_vllm={args.use_vllm}, vllm_mode={trainer.vllm_mode!r}: weightsync's ms-swift "
            "integration needs use_vllm=True and vllm_mode='colocate' (swift's in-process "
            "engine); in server mode swift pushes weights to `swift rollout` over its own client, "
            "which this integration does not drive"
        )
    if args.async_generate:
        raise ValueError(
            "async_generate=True: swift generates asynchronously against a `swift rollout` "
            "server only (vllm_mode='server'), which weightsync's ms-swift integration does not "
            "drive; use async_generate=False with vllm_mode='colocate'"
        )
    if args.vllm_tensor_parallel_size != 1:
        raise ValueError(
            f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size}: weightsync's in-process "
            "adapter is tested with one engine rank per process only; use 1"
        )
    deepspeed = trainer.accelerator.state.deepspeed_plugin
    if trainer.is_fsdp_enabled or (deepspeed is not None and deepspeed.zero_stage == 3):
        raise ValueError(
            "this trainer shards its parameters (FSDP2 or DeepSpeed ZeRO-3); weightsync's "
            "ms-swift integration syncs a whole model held by one process and does not gather "
            "shards yet"
        )
    if args.tuner_type not in TUNER_TYPES:
        raise ValueError(
            f"tuner_type={args.tuner_type!r}: weightsync's ms-swift integration syncs "
            f"{' and '.join(TUNER_TYPES)} training only (what it sends of other tuners is not "
            "defined); use tuner_type='full' or 'lora', or swift's own sync"
        )
    if verify and args.sleep_level > 0:
        raise ValueError(
            f"verify=True generates a canary right after the sync, but with sleep_level="
            f"{args.sleep_level} swift wakes the KV cache only later, at generate; verify with "
            "sleep_level=0, or call weightsync.verify.check_engine yourself once it is awake"
        )


def _generate_with_adapter(swift_engine: Any, engine: VLLMEngine) -> None:
    """swift's engine asks ``_get_grpo_lora_request`` for the adapter when its caller gives
    none (its own id 111, loaded by swift's sync): give it weightsync's served adapter."""

    def grpo_lora_request(adapter_request: Any = None) -> Any:
        return adapter_request or engine.lora_request

    swift_engine._get_grpo_lora_request = grpo_lora_request
