"""Syncer: the state a framework would otherwise track by hand between syncs."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from torch import nn

from . import errors, policy
from .engines.base import Engine, adapt
from .errors import BaseUnprovenError
from .execute import execute
from .plan import Plan
from .proven import check_after_sync
from .strategies import AdapterSync, FullSync, ReloadWeights, Strategy, SyncReport

logger = logging.getLogger(__name__)


def synced_version(engine: Engine, report: SyncReport) -> str | None:
    """The version a completed sync left in ``engine``, as the engine attested it.

    Taken from the attestation the sync's last write already made (`Engine.written_version`)
    when the sync wrote (``report.engine_calls``): asking the engine again would cost every
    sync another round of calls (an attestation, and a LoRA listing). A sync that wrote nothing
    (every layer skipped) is asked now (`Engine.weights_version`)."""
    if report.engine_calls:
        return engine.written_version
    return engine.weights_version


class Syncer:
    """Told the training setup once; after every wake, chooses a strategy and syncs.

    It owns ``base_sync_done``: False until a sync completes, set False again *before* each
    sync starts, True only once it completed (and passed verification, when it was verified). So a
    sync that fails half-way leaves the base marked unsynced and the next call resends
    everything.

    The sleep level comes from the engine itself (`Engine.attest`: every sleep, wake and
    weight write since the last full restore, by anyone, as the engine records it; plus what
    the caller reports with `Engine.mark_asleep`), or from the ``sleep_level`` argument; the
    deeper of the two wins, and a reported level turns skipping of unchanged layers off.

    Example::

        syncer = Syncer(VLLMEngine(llm), train_type="lora")
        for step in range(steps):
            ...train...
            syncer.engine.wake_up(["weights"])
            syncer.sync(model)               # picks FullSync / AdapterSync, logs why
            syncer.engine.wake_up(["kv_cache"])
            ...generate with lora_request=syncer.engine.lora_request...

    Args:
        engine: an `Engine` or a raw engine a registered adapter accepts (``vllm.LLM``).
        train_type: ``"full"`` or ``"lora"``.
        rollout_lora: the engine serves the adapter; defaults to what the engine reports.
        prefer_reload: restore a discarded base from the engine's checkpoint (see policy).
        base_sync_done: start as if the base were synced (e.g. the engine was started from the
            very checkpoint the trainer loaded, as verl assumes unless load_format is "dummy").
        verify: True: check every sync on a canary prompt (see `weightsync.verify`). The
            canary is generated, so the KV cache must be awake at sync time; with the split
            wake of the example, leave this unset and call ``verify.check_engine`` after the KV
            wake. None (the default): only the first sync of an engine whose architecture or
            quantization weightsync has not proven exact (`weightsync.proven`), once; a
            mismatch raises `UnprovenEngineError`, naming the architecture. False: never, not
            even that first one (the explicit opt-out).
    """

    def __init__(
        self,
        engine: Engine | Any,
        *,
        train_type: policy.TrainType,
        rollout_lora: bool | None = None,
        prefer_reload: bool = False,
        base_sync_done: bool = False,
        verify: bool | None = None,
    ) -> None:
        self.engine = adapt(engine)
        self.train_type = train_type
        self.rollout_lora = self.engine.serves_lora if rollout_lora is None else rollout_lora
        self.prefer_reload = prefer_reload
        self.base_sync_done = base_sync_done
        self.verify = verify
        self.step = 0
        self.choose()  # validate the setup now, not at the first sync

    def choose(self, sleep_level: int | None = None) -> Strategy:
        """The strategy the next `sync` would run."""
        level = self.engine.sleep_level
        if sleep_level is not None:
            level = max(level, sleep_level) if sleep_level in policy.SLEEP_LEVELS else sleep_level
        return policy.choose(
            train_type=self.train_type,
            rollout_lora=self.rollout_lora,
            base_sync_done=self.base_sync_done,
            sleep_level=level,
            prefer_reload=self.prefer_reload,
        )

    def plan(self, model: nn.Module, *, sleep_level: int | None = None) -> Plan:
        """What the next `sync` would write, checked, with nothing written:
        ``print(syncer.plan(model))`` explains the choice and its cost.

        Where the policy picks `AdapterSync` but nothing proves the engine holds the base the
        adapter was trained against (a merged sync since, by another Syncer or a strategy
        called directly; a base written by someone else; a frozen base changed on the
        trainer's side; see `weightsync.strategies.proof`), the base is restored with the
        adapter instead (FullSync base + adapter, or ReloadWeights with ``prefer_reload``),
        and the plan's reason says why."""
        return self._plan(self.choose(sleep_level), model)[1]

    def decide(self, model: nn.Module, *, sleep_level: int | None = None) -> Strategy:
        """The strategy the next `sync` of ``model`` would run: `choose`'s, or the base
        restore `plan` puts in place of an `AdapterSync` whose base is not proven."""
        return self._plan(self.choose(sleep_level), model)[0]

    def _plan(self, strategy: Strategy, model: nn.Module) -> tuple[Strategy, Plan]:
        try:
            return strategy, strategy.plan(model, self.engine)
        except BaseUnprovenError as err:
            if not isinstance(strategy, AdapterSync):
                raise
            why = err.why
            restore: Strategy = (
                ReloadWeights(reason=f"the engine's base is not proven: {why}; reloading it")
                if self.prefer_reload
                else FullSync(
                    lora="separate",
                    reason=f"the engine's base is not proven: {why}; pushing base + adapter",
                )
            )
            return restore, restore.plan(model, self.engine)

    def sync(self, model: nn.Module, *, sleep_level: int | None = None) -> SyncReport:
        """Choose, sync ``model`` into the engine, and update ``base_sync_done``.

        The report's ``weights_version`` is the version the engine attested at the end of the
        sync (`synced_version`), for tagging the rollouts generated next; it equals
        `Engine.weights_version` until anyone changes the engine again.

        Raises whatever the strategy or the verification raises; nothing is swallowed.
        """
        start = time.perf_counter()
        strategy = self.choose(sleep_level)
        synced, self.base_sync_done = self.base_sync_done, False
        chosen, plan = self._plan(strategy, model)
        try:
            report = execute(plan, self.engine, started=start)
        except BaseException as error:
            if errors.left_untouched(error):  # a failed stage: the engine holds what it held
                self.base_sync_done = synced
            raise
        diff = check_after_sync(
            model,
            self.engine,
            verify=self.verify,
            strategy=plan.strategy,
            step=self.step,
            rewrite=lambda: execute(chosen.plan(model, self.engine), self.engine),
        )
        # after the check: a check that compared with vLLM's own load wrote the sync again
        report = dataclasses.replace(report, weights_version=synced_version(self.engine, report))
        if diff is not None:
            report = dataclasses.replace(report, verified_logprob_diff=diff)
        self.base_sync_done = True
        logger.info(
            "weightsync step %d: %s (%s), %d bytes in %.3fs",
            self.step,
            report.strategy,
            report.reason,
            report.bytes,
            report.seconds,
        )
        self.step += 1
        return report

    async def async_sync(self, model: nn.Module, *, sleep_level: int | None = None) -> SyncReport:
        """`sync`, for a trainer running an event loop: the sync runs in a worker thread, so
        the loop keeps running meanwhile -- its rollouts, and the engine's own calls when the
        engine lives on this very loop (an ``AsyncLLM``: `AsyncLLMEngine` schedules each call
        onto its loop and waits in the worker thread, which blocking the loop here would
        deadlock).

        The model must not be trained while the sync reads it. Cancelling the awaiting task
        does not stop the sync: it runs to its end (or its error) in its thread, leaving
        ``base_sync_done`` as `sync` does; one sync at a time, as with `sync`.
        """
        return await asyncio.to_thread(self.sync, model, sleep_level=sleep_level)
