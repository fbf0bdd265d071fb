"""Errors weightsync raises.

Every error is raised *before* anything is written into the engine, unless its docstring says
otherwise, so the engine keeps serving the weights it had. Messages name the weight, what was
expected, what was found, and what to do instead.
"""

from __future__ import annotations

import math


class WeightSyncError(Exception):
    """Base class of every error weightsync raises on purpose."""


class WeightMismatchError(WeightSyncError, ValueError):
    """The trainer's weights do not fit the engine: a name the engine does not load, a weight
    the engine loads but the trainer did not send, or a shape that differs."""


class AdapterError(WeightSyncError, ValueError):
    """The LoRA adapter cannot be served by the engine (rank above its limit, LoRA not enabled,
    an adapter type the engine cannot run)."""


class UnsupportedModelError(WeightSyncError, ValueError):
    """The trainer's model has a part weightsync cannot turn into engine weights (for example a
    DoRA adapter, or a quantized base layer)."""


class EngineAsleepError(WeightSyncError, RuntimeError):
    """Weights were about to be written into an engine whose weight memory is asleep.

    On a GPU, writing into sleeping weights writes to unmapped memory (trl#5142). Wake the
    "weights" tag first, load, then wake "kv_cache"."""


class BaseDiscardedError(WeightSyncError, RuntimeError):
    """A sync that does not restore the base weights was asked for after a level-2 sleep.

    Level 2 throws the weights away; waking without a full restore generates gibberish
    (vllm#29341). Only FullSync or ReloadWeights can follow a level-2 sleep."""


class BaseUnprovenError(WeightSyncError, RuntimeError):
    """An adapter was to be sent alone, but nothing proves the engine holds the base it was
    trained against (a merged sync since, a base written by someone else or from another
    model, a frozen base changed on the trainer's side, or an unknown state): loaded onto
    another base, the adapter would serve wrong tokens without a word. Nothing was written;
    restore the base with the adapter (FullSync(lora="separate"), which `Syncer` plans by
    itself). See `weightsync.strategies.proof`. ``why`` says what is not proven."""

    def __init__(self, message: str, why: str = "") -> None:
        super().__init__(message)
        self.why = why


class EngineChangedError(WeightSyncError, RuntimeError):
    """The engine's epoch moved between planning a sync and writing it (someone slept, woke,
    reloaded or wrote it meanwhile), and the plan skipped weights it may no longer hold.
    Nothing was written; plan the sync again."""


class VerificationError(WeightSyncError, RuntimeError):
    """After a sync, the engine's logprobs on the canary prompt disagree with the trainer's.

    Raised after the weights were written: the engine holds what was sent, and what was sent
    does not reproduce the trainer. The state helper marks the base unsynced, so the next
    sync resends everything. ``mean`` and ``largest``: the canary's differences, when the
    canary ran (NaN otherwise)."""

    def __init__(self, message: str, *, mean: float = math.nan, largest: float = math.nan) -> None:
        super().__init__(message)
        self.mean, self.largest = mean, largest


class UnprovenEngineError(VerificationError):
    """The first sync of an engine whose architecture or quantization weightsync has not
    proven exact (`weightsync.proven`) was verified, and the engine does not serve the
    trainer's weights. Raised after the write; the base is marked lost, so the next sync
    restores every weight. ``architecture`` names the engine's architecture."""

    def __init__(self, message: str, architecture: str = "") -> None:
        super().__init__(message)
        self.architecture = architecture


class EngineBrokenError(WeightSyncError, RuntimeError):
    """A write failed and the engine could not be brought back to a servable state; it is left
    paused. Restart it (or reload its checkpoint through vLLM) before resuming it.

    Raised after something was written (the exception to this module's rule)."""


class EngineUnavailableError(WeightSyncError, RuntimeError):
    """The engine does not answer: a server that refuses connections or times out, a vLLM
    engine core that died. The message names the engine and what was seen.

    Nothing can be written into an engine that is gone; a write it interrupted leaves that
    engine in an unknown state, so only a full restore may follow (restart it first)."""


class BytesRejectedError(WeightSyncError, RuntimeError):
    """An engine's worker refused bytes it received: their keyed tag is not the one the trainer
    made (``wire/tags.py``), so they were altered on disk or in transit. Nothing of that bucket
    was loaded (with files, nothing of the whole sync: every file is checked before the first
    load); the engine recovered as from any failed write, and the next sync restores it fully.
    """


class AuthError(WeightSyncError, PermissionError):
    """An out-of-process engine that refuses weightsync's token, or one that would take weight
    changes from anyone who reaches it (no token guard, reached over something other than
    loopback). Raised before anything is sent; the message says which and what to do."""


class NoCheckpointError(WeightSyncError, ValueError):
    """The engine was asked to reload a checkpoint it does not have: it was started with
    ``load_format="dummy"`` (random weights the first sync fills) from a folder without weight
    files, so there is nothing on disk to reload. Send the weights (FullSync) or reload a
    snapshot (``ReloadWeights(snapshot_dir=...)``)."""


