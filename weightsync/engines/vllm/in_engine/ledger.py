"""The engine's own account of its weights, kept inside each vLLM worker: the epoch.

A trainer that remembers what it sent cannot know what happened to the engine since: another
client may have slept it (``POST /sleep?level=2``), the framework may have called
``llm.sleep(level=2); llm.wake_up()`` or written weights with ``model.load_weights`` (TRL,
verl, OpenRLHF, NeMo-RL all do), the server may have restarted. So the worker keeps the record
itself. Every call through which vLLM changes or may lose the weights advances the worker's
*epoch* and is logged with the harm it may have done:

- harm 1: a level-1 sleep (weights offloaded to host memory and kept) or a wake;
- harm 2: a level-2 sleep (weights discarded), any weight write or reload (``reload_weights``,
  ``load_model``, the weight-transfer API's ``update_weights`` / ``finish_weight_update``, the
  model's own ``load_weights``), by anyone -- weightsync's own writes included. Not a call of
  the weight-transfer API whose backend is weightsync's own and which wrote nothing (a stage,
  a check, an update refused or aborted before its load): that backend counts its writes to the
  model (``weightsync_touches``), so a refused sync leaves the epoch's harm as it was.

Adapters do no harm to the base and leave the epoch alone, but each worker counts the adapter
writes it sees (vLLM's ``add_lora``, by anyone -- a re-add with ``load_inplace=True`` replaces
an adapter under the id it had -- and weightsync's in-memory installs, `note_adapter`): the
engine's version (``weights_version``) moves with every adapter write, not only with the ids.

The trainer reads the epoch after each write it completes (`attest`); later it asks for the
harm *since* that epoch. A restarted engine has a new ``boot`` id, and a log that no longer
reaches back that far counts as harm 2: what cannot be shown to be intact is assumed lost.
A write that goes through no vLLM call (``param.data.copy_`` inside ``apply_model``, another
library holding the tensors) is found by content: each worker keeps a *seal* of its weights --
a digest of 64 evenly spaced elements of every parameter -- taken at the first report after
each recorded event, and checks it at every report while the weights are awake; a seal that
changed without an event is logged as harm 2 (an unseen write). Not seen: a write that changes
none of the sampled elements (docs/failure-modes.md says so).

The ledger is installed the first time a trainer asks (`attest`), by wrapping those methods on
the worker, its model runner and its model (vLLM resolves ``collective_rpc`` method names on the
instance, so the wrappers see every caller). If the engine is asleep when it is installed, the
sleep's level is unknown and is logged as harm 2.

This module runs inside vLLM's workers (and in the trainer's process for an in-process engine);
it imports only the standard library and torch.
"""

from __future__ import annotations

import functools
import hashlib
import uuid
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

#: Log length per worker; a trainer asking about an older epoch is told harm 2.
LOG_SIZE = 4096

#: Elements of each parameter the seal samples.
SEAL_SAMPLES = 64

#: Worker and model-runner methods that change or may lose the weights, and their harm.
_WORKER_METHODS = {
    "reload_weights": 2,
    "load_model": 2,
    "update_weights": 2,
    "finish_weight_update": 2,
}


#: The weight-transfer API's calls: a backend that counts its writes to the model
#: (``weightsync_touches``: weightsync's own, ``backend.py``) says whether one wrote.
_WEIGHT_TRANSFER_CALLS = frozenset({"update_weights", "finish_weight_update"})


class Ledger:
    """One worker's epoch, log of (epoch, harm), sleeping tags and adapter writes."""

    def __init__(self, asleep: bool) -> None:
        self.boot = uuid.uuid4().hex
        self.epoch = 0
        self.adapters = 0
        self.log: deque[tuple[int, int]] = deque(maxlen=LOG_SIZE)
        self.seal: bytes | None = None
        self.asleep: set[str] = set()
        #: The clear a KV cache owes since it slept through a completed reload
        #: (`model_ops.clear_kv_cache`), run at the cache's wake.
        self.at_kv_wake: Callable[[], None] | None = None
        if asleep:  # slept before anyone watched: the level is unknown
            self.record(2)
            self.asleep = {"weights", "kv_cache"}

    def record(self, harm: int) -> None:
        self.epoch += 1
        self.log.append((self.epoch, harm))
        self.seal = None  # taken again at the next report, after the event
        # Where the seal reads is found again too: nothing of the weights is held across a
        # sleep (a view would keep memory a level-2 sleep frees) or a reload.
        _SAMPLERS.clear()

    def check_seal(self, model: Any) -> None:
        """Seal ``model``'s weights if no seal was taken since the last event; else log harm 2
        if they changed since (a write no vLLM call saw)."""
        now = seal(model)
        if self.seal is not None and now != self.seal:
            self.record(2)
        self.seal = now

    def report(self, since: list[Any] | None) -> dict[str, Any]:
        """This worker's boot, epoch, sleeping tags, adapter writes, and the worst harm logged
        after epoch ``since`` (``[boot, epoch]``; None: since the ledger was installed)."""
        if since is None:
            harm = max((h for _, h in self.log), default=0)
        elif since[0] != self.boot:
            harm = 2  # another process: the engine restarted
        elif self.log and self.log[0][0] > int(since[1]) + 1:
            harm = 2  # the log no longer reaches back to it
        else:
            harm = max((h for e, h in self.log if e > int(since[1])), default=0)
        return {
            "boot": self.boot,
            "epoch": self.epoch,
            "asleep": sorted(self.asleep),
            "harm": harm,
            "adapters": self.adapters,
        }


