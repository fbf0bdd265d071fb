"""The worker half of weightsync's backend for vLLM's weight-transfer API (its trainer half is
``WeightTransferTransport`` in ``transports/weight_transfer.py``).

vLLM 0.32 exposes a four-call weight-update protocol: ``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights`` (one or many chunks), ``finish_weight_update``, as
``LLM`` methods, ``AsyncLLM`` methods and HTTP routes (``vllm serve --weight-transfer-config
'{"backend": "weightsync"}'``). The bytes travel through a *backend* vLLM creates in every
worker: `WeightsyncTransferEngine` receives checkpoint-format buckets as files in a folder, or
over a gloo group (any host), and loads them with vLLM's layerwise reload.

Stage, then commit. vLLM's calls neither pause the engine nor touch the model by themselves, so
``start_weight_update`` here only opens the update: the layerwise reload (which puts every layer
on the meta device) begins at the first load, after every check passed. Over files every file's
tag, names and shapes are checked before the first byte is loaded, and the reload reads views of
the files' mappings (no copy of its own: the trainer's write is the one copy). Over gloo the stream can be
staged while the engine keeps generating: one ``update_weights`` starts receiving it into host
memory in a thread (``gloo.Staging``, bounded by ``max_bytes``) and returns, a second waits for
its END and checks every name and shape, and a third, inside the trainer's pause, loads it. A
refused tag, a cut stream, a dead trainer or a name the engine does not load before the load
leaves the model untouched. A stage no commit claims expires (``WEIGHTSYNC_STAGE_EXPIRY_S``,
``gloo.Staging``), and the commit claims it on every worker or on none
(``model_ops.claim_staged``), as the worker extension's gloo stage does.

Why it never raises from vLLM's four calls: vLLM's multiprocess executor stops reading replies at
the first failed worker, so with TP>1 the other workers' replies stay queued and answer the next
calls; and a raising ``finish_weight_update`` leaves vLLM's ``_weight_update_active`` set, so
every later update is refused. Instead a failure abandons a half-done reload at once
(``model_ops.abandon_layerwise_reload``), the rest of the update is skipped, and the trainer
reads every worker's `Outcome` through the worker extension (``weightsync_weight_update``),
which answers through ``/collective_rpc``. That answer carries the ``RELOAD_REPORT``: the layers
a failed load had finished (a mix: a server with weightsync's middleware, ``server_lease.py``,
refuses to generate until a full sync) or, after a success, whether every weight of the engine
was loaded (which lifts that fence). Layers a failed load finished are reported once, there or
by the next ``weightsync_abandon`` (a pause lease that expires after the trainer died).

A trainer killed once its load call was sent leaves an update loaded but never finished; the
server's pause lease settles it (the worker extension's ``weightsync_settle``): finished by
vLLM's own finish when every worker's load was whole (`loaded_whole`), given up otherwise
(`give_up`, then closed).

Registration: the backend must be registered in every worker process before vLLM builds it
(``Worker.load_model``). The worker extension calls `register_when_vllm_loads` when vLLM imports
it in each worker (``--worker-extension-cls``), which registers without importing vLLM first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.abc
import importlib.util
import json
import logging
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ....wire import format as fmt
from ....wire import gloo
from ....wire.delta import LoadedCopies
from ....wire.files import MappedFiles
from ....wire.protocol import RELOAD_REPORT, InitInfo, Outcome, UpdateInfo
from .heap import free_later, keep_freed_memory
from .model_ops import (
    abandon_layerwise_reload,
    check_loadable,
    claim_staged,
    clear_kv_cache,
    finished_in,
    has_cpu_moe,
    part_loaded,
    refresh,
    refreshable,
    repack_cpu_moe,
    tied_modules,
    unwritten_twins,
)

logger = logging.getLogger(f"vllm.{__name__}")  # in vLLM's workers: see server_lease.py

#: The name to put in ``--weight-transfer-config '{"backend": "weightsync"}'``.
BACKEND = "weightsync"

_FACTORY = "vllm.distributed.weight_transfer.factory"


def register() -> None:
    """Register `WeightsyncTransferEngine` with vLLM's worker-side factory as
    ``"weightsync"``. Idempotent: safe in every process, as often as it is called."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # The factory raises ValueError for a name already registered (its only other ValueError
    # is a module path without a class name, which this call never makes).
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "WeightsyncTransferEngine")


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers the backend the moment vLLM's factory module is first imported.

    Importing weightsync must not import vLLM (seconds, and a trainer may never use it), so
    when this runs before vLLM is imported, registration waits for vLLM's factory. The finder
    stays in ``sys.meta_path`` until then, so a process forked from this one (vLLM forks its
    engine core and workers by default) registers too, when its worker imports the factory.
    """

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _FACTORY:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            register()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def register_when_vllm_loads() -> None:
    """`register` now if vLLM's factory is imported, else as soon as it is."""
    if _FACTORY in sys.modules:
        register()
    elif not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())


