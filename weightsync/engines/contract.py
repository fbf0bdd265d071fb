"""The contract an engine adapter implements: what it reports and the verbs it performs.

An adapter wraps one engine the trainer already created; strategies talk to the adapter only,
so adding an engine (SGLang, a remote server) means writing one class and registering it,
without touching the policy or the strategies. What it implements is all here: the facts it
reports (`facts`), five writes and reads (`load_weights`, `check_adapter`, `load_adapter`,
`reload_checkpoint`, and the two generation calls verification uses, `greedy_batch` and
`score_batch`), the engine's own sleep and wake, and -- optional, for engines that can --
`_attest`, the engine's own record of what happened to its weights. What the trainer keeps
about an engine between syncs (the harm since the last restore, what it holds from weightsync)
is not the adapter's to write: it is `weightsync.engines.base.Engine`, which every adapter
subclasses. docs/engine-contract.md walks through a minimal adapter.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch

from ..plan import Adapter, Bucket
from ..wire.protocol import EngineFacts

__all__ = ["FANOUT", "Attestation", "EngineContract", "EngineFacts", "FanOut", "Staged"]


class Staged:
    """A write staged on an engine while it serves, not yet applied.

    `apply` commits it (once; for an engine, inside its pause) and returns the engine calls it
    made; `drop` releases what is staged and is always called, applied or not; `discard`
    releases it when it will never be applied (another replica of a fan-out failed to stage:
    nothing of this sync may stay behind), `drop` by default.
    """

    def __init__(
        self,
        apply: Callable[[], int | None],
        drop: Callable[[], None] = lambda: None,
        discard: Callable[[], None] | None = None,
    ) -> None:
        self.apply = apply
        self.drop = drop
        self.discard = discard or drop


class FanOut:
    """One sync staged on several engines at once (`weightsync.engines.replicas.Replicas`):
    what one engine's transport made of a piece for its carrier, another's may take instead of
    making it again -- for a Ray actor, the object its put wrote into the store, so a fan-out
    to N actors puts the synced bytes once, not N times. It lives for the stage of one sync
    (`FANOUT` names it in each replica's thread) and holds what it made until then.

    A piece is keyed by the names, storage and version of its tensors: within one sync every
    name comes once and a produced tensor is not changed, so the same key is the same bytes.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made: dict[Hashable, tuple[threading.Lock, list[Any]]] = {}

    def once(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """``make()``'s result for ``key``: made by the first caller (the others wait for it),
        made again by a caller after a failed make."""
        with self._lock:
            lock, made = self._made.setdefault(key, (threading.Lock(), []))
        with lock:
            if not made:
                made.append(make())
            return made[0]


#: The fan-out a transport's stage runs in (None: one engine alone); set by `Replicas`.
FANOUT: ContextVar[FanOut | None] = ContextVar("weightsync_fanout", default=None)


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


class EngineContract(ABC):
    """What an engine adapter implements (subclass `weightsync.engines.base.Engine`, which
    adds the trainer's record on top): the facts the engine reports, its writes, its generation
    calls for verification, its sleep and wake, and optionally its own attestation."""

    #: Name under which the adapter is registered (see `register`).
    name: ClassVar[str]

    #: The engine may load while another engine of this process loads. False for engines that
    #: load one at a time (in-process vLLM engines share modules): `Replicas` then commits them
    #: one after the other.
    loads_concurrently: ClassVar[bool] = True

    @classmethod
    def accepts(cls, obj: Any) -> bool:
        """Whether this adapter can wrap the raw engine ``obj`` (used by `adapt`)."""
        return False

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
        unsynced (a ``vllm serve`` with weightsync's middleware refuses to generate from it). Returns the number of engine calls made.
        """

    @property
    def stages_weights(self) -> bool:
        """`stage_weights` puts the bytes on the engine's side while it serves (a ``vllm serve``
        or multiprocess engine over tmpfs: files written and tagged). False: the engine has
        nowhere to stage them, and `stage_weights` holds the stream in this process."""
        return False

    def stage_weights(self, buckets: Iterable[Bucket]) -> Staged:
        """Stage ``buckets`` (consumed here, in order) while the engine keeps serving; nothing is
        applied until the returned `Staged` is. A failure here leaves the engine untouched.

        `weightsync.engines.Replicas` stages on every replica before it commits any, so one
        replica's failed stage commits none. This default, for an engine that cannot stage
        (`stages_weights` False: an in-process engine, a stream transport), holds the produced
        buckets in this process (one copy of the synced bytes, where the trainer produced them)
        and loads them at commit."""
        held = list(buckets)
        return Staged(lambda: self.load_weights(held))

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

    def stage_adapter(self, adapter: Adapter) -> Staged:
        """Carry ``adapter`` to the engine while it serves; nothing is loaded until the returned
        `Staged` is applied. A failure here leaves the engine untouched.

        `weightsync.engines.Replicas` stages the adapter on every replica before it loads it
        into any, so the transfer, where an adapter's load fails most (a refused frame, a
        tag that differs), fails on none or loads on none. This default, for an engine whose
        load has no transfer to split off (an in-process engine builds the adapter from the
        trainer's tensors, and replaces the served one only once it is built), stages
        nothing and loads it at apply."""
        return Staged(lambda: self.load_adapter(adapter))

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

    def _attest(self, since: Hashable | None) -> Attestation:
        """What the engine itself reports now, with the worst harm since epoch ``since`` (None:
        all the engine has on record). The default is an engine that can attest nothing: no
        epoch, nothing it knows asleep, and its weights may have been discarded at any time
        (harm 2), so nothing is ever skipped and only a full restore may run after any sleep.
        Override to read the engine's own record (vLLM: the workers' ledger)."""
        return Attestation(None, frozenset(), 2)
