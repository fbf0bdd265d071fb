"""The worker extension: weightsync's methods inside each vLLM worker process.

vLLM imports this module inside each of its worker processes when started with
``--worker-extension-cls weightsync.engines.vllm.worker.WeightsyncWorker`` (or
``LLM(worker_extension_cls=...)``) and mixes `WeightsyncWorker` into its worker class. Its
methods are then reachable with ``collective_rpc`` (``POST /collective_rpc`` on a server started
with ``VLLM_SERVER_DEV_MODE=1``), which runs them on every worker (every TP rank) and passes JSON
arguments only: tensors cannot travel that way, so bytes come through the wire (``weightsync.wire``:
files on tmpfs, or a gloo group with the trainer as rank 0).

Why a worker extension and not vLLM's stock ``reload_weights`` alone:

- **Recovery.** Every load runs `model_ops.reload`, which abandons a half-done layerwise reload
  so the engine keeps working, and reports the layers it had finished (a mix of old and new:
  a server's middleware then refuses generation until a full sync, ``server_lease.py``).
- **Facts.** What the engine loads (`EngineFacts`) is read here, from the model vLLM built, not
  trusted from the caller.
- **The epoch.** The worker's ledger (``ledger.py``) records every sleep, wake and write, by
  anyone.
- **Tied embeddings.** A checkpoint stores a tied tensor once; vLLM's own reload from disk then
  leaves ``lm_head`` stale. Reloads here send such a tensor under every name it is registered as.

Every method returns an `Outcome` (as JSON) instead of raising (``wire.protocol`` says why).
Like everything under ``in_engine/``, this module imports only ``weightsync.wire``, torch and
(lazily) vLLM: nothing of the trainer side.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from ....errors import StageLostError
from ....wire import format as fmt
from ....wire import gloo, scratch
from ....wire.delta import LoadedCopies
from ....wire.files import MappedFiles, check_files
from ....wire.protocol import RELOAD_REPORT, EngineFacts, Outcome
from ....wire.stage import Held, stage_expiry_s
from . import backend, ledger, model_ops
from . import checkpoint as ckpt
from .heap import free_later
from .model_ops import check_loadable


class WeightsyncWorker:
    """Mixed into vLLM's worker class; every method is a ``collective_rpc`` target.

    Method names start with ``weightsync_`` because vLLM refuses an extension whose names
    collide with the worker's own.
    """

    # Provided by the vLLM worker class this is mixed into.
    vllm_config: Any
    model_runner: Any
    rank: int

    _weightsync_facts: EngineFacts | None = None
    _weightsync_mapped: MappedFiles | None = None
    _weightsync_sealed: MappedFiles | None = None
    _weightsync_group: Any = None
    _weightsync_store: Any = None
    _weightsync_adapter_root: Path | None = None
    _weightsync_copies: LoadedCopies | None = None
    _weightsync_stage: Held | None = None
    _weightsync_stage_delta: str = ""
    #: The id of the held stage, its trainer's (one per prepare; "": none given).
    _weightsync_stage_id: str = ""

    def _weightsync_outcome(self, error: BaseException | None = None, value: Any = None) -> dict:
        if error is not None:
            return Outcome.failed(error, rank=self.rank).to_json()
        return Outcome(rank=self.rank, value=value).to_json()

    # --- facts and state ----------------------------------------------------------------------

    def weightsync_facts(self) -> dict[str, Any]:
        """What this engine loads and serves (`EngineFacts`). Read once, on the first call:
        vLLM repoints ``model_config.model`` at any folder it later reloads from."""
        try:
            facts = self._weightsync_known_facts()
        except Exception as e:  # noqa: BLE001 (returned to the trainer, see the module docstring)
            return self._weightsync_outcome(e)
        return self._weightsync_outcome(value=facts.to_json())

    def _weightsync_known_facts(self) -> EngineFacts:
        if self._weightsync_facts is None:
            self._weightsync_facts = model_ops.read_facts(self)
            if (engine := self._weightsync_backend()) is not None:
                engine.expected = self._weightsync_facts.weights  # what its checks refuse
                engine.worker = self  # whose KV cache a completed load clears
        return self._weightsync_facts

    def weightsync_attest(
        self, since: list[list[Any]] | None = None, asleep: bool = False
    ) -> dict[str, Any]:
        """This worker's epoch, sleeping tags and the worst harm since ``since`` (see
        ``ledger.py``); installs the ledger on the first call."""
        return self._weightsync_outcome(value=ledger.attest(self, since, asleep))

    # --- loading -------------------------------------------------------------------------------

    def weightsync_load_files(
        self,
        folder: str,
        files: list[str] | None = None,
        key: str = "",
        tags: list[str] | None = None,
    ) -> dict:
        """Load the bucket files the trainer wrote to ``folder`` (tmpfs transport): the kept
        ``files``, read through mappings held between syncs, or every file of a folder written
        for this sync alone (``files`` None: its bucket files, in order), read through
        mappings of this load alone (views, not a copy; unmapped once the reload let go of
        them, so nothing of the folder stays in RAM after its writer removes it). With
        ``key``, every file is checked against its tag (``wire.tags``), through the mapping it
        is then loaded from, before the first is loaded: a file someone else rewrote refuses
        the sync with nothing loaded."""
        try:
            if files is None:
                names = sorted(p.name for p in Path(folder).glob("bucket-*.safetensors"))
                stream = MappedFiles().read(folder, names, key, tags)
            else:
                if self._weightsync_mapped is None:
                    self._weightsync_mapped = MappedFiles()
                stream = self._weightsync_mapped.read(folder, files, key, tags)
        except Exception as e:  # noqa: BLE001 (returned to the trainer, see the module docstring)
            return self._weightsync_outcome(e)
        return self._weightsync_reload(stream)

    def weightsync_stage_files(
        self,
        files: list[str],
        key: str = "",
        tags: list[str] | None = None,
        keep: bool = True,
        stage: str = "",
    ) -> dict:
        """Stage the trainer's sealed bucket files (tmpfs transport, ``wire.files``) while the
        engine serves: map each (``/proc/<trainer>/fd/<n>``; one that is not sealed is refused),
        check every tag and that this engine loads every tensor, and hold the views for
        `weightsync_commit_staged` (or until they expire, ``WEIGHTSYNC_STAGE_EXPIRY_S``). The
        seals leave the trainer's own mapping as the files' only writer, so what is checked
        here is what the commit loads. ``keep``: keep the mappings for the next sync's files
        (dropped if the stage expires: its trainer is likely gone); else they go with the
        stage. ``stage``: its id, which its commit and drop name (`_weightsync_other_stage`).
        The value is how many files were staged."""
        self._weightsync_drop_stage()
        try:
            expire_s = stage_expiry_s()
            if keep:
                mapped = self._weightsync_sealed = self._weightsync_sealed or MappedFiles()
            else:
                mapped = MappedFiles()
            pairs = list(mapped.read("", files, key, tags, sealed=True))
            check_loadable(pairs, self._weightsync_known_facts().weights)
        except Exception as e:  # noqa: BLE001 (returned to the trainer)
            if self._weightsync_sealed is not None:
                self._weightsync_sealed.forget()  # the trainer lets these files go
            return self._weightsync_outcome(e)
        held = Held(expire_s, on_expire=mapped.forget)
        held.hold(pairs, len(files))
        self._weightsync_stage, self._weightsync_stage_id = held, stage
        return self._weightsync_outcome(value=len(files))

    def weightsync_open_sealed(
        self, files: list[str], key: str = "", tags: list[str] | None = None
    ) -> dict:
        """Map the trainer's sealed files ``files``, check their tags, and let them go: whether
        this worker can open its trainer's files at all (``TmpfsTransport.connect``)."""
        try:
            list(MappedFiles().read("", files, key, tags, sealed=True))
        except Exception as e:  # noqa: BLE001 (returned to the trainer)
            return self._weightsync_outcome(e)
        return self._weightsync_outcome()

    def _weightsync_reload(self, stream: Any) -> dict:
        """`model_ops.reload`, its report saying whether every weight of the engine came."""
        expected = self._weightsync_known_facts().weights
        return model_ops.reload(self, stream, expected=expected).to_json()

    def weightsync_check_files(
        self, folder: str, files: list[str], key: str, tags: list[str]
    ) -> dict:
        """Check files the trainer wrote for vLLM's own loaders (an adapter folder) against
        their tags before the trainer asks vLLM to read them."""
        try:
            check_files(folder, files, key, tags)
        except Exception as e:  # noqa: BLE001 (returned to the trainer)
            return self._weightsync_outcome(e)
        return self._weightsync_outcome()

    def weightsync_check_update(self, folder: str, files: list[str]) -> dict:
        """Check the files of an update through vLLM's weight-transfer API while the engine
        serves, before the trainer pauses it: every tensor a weight this engine loads, at its
        shape (the files' headers only). An update that names another model is refused before
        anything is paused or unloaded. The tags are checked once, by the load in the pause,
        on the mappings it loads from: a check here too would hash every byte twice (docs/failure-modes.md
        row 66), and a file could still change after it."""
        paths = [Path(folder) / name for name in files]
        try:
            check_loadable(backend.file_shapes(paths), self._weightsync_known_facts().weights)
        except Exception as e:  # noqa: BLE001 (returned to the trainer)
            return self._weightsync_outcome(e)
        return self._weightsync_outcome()

    def weightsync_reload_checkpoint(self, path: str = "") -> dict:
        """Re-read a checkpoint folder (the one the engine started from when ``path`` is
        empty), the files vLLM's loader picks there, each tied tensor under every name, so
        ``lm_head`` is not left stale."""
        try:
            facts = self._weightsync_known_facts()
            weight_files = (
                ckpt.weight_files(path, self.vllm_config.load_config) if path else facts.files
            )
            if not weight_files:
                raise FileNotFoundError(f"no weight files in {path or facts.checkpoint!r}")
            stream = fmt.read(weight_files, model_ops.checkpoint_twins(weight_files, facts.tied))
        except Exception as e:  # noqa: BLE001 (returned to the trainer)
            return self._weightsync_outcome(e)
        return self._weightsync_reload(stream)

    def weightsync_join_gloo(
        self, host: str, port: int, world_size: int, timeout_s: float, secret: str
    ) -> dict:
        """Join the trainer's gloo group as rank ``1 + worker rank`` (the trainer is rank 0),
        under the rendezvous' ``secret`` (``wire.gloo``)."""
        try:
            self._weightsync_group, self._weightsync_store = gloo.join_group(
                host, int(port), 1 + self.rank, int(world_size), float(timeout_s), secret
            )
        except Exception as e:  # noqa: BLE001 (returned to the trainer)
            return self._weightsync_outcome(e)
        return self._weightsync_outcome()

    def weightsync_receive_gloo(self, key: str = "", delta: str = "") -> dict:
        """Load what the trainer broadcasts over the gloo group until its END frame, each
        bucket checked against its tag first when the trainer tags the stream (``key``). On a
        failure here the stream is drained first, so the trainer's broadcasts complete.

        ``delta``: the trainer sends deltas (``wire.delta``) and this is the id the sync
        leaves: every bucket is kept, DELTA frames patch the kept copies, and the copies carry
        ``delta`` once the whole sync loaded; any failure drops them all (the next sync is
        full)."""
        if self._weightsync_group is None:
            return self._weightsync_outcome(RuntimeError("no gloo group: join it first"))
        copies = None
        if delta:
            copies = self._weightsync_copies = self._weightsync_copies or LoadedCopies()
            copies.begin()
        receiver = gloo.Receiver(self._weightsync_group, key, copies)
        outcome = model_ops.reload(
            self, iter(receiver), expected=self._weightsync_known_facts().weights
        )
        if copies is not None:
            if outcome.ok:
                copies.commit(delta, receiver.buckets)
            else:
                copies.clear()
        if not outcome.ok:
            receiver.drain()
        return outcome.to_json()

    def weightsync_stage_gloo(
        self, key: str = "", delta: str = "", max_bytes: int | None = None, stage: str = ""
    ) -> dict:
        """Start receiving the trainer's next gloo stream in a thread (`gloo.Staging`) and
        return at once: the engine keeps generating while the bytes travel, and nothing is
        loaded until `weightsync_commit_staged`. A stage not yet committed is dropped; one that
        ended and that no commit claims expires (``WEIGHTSYNC_STAGE_EXPIRY_S``, `gloo.Staging`).
        ``key`` and ``delta`` as for `weightsync_receive_gloo`; ``max_bytes``: the most this
        worker may stage; ``stage``: its id (`_weightsync_other_stage`)."""
        if self._weightsync_group is None:
            return self._weightsync_outcome(RuntimeError("no gloo group: join it first"))
        self._weightsync_drop_stage()
        try:
            expire_s = stage_expiry_s()  # refused before a byte is staged
        except ValueError as e:
            return self._weightsync_outcome(e)
        copies = None
        if delta:
            copies = self._weightsync_copies = self._weightsync_copies or LoadedCopies()
            copies.begin()
        self._weightsync_stage_delta = delta
        self._weightsync_stage = gloo.Staging(
            self._weightsync_group, key, copies, max_bytes=max_bytes, expire_s=expire_s
        )
        self._weightsync_stage_id = stage
        return self._weightsync_outcome()

    def weightsync_staged(self, timeout_s: float, stage: str = "") -> dict:
        """Wait for the staged stream's END (checked), then check that this engine loads every
        staged tensor (`check_loadable`); the value is how many buckets it held. A stage that
        failed is dropped and its error returned: nothing was loaded."""
        if (other := self._weightsync_other_stage(stage)) is not None:
            return self._weightsync_outcome(other)
        held = self._weightsync_stage
        if not isinstance(held, gloo.Staging):
            return self._weightsync_outcome(RuntimeError("no gloo stream is staged"))
        try:
            pairs = held.wait(float(timeout_s))
            check_loadable(pairs, self._weightsync_known_facts().weights)
        except Exception as e:  # noqa: BLE001 (returned to the trainer)
            self._weightsync_drop_stage()
            return self._weightsync_outcome(e)
        return self._weightsync_outcome(value=held.buckets)

    def weightsync_commit_staged(self, stage: str = "") -> dict:
        """Load the staged stream (checked whole by `weightsync_staged`) and let it go. Claimed
        on every worker or on none (`model_ops.claim_staged`): a stage that expired unclaimed
        on any worker (``WEIGHTSYNC_STAGE_EXPIRY_S``) refuses the commit with
        `StageExpiredError`, nothing loaded. ``stage``: the id of the stage this commit loads;
        another sync's stage held instead is left as it is and the commit refused
        (`StageLostError`), nothing loaded."""
        other = self._weightsync_other_stage(stage)
        held = self._weightsync_stage
        try:  # every worker votes, also one whose stage is another sync's
            pairs = model_ops.claim_staged(held, refusal=other)
        except Exception as e:  # noqa: BLE001 (returned to the trainer)
            if other is None:  # this commit's own stage, refused: let it go
                self._weightsync_drop_stage()
            return self._weightsync_outcome(e)
        assert held is not None  # claimed
        outcome = model_ops.reload(self, iter(pairs))
        copies = self._weightsync_copies if self._weightsync_stage_delta else None
        if copies is not None and outcome.ok:
            copies.commit(self._weightsync_stage_delta, held.buckets)
            self._weightsync_stage_delta = ""
        self._weightsync_drop_stage()
        free_later(pairs)  # out of the pause
        return outcome.to_json()

    def weightsync_drop_staged(self, stage: str = "") -> dict:
        """Drop what is staged, uncommitted (the trainer's sync failed before its commit), and
        the mappings of sealed files (the trainer lets those go: its next files are fresh).
        ``stage``: drop only the stage of that id; another sync's is left as it is."""
        if self._weightsync_other_stage(stage) is not None:
            return self._weightsync_outcome()
        self._weightsync_drop_stage()
        if self._weightsync_sealed is not None:
            self._weightsync_sealed.forget()
        return self._weightsync_outcome()

    def weightsync_staged_bytes(self) -> dict:
        """The bytes this worker holds staged for a commit (``wire.gloo.Staging``): its gloo
        stage's and its weight-transfer backend's. 0 once a stage is committed, dropped, or
        expired (``WEIGHTSYNC_STAGE_EXPIRY_S``): what a trainer that died before its commit
        still costs the worker."""
        held = 0 if self._weightsync_stage is None else self._weightsync_stage.held
        if (engine := self._weightsync_backend()) is not None:
            held += engine.staged_bytes()
        return self._weightsync_outcome(value=held)

    def _weightsync_other_stage(self, stage: str) -> StageLostError | None:
        """Why a call naming the stage ``stage`` must leave the held stage alone: it is another
        sync's, or none is held (None: it is this one's, or the call named none). One stage is
        held at a time, and each names its trainer's id, so a trainer whose stage another
        replaced, or that died half-way while another staged, commits or drops nothing of the
        other's (a Ray actor's stage of a dead trainer failing after a live trainer staged:
        tests/test_ray_vllm.py, kill seed 32)."""
        if not stage or (self._weightsync_stage is not None and stage == self._weightsync_stage_id):
            return None
        return StageLostError(
            f"the stage {stage} is no longer held by this worker: another sync's stage replaced "
            "it, or it was dropped or expired. Nothing of it was loaded; sync again"
        )

    def _weightsync_drop_stage(self) -> None:
        if self._weightsync_stage is not None:
            self._weightsync_stage.drop()
            self._weightsync_stage = None
        self._weightsync_stage_id = ""
        if self._weightsync_stage_delta and self._weightsync_copies is not None:
            self._weightsync_copies.clear()  # patched by an uncommitted stream: the next is full
        self._weightsync_stage_delta = ""

    def weightsync_delta_state(self, backend: bool = False) -> dict:
        """The id of the sync this worker's kept copies come from (``wire.delta``); None when
        it keeps none (never sent deltas, restarted, or its last sync failed). ``backend``:
        the copies of weightsync's weight-transfer backend (``WeightTransferTransport``), not
        those of ``weightsync_receive_gloo``."""
        copies = self._weightsync_kept(backend)
        return self._weightsync_outcome(value=None if copies is None else copies.synced)

    def weightsync_delta_digests(self, backend: bool = False) -> dict:
        """Name -> SHA-256 of every tensor in the kept copies (``LoadedCopies.digests``), so a
        trainer can check them against what a full sync sends."""
        copies = self._weightsync_kept(backend)
        return self._weightsync_outcome(value={} if copies is None else copies.digests())

    def weightsync_delta_drop(self, backend: bool = False) -> dict:
        """Drop the kept copies (the trainer's delta transport closed): frees one copy of the
        weights in this worker."""
        if not backend:
            self._weightsync_copies = None
        elif (engine := self._weightsync_backend()) is not None:
            engine.copies = None
        return self._weightsync_outcome()

    def _weightsync_kept(self, backend: bool) -> LoadedCopies | None:
        if not backend:
            return self._weightsync_copies
        return getattr(self._weightsync_backend(), "copies", None)

    def _weightsync_backend(self) -> Any:
        """weightsync's weight-transfer backend of this worker (``backend.py``), or None (the
        engine runs another backend, or none)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return engine if hasattr(engine, "take_written") else None

    def weightsync_weight_update(self) -> dict:
        """This worker's outcome of the update weightsync's weight-transfer backend runs or ran
        last (vLLM's four calls return nothing): its error, and once it finished the
        ``RELOAD_REPORT`` of what it did to the weights, which fences a server serving a mix or
        lifts the fence after a full restore (``server_lease.py`` reads it here)."""
        engine = self._weightsync_backend()
        if engine is None:
            error = RuntimeError(
                "this engine does not run weightsync's weight-transfer backend "
                """(--weight-transfer-config '{"backend": "weightsync"}')"""
            )
            return self._weightsync_outcome(error)
        return dict(engine.outcome().to_json())

    def weightsync_receive_adapter(
        self, version: int, config: str, key: str = "", keep: int = 2
    ) -> dict:
        """Receive an adapter version over the gloo group and write it where this server's
        LoRA loader reads it (rank 0; the trainer may be on another host): a new versioned
        folder in a scratch folder of this host, the ``keep`` newest kept (at least two: a
        request admitted before a swap may still read an older one). Its path is the outcome's
        value (rank 0)."""
        if self._weightsync_group is None:
            return self._weightsync_outcome(RuntimeError("no gloo group: join it first"))
        receiver = gloo.Receiver(self._weightsync_group, key)
        try:
            tensors = [(name, t.clone()) for name, t in receiver]  # views share one payload
            if self.rank != 0:
                return self._weightsync_outcome()
            if self._weightsync_adapter_root is None:
                self._weightsync_adapter_root = scratch.scratch_dir(self, "adapters")
            folder = self._weightsync_adapter_root / f"adapter-v{int(version):06d}"
            fmt.write_adapter(folder, tensors, json.loads(config))
            for old in sorted(folder.parent.glob("adapter-v*"))[: -max(2, int(keep))]:
                shutil.rmtree(old, ignore_errors=True)
        except Exception as e:  # noqa: BLE001 (returned to the trainer)
            receiver.drain()
            return self._weightsync_outcome(e)
        return self._weightsync_outcome(value=str(folder))

    def weightsync_drop_adapters(self) -> dict:
        """Remove the adapter folders `weightsync_receive_adapter` wrote (the trainer closes)."""
        if self._weightsync_adapter_root is not None:
            shutil.rmtree(self._weightsync_adapter_root, ignore_errors=True)
            self._weightsync_adapter_root = None
        return self._weightsync_outcome()

    def weightsync_abandon(self) -> dict:
        """Give every layer a half-done layerwise reload left unfinished its previous tensors
        back. Safe to call when nothing is pending; the value says whether anything was, and
        which layers it had finished (``wire.protocol.RELOAD_REPORT``, which fences a server
        when any were), the layers failed loads of weightsync's weight-transfer backend
        finished included when no report named them yet (their trainer died first). The
        backend's update is given up with it (``give_up``): whoever abandons -- a pause lease
        that expired, a trainer's recovery -- ends it, the bytes a dead trainer staged are let
        go now rather than at the next trainer's update, and a finish that comes later leaves
        the model as the abandon did."""
        try:
            report = model_ops.abandon(self)
            if (engine := self._weightsync_backend()) is not None:
                engine.give_up()
                written = report[RELOAD_REPORT]["written"]
                written[:] = sorted({*written, *engine.take_written()})
            return self._weightsync_outcome(value=report)
        except Exception as e:  # noqa: BLE001 (returned to the trainer)
            return self._weightsync_outcome(e)

    def weightsync_settle(self) -> dict:
        """End what a trainer that is gone left in this engine (a pause lease that expired,
        ``server_lease.py``; a trainer finding a weight-transfer update another left open,
        ``WeightTransferTransport._start``), on the engine's side alone.

        A weight-transfer update whose load ended on every worker without an error and
        covered every weight the engine loads (``loaded_whole``: a full restore that only
        lacks its finish -- its trainer was killed once its load call was sent) is finished by
        vLLM's own ``finish_weight_update`` on this worker, as the trainer's call would have:
        the backend finalizes the reload (and clears the KV cache), vLLM marks the update
        closed and resets its LoRA state, the ledger records the write. The value is then the
        update's outcome (`RELOAD_REPORT` ``complete``, which lifts a server's fence; a finish
        that failed reports its error and the layers it had finished, which fence). The
        workers vote first (`model_ops.every_worker`): one worker that is not whole (an
        error, a name it did not load, no load at all, its coverage unknown) and none
        finishes, so no engine is finished on some ranks only. Otherwise: `weightsync_abandon`
        (the layers a load finished keep their new weights and are reported: fenced), and an
        update left open is closed with nothing more loaded, so the next trainer finds it
        closed (at TP>1 vLLM's refusal of a new update while one is open puts its replies out
        of step)."""
        engine = self._weightsync_backend()
        open_update = bool(getattr(self, "_weight_update_active", False))
        try:
            whole = open_update and engine is not None and bool(engine.loaded_whole())
        except Exception:  # noqa: BLE001 (a worker that cannot tell votes no, as it must vote)
            whole = False
        whole = model_ops.every_worker(whole)
        try:
            if not whole:
                abandoned = self.weightsync_abandon()
                if open_update and not abandoned["error"]:
                    self.finish_weight_update()  # type: ignore[attr-defined]
                return abandoned
            self.finish_weight_update()  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 (returned: the lease leaves the engine paused)
            return self._weightsync_outcome(e)
        return dict(engine.outcome().to_json())


# vLLM builds its weight-transfer backend in every worker, by name, before the first load: the
# "weightsync" backend must be known by then, and this module is what vLLM imports there.
backend.register_when_vllm_loads()
