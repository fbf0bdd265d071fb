"""Syncing from a sharded trainer (FSDP2): every rank calls `sync`, one rank writes.

An FSDP2 trainer holds each parameter as a ``DTensor``: every rank has a shard, and gathering
the whole tensor (``full_tensor()``) is a collective all ranks must make, in the same order.
The engine lives on one rank (``src``). A sync then goes, on every rank:

1. **Facts.** ``src`` broadcasts what planning needs from the engine (dtype, expected weights
   and shapes, tied names, whether it serves LoRA, its sleep state) and the strategy to run
   (its own, or its `Syncer`'s choice), so every rank can plan.
2. **Plan and agree.** Every rank plans against those facts (``src`` also checks the adapter
   against the real engine); nothing is gathered while planning. The outcomes are exchanged:
   if any rank refused or failed, every rank raises the same error, naming the rank, and
   nothing was written. Ranks whose plans differ (names, shapes, order) refuse too.
3. **Stream in lockstep.** ``src`` executes the plan into its engine. Each time it is about
   to materialise a tensor it broadcasts "continue, tensor i"; the other ranks take part in that
   gather and drop their copy at once. So ``src`` holds one bucket of whole tensors (as without
   sharding) and the others one tensor. When ``src`` finishes it broadcasts "done" and the
   report; if the engine fails part-way it broadcasts "abort" and the error, and every rank
   raises it -- nobody is left waiting in a gather.

What is not covered: a rank other than ``src`` failing *inside* a gather after the ranks agreed
(an out-of-memory in the merge math) leaves ``src`` waiting in the collective until the process
group's timeout. ``ReloadWeights`` from the engine's own checkpoint skips its sampled comparison
of base values with the checkpoint (it would gather while planning); the PEFT set-up and
trainable-base checks still apply. A ``Syncer`` with ``verify=True`` is refused: verification
runs the trainer's forward, which under FSDP every rank must run.
"""

from __future__ import annotations

import builtins
import dataclasses
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import errors
from .engines.base import CHECKPOINT, Attestation, Engine, EngineFacts, adapt
from .execute import SyncReport, execute
from .plan import Adapter, Plan
from .strategies.base import Strategy
from .syncer import Syncer
from .trainer.gather import full

_CONTINUE, _DONE, _ABORT = 0, 1, 2
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


