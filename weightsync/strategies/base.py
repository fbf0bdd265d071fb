"""The Strategy interface: one way of bringing an engine in step with the trainer.

A sync is a plan, then its execution. ``plan(model, engine)`` decides everything that will be
written and checks it against the engine (engine awake, PEFT set-up allowed, names, shapes,
tied names, the adapter as the engine will load it); every refusal is raised there, so a refused
sync has written nothing. `execute` then writes exactly the plan, the same way for every
strategy: strategies differ only in what they plan. What a framework must remember between
syncs (has the base been pushed?) lives in `weightsync.Syncer`, not here.
"""

from __future__ import annotations

import re
import time
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from torch import nn

from ..engines.base import Attestation, Engine, adapt
from ..errors import BadArgumentError, EngineCannotRunError, WeightMismatchError
from ..execute import SyncReport, execute
from ..plan import Plan, Weight, content_key
from ..proven import check_after_sync, refuse
from ..trainer import quantize
from ..trainer.tensors import as_engine_holds
from ..trainer.values import check_plan


class Strategy(ABC):
    """One way to sync.

    Subclasses set ``name`` and ``restores_base`` (whether a completed sync leaves every base
    weight of the engine equal to the trainer's: only such a strategy may follow a level-2
    sleep) and implement `_plan`.
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

    def plan(self, model: nn.Module, engine: Engine | Any) -> Plan:
        """Decide what this sync would write and check it against ``engine``; write nothing.

        The plan's values are checked last (`weightsync.trainer.values.check_plan`): a pass
        over every trainer tensor the sync reads, so a NaN, an inf or a tensor without data is
        refused here, naming the weight, not found by the engine half-way through the write.

        Raises:
            WeightSyncError: the sync cannot reproduce the trainer in this engine
                (EngineAsleepError, BaseDiscardedError, WeightMismatchError, AdapterError,
                UnsupportedModelError -- also for an architecture `weightsync.proven.REFUSED`
                lists --, BadValuesError), or ``model`` is not a model
                (BadArgumentError).
        """
        if not isinstance(model, nn.Module):
            raise BadArgumentError(
                f"{self.label}: model must be the trainer's torch.nn.Module (a transformers "
                f"causal LM or a peft.PeftModel), got {_kind(model)}. Nothing was written."
            )
        engine = adapt(engine)
        now = engine.check_writable(restores_base=self.restores_base, strategy=self.label)
        refuse(engine, self.label)
        plan = self._plan(model, engine, now)
        check_plan(plan)
        return plan

    def sync(
        self, model: nn.Module, engine: Engine | Any, *, verify: bool | None = None
    ) -> SyncReport:
        """Make ``engine`` serve what ``model`` computes: `plan`, `execute`, then the check
        ``verify`` asks for (`weightsync.proven.check_after_sync`).

        Args:
            model: a transformers causal LM or a ``peft.PeftModel``; never modified.
            engine: an `Engine`, or a raw engine object a registered
                adapter accepts (a ``vllm.LLM``: a fresh engine record each call, so its
                first-sync check runs each call too; keep the `Engine` to run it once).
            verify: True: compare the engine with ``model`` on the canary prompts
                (`weightsync.verify.check_engine`). None (the default): only the first sync
                of an engine weightsync has not proven exact (`weightsync.proven`). False:
                never.

        Raises:
            WeightSyncError: whatever `plan` raises, before anything is written.
            VerificationError: the check ran and failed, after the write
                (`UnprovenEngineError` for the first-sync check); the base is marked lost.
            Exception: whatever the engine raises while writing (the base is then unsynced).
        """
        engine = adapt(engine)
        start = time.perf_counter()
        report = execute(self.plan(model, engine), engine, started=start)
        diff = check_after_sync(
            model,
            engine,
            verify=verify,
            strategy=self.label,
            rewrite=lambda: execute(self.plan(model, engine), engine),
        )
        return report if diff is None else replace(report, verified_logprob_diff=diff)

    @abstractmethod
    def _plan(self, model: nn.Module, engine: Engine, now: Attestation) -> Plan:
        """Everything this strategy would write into ``engine``, checked; raise if impossible.
        ``now``: what the engine attested as `plan` began (`Engine.check_writable`), the state
        the plan is made on; `execute` checks it again before writing."""


def _kind(obj: Any) -> str:
    """What ``obj`` is, for a message: ``None``, or its type's qualified name."""
    return "None" if obj is None else f"a {type(obj).__module__}.{type(obj).__qualname__}"


@dataclass(frozen=True)
class Skip:
    """How a full sync's tensors split into those sent and those the engine still holds."""

    send: list[Weight]
    skipped: list[str]
    groups: list[str]
    held_after: dict[str, tuple]
    note: str
    attested: Hashable | None