class EngineCannotRunError(WeightSyncError, RuntimeError):
    """The engine cannot run what it serves on its own CPU or device: its workers found a
    quantized layer whose kernel their vLLM build lacks (W4A16's ``cpu_gemm_wna16`` exists only
    for some CPUs). vLLM started it; its first forward would fail. Nothing was written."""


class BadValuesError(WeightSyncError, ValueError):
    """A weight the sync would write holds values no engine can serve: NaN or inf, a magnitude
    the engine's dtype cannot hold, or no data at all (a tensor on the ``meta`` device, or one
    whose storage was freed). The message names the weight. Nothing was written."""


class BadArgumentError(WeightSyncError, TypeError):
    """An argument is not the kind of object weightsync takes (``sync(None)``, a state dict
    where a model is expected, an engine no adapter accepts). The message names the argument
    and what was given. Nothing was written."""


class PauseExpiredError(WeightSyncError, RuntimeError):
    """A write into a ``vllm serve`` server came after the server's pause lease ran out
    (``engines/vllm/server_lease.py``): the trainer was silent longer than the lease inside its
    pause, so the server restored any unfinished layers and resumed without it. The call that
    came late was not run; what the server serves is whole (its old weights, or the new ones if
    the write had completed), and the next sync must restore it fully (the base is marked
    lost). Raise the lease (``WEIGHTSYNC_PAUSE_LEASE_S`` in the server's environment) if the
    trainer is that slow on purpose.

    ``finished``: the label of the weights the lease finished this trainer's update into (a
    weight-transfer load it had made whole), which the server serves; None when the lease
    finished nothing. The trainer's commit counts such a sync done while the engine still
    attests that label (``control.run_commit``)."""

    def __init__(self, message: str, finished: str | None = None) -> None:
        super().__init__(message)
        self.finished = finished


class StageLostError(WeightSyncError, RuntimeError):
    """A commit named a stage the engine no longer holds: it was held uncommitted longer than
    its time to live (``WEIGHTSYNC_STAGE_EXPIRY_S`` in the engine's environment), another sync's
    stage replaced it, or it was dropped. Nothing of the sync was loaded: the engine serves what
    it did. Sync again (and raise the expiry if the trainer is that slow between stage and
    commit on purpose). A Ray actor refuses it before it pauses, so the base is kept."""


class StageExpiredError(StageLostError):
    """The `StageLostError` of a server's workers: the stage had ended whole, and no commit
    claimed it within ``WEIGHTSYNC_STAGE_EXPIRY_S`` (``wire.gloo.Staging``), the wait of a
    trainer that died between its stage and its commit. Nothing was loaded on any worker (every
    worker claims, or none does)."""


class ReplicasSplitError(WeightSyncError, RuntimeError):
    """A sync over `weightsync.engines.Replicas` committed on some replicas and failed on
    others (every replica had staged it; a commit failed while applying): the replicas no
    longer serve one version. The message names what each holds. Raised after something was
    written; every replica is marked unsynced, so the next sync restores all of them."""


class EngineFencedError(WeightSyncError, RuntimeError):
    """A ``vllm serve`` server refused to generate (HTTP 503): a weightsync write into it failed
    part-way and left a mix of old and new layers, so its middleware
    (``engines/vllm/server_lease.py``) refuses generation until a full sync (FullSync, or
    ReloadWeights) completes. The message carries the server's reason."""


class EngineBusyError(WeightSyncError, RuntimeError):
    """A ``vllm serve`` server refused a call (HTTP 409, nothing run) because another caller
    holds its pause or runs a commit on it (``engines/vllm/server_lease.py``): while a pause is
    in force only calls carrying its lease, and reads, are run, so one trainer cannot resume,
    finish, abandon or write into another's update. The server serves what it served. Sync
    again once the other write ends (its lease bounds it)."""


class StaleRolloutError(WeightSyncError, RuntimeError):
    """A rollout batch's sampled-token logprobs are further from the trainer's than the engine's
    tolerance allows (`weightsync.alarm`): the engine generated from other weights than the
    trainer holds. Raised only when asked (``raise_on_alarm``); otherwise logged."""


_UNTOUCHED = "_weightsync_untouched"


def untouched(error: BaseException) -> BaseException:
    """Mark ``error`` as having failed a sync before any of it reached the engine's weights (a
    stage that failed: a refused frame, the trainer's own error while the bytes travelled), and
    say so in a note on it. The error itself is not changed: the cause stays what is raised.
    `execute` does not mark such an engine's base lost and `Syncer` keeps ``base_sync_done``."""
    setattr(error, _UNTOUCHED, True)
    note = getattr(error, "add_note", None)  # Python 3.11+
    if note is not None:
        note("weightsync: nothing of this sync reached the engine; it serves what it did")
    return error


def left_untouched(error: BaseException) -> bool:
    """Whether `untouched` marked ``error``."""
    return bool(getattr(error, _UNTOUCHED, False))
