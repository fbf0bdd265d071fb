"""What a rollout engine must offer so that every strategy can sync into it.

An adapter wraps one engine the trainer already created; strategies talk to the adapter only,
so adding an engine (SGLang, a remote server) means writing one class here and registering it,
without touching the policy or the strategies.

The adapter also owns the engine's *sleep state*. A sync must never write into sleeping weight
memory (on a GPU that memory is unmapped: trl#5142), and after a level-2 sleep the base weights
are gone until something restores them all (vllm#29341). Both are checked by
`Engine.check_writable` before any strategy writes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, cast

import torch

from ..errors import BaseDiscardedError, EngineAsleepError
from ..plan import Adapter, Bucket


class Engine(ABC):
    """A rollout engine seen from the trainer.

    Subclasses implement the engine calls; the sleep bookkeeping lives here so every engine
    enforces the same lifecycle rules.
    """

    #: Name under which the adapter is registered (see `register`).
    name: ClassVar[str]

    #: A write that leaves some layers out leaves them as they were, so a sync may skip the
    #: layers the engine already holds exactly (see ``strategies.base.unchanged``).
    keeps_unsent_layers: bool = True

    @classmethod
    def accepts(cls, obj: Any) -> bool:
        """Whether this adapter can wrap the raw engine ``obj`` (used by `adapt`)."""
        return False

    def __init__(self) -> None:
        self._asleep: set[str] = set()
        self._base_discarded = False
        self._deepest_sleep = 0
        #: What the engine holds from the last completed sync, by checkpoint name: the change
        #: key of the trainer tensor it was computed from (see ``plan.change_key``) and weak
        #: references to its inputs. Emptied whenever the engine's weights may have changed
        #: otherwise (a level-2 sleep, a failed or partial write, a checkpoint reload).
        self.held: dict[str, tuple] = {}

    # --- what the engine holds -------------------------------------------------------------

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """The dtype the engine computes in; weights are sent in it, cast once."""

    @property
    @abstractmethod
    def expected_weights(self) -> Mapping[str, tuple[int, ...]]:
        """Checkpoint name -> shape of every weight the engine loads.

        This is the contract a full sync is checked against before anything is written: a name
        outside it, a name of it missing from the stream, or a different shape is an error.
        """

    @property
    def shared_weights(self) -> list[tuple[str, ...]]:
        """Groups of names the engine holds as *one* tensor (tied embeddings). Whatever is
        sent under them must be one tensor in the trainer too, or the engine cannot hold it."""
        return []

    @property
    @abstractmethod
    def serves_lora(self) -> bool:
        """The engine applies a LoRA adapter at generation time (vLLM ``enable_lora``)."""

    def describe(self) -> str:
        """One line naming the engine, for plans and logs."""
        lora = ", serves LoRA" if self.serves_lora else ""
        return f"{self.name} engine ({str(self.dtype).removeprefix('torch.')}{lora})"

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
        """Put the engine to sleep and remember what that did to its weights."""
        self._engine_sleep(level)
        self.mark_asleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the engine (all of it, or the given tags: "weights", "kv_cache")."""
        self._engine_wake(tags)
        self.mark_awake(tags)

    def _observe(self) -> None:
        """Fold in sleeps and wakes made on the engine without this adapter.

        Frameworks sleep the engine themselves (TRL calls ``llm.sleep(level=2)`` in its
        ``__init__`` and after every generate). An adapter that can see those calls records them
        here with `mark_asleep` / `mark_awake`; one that sees a sleep but not its
        level must record level 2, the level that discards the base. Called before the sleep
        state is read. The default sees nothing: such an engine relies on `sleep` and
        `mark_asleep`.
        """

    def mark_asleep(self, level: int) -> None:
        """Record a sleep the caller made on the engine directly (without `sleep`)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self._asleep = {"weights", "kv_cache"}
        self._deepest_sleep = max(self._deepest_sleep, level)
        self._base_discarded = self._base_discarded or level == 2
        if level == 2:
            self.held = {}

    def mark_awake(self, tags: list[str] | None = None) -> None:
        """Record a wake the caller made on the engine directly (without `wake_up`)."""
        self._asleep -= set(tags) if tags is not None else self._asleep

    @property
    def asleep(self) -> frozenset[str]:
        """The memory tags ("weights", "kv_cache") asleep now."""
        self._observe()
        return frozenset(self._asleep)

    @property
    def sleep_level(self) -> int:
        """The deepest sleep level since the last completed base restore (0: none)."""
        self._observe()
        return self._deepest_sleep

    @property
    def base_discarded(self) -> bool:
        """A level-2 sleep threw the base away and nothing has restored it yet."""
        self._observe()
        return self._base_discarded

    def check_writable(self, *, restores_base: bool, strategy: str) -> None:
        """Refuse a write the engine's sleep state makes unsafe.

        Raises:
            EngineAsleepError: the "weights" memory is asleep.
            BaseDiscardedError: a level-2 sleep discarded the base and ``strategy`` does not
                restore all of it.
        """
        self._observe()
        if "weights" in self._asleep:
            raise EngineAsleepError(
                f"{strategy}: the engine's weights are asleep; call wake_up(tags=['weights']) "
                "before syncing (writing into sleeping weights corrupts memory, trl#5142), "
                "then wake_up(tags=['kv_cache']) after."
            )
        if self._base_discarded and not restores_base:
            raise BaseDiscardedError(
                f"{strategy}: a level-2 sleep discarded the engine's base weights and {strategy} "
                "does not restore them; waking without a full restore generates gibberish "
                "(vllm#29341). Use FullSync or ReloadWeights (policy.choose picks one when told "
                "sleep_level=2)."
            )

    def base_restored(self) -> None:
        """Called by strategies once every base weight has been written."""
        self._base_discarded = False
        self._deepest_sleep = 0


_REGISTRY: dict[str, type[Engine]] = {}


def register(cls: type[Engine]) -> type[Engine]:
    """Class decorator: make an engine adapter known to `adapt` under ``cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


def adapt(engine: Any) -> Engine:
    """Wrap a raw engine object (e.g. a ``vllm.LLM``) in the registered adapter that accepts it;
    an `Engine` is returned as it is."""
    if isinstance(engine, Engine):
        return engine
    for cls in _REGISTRY.values():
        if cls.accepts(engine):
            # A registered adapter is constructed from the raw engine it accepts (the abstract
            # Engine.__init__ takes none, so type[Engine] does not say so).
            return cast("Callable[[Any], Engine]", cls)(engine)
    raise TypeError(
        f"no engine adapter accepts {type(engine).__module__}.{type(engine).__name__}; "
        f"registered: {sorted(_REGISTRY)}. Wrap it in an Engine subclass and @register it."
    )
