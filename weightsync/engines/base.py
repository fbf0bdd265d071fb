"""The trainer's record of an engine, kept the same way for every adapter: `Engine`.

The contract an adapter implements is `weightsync.engines.contract.EngineContract`; `Engine`
adds what the trainer side keeps about the engine between syncs, and every adapter subclasses
it. The record holds the engine's *state* as the engine attests it, never as a picture the
trainer keeps: a sync must never write into sleeping weight memory (on a GPU that memory is
unmapped: trl#5142), after a level-2 sleep the base weights are gone until something restores
them all (vllm#29341), and anyone -- another client, the framework, vLLM itself -- may have
slept, woken or rewritten the engine since weightsync last looked. An engine that can attest
keeps an *epoch* that every sleep, wake, reload, restart and weight write advances (for vLLM:
``engines/vllm/in_engine/ledger.py``, inside its workers); one that cannot is assumed to have
lost its base at any time. Both are checked by `Engine.check_writable` before any strategy
writes.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Hashable, Mapping
from dataclasses import replace
from typing import Any, cast

from ..errors import BadArgumentError, BaseDiscardedError, EngineAsleepError
from .contract import Attestation, EngineContract, EngineFacts

logger = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT",
    "Attestation",
    "Engine",
    "EngineContract",
    "EngineFacts",
    "adapt",
    "register",
]

#: `Engine.held_base` of an engine weightsync never wrote: it holds its own checkpoint.
CHECKPOINT = "checkpoint"


class Engine(EngineContract):
    """A rollout engine seen from the trainer: the adapter's contract (`EngineContract`) and
    the trainer's record of the engine, so every engine enforces the same lifecycle rules.
    """

    def __init__(self) -> None:
        #: Epoch the engine attested right after the last completed base restore; harm is
        #: measured from it. None until then: everything the engine has on record counts.
        self._restored_at: Hashable | None = None
        #: Harm known on the trainer side since then: reported sleeps, failed writes.
        self._known_harm = 0
        #: Sleeping tags known from this adapter's own calls (engines that cannot attest).
        self._own_asleep: set[str] = set()
        #: What the engine holds from the last completed sync (checkpoint name -> content
        #: key, see ``plan.content_key``) and the engine epoch that record is valid at.
        self._held: dict[str, tuple] = {}
        self._held_epoch: Hashable | None = None
        #: What the engine attested when `check_writable` last let a write through.
        self._checked: Attestation | None = None
        #: The base the engine holds from weightsync's writes since the last completed base
        #: restore (checkpoint name -> `strategies.proof.base_key` of the unmerged trainer
        #: tensor), and the strategy that wrote it; None: weightsync wrote nothing yet.
        self._base: dict[str, tuple] | None = None
        self._base_source = ""
        #: The first-sync check of an engine weightsync has not proven exact has run
        #: (`weightsync.proven.check_after_sync`): passed, or found impossible to run.
        self.first_sync_checked = False

    # --- the lifecycle, as the trainer records it -------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Put the engine to sleep (an engine that attests its epoch records it itself)."""
        self._engine_sleep(level)
        self.mark_asleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the engine (all of it, or the given tags: "weights", "kv_cache")."""
        self._engine_wake(tags)
        self.mark_awake(tags)

    def mark_asleep(self, level: int) -> None:
        """Report a sleep the caller made on the engine directly (without `sleep`).

        An engine that attests its epoch sees such sleeps itself; a report still counts, and
        turns skipping off until the next completed base restore. An engine that cannot
        attest knows of sleeps only this way (and through `sleep`)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self._own_asleep = {"weights", "kv_cache"}
        self._known_harm = max(self._known_harm, level)

    def mark_awake(self, tags: list[str] | None = None) -> None:
        """Report a wake the caller made on the engine directly (without `wake_up`)."""
        self._own_asleep -= set(tags) if tags is not None else self._own_asleep

    def mark_lost(self) -> None:
        """The trainer side knows the base may be a mix of old and new weights (a write that
        failed part-way): until a full restore, only a strategy that restores the base may
        run, and nothing is skipped."""
        self._known_harm = 2
        self._base, self._base_source = {}, "a write that failed part-way (or failed verification)"
        self.forget()

    # --- what the engine attests, with what the trainer knows ---------------------------------

    def attest(self) -> Attestation:
        """The engine's epoch, sleeping tags and the worst harm to its base since the last
        completed base restore, as the engine reports them *now* (never a cached picture),
        with what the trainer side knows on top (reported sleeps, failed writes)."""
        a = self._attest(self._restored_at)
        if a.epoch is None:  # no record of its own: the sleeps made through this adapter count
            a = replace(a, asleep=a.asleep | self._own_asleep)
        return replace(a, harm=max(a.harm, self._known_harm))

    @property
    def asleep(self) -> frozenset[str]:
        """The memory tags ("weights", "kv_cache") asleep now."""
        return self.attest().asleep

    @property
    def sleep_level(self) -> int:
        """The worst harm to the base since the last completed base restore: 0 none, 1 a
        level-1 sleep (weights kept), 2 a level-2 sleep, a write by anyone else, a restart,
        or anything the engine cannot rule out."""
        return self.attest().harm

    @property
    def base_discarded(self) -> bool:
        """The base may be gone or replaced since the last completed restore (see
        `sleep_level`): only a strategy that restores all of it may run."""
        return self.attest().harm >= 2

    def check_writable(self, *, restores_base: bool, strategy: str) -> Attestation:
        """Refuse a write the engine's sleep state makes unsafe; return the attestation the
        decision was made on.

        Raises:
            EngineAsleepError: the "weights" memory is asleep.
            BaseDiscardedError: the base may be gone (`base_discarded`) and ``strategy`` does
                not restore all of it.
        """
        now = self._checked = self.attest()
        if "weights" in now.asleep:
            raise EngineAsleepError(
                f"{strategy}: the engine's weights are asleep; call wake_up(tags=['weights']) "
                "before syncing (writing into sleeping weights corrupts memory, trl#5142), "
                "then wake_up(tags=['kv_cache']) after."
            )
        if now.harm >= 2 and not restores_base:
            raise BaseDiscardedError(
                f"{strategy}: the engine's base weights may be gone since the last full restore "
                "(a level-2 sleep discarded them, or a write by someone else, a restart or a "
                "failed write replaced them, or the engine cannot attest its state) and "
                f"{strategy} does not restore them; waking without a full restore generates "
                "gibberish (vllm#29341). Use FullSync or ReloadWeights (policy.choose picks one "
                "when told sleep_level=2; Syncer does it by itself)."
            )
        return now

    # --- what the engine holds from weightsync ------------------------------------------------

    def skippable(self) -> tuple[Mapping[str, tuple], Hashable | None, str]:
        """The record of what the engine holds from the last completed sync (checkpoint name ->
        content key), the epoch it is valid at, and why it is empty when it is.

        The record counts only while the engine attests that nothing happened to its weights
        since weightsync wrote them: the same epoch, and no sleep the caller reported."""
        now = self.attest()
        if now.epoch is None:
            return {}, None, "the engine cannot attest its epoch (no weightsync worker extension)"
        if not self._held:
            return {}, None, "no earlier completed sync recorded what the engine holds"
        if self._known_harm:
            return {}, None, f"a sleep (level {self._known_harm}) was reported since the last sync"
        if now.epoch != self._held_epoch:
            return (
                {},
                None,
                (
                    "the engine's epoch moved since the last sync (a sleep, wake, reload, restart "
                    "or weight write, by anyone)"
                ),
            )
        return dict(self._held), now.epoch, ""

    def remember(
        self,
        held: Mapping[str, tuple],
        *,
        restored: bool,
        base: Mapping[str, tuple] | None = None,
        source: str = "",
        after: Attestation | None = None,
    ) -> None:
        """After a completed write: the engine holds ``held`` (name -> content key) at the
        epoch it attests now; ``restored``: every base weight was written; ``base``: the base
        the engine holds now, by `strategies.proof.base_key` (None: unknown, as after a write
        that did not say), written by the strategy ``source``. ``after``: for a write that
        moves no epoch (an adapter alone: adapter loads leave it), the attestation
        `check_writable` made before it, taken as the engine's state after it rather than
        asking again; whatever else happened to the engine meanwhile lies after that epoch,
        so the next attestation still sees it.

        A write that is not a restore (an adapter sync that also sends a trained head copy)
        moved the epoch itself; if the base was intact when it started (the attestation
        `check_writable` returned), the harm is measured from after it, keeping what there was
        before (a level-1 sleep)."""
        before = self._checked
        now = self.attest() if after is None else after
        if after is None and not self._written_at(now):
            # Another write came between this write's commit and now: the engine holds that
            # write (or a mix with it), not only this one. Keep no record; restore fully next.
            logger.warning(
                "weightsync: %s was written by someone else right after this sync committed "
                "(its epoch moved between the commit and now); the next sync restores it fully",
                self.describe(),
            )
            self.mark_lost()
            return
        intact = before is not None and before.harm < 2  # the base survived up to this write
        kept = restored or (intact and now.epoch is not None)
        if restored:
            self._restored_at = now.epoch
            self._known_harm = 0
        elif kept:
            self._restored_at = now.epoch
            self._known_harm = max(self._known_harm, before.harm if before else 0)
        # A write that is not a restore leaves the base it found (held_base still asks the
        # engine for harm at the next proof), also where the engine keeps no epoch.
        self._base = dict(base) if (restored or intact) and base is not None else {}
        self._base_source = source or "a write that recorded no base"
        if held and now.epoch is not None:
            self._held, self._held_epoch = dict(held), now.epoch
        else:
            self.forget()

    def held_base(
        self, now: Attestation | None = None
    ) -> tuple[Mapping[str, tuple] | str | None, str, str]:
        """The base the engine holds now, as far as it is proven: ``(keys, source, "")`` --
        checkpoint name -> `strategies.proof.base_key` of what weightsync wrote, by the
        strategy ``source``, which the engine attests is still there (no harm 2 since: a
        level-1 sleep keeps it); ``(CHECKPOINT, "", "")`` when weightsync wrote nothing into
        the engine and it attests no weight write since weightsync first watched it (it
        holds its own checkpoint); else ``(None, "", why not)``.

        ``now``: this engine's `attest` taken as the caller's plan began (the one
        `check_writable` returned), used instead of asking again: the plan writes nothing,
        and whatever happens to the engine after it is seen by the check `execute` makes
        before writing."""
        now = self.attest() if now is None else now
        if now.harm >= 2:
            return (
                None,
                "",
                (
                    "the engine's base may be gone or replaced since the last full restore (a "
                    "level-2 sleep, a write by someone else, a restart, a failed write, or an "
                    "engine that cannot attest its state)"
                ),
            )
        if self._base is None:
            return CHECKPOINT, "", ""
        return dict(self._base), self._base_source, ""

    def _written_at(self, now: Attestation) -> bool:
        """Whether ``now``, attested once the last write ended, is still the epoch that write
        committed: an engine whose commit attests its epoch inside the pause compares the two
        (`vllm.remote.RemoteVLLMEngine`); one that does not (in process: no other client
        writes between the commit and the record) says True."""
        return True

    def forget(self) -> None:
        """Drop the record of what the engine holds: the next full sync sends everything."""
        self._held, self._held_epoch = {}, None


