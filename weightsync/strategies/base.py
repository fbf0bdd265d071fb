"""The Strategy interface: one way of bringing an engine in step with the trainer.

A strategy is small and stateless apart from its options: ``sync(model, engine)`` checks
everything it can *before* writing (engine awake, names, shapes, adapter rank), writes, and
returns a :class:`SyncReport`. What a framework must remember between syncs (has the base been
pushed?) lives in :class:`weightsync.Syncer`, not here.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from torch import nn

from ..engines.base import Engine, adapt
from ..errors import WeightMismatchError
from ..plan import Bucket, Tensor


@dataclass(frozen=True)
class SyncReport:
    """What one sync did.

    Attributes:
        strategy: the strategy's name (with its mode, e.g. ``FullSync(lora=merge)``).
        reason: why it was chosen (from :func:`weightsync.policy.choose`, or its default).
        tensors: tensors written into the engine (adapter tensors included).
        bytes: bytes written into the engine, in the dtype they were sent in.
        seconds: wall time of the sync, checks included, verification excluded.
        engine_calls: calls made into the engine (RPCs, adapter loads, reloads).
        buckets: buckets the weight stream was cut into (0 if none was streamed).
        verified_logprob_diff: largest logprob difference on the canary, if verified.
    """

    strategy: str
    reason: str
    tensors: int
    bytes: int
    seconds: float
    engine_calls: int
    buckets: int = 0
    verified_logprob_diff: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Tally:
    tensors: int = 0
    bytes: int = 0
    engine_calls: int = 0
    buckets: int = 0

    def count(self, stream: Iterable[Bucket]) -> Iterator[Bucket]:
        """Pass ``stream`` through, counting buckets, tensors and bytes as they are sent."""
        for bucket in stream:
            self.buckets += 1
            self.tensors += len(bucket)
            self.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            yield bucket


class Strategy(ABC):
    """One way to sync.

    Subclasses set ``name`` and ``restores_base`` (whether a completed sync leaves every base
    weight of the engine equal to the trainer's: only such a strategy may follow a level-2
    sleep) and implement :meth:`_sync`.
    """

    name: ClassVar[str]
    restores_base: ClassVar[bool]
    default_reason: ClassVar[str] = "chosen by the caller"

    def __init__(self, *, reason: str | None = None) -> None:
        self.reason = reason or self.default_reason

    @property
    def label(self) -> str:
        """Name plus mode, as shown in reports and logs."""
        return self.name

    def __repr__(self) -> str:
        return f"<{self.label}: {self.reason}>"

    def sync(self, model: nn.Module, engine: Engine | Any, *, verify: bool = False) -> SyncReport:
        """Make ``engine`` serve what ``model`` computes.

        Args:
            model: a transformers causal LM or a ``peft.PeftModel``; never modified.
            engine: an :class:`~weightsync.engines.Engine`, or a raw engine object a registered
                adapter accepts (a ``vllm.LLM``).
            verify: afterwards compare the engine's logprobs on a canary prompt with the
                model's and raise :class:`~weightsync.errors.VerificationError` on mismatch.

        Raises:
            EngineAsleepError, BaseDiscardedError, WeightMismatchError, AdapterError,
            UnsupportedModelError: before anything is written.
        """
        engine = adapt(engine)
        engine.check_writable(restores_base=self.restores_base, strategy=self.label)
        start = time.perf_counter()
        tally = _Tally()
        self._sync(model, engine, tally)
        seconds = time.perf_counter() - start
        if self.restores_base:
            engine.base_restored()
        diff = None
        if verify:
            from ..verify import check_engine

            diff = check_engine(model, engine, strategy=self.label)
        return SyncReport(
            strategy=self.label,
            reason=self.reason,
            tensors=tally.tensors,
            bytes=tally.bytes,
            seconds=seconds,
            engine_calls=tally.engine_calls,
            buckets=tally.buckets,
            verified_logprob_diff=diff,
        )

    @abstractmethod
    def _sync(self, model: nn.Module, engine: Engine, tally: _Tally) -> None:
        """Check, then write; record what was sent in ``tally``."""


def check_names(tensors: list[Tensor], engine: Engine, *, complete: bool) -> None:
    """Raise :class:`WeightMismatchError` unless ``tensors`` fit what ``engine`` loads.

    Args:
        complete: the stream claims to be every weight of the engine (a full sync), so a weight
            the engine loads and the stream lacks is an error too.
    """
    expected = engine.expected_weights
    names = [t.name for t in tensors]
    problems = []
    unknown = [n for n in names if n not in expected]
    if unknown:
        problems.append(f"{len(unknown)} weight(s) the engine does not have: {_few(unknown)}")
    if complete:
        missing = sorted(set(expected) - set(names))
        if missing:
            problems.append(f"{len(missing)} weight(s) the engine loads but the trainer did not send: {_few(missing)}")
    shapes = [
        f"{t.name}: trainer {tuple(t.shape)}, engine {tuple(expected[t.name])}"
        for t in tensors
        if t.name in expected and tuple(expected[t.name]) != tuple(t.shape)
    ]
    if shapes:
        problems.append(f"{len(shapes)} shape mismatch(es): {_few(shapes)}")
    by_name = {t.name: t for t in tensors}
    for group in engine.shared_weights:
        sent = [by_name[n] for n in group if n in by_name]
        # A partial stream (an adapter sync's modules_to_save copy of lm_head) that carries one
        # name of the group writes a tensor the trainer holds apart from the names it lacks.
        partial = not complete and 0 < len(sent) < len(group)
        if partial or len({(t.source, t.merged) for t in sent}) > 1:
            problems.append(
                f"the engine holds {list(group)} as one tensor (tied embeddings), but the "
                "trainer's differ (an lm_head trained apart from the embeddings, or LoRA on one "
                "of them): the engine cannot hold the trainer's weights. Start the engine from a "
                "checkpoint saved with tie_word_embeddings=False"
            )
    if problems:
        raise WeightMismatchError(
            "the trainer's weights do not fit the engine, nothing was written:\n  - "
            + "\n  - ".join(problems)
            + "\nIs the engine running the same architecture and checkpoint layout as the trainer?"
        )


def _few(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... (+{len(items) - limit} more)" if len(items) > limit else "")