def worker_rank(parallel_config: Any) -> int:
    """This worker's rank among all workers of all data-parallel replicas (as vLLM's NCCL
    backend computes it): gloo ranks are keyed on it."""
    return int(
        parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank
    )


def file_shapes(paths: list[Path]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Name and shape of every tensor of bucket files (headers only), each also under its
    aliases (``wire.format``)."""
    from safetensors import safe_open

    for path in paths:
        with safe_open(str(path), framework="pt") as h:
            others = json.loads((h.metadata() or {}).get(fmt.ALIASES_KEY, "{}"))
            for key in h.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                shape = tuple(h.get_slice(key).get_shape())
                yield key, shape
                for other in others.get(key, []):
                    yield other, shape


def _make_engine_class() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class WeightsyncTransferEngine(WeightTransferEngine):
        """vLLM weight-transfer backend ``"weightsync"``: checkpoint-format buckets from files
        or a gloo group, checked whole, then loaded with vLLM's layerwise reload; see the module
        docstring for the stage and commit, and why it reports failures instead of raising."""

        init_info_cls = InitInfo
        update_info_cls = UpdateInfo
        # The trainer's buckets carry the main model's checkpoint names.
        supports_draft_weight_update = False

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.rank = worker_rank(self.parallel_config)
            self._group: Any = None
            self._store: Any = None
            self._timeout_s = 300.0
            #: The bucket bytes of the last update a delta trainer sent (``wire.delta``); the
            #: worker extension's ``weightsync_delta_state(backend=True)`` reports their id.
            self.copies: LoadedCopies | None = None
            #: Name -> shape of every weight the engine loads, set by the worker extension when
            #: it reads the engine's facts: what is staged is checked against it, and a load
            #: that covered all of it is a full restore. Empty: neither is known.
            self.expected: Mapping[str, tuple[int, ...]] = {}
            #: The worker this backend loads into, set with ``expected``: a completed load clears
            #: its KV cache (`model_ops.clear_kv_cache`, as every other weightsync load does).
            self.worker: Any = None
            self._written: list[str] = []  # layers failed loads finished, not yet reported
            #: Modules that hold one parameter between them (`model_ops.tied_modules`), read
            #: at the first load, before any reload is pending.
            self._twins: list[list[tuple[str, torch.nn.Module]]] | None = None
            self._stage: gloo.Staging | None = None
            #: Calls that wrote the model (a load, a finish's finalize, an abandon's restore):
            #: the ledger counts a weight-transfer call whose update staged, checked or was
            #: refused with nothing loaded as no harm (``ledger._WEIGHT_TRANSFER_CALLS``).
            self.weightsync_touches = 0
            self._new_round()

        def _new_round(self) -> None:
            self.drop_stage()
            self._error = ""  # the first failure of this update ("" = none)
            self._delta = ""  # the id a delta update leaves in `copies` once loaded
            self._buckets = 0  # buckets received in this update (gloo)
            self._reloading = False  # the layerwise reload began (the model is being written)
            self._loaded: set[str] = set()  # names loaded in this update
            self._declared_whole = False  # a `final` call loaded without an error
            self._finished = False  # finish_weight_update ran

        # -- vLLM's calls ------------------------------------------------------------------

        def init_transfer_engine(self, init_info: InitInfo) -> None:
            # A new trainer: an update the last one left open reports to nobody.
            self._new_round()
            self._timeout_s = float(init_info.timeout_s)
            if not init_info.host:
                return  # files only: nothing to set up
            try:
                self._group, self._store = gloo.join_group(
                    init_info.host,
                    int(init_info.port),
                    1 + self.rank,
                    int(init_info.world_size),
                    float(init_info.timeout_s),
                    init_info.secret,
                )
            except Exception:  # the trainer's rendezvous times out and says so
                logger.exception("weightsync: worker %d could not join the gloo group", self.rank)

        def start_weight_update(self) -> None:
            self._new_round()  # the model is untouched until the first load (module docstring)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            try:
                info = self.parse_update_info(update_info)
            except Exception as e:  # noqa: BLE001 (reported, see the module docstring)
                self._fail(e)
                return
            if info.abort:
                self._fail(RuntimeError(f"the trainer aborted the update: {info.abort}"))
                return
            if info.gloo and self._group is None:
                self._fail(RuntimeError("no gloo group: init_weight_transfer_engine with a host"))
            if info.commit:
                self._commit_stage()
                self._declared_whole = info.final and not self._error
                return
            copies = None
            if info.delta and not self._error:
                copies = self.copies = self.copies or LoadedCopies()
                copies.begin()
                self._delta = info.delta
            if info.stage and not self._error:
                try:
                    self._stage = gloo.Staging(
                        self._group, info.key, copies, max_bytes=info.max_bytes
                    )
                except Exception as e:  # noqa: BLE001 (a bad WEIGHTSYNC_STAGE_EXPIRY_S: reported)
                    self._fail(e)
                return
            receiver = None
            if info.gloo and not info.staged and self._group is not None:
                receiver = gloo.Receiver(self._group, info.key, copies)
            if not self._error:
                try:
                    self._step(info, receiver)
                except Exception as e:  # noqa: BLE001 (reported, see the module docstring)
                    self._fail(e)
            if receiver is not None:
                receiver.drain()  # the trainer's broadcasts complete even after a failure
                self._buckets += receiver.buckets
            self._declared_whole = info.final and self._reloading and not self._error

        def receive_weights(self, update_info: UpdateInfo) -> None:
            self.update_weights(dataclasses.asdict(update_info))

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            part = part_loaded(self.model) if self._reloading and not self._error else []
            if part:  # refused: vLLM would finish them with the rest of them uninitialised
                shown = ", ".join(part[:4]) + (
                    f" and {len(part) - 4} more" if len(part) > 4 else ""
                )
                self._fail(
                    RuntimeError(
                        f"the update loaded some weights of {shown} but not all of them: vLLM "
                        "would finish those layers with the rest of their tensors uninitialised. "
                        "They keep their previous weights; an update must send every weight of "
                        "each layer it writes"
                    )
                )
            twins = (
                unwritten_twins(self._twins or []) if self._reloading and not self._error else []
            )
            fixed = [name for name, m in twins if not refreshable(m)]
            if fixed:  # refused, as a layer loaded in part
                self._fail(
                    RuntimeError(
                        f"the update loaded a parameter {', '.join(fixed)} shares with another "
                        "layer under the other layer's name only, and weightsync cannot "
                        "re-derive what their processing made of it: send the tensor under "
                        "each of its names"
                    )
                )
            if self._reloading and not self._error:
                self.weightsync_touches += 1
                try:
                    finalize_layerwise_reload(self.model, self.model_config)
                    self._reloading = False
                    # A tied head the update did not load computes from the new weight, as
                    # if it had been sent under the head's name too (model_ops.unwritten_twins).
                    refresh(twins)
                    # vLLM-CPU's reload skips the experts' prepack (model_ops.repack_cpu_moe).
                    if has_cpu_moe(self.model):
                        repack_cpu_moe(self.model)
                    if self.worker is not None:
                        clear_kv_cache(self.worker)
                except Exception as e:  # noqa: BLE001 (reported, see the module docstring)
                    self._fail(e)
            if self._delta and self.copies is not None and not self._error:
                self.copies.commit(self._delta, self._buckets)
            self.drop_stage()
            self._finished = True

        def shutdown(self) -> None:
            self.drop_stage()
            self._group = self._store = None

        # -- what the worker extension reads -------------------------------------------------

        def outcome(self) -> Outcome:
            """The running update's outcome so far or, once finished, with its
            ``RELOAD_REPORT``: the layers failed loads finished (reported once: `take_written`),
            or whether it loaded every weight of the engine."""
            if not self._finished:
                return Outcome(error=self._error, rank=self.rank)
            if self._error:
                report: dict[str, Any] = {"written": self.take_written()}
            else:
                complete = bool(self.expected) and self._loaded.issuperset(self.expected)
                report = {"complete": complete}
            return Outcome(error=self._error, rank=self.rank, value={RELOAD_REPORT: report})

        def loaded_whole(self) -> bool:
            """Whether this update's load ended without an error and is whole -- the trainer's
            call marked `final` loaded, or, unmarked, every weight the engine loads loaded
            (``expected``: unknown, or a name missing, is not whole) -- and nothing has
            finished or given the update up yet: what only the finish is missing to be the
            write its trainer made (``WeightsyncWorker.weightsync_settle`` finishes it for a
            trainer that died after its load). A `final` update may load some weights only:
            a sync that skipped what the engine provably holds declares it whole that way. A
            layer loaded in part (`part_loaded`) is never whole: its finish refuses it."""
            return (
                self._reloading
                and not self._error
                and not self._finished
                and (
                    self._declared_whole
                    or (bool(self.expected) and self._loaded.issuperset(self.expected))
                )
                and not part_loaded(self.model)
            )

        def give_up(self) -> None:
            """This update is given up (``weightsync_abandon``, which restored every layer its
            load left unfinished): the stage goes; the kept copies of a delta update go too
            (a stage or a load patched them for a sync that will not complete: the next is
            sent whole); and a load that began can no longer be finished -- the finish then
            leaves the model as the abandon did instead of finalizing a reload that is no
            longer there, and the outcome says the update failed. A finished update is past
            giving up: only its stage (none) goes."""
            self.drop_stage()
            if self._finished:
                return
            if self._delta and self.copies is not None:
                self.copies.clear()
            self._delta = ""
            if self._reloading:
                self._reloading = False
                self._error = self._error or "RuntimeError: the update was abandoned unfinished"

        def take_written(self) -> list[str]:
            """The layers failed loads had finished (a mix) that no report has named yet."""
            written, self._written = self._written, []
            return written

        # -- helpers -------------------------------------------------------------------------

        def _commit_stage(self) -> None:
            """Load what is staged, claimed on every worker or on none (`claim_staged`: a stage
            that expired unclaimed on any worker refuses the commit, nothing loaded). Every
            worker votes, whatever its state: a worker that already failed votes no."""
            try:
                pairs = claim_staged(None if self._error else self._stage)
                assert self._stage is not None  # claimed
                self._buckets = self._stage.buckets
                self._load(iter(pairs))
                self.drop_stage()
                free_later(pairs)  # out of the pause
            except Exception as e:  # noqa: BLE001 (reported, see the module docstring)
                self._fail(e)

        def _step(self, info: UpdateInfo, receiver: gloo.Receiver | None) -> None:
            """Check (and load) one chunk: files, a stream, or the stage's check."""
            if info.staged:
                if self._stage is None:
                    raise RuntimeError("nothing is staged: update_weights with stage first")
                pairs = self._stage.wait(self._timeout_s)
                self._buckets = self._stage.buckets
                if self.expected:
                    check_loadable(pairs, self.expected)
                return
            if receiver is not None:
                self._load(iter(receiver))
                return
            # Views of mappings of this chunk alone (one copy per byte, the trainer's write;
            # the folder is fresh per update, so no file is rewritten under them), every file's
            # tag checked on the mapping it is then loaded from, before any is loaded.
            views = MappedFiles().read(info.folder, info.files, info.key, info.tags)
            if self.expected:
                check_loadable(
                    file_shapes([Path(info.folder) / n for n in info.files]), self.expected
                )
            self._load(views)

        def _load(self, pairs: Iterator[tuple[str, torch.Tensor]]) -> None:
            from vllm.model_executor.model_loader.mtp_validation import (
                disable_mtp_completeness_check,
            )
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            self.weightsync_touches += 1
            if not self._reloading:
                if self._twins is None:
                    self._twins = tied_modules(self.model)
                keep_freed_memory(self.worker)  # the next update reuses this one's memory
                initialize_layerwise_reload(self.model)
                self._reloading = True
            with torch.no_grad(), disable_mtp_completeness_check():
                self.model.load_weights(self._noting(pairs))

        def _noting(
            self, pairs: Iterator[tuple[str, torch.Tensor]]
        ) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in pairs:
                self._loaded.add(name)
                yield name, tensor

        def _fail(self, error: BaseException) -> None:
            """Record the first failure of this update, drop what is staged and, if the load
            began, give every layer it left unfinished its previous tensors back (noting those
            it had finished: a mix), so the worker keeps serving."""
            logger.error("weightsync: weight update failed on worker %d: %s", self.rank, error)
            if self.copies is not None:
                self.copies.clear()  # in doubt: the next update is sent whole
            if not self._error:
                self._error = f"{type(error).__name__}: {error}"
            self.drop_stage()
            if not self._reloading:
                return  # nothing was loaded: the old weights are whole
            self._written = sorted({*self._written, *finished_in(self.model)})
            self.weightsync_touches += 1
            try:
                abandon_layerwise_reload(self.model, self.model_config)
                self._reloading = False
            except Exception as e:  # the trainer must restart this engine
                logger.exception("weightsync: restoring the unfinished layers failed")
                self._error += f"; restoring the unfinished layers failed too ({e})"

        def staged_bytes(self) -> int:
            """Bytes held staged for a commit (0: none, or dropped, or expired)."""
            return 0 if self._stage is None else self._stage.held

        def drop_stage(self) -> None:
            """Let go of what is staged (a commit of this update then finds nothing)."""
            if self._stage is not None:
                self._stage.drop()
            self._stage = None

    return WeightsyncTransferEngine


def __getattr__(name: str) -> Any:
    """``WeightsyncTransferEngine`` is built on first access: its base class is vLLM's, and
    importing this module must not import vLLM (see `register_when_vllm_loads`)."""
    if name == "WeightsyncTransferEngine":
        cls = _make_engine_class()
        cls.__module__, cls.__qualname__ = __name__, name
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