class _Facts(Engine):
    """The engine as every rank sees it while planning: the facts ``src`` broadcast.

    On ``src`` it also holds the real engine, to check the adapter against it. It cannot write:
    only ``src`` writes, into the real engine.
    """

    name = "facts"

    def __init__(self, facts: Mapping[str, Any], real: Engine | None) -> None:
        super().__init__()
        self._seen = facts
        self._real = real

    def _attest(self, since: Hashable | None) -> Attestation:
        # As src's engine attested it when the facts were taken; no epoch, so nothing is
        # skipped (a sharded tensor has no content key either). The real engine's state is
        # checked again when src executes.
        return Attestation(None, frozenset(self._seen["asleep"]), self._seen["harm"])

    @property
    def facts(self) -> EngineFacts:
        return self._seen["facts"]

    def describe(self) -> str:
        return self._seen["describe"]

    def check_adapter(self, adapter: Adapter) -> None:
        if self._real is not None:  # the other ranks learn the outcome when the ranks agree
            self._real.check_adapter(adapter)

    def held_base(
        self, now: Attestation | None = None
    ) -> tuple[Mapping[str, tuple] | str | None, str, str]:
        # The adapter's base is proven on src, against the real engine's record (the other
        # ranks learn the outcome when the ranks agree); elsewhere only what the trainer's
        # set-up says is checked (`strategies.proof`, as against an engine's checkpoint).
        # ``now`` is the facts' attestation, not the real engine's: it asks for its own.
        if self._real is not None:
            return self._real.held_base()
        return CHECKPOINT, "", ""

    def _cannot(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("weightsync.distributed: planning facts cannot write or generate")

    load_weights = load_adapter = reload_checkpoint = _cannot
    greedy_batch = score_batch = _engine_sleep = _engine_wake = _cannot


def _facts_of(engine: Engine, strategy: Strategy) -> dict[str, Any]:
    now = engine.attest()
    return {
        "strategy": strategy,
        "facts": engine.facts,
        "describe": engine.describe(),
        "asleep": sorted(now.asleep),
        "harm": now.harm,
    }


def _failure(exc: BaseException) -> tuple[str, str, bool]:
    return type(exc).__name__, str(exc), errors.left_untouched(exc)


def _raise(
    rank: int, kind: str, message: str, untouched: bool = False, cause: BaseException | None = None
) -> None:
    """Raise, on this rank, the error ``rank`` met: same class when it is one of weightsync's
    errors or a builtin, same message everywhere, marked `errors.untouched` if it was."""
    cls = getattr(errors, kind, None) or getattr(builtins, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = RuntimeError
    text = f"rank {rank}: {kind}: {message}"
    try:
        exc = cls(text)
    except Exception:  # noqa: BLE001 -- a class whose constructor wants more than a message
        exc = RuntimeError(text)
    if untouched:
        errors.untouched(exc)
    raise exc from cause


def _digest(plan: Plan) -> tuple[Any, ...]:
    """What must be identical on every rank for the gathers to line up."""
    adapter = plan.adapter
    return (
        plan.strategy,
        plan.reload,
        tuple((t.name, t.shape) for t in plan.weights),
        tuple((k, tuple(t.shape)) for k, t in adapter.tensors.items()) if adapter else None,
    )


def sync(
    how: Strategy | Syncer | None,
    model: nn.Module,
    engine: Engine | Any | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    src: int = 0,
) -> SyncReport:
    """Sync a sharded ``model`` into the engine held by rank ``src``; call it on every rank.

    Args:
        how: on ``src``, the `Strategy` to run or the
            `Syncer` that chooses it (its ``base_sync_done`` is updated as
            `Syncer.sync` does). On the other ranks it is ignored (pass the same object,
            or None): the strategy ``src`` runs is broadcast.
        model: this rank's model (FSDP2-sharded, or whole); the same architecture on every rank.
        engine: on ``src``, the engine (or a raw ``vllm.LLM``; a Syncer's own engine is used
            when None); None on every other rank.
        group: the process group the ranks sync over (None: the default group).
        src: the global rank holding the engine.

    Returns:
        The `SyncReport`, on every rank (without ``plan`` off ``src``).

    Raises:
        Exception: on every rank, the same error (its class if weightsync or Python defines
            it, else RuntimeError), naming the rank it came from: a refusal
            while planning (nothing written), or the engine's error while writing (the base is
            then unsynced, unless the error says nothing of the sync reached the engine).
    """
    rank = dist.get_rank()
    real: Engine | None = None
    syncer = how if isinstance(how, Syncer) else None
    facts: list[Any] = [None]
    if rank == src:
        try:
            facts[0] = _prepare(how, engine, model)
            real = syncer.engine if syncer is not None else adapt(engine)
        except Exception as exc:  # noqa: BLE001 -- every failure is shared with every rank
            facts[0] = {"error": _failure(exc)}
    dist.broadcast_object_list(facts, src=src, group=group)
    if "error" in facts[0]:
        _raise(src, *facts[0]["error"])
    strategy: Strategy = facts[0]["strategy"]

    # Plan everywhere, then agree before anything is written.
    start = time.perf_counter()
    plan: Plan | None = None
    mine: tuple[str, Any]
    failed: Exception | None = None
    try:
        if rank != src and engine is not None:
            raise ValueError(f"rank {rank} was given an engine; only rank {src} holds one")
        plan = strategy.plan(model, _Facts(facts[0], real))
        mine = ("ok", _digest(plan))
    except Exception as exc:  # noqa: BLE001 -- every failure is shared with every rank
        mine, failed = ("error", _failure(exc)), exc
    outcomes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, mine, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(outcomes))
    for r, (status, detail) in zip(ranks, outcomes, strict=True):
        if status == "error":
            _raise(r, detail[0], detail[1], detail[2], cause=failed)
    if any(detail != outcomes[0][1] for _, detail in outcomes):
        raise RuntimeError(
            "weightsync.distributed: the ranks planned different syncs (names, shapes or order "
            "differ), nothing was written. Every rank must hold the same model architecture."
        )
    assert plan is not None
    synced = syncer.base_sync_done if syncer is not None else False
    if syncer is not None:
        syncer.base_sync_done = False

    # The adapter is small: gathered whole by every rank, kept by src only.
    if plan.adapter is not None:
        gathered = {k: full(t) for k, t in plan.adapter.tensors.items()}
        if rank == src:
            adapter = dataclasses.replace(plan.adapter, tensors=gathered)
            plan = dataclasses.replace(plan, adapter=adapter)
        del gathered
    try:
        if rank != src:
            return _follow(plan, src, group)
        report = _lead(plan, real, src, group, start)
    except BaseException as error:
        if syncer is not None and errors.left_untouched(error):  # a failed stage: as it was
            syncer.base_sync_done = synced
        raise
    if syncer is not None:
        syncer.base_sync_done = True
        syncer.step += 1
    return report


def _prepare(how: Strategy | Syncer | None, engine: Any, model: nn.Module) -> dict[str, Any]:
    """On ``src``: the strategy to run and the engine's facts. A Syncer's choice is made with
    the adapter's base proof (`Syncer.decide`), on ``src``'s model and engine record: the
    other ranks hold no record of the engine, and plan what ``src`` decided."""
    if isinstance(how, Syncer):
        if engine is not None and adapt(engine) is not how.engine:
            raise ValueError("pass either a Syncer or an engine on the engine rank, not both")
        if how.verify:
            raise ValueError(
                "a Syncer with verify=True cannot sync a sharded model: verification runs the "
                "trainer's forward on the engine rank alone, which FSDP cannot. Create it with "
                "verify=False and verify on an unsharded copy if you need to"
            )
        return _facts_of(how.engine, how.decide(model))
    if not isinstance(how, Strategy):
        raise TypeError(f"the engine rank needs a Strategy or a Syncer, got {type(how).__name__}")
    if engine is None:
        raise ValueError("the engine rank was given no engine")
    return _facts_of(adapt(engine), how)


def _announce(i: int, produce: Callable[[torch.dtype], torch.Tensor], src: int, group: Any):
    def produce_in_step(dtype: torch.dtype) -> torch.Tensor:
        dist.broadcast(torch.tensor([_CONTINUE, i, _DTYPES.index(dtype)]), src=src, group=group)
        return produce(dtype)

    return produce_in_step


def _lead(plan: Plan, engine: Engine | None, src: int, group: Any, start: float) -> SyncReport:
    """On ``src``: execute ``plan``, announcing each tensor so the other ranks gather with it."""
    assert engine is not None
    weights = tuple(
        dataclasses.replace(t, produce=_announce(i, t.produce, src, group))
        for i, t in enumerate(plan.weights)
    )
    try:
        report = execute(dataclasses.replace(plan, weights=weights), engine, started=start)
    except Exception as exc:  # noqa: BLE001 -- the other ranks must learn of any failure
        dist.broadcast(torch.tensor([_ABORT, 0, 0]), src=src, group=group)
        dist.broadcast_object_list([_failure(exc)], src=src, group=group)
        _raise(src, *_failure(exc), cause=exc)
    dist.broadcast(torch.tensor([_DONE, 0, 0]), src=src, group=group)
    done = dataclasses.replace(report, plan=plan)
    dist.broadcast_object_list([done.to_dict()], src=src, group=group)
    return done


def _follow(plan: Plan, src: int, group: Any) -> SyncReport:
    """Off ``src``: take part in every gather ``src`` announces, dropping each copy at once."""
    signal = torch.zeros(3, dtype=torch.int64)
    while True:
        dist.broadcast(signal, src=src, group=group)
        what, i, dtype = signal.tolist()
        if what == _CONTINUE:
            plan.weights[i].produce(_DTYPES[dtype])  # gathered, then dropped
            continue
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=src, group=group)
        if what == _ABORT:
            _raise(src, *message[0])
        return SyncReport(**message[0])