def unchanged(
    tensors: list[Weight],
    engine: Engine,
    *,
    enabled: bool = True,
    digests: dict[int, tuple] | None = None,
) -> Skip:
    """Split a full sync's ``tensors`` into those to send and those the engine already holds.

    A tensor is skipped only when both sides prove it unchanged: on the trainer side its
    content key (digests of its frozen inputs' bytes, see `content_key`) equals the one
    recorded when the engine received it; on the engine side the engine attests that its
    epoch has not moved since that sync (no sleep, wake, reload, restart or write by anyone;
    see `Engine.skippable`). Skipping is all or nothing per group of tensors the engine loads
    together -- a decoder layer (``...layers.<i>.``, which also keeps vLLM's fused q/k/v and
    gate/up together) or one other module -- and tied names share a group, because vLLM's
    layerwise reload restores a module that received nothing, but a module that received part
    of its tensors is not finished.

    ``enabled=False`` (``FullSync(skip_unchanged=False)``, or a sleep the caller reported)
    sends everything and records nothing. ``digests``: digests computed anew for this plan
    already (by input tensor id), reused rather than hashed again.
    """
    if not enabled:
        return Skip(list(tensors), [], [], {}, "skip_unchanged is off for this sync", None)
    if not engine.keeps_unsent_layers:
        return Skip(list(tensors), [], [], {}, "this engine re-processes every layer", None)
    digests = dict(digests or {})
    keys = {t.name: content_key(t, digests) for t in tensors}
    held_after = {name: key for name, key in keys.items() if key is not None}
    record, epoch, why_not = engine.skippable()
    if not record:
        return Skip(list(tensors), [], [], held_after, why_not, None)
    group_of = _groups(tensors)
    stale = {
        group_of[t.name]
        for t in tensors
        if keys[t.name] is None or record.get(t.name) != keys[t.name]
    }
    send = [t for t in tensors if group_of[t.name] in stale]
    skipped = [t.name for t in tensors if group_of[t.name] not in stale]
    groups = list(dict.fromkeys(group_of[n] for n in skipped))
    note = (
        "the xxh3-128 digests of their frozen inputs equal those of the last sync, and the engine "
        "attests no sleep, wake, reload, restart or weight write since it received them"
        if skipped
        else "every group has a trainable or changed input"
    )
    return Skip(send, skipped, groups, held_after, note, epoch)


_LAYER = re.compile(r"^(.*?\.\d+)\.")


def _groups(tensors: list[Weight]) -> dict[str, str]:
    """name -> the group it is loaded with: its decoder layer, else its module; tied names
    (one trainer tensor) are merged into one group."""
    group = {}
    for t in tensors:
        layer = _LAYER.match(t.name)
        group[t.name] = layer.group(1) if layer else t.name.rsplit(".", 1)[0]
    by_source: dict[int, str] = {}
    for t in tensors:
        first = by_source.setdefault(t.source, group[t.name])
        if first != group[t.name]:
            old = group[t.name]
            group = {n: first if g == old else g for n, g in group.items()}
    return group


def in_engine_format(tensors: list[Weight], engine: Engine) -> list[Weight]:
    """``tensors`` as ``engine`` loads them: in its dtype, except a weight it holds in another
    floating dtype (`EngineFacts.held`: a float32 router), which travels in one that reaches
    it unrounded (`weightsync.trainer.tensors.as_engine_holds`); and if the engine is
    pre-quantized (its checkpoint holds quantized tensors), each weight of a module it holds
    quantized becomes that scheme's tensors, quantized on the trainer side in the stream
    (`weightsync.trainer.quantize`). An online method (``quantization="fp8_per_channel"``)
    quantizes what it loads itself: it gets the weights as they are.

    Raises:
        WeightMismatchError: the engine's scheme is not one weightsync reproduces exactly.
    """
    tensors = as_engine_holds(tensors, engine.facts.held)
    q = engine.facts.quantized
    if q is None or not q.prequantized:
        return tensors
    scheme = quantize.scheme_of(q)
    modules = quantize.quantized_modules(engine.expected_weights)
    return quantize.quantized(tensors, scheme, modules, engine.dtype)


def quantization_note(engine: Engine) -> tuple[str, ...]:
    """The plan note saying how the engine quantizes, and what that means for the sync."""
    q = engine.facts.quantized
    if q is None:
        return ()
    what = str(q)
    if q.prequantized:
        scheme = quantize.scheme_of(q)
        parts = ", ".join(part for part, _, _ in scheme.layout((1, 1), engine.dtype))
        return (
            f"the engine is quantized: {what}; weights of its quantized modules are quantized "
            f"on the trainer side to {scheme.name} ({parts}), a bucket at a time",
        )
    return (f"the engine is quantized: {what}; weights are sent unquantized",)


def check_names(tensors: list[Weight], engine: Engine, *, complete: bool) -> None:
    """Raise `WeightMismatchError` unless ``tensors`` fit what ``engine`` loads, and
    `EngineCannotRunError` if the engine reported it cannot run its quantized layers.

    Args:
        complete: the stream claims to be every weight of the engine (a full sync), so a weight
            the engine loads and the stream lacks is an error too.
    """
    q = engine.facts.quantized
    if q is not None and q.unrunnable:
        raise EngineCannotRunError(
            f"the engine cannot run its quantization ({q}) on its own CPU or device, nothing was "
            f"written: {q.unrunnable}. vLLM started it, but its first forward would fail the "
            "same way. Use a scheme this vLLM build has kernels for (docs/quantized.md)."
        )
    expected = engine.expected_weights
    names = [t.name for t in tensors]
    problems = []
    unknown = [n for n in names if n not in expected]
    if unknown:
        problems.append(f"{len(unknown)} weight(s) the engine does not have: {_few(unknown)}")
    if complete:
        missing = sorted(set(expected) - set(names))
        if missing:
            problems.append(
                f"{len(missing)} weight(s) the engine loads but the trainer did not send: {_few(missing)}"
            )
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
            + _quantized_hint(engine)
        )


def _quantized_hint(engine: Engine) -> str:
    q = engine.facts.quantized
    if q is None:
        return ""
    return (
        f"\nThe engine is quantized ({q}): it loads the weights of that "
        "scheme; see docs/quantized.md for the schemes weightsync syncs into."
    )


def _few(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... (+{len(items) - limit} more)" if len(items) > limit else "")
