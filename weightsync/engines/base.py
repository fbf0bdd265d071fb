"""What a rollout engine must offer so that every strategy can sync into it.

An adapter wraps one engine the trainer already created; strategies talk to the adapter only,
so adding an engine (SGLang, a remote server) means writing one class here and registering it,
without touching the policy or the strategies.

The adapter reports the engine's *state* as the engine attests it, never as a picture the
trainer keeps: a sync must never write into sleeping weight memory (on a GPU that memory is
unmapped: trl#5142), after a level-2 sleep the base weights are gone until something restores
them all (vllm#29341), and anyone -- another client, the framework, vLLM itself -- may have
slept, woken or rewritten the engine since weightsync last looked. An engine that can attest
keeps an *epoch* that every sleep, wake, reload, restart and weight write advances (for vLLM:
``engines/vllm/in_engine/ledger.py``, inside its workers); one that cannot is assumed to have lost its
base at any time. Both are checked by `Engine.check_writable` before any strategy writes.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, cast

import torch

from ..errors import BaseDiscardedError, EngineAsleepError
from ..plan import Adapter, Bucket
from ..wire.protocol import EngineFacts

__all__ = ["Attestation", "Engine", "EngineFacts", "adapt", "register"]


@dataclass(frozen=True)
class Attestation:
    """What an engine reports about its own weights at the moment of asking.

    Attributes:
        epoch: an opaque value that changes whenever anything may have changed the weights
            (a sleep, wake, reload, restart or weight write, by anyone); None when the engine
            cannot attest one (then nothing it holds may be skipped).
        asleep: the memory tags ("weights", "kv_cache") asleep now.
        harm: the worst that happened to the base since the last completed base restore:
            0 nothing, 1 level-1 sleeps only (weights kept), 2 the weights may be lost or
            replaced (a level-2 sleep, a write by anyone, a restart, or unknown).
        adapters: the adapter writes the engine counted (loads and in-place replacements, by
            anyone); part of the engine's version, not of the base's record.
    """

    epoch: Hashable | None
    asleep: frozenset[str]
    harm: int
    adapters: int = 0


class Engine(ABC):
    """A rollout engine seen from the trainer.

    Subclasses implement the engine calls; the sleep bookkeeping lives here so every engine
    enforces the same lifecycle rules.
    """

    #: Name under which the adapter is registered (see `register`).
    name: ClassVar[str]

    #: The engine may load while another engine of this process loads. False for engines that
    #: load one at a time (in-process vLLM engines share modules): `Replicas` then buffers the
    #: stream for them instead of waiting on them.
    loads_concurrently: ClassVar[bool] = True

    @classmethod
    def accepts(cls, obj: Any) -> bool:
        """Whether this adapter can wrap the raw engine ``obj`` (used by `adapt`)."""
        return False

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

    # --- what the engine holds -------------------------------------------------------------

    @property
    @abstractmethod
    def facts(self) -> EngineFacts:
        """What the engine loads and serves, read from the engine itself (see `EngineFacts`).

        Every check a plan makes is against these: ``weights`` is the contract a full sync is
        checked against before anything is written (a name outside it, a name of it missing
        from the stream, or a different shape is an error); whatever is sent under one group
        of ``tied`` must be one tensor in the trainer too, or the engine cannot hold it."""

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the engine computes in; weights are sent in it, cast once."""
        return cast("torch.dtype", getattr(torch, self.facts.dtype))

    @property
    def expected_weights(self) -> Mapping[str, tuple[int, ...]]:
        """Checkpoint name -> shape of every weight the engine loads."""
        return self.facts.weights

    @property
    def shared_weights(self) -> list[tuple[str, ...]]:
        """Groups of names the engine holds as *one* tensor (tied embeddings)."""
        return list(self.facts.tied)

    @property
    def serves_lora(self) -> bool:
        """The engine applies a LoRA adapter at generation time (vLLM ``enable_lora``)."""
        return self.facts.lora is not None

    @property
    def keeps_unsent_layers(self) -> bool:
        """A write that leaves some layers out leaves them as they were, so a sync may skip
        the layers the engine attests it still holds exactly (``strategies.base.unchanged``)."""
        return self.facts.keeps_unsent_layers

    def describe(self) -> str:
        """One line naming the engine, for plans and logs."""
        lora = ", serves LoRA" if self.serves_lora else ""
        return (
            f"{self.name} engine ({str(self.dtype).removeprefix('torch.')}{lora}{self.quantized})"
        )

    @property
    def quantized(self) -> str:
        """``", <how it quantizes>"`` for a quantized engine (see `Quantization`), else ``""``:
        what every description of the engine appends after its dtype."""
        q = self.facts.quantized
        return f", {q}" if q is not None else ""

    @property
    def weights_version(self) -> str | None:
        """The version of the weights the engine serves now, as the engine itself reports it
        (equal versions: the same weights), for tagging rollouts; None for an engine that
        reports none (the default). Engines with weightsync's worker extension derive it from
        the epoch their workers attest (`weightsync.engines.vllm.remote.RemoteVLLMEngine`)."""
        return None

    @property
    def written_version(self) -> str | None:
        """The version the last completed write left, as the engine attested it at the end of
        that write (what `Syncer` reports: asking again after every sync would cost another
        round of calls). This default asks now (`weights_version`)."""
        return self.weights_version

    def checkpoint_head(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The first row of each named tensor in the checkpoint `reload_checkpoint`
        reloads, for a cheap check that the trainer's base is still that checkpoint. An engine
        that cannot read its checkpoint returns ``{}`` (the check then rests on the PEFT set-up
        alone)."""
        return {}

    # --- writing ------------------------------------------------------------------------------

    @abstractmethod
    def load_weights(self, buckets: Iterable[Bucket]) -> int:
        """Load checkpoint-format weights, re-running the engine's post-load processing.

        ``buckets`` is consumed lazily, in order. If it raises part-way, the error propagates
        and the engine holds a mix of old and new weights: the caller must treat the base as
        unsynced. Returns the number of engine calls made.
        """

    @abstractmethod
    def check_adapter(self, adapter: Adapter) -> None:
        """Raise `AdapterError` if the engine cannot serve ``adapter``.
        Called before anything is written, so a bad adapter loses nothing."""

    @abstractmethod
    def load_adapter(self, adapter: Adapter) -> int:
        """Replace the served adapter with ``adapter`` under a stable id, in place.

        Re-adding an id without in-place replacement silently keeps the old adapter (vLLM);
        an implementation must make the new one take effect. Returns the engine calls made.
        """

    @abstractmethod
    def reload_checkpoint(self, path: str | None = None) -> int:
        """Have the engine re-read weights from a checkpoint folder: its original one when
        ``path`` is None. Returns the engine calls made."""

    @abstractmethod
    def greedy_batch(
        self, prompts: list[list[int]], max_tokens: int
    ) -> list[tuple[list[int], list[float]]]:
        """Greedy-decode ``max_tokens`` tokens for each prompt (with the served adapter, if
        any), in one engine call, and return them with their logprobs. Used to verify a sync
        against the trainer."""

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """`greedy_batch` for one prompt."""
        return self.greedy_batch([prompt_ids], max_tokens)[0]

    @abstractmethod
    def score_batch(self, prompts: list[list[int]], top_k: int) -> list[list[dict[int, float]]]:
        """The engine's prompt logprobs (teacher forcing, with the served adapter, if any), in
        one engine call, computed under the weights served now (no cached KV reused).

        For each prompt, one dict per position ``i`` in ``1 .. len(prompt) - 1``: token id ->
        logprob of the engine's next-token distribution after ``prompt[:i]``, holding
        ``prompt[i]`` and the ``top_k`` most likely tokens (vLLM ``prompt_logprobs=top_k``).
        Verification compares these with the trainer's over many positions, which sees a
        defect far below what a few greedy tokens show (a one-step-stale head in bf16).
        """

    # --- lifecycle ----------------------------------------------------------------------------

    @abstractmethod
    def _engine_sleep(self, level: int) -> None: ...

    @abstractmethod
    def _engine_wake(self, tags: list[str] | None) -> None: ...

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
        self.forget()

    # --- what the engine attests --------------------------------------------------------------

    def _attest(self, since: Hashable | None) -> Attestation:
        """What the engine itself reports now, with the worst harm since epoch ``since``
        (None: all the engine has on record). The default is an engine that can attest
        nothing: its weights may have been discarded at any time (harm 2), and only the sleeps
        made through this adapter are known. Override to read the engine's own record."""
        return Attestation(None, frozenset(self._own_asleep), 2)

    def attest(self) -> Attestation:
        """The engine's epoch, sleeping tags and the worst harm to its base since the last
        completed base restore, as the engine reports them *now* (never a cached picture),
        with what the trainer side knows on top (reported sleeps, failed writes)."""
        a = self._attest(self._restored_at)
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

    def remember(self, held: Mapping[str, tuple], *, restored: bool) -> None:
        """After a completed write: the engine holds ``held`` (name -> content key) at the
        epoch it attests now; ``restored``: every base weight was written.

        A write that is not a restore (an adapter sync that also sends a trained head copy)
        moved the epoch itself; if the base was intact when it started (the attestation
        `check_writable` returned), the harm is measured from after it, keeping what there was
        before (a level-1 sleep)."""
        before = self._checked
        now = self.attest()
        if restored:
            self._restored_at = now.epoch
            self._known_harm = 0
        elif before is not None and before.harm < 2 and now.epoch is not None:
            self._restored_at = now.epoch
            self._known_harm = max(self._known_harm, before.harm)
        if held and now.epoch is not None:
            self._held, self._held_epoch = dict(held), now.epoch
        else:
            self.forget()

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
    raise TypeError(
        f"no engine adapter accepts {type(engine).__module__}.{type(engine).__name__}; "
        f"registered: {sorted(_REGISTRY)}. Wrap it in an Engine subclass and @register it."
    )