_REGISTRY: dict[str, type[Engine]] = {}


def register(cls: type[Engine]) -> type[Engine]:
    """Class decorator: make an engine adapter known to `adapt` under ``cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


#: Modules of the adapters weightsync ships, imported on the first `adapt` (importing them
#: does not import vLLM; each registers itself).
_BUILTIN = (
    "weightsync.engines.vllm.inprocess",
    "weightsync.engines.vllm.remote",
    "weightsync.engines.vllm.asyncllm",
    "weightsync.engines.vllm.ray.engine",
)


def instance_of(obj: Any, module: str, name: str) -> bool:
    """Whether ``obj`` is an instance of ``module.name``, importing ``module`` only when the type
    of ``obj`` comes from that library (`Engine.accepts` must not import vLLM or Ray for
    another engine's objects)."""
    if not type(obj).__module__.startswith(module.split(".", 1)[0]):
        return False
    return isinstance(obj, getattr(importlib.import_module(module), name))


def adapt(engine: Any) -> Engine:
    """Wrap a raw engine object (e.g. a ``vllm.LLM``) in the registered adapter that accepts it;
    an `Engine` is returned as it is."""
    if isinstance(engine, Engine):
        return engine
    for module in _BUILTIN:
        importlib.import_module(module)
    for cls in _REGISTRY.values():
        if cls.accepts(engine):
            # A registered adapter is constructed from the raw engine it accepts (the abstract
            # Engine.__init__ takes none, so type[Engine] does not say so).
            return cast("Callable[[Any], Engine]", cls)(engine)
    raise BadArgumentError(
        f"engine: no engine adapter accepts {type(engine).__module__}.{type(engine).__name__}; "
        f"registered: {sorted(_REGISTRY)}. Wrap it in an Engine subclass and @register it."
    )