def seal(model: Any) -> bytes:
    """A digest of ``SEAL_SAMPLES`` evenly spaced elements of every parameter of ``model`` (as
    stored, bytes, any dtype or device; a tensor subclass by its inner tensors) and of their
    names. It runs at every report, so where it reads is found once per model and event
    (`_Sampler`) and kept while the model still holds the same tensors: the digest is then one
    gather of the samples (a ``cat`` of strided views) and one hash."""
    sampler = _SAMPLERS.get(model)
    if sampler is None or not sampler.current():
        sampler = _SAMPLERS[model] = _Sampler(model)
    return sampler.digest()


class _Sampler:
    """Where `seal` reads ``model``: a view of the sampled elements of each plain, contiguous
    parameter (a tensor subclass, or a strided one, is sampled anew at each digest), kept
    while `current`: every module and parameter of the tree is the object it was, none was
    added, and every parameter's data is where it was (``p.data = ...`` moves it). A write in
    place is read through the views; anything else finds the parameters again."""

    def __init__(self, model: Any) -> None:
        self.same: list[tuple[dict, str, Any]] = []  # (registry, key, object it holds)
        self.sizes: list[tuple[dict, int]] = []  # (registry, entries it holds)
        self.placed: list[tuple[torch.Tensor, int]] = []  # (parameter, its data_ptr)
        names: list[str] = []
        self.views: dict[tuple[torch.dtype, Any], list[torch.Tensor]] = {}
        self.fresh: list[torch.Tensor] = []  # sampled anew: subclasses, strided tensors
        for prefix, module in model.named_modules(remove_duplicate=False):
            for registry in (module._modules, module._parameters):
                self.sizes.append((registry, len(registry)))
                self.same += [(registry, key, held) for key, held in registry.items()]
            for attr, p in module._parameters.items():
                if p is None or p.device.type == "meta":
                    continue
                names.append(f"{prefix}.{attr}" if prefix else attr)
                self.placed.append((p, p.data_ptr()))
                t = p.detach()
                if not _flat(t):
                    self.fresh.append(p)
                elif t.numel():
                    view = _bytes_view(t).reshape(-1)
                    step = max(1, (view.numel() - 1) // (SEAL_SAMPLES - 1))
                    sample = view[::step][:SEAL_SAMPLES]
                    self.views.setdefault((sample.dtype, sample.device), []).append(sample)
        self.names = hashlib.blake2b("\n".join(names).encode(), digest_size=16).digest()

    def current(self) -> bool:
        return (
            all(registry.get(key) is held for registry, key, held in self.same)
            and all(len(registry) == n for registry, n in self.sizes)
            and all(p.data_ptr() == ptr for p, ptr in self.placed)
        )

    def digest(self) -> bytes:
        digest = hashlib.blake2b(self.names, digest_size=16)
        groups = dict(self.views)
        for p in self.fresh:
            for t in _plain(p.detach()):
                if t.numel():
                    t = _bytes_view(t)
                    sample = torch.take(t, _index(t.numel(), t.device))
                    groups.setdefault(("fresh", sample.dtype, sample.device), []).append(sample)
        for group in groups.values():
            digest.update(torch.cat(group).cpu().view(torch.uint8).numpy().tobytes())
        return digest.digest()


def _flat(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain tensor whose elements a strided view of its storage reaches."""
    return type(t) is torch.Tensor and t.is_contiguous()


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """``t``, or its bytes for a 1-byte kind (fp8, int8: ``take`` and ``cat`` need not support
    them)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _index(n: int, device: Any) -> torch.Tensor:
    """``SEAL_SAMPLES`` evenly spaced positions in ``n`` elements (integer arithmetic: a float
    linspace rounds past the end of a large tensor), kept per size and device."""
    index = _INDICES.get((n, device))
    if index is None:
        count = min(n, SEAL_SAMPLES)
        steps = torch.arange(count, dtype=torch.int64, device=device)
        index = _INDICES[(n, device)] = steps * (n - 1) // max(count - 1, 1)
    return index


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data: itself, or a tensor subclass's inner tensors
    (torchao's quantized weights: their data and scales, by ``__tensor_flatten__``)."""
    if not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [plain for name in names for plain in _plain(getattr(t, name))]


_INDICES: dict[tuple[int, Any], torch.Tensor] = {}
_SAMPLERS: weakref.WeakKeyDictionary[Any, _Sampler] = weakref.WeakKeyDictionary()


def _model(worker: Any) -> Any:
    runner = getattr(worker, "model_runner", worker)
    get_model = getattr(runner, "get_model", None)
    return get_model() if get_model is not None else getattr(runner, "model", None)


def worker_of(obj: Any) -> Any:
    """The vLLM worker behind ``obj`` (a ``collective_rpc`` callable receives vLLM's wrapper)."""
    return getattr(obj, "worker", None) or obj


def _wrap(owner: Any, method: str, ledger: Ledger, harm: int) -> None:
    original = getattr(owner, method, None)
    if original is None or getattr(original, "_weightsync_ledger", None) is ledger:
        return

    @functools.wraps(original)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        touches = _touches(owner, method)
        try:
            return original(*args, **kwargs)
        finally:  # a write that failed part-way did its harm too
            if touches is None or _touches(owner, method) != touches:
                ledger.record(harm)
            if method == "load_model":
                _watch_model(owner, ledger)

    recorded._weightsync_ledger = ledger  # type: ignore[attr-defined]
    setattr(owner, method, recorded)


def _touches(owner: Any, method: str) -> int | None:
    """How many writes to the model the backend of ``owner``'s weight-transfer call counted
    (None: not such a call, or a backend that does not count them: its calls are writes)."""
    if method not in _WEIGHT_TRANSFER_CALLS:
        return None
    return getattr(getattr(owner, "weight_transfer_engine", None), "weightsync_touches", None)


def _watch_model(owner: Any, ledger: Ledger) -> None:
    model = _model(owner)
    if model is not None:
        _wrap(model, "load_weights", ledger, 2)


def _install(worker: Any, asleep: bool) -> Ledger:
    ledger = Ledger(asleep)
    sleep, wake_up = worker.sleep, worker.wake_up

    @functools.wraps(sleep)
    def recorded_sleep(level: int = 1) -> Any:
        ledger.record(2 if level >= 2 else 1)  # before: a sleep that fails part-way counts
        ledger.asleep = {"weights", "kv_cache"}
        return sleep(level)

    @functools.wraps(wake_up)
    def recorded_wake_up(tags: list[str] | None = None) -> Any:
        try:
            woken = wake_up(tags)
        finally:
            ledger.record(1)
            ledger.asleep -= set(tags) if tags else set(ledger.asleep)
        if ledger.at_kv_wake is not None and "kv_cache" not in ledger.asleep:
            owed, ledger.at_kv_wake = ledger.at_kv_wake, None
            owed()
        return woken

    worker.sleep, worker.wake_up = recorded_sleep, recorded_wake_up
    add_lora = getattr(worker, "add_lora", None)
    if add_lora is not None:

        @functools.wraps(add_lora)
        def counted_add_lora(*args: Any, **kwargs: Any) -> Any:
            try:
                return add_lora(*args, **kwargs)
            finally:  # a load that failed part-way may have replaced the adapter too
                ledger.adapters += 1

        worker.add_lora = counted_add_lora
    for owner in (worker, getattr(worker, "model_runner", None)):
        if owner is not None:
            for method, harm in _WORKER_METHODS.items():
                _wrap(owner, method, ledger, harm)
    _watch_model(worker, ledger)
    worker._weightsync_ledger = ledger
    return ledger


def _ledger(worker: Any, asleep: bool) -> Ledger:
    ledger = getattr(worker, "_weightsync_ledger", None)
    return ledger if ledger is not None else _install(worker, asleep)


def kv_cache_awake(obj: Any) -> bool:
    """Whether this worker's KV cache is known to be in memory: a ledger watches its sleeps
    and none put the cache to sleep since its last wake (False when no ledger watches: a GPU
    cache asleep is unmapped memory, which must not be touched)."""
    ledger = getattr(worker_of(obj), "_weightsync_ledger", None)
    return ledger is not None and "kv_cache" not in ledger.asleep


def epoch(obj: Any) -> tuple[Any, int]:
    """This worker's boot and epoch: they move at every sleep, wake and base write it saw."""
    ledger = _ledger(worker_of(obj), asleep=False)
    return ledger.boot, ledger.epoch


def note_adapter(obj: Any) -> None:
    """Count an adapter write made without ``add_lora`` (weightsync's in-memory install)."""
    _ledger(worker_of(obj), asleep=False).adapters += 1


def attest(obj: Any, since: list[list[Any]] | None = None, asleep: bool = False) -> dict[str, Any]:
    """What this worker attests about its weights (see `Ledger.report`), installing the
    ledger on first use (``asleep``: the engine is asleep now, as its executor says).

    A ``collective_rpc`` target: ``since`` holds one ``[boot, epoch]`` per worker rank, or
    None. The worker extension exposes it as ``weightsync_attest``."""
    worker = worker_of(obj)
    ledger = _ledger(worker, asleep)
    model = _model(worker)
    if not asleep and "weights" not in ledger.asleep and model is not None:
        ledger.check_seal(model)
    rank = int(getattr(worker, "rank", 0) or 0)
    mine = since[rank] if since is not None and rank < len(since) else None
    return ledger.report(mine)
