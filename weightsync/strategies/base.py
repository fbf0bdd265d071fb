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
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from ..engines.base import Engine, adapt
from ..errors import EngineChangedError, WeightMismatchError
from ..plan import Bucket, Plan, Tensor, content_key, numel
from ..stream import buckets


@dataclass(frozen=True)
class SyncReport:
    """What one sync did.

    Attributes:
        strategy: the strategy's name (with its mode, e.g. ``FullSync(lora=merge)``).
        reason: why it was chosen (from `weightsync.policy.choose`, or its default).
        plan: the plan that was executed (``print(report.plan)`` explains it).
        tensors: tensors written into the engine (adapter tensors included).
        bytes: bytes written into the engine, in the dtype they were sent in.
        seconds: wall time of the sync, checks included, verification excluded.
        engine_calls: calls made into the engine (RPCs, adapter loads, reloads).
        buckets: buckets the weight stream was cut into (0 if none was streamed).
        verified_logprob_diff: mean logprob difference on the canary prompts, if verified.
    """

    strategy: str
    reason: str
    tensors: int
    bytes: int
    seconds: float
    engine_calls: int
    buckets: int = 0
    verified_logprob_diff: float | None = None
    plan: Plan | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The figures, without the plan (which holds references to the trainer's tensors)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "plan"}


@dataclass
class Tally:
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

        Raises:
            WeightSyncError: the sync cannot reproduce the trainer in this engine
                (EngineAsleepError, BaseDiscardedError, WeightMismatchError, AdapterError or
                UnsupportedModelError).
        """
        engine = adapt(engine)
        engine.check_writable(restores_base=self.restores_base, strategy=self.label)
        return self._plan(model, engine)

    def sync(self, model: nn.Module, engine: Engine | Any, *, verify: bool = False) -> SyncReport:
        """Make ``engine`` serve what ``model`` computes: `plan`, then `execute`.

        Args:
            model: a transformers causal LM or a ``peft.PeftModel``; never modified.
            engine: an `Engine`, or a raw engine object a registered
                adapter accepts (a ``vllm.LLM``).
            verify: afterwards compare the engine's logprobs on a canary prompt with the
                model's and raise `VerificationError` on mismatch.

        Raises:
            WeightSyncError: whatever `plan` raises, before anything is written.
            Exception: whatever the engine raises while writing (the base is then unsynced).
        """
        engine = adapt(engine)
        start = time.perf_counter()
        report = execute(self.plan(model, engine), engine, started=start)
        if verify:
            from ..verify import check_engine

            diff = check_engine(model, engine, strategy=self.label)
            report = SyncReport(
                **{**report.to_dict(), "verified_logprob_diff": diff}, plan=report.plan
            )
        return report

    @abstractmethod
    def _plan(self, model: nn.Module, engine: Engine) -> Plan:
        """Everything this strategy would write into ``engine``, checked; raise if impossible."""


def execute(plan: Plan, engine: Engine | Any, *, started: float | None = None) -> SyncReport:
    """Write ``plan`` into ``engine``, exactly and in its order (see `Plan`).

    The sleep guard is checked again, since the engine may have slept since the plan was made.
    If a write fails part-way the error propagates and the engine holds a mix of old and new
    weights: the base must be treated as unsynced (``Syncer`` does).
    """
    engine = adapt(engine)
    now = engine.check_writable(restores_base=plan.restores_base, strategy=plan.strategy)
    if plan.skipped and now.epoch != plan.attested:
        raise EngineChangedError(
            f"{plan.strategy}: the engine's epoch moved between planning and writing (a sleep, "
            "wake, reload or weight write by someone else), so the weights the plan skips may "
            "no longer be there; nothing was written. Plan the sync again."
        )
    start = time.perf_counter() if started is None else started
    tally = Tally()
    try:
        _write(plan, engine, tally)
    except BaseException:
        engine.mark_lost()  # a part-written engine holds nothing we can vouch for
        raise
    # A folder reload re-read what it holds from disk: keep no record (skipping is off once).
    engine.remember({} if plan.reload else plan.held_after, restored=plan.restores_base)
    return SyncReport(
        strategy=plan.strategy,
        reason=plan.reason,
        tensors=tally.tensors,
        bytes=tally.bytes,
        seconds=time.perf_counter() - start,
        engine_calls=tally.engine_calls,
        buckets=tally.buckets,
        plan=plan,
    )


def _write(plan: Plan, engine: Engine, tally: Tally) -> None:
    if plan.reload == "snapshot":
        assert plan.snapshot_dir is not None
        write_snapshot(plan.weights, plan.dtype, Path(plan.snapshot_dir), plan.bucket_bytes)
        tally.engine_calls += engine.reload_checkpoint(plan.snapshot_dir)
        tally.tensors += len(plan.weights)
        tally.bytes += plan.weight_bytes
    else:
        if plan.reload == "checkpoint":
            tally.engine_calls += engine.reload_checkpoint()
            tally.tensors += len(engine.expected_weights)
            tally.bytes += _expected_bytes(engine)
        if plan.weights:
            stream = tally.count(buckets(list(plan.weights), plan.dtype, plan.bucket_bytes))
            tally.engine_calls += engine.load_weights(stream)
    if plan.adapter is not None:
        tally.engine_calls += engine.load_adapter(plan.adapter)
        tally.tensors += len(plan.adapter.tensors)
        tally.bytes += plan.adapter.nbytes


@dataclass(frozen=True)
class Skip:
    """How a full sync's tensors split into those sent and those the engine still holds."""

    send: list[Tensor]
    skipped: list[str]
    groups: list[str]
    held_after: dict[str, tuple]
    note: str
    attested: Hashable | None


def unchanged(tensors: list[Tensor], engine: Engine, *, enabled: bool = True) -> Skip:
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
    sends everything and records nothing.
    """
    if not enabled:
        return Skip(list(tensors), [], [], {}, "skip_unchanged is off for this sync", None)
    if not engine.keeps_unsent_layers:
        return Skip(list(tensors), [], [], {}, "this engine re-processes every layer", None)
    digests: dict[int, tuple] = {}
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


def _groups(tensors: list[Tensor]) -> dict[str, str]:
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


def _expected_bytes(engine: Engine) -> int:
    """Bytes of every weight the engine loads, in its dtype."""
    itemsize = torch.empty((), dtype=engine.dtype).element_size()
    return sum(numel(shape) * itemsize for shape in engine.expected_weights.values())


def write_snapshot(
    tensors: Iterable[Tensor], dtype: torch.dtype, folder: Path, bucket_bytes: int
) -> None:
    """Write ``tensors`` as safetensors shards into ``folder``, replacing earlier shards."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.safetensors"):
        old.unlink()
    # A tied tensor is stored once, under its first name, as a checkpoint stores it (safetensors
    # refuses shared storage); the engine's reload sends it under its other names.
    unique: dict[int, Tensor] = {}
    for t in tensors:
        unique.setdefault(t.source, t)
    for i, bucket in enumerate(buckets(list(unique.values()), dtype, bucket_bytes)):
        save_file(
            {name: t.contiguous() for name, t in bucket},
            str(folder / f"weights-{i:05d}.safetensors"),
        )


def check_names(tensors: list[Tensor], engine: Engine, *, complete: bool) -> None:
    """Raise `WeightMismatchError` unless ``tensors`` fit what ``engine`` loads.

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
        )


def _few(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... (+{len(items) - limit} more)" if len(items) > limit else "")
