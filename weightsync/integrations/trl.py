"""TRL: make a trainer that generates with vLLM sync through weightsync.

Every TRL trainer that uses vLLM (GRPO, RLOO, Distillation, ...) holds a
``trl.generation.vllm_generation.VLLMGeneration`` as ``trainer.vllm_generation``, and its
``sync_weights`` is the one place weights go into the engine. TRL's own sync writes through the
vLLM model's raw ``load_weights`` with no post-load processing, sends a tied embedding once (a
stale ``lm_head``), and merges LoRA into the trainer's weights in place and back (the base
drifts). `use_weightsync` replaces that one method on the instance, so all of this goes through
`Syncer` instead::

    trainer = GRPOTrainer(model=..., args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...))
    syncer = use_weightsync(trainer)          # before trainer.train()
    trainer.train()

In colocate mode the engine is the trainer's own ``vllm.LLM`` (`VLLMEngine`, which records
TRL's sleeps itself); ``serve_lora=True`` re-creates it with LoRA enabled through TRL's own
``_init_vllm``. In server mode the server is synced through `VLLMServerEngine` instead of TRL's
NCCL push; `server_mode` creates the trainer without TRL's weight-transfer group. Refused rather
than synced wrongly: tensor parallelism in the trainer's own engine, several trainer processes
in server mode, and FSDP or DeepSpeed ZeRO-3 parameters. What each piece changes, why it is
needed and what each option costs: docs/recipes.md, "TRL".
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import typing
from collections.abc import Iterator
from typing import Any

from ..alarm import RolloutAlarm, trainer_alarm
from ..engines.base import Engine
from ..engines.vllm.inprocess import VLLMEngine
from ..engines.vllm.server import VLLMServerEngine
from ..engines.vllm.server_auth import HEADER as TOKEN_HEADER
from ..engines.vllm.server_auth import TOKEN_ENV
from ..engines.vllm.transports import Transport
from ..syncer import Syncer


def use_weightsync(
    trainer: Any,
    *,
    serve_lora: bool = False,
    sleep_level: int = 2,
    max_lora_rank: int | None = None,
    verify: bool | None = None,
    token: str | None = None,
    transport: str | Transport = "tmpfs",
    allow_unauthenticated: bool = False,
    alarm: typing.Literal["log", "raise", "off"] | RolloutAlarm = "log",
) -> Syncer:
    """Route ``trainer``'s vLLM weight sync through a weightsync `Syncer`.

    Call it once, after creating the trainer and before ``trainer.train()``.

    Args:
        trainer: a TRL trainer with ``use_vllm=True`` (it holds ``trainer.vllm_generation``),
            in ``vllm_mode="colocate"`` or ``"server"``.
        serve_lora: the engine applies the trainer's LoRA adapter at generation time instead of
            receiving merged weights; the trainer's model must be a ``peft.PeftModel``. In
            colocate mode the engine is recreated with LoRA enabled if it was created without
            (see module doc); a server must have been started with ``--enable-lora``.
        sleep_level: the level TRL's sleeps use when ``vllm_enable_sleep_mode=True``. TRL's own
            is 2, which discards the weights, so every step resends all of them. Level 1
            offloads them instead and keeps them: with ``serve_lora`` a step then sends only the
            adapter, at the price of host memory holding the weights while training.
        max_lora_rank: for ``serve_lora``, the engine's ``max_lora_rank``; defaults to the
            smallest vLLM accepts that covers the adapter's rank.
        verify: True: check every sync against the trainer on a canary prompt. Verification
            generates, so it needs the KV cache awake: it cannot run with sleep mode, where TRL
            wakes the KV cache only after the sync.
            None (the default): only the first sync of an engine weightsync has not proven
            exact (`weightsync.proven`; with the KV cache asleep at that sync, the next one
            made awake). False: never.
        token: server mode: weightsync's token for the server (default: the one TRL's client
            was given by `server_mode`, else ``WEIGHTSYNC_TOKEN``), see `VLLMServerEngine`.
        transport: server mode: how the bytes travel (``"tmpfs"``: same host, ``"gloo"``: any
            host, or a `Transport` such as ``WeightTransferGloo``).
        allow_unauthenticated: server mode: use a server reached over the network without a
            token (see `VLLMServerEngine`).
        alarm: check every rollout batch (`weightsync.alarm`): the engine's logprobs of the
            tokens it sampled against the trainer's ``old_per_token_logps`` of the same tokens,
            which GRPO and RLOO already compute for their importance-sampling correction
            (``vllm_importance_sampling_correction=True``, TRL's default; without it there is
            nothing free to compare and no check runs). ``"log"``: a warning on an alarm, and
            the metrics ``weightsync/rollout_logp_gap`` and ``weightsync/rollout_alarm`` in
            TRL's logs; ``"raise"``: `StaleRolloutError` instead of the warning; a
            `RolloutAlarm`: that one (its own bound). Off, with a warning, when the trainer's
            forward has dropout (`weightsync.alarm.trainer_dropout`), or the engine quantizes
            and no `RolloutAlarm` with a measured bound is given (`alarm.trainer_alarm`).

    Returns:
        The `Syncer` now used by every sync (``.engine`` is the `VLLMEngine`, or the
        `VLLMServerEngine` in server mode; ``.engine.lora_request`` / ``.engine.served_adapter``
        the served adapter).

    Raises:
        ValueError: the trainer does not generate with vLLM, its parameters are sharded,
            ``serve_lora`` without a PEFT model (or on a server without LoRA), a sleep level
            other than 1 or 2 (or one given without sleep mode, or in server mode), or the
            trainer was already integrated.
        AuthError, EngineUnavailableError: server mode: the server cannot be used (see
            `VLLMServerEngine`), before anything is sent.
    """
    vg = getattr(trainer, "vllm_generation", None)
    if vg is None:
        raise ValueError(
            f"{type(trainer).__name__} has no vllm_generation: create it with use_vllm=True so "
            "that it generates with vLLM (vllm_mode='colocate' or 'server')"
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
    engine: Engine
    if vg.mode == "server":
        engine = VLLMServerEngine(
            vg.vllm_client.base_url,
            token=token or vg.vllm_client.session.headers.get(TOKEN_HEADER),
            transport=transport,
            allow_unauthenticated=allow_unauthenticated,
        )
        if serve_lora and not engine.serves_lora:
            engine.close()
            raise ValueError(
                f"serve_lora=True, but the server at {vg.vllm_client.base_url} does not serve "
                "LoRA: start it with --enable-lora --max-lora-rank <r or more> (and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), or use serve_lora=False (merged sync)"
            )
    else:
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
    base_model = vg.vllm_client.model if vg.mode == "server" else None

    def sync_weights() -> None:
        # TRL's order: wake the weights before writing them (trl#5142), KV cache at generate.
        if vg.mode == "colocate" and vg.enable_sleep_mode:
            from trl.generation.vllm_generation import empty_cache

            empty_cache()
            engine.wake_up(tags=["weights"])
        syncer.sync(vg.model)
        if isinstance(engine, VLLMServerEngine):
            # TRL's requests name the model to generate with: the adapter just loaded, if served.
            vg.vllm_client.model = engine.served_adapter or base_model
        else:
            # generate() re-syncs while this is set: this sync restored what the sleep discarded.
            vg._llm_weights_sleeping = False

    vg.sync_weights = sync_weights
    vg.weightsync = syncer
    checker = trainer_alarm(trainer.model, engine, alarm)
    if checker is not None:
        _check_rollouts(trainer, checker)
    return syncer


@contextlib.contextmanager
def server_mode(token: str | None = None) -> Iterator[None]:
    """Create TRL trainers in server mode without TRL's own weight-transfer group.

    TRL's ``VLLMClient.init_communicator`` runs inside the trainer's ``__init__`` and opens an
    NCCL group with the server's workers for TRL's per-tensor push: it needs CUDA and a server
    started with ``--weight-transfer-config '{"backend": "nccl"}'``. `use_weightsync` replaces that
    push, so the group is not needed; under this context manager it is not opened, and TRL's
    client sends weightsync's token instead (TRL reads the server's ``/server_info``, a dev route
    a guarded server answers only with it). A trainer so created refuses TRL's own push with a
    message saying to call `use_weightsync`, which takes the token from the client::

        with server_mode(token):
            trainer = GRPOTrainer(..., args=GRPOConfig(vllm_mode="server", ...))
        use_weightsync(trainer)

    Args:
        token: the server's weightsync token (default: ``WEIGHTSYNC_TOKEN``); None: send none.
    """
    from trl.generation.vllm_client import VLLMClient

    token = token or os.environ.get(TOKEN_ENV) or None
    init_communicator = VLLMClient.init_communicator

    def without_trl_weight_transfer(self: Any, device: Any = 0) -> None:
        def refuse(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(
                "this trainer was created under weightsync's server_mode(), which skips TRL's "
                "own weight transfer: call weightsync.integrations.trl.use_weightsync(trainer) "
                "before training"
            )

        self.update_named_params = refuse
        if token:
            self.session.headers[TOKEN_HEADER] = token

    VLLMClient.init_communicator = without_trl_weight_transfer
    try:
        yield
    finally:
        VLLMClient.init_communicator = init_communicator


def _check_supported(vg: Any, sleep_level: int, verify: bool | None) -> None:
    if vg.mode == "server":
        if vg.accelerator.num_processes != 1:
            raise ValueError(
                f"server mode with {vg.accelerator.num_processes} trainer processes: weightsync's "
                "TRL integration syncs the server from one trainer process only (not tested "
                "with more yet)"
            )
        if sleep_level != 2:
            raise ValueError(
                f"sleep_level={sleep_level} has no effect in server mode: TRL does not sleep a "
                "server (weightsync still sees any sleep made on it, by anyone)"
            )
    elif vg.tensor_parallel_size != 1:
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


def _check_rollouts(trainer: Any, alarm: RolloutAlarm) -> None:
    """Run ``alarm`` on every batch ``trainer._generate_and_score_completions`` returns with
    both sides' logprobs, and add its figures to the trainer's metrics."""
    generate_and_score = getattr(trainer, "_generate_and_score_completions", None)
    if generate_and_score is None:  # a trainer without GRPO's batch: nothing to compare
        return

    @functools.wraps(generate_and_score)
    def checked(inputs: Any) -> Any:
        out = generate_and_score(inputs)
        trainer_lp, engine_lp = out.get("old_per_token_logps"), out.get("sampling_per_token_logps")
        if trainer_lp is None or engine_lp is None:
            return out
        mask = out["completion_mask"]
        if out.get("tool_mask") is not None:
            mask = mask * out["tool_mask"]
        gap = alarm.check(trainer_lp, engine_lp, mask)
        metrics = trainer._metrics["train" if trainer.model.training else "eval"]
        metrics["weightsync/rollout_logp_gap"].append(gap.mean)
        metrics["weightsync/rollout_alarm"].append(float(gap.alarm))
        return out

    trainer._generate_and_score_completions = checked


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
