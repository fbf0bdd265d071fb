"""A vLLM engine in other processes: a ``vllm serve`` server or a multiprocess ``vllm.LLM``.

One engine class, `RemoteVLLMEngine`, with two pluggable halves:

- a *control plane* (``control.py``: `HTTPControl` for a server, `LLMControl` for a
  multiprocess ``LLM``): pause/resume, prefix-cache reset, adapters by name, generation, sleep,
  and ``collective_rpc`` into weightsync's worker extension (``in_engine/extension.py``);
- a *transport* for the bytes (``transports/``): tmpfs files, a gloo group, vLLM's
  weight-transfer API.

Every write: stage what the transport can stage while the engine serves (tmpfs: every bucket's
file, written and tagged; gloo and Ray: the workers' or the actor's stage), then commit it as
one `Commit` (``control.py``): pause (in-flight requests are kept, not dropped), the stage's
worker calls, the unload of the served adapter after a base write, the version read and
labelled, the prefix-cache reset, resume. `run_commit` is the one composition of a commit, and
the control chooses where it runs (`Control.commit`): a ``vllm serve`` server with weightsync's
pause lease (``server_lease.py``) and a Ray actor run all of it on their own side in one call
from the trainer, so the pause holds no round trip to the trainer and a trainer killed during
the call leaves an engine that finishes, or recovers, and resumes by itself; a server without
the middleware (one round trip a call, as before) and a multiprocess ``LLM`` or ``AsyncLLM``
(in this process) run it here. A stage that is a stream only this side can send (gloo with
``stage=False``, vLLM's weight-transfer API) is sent inside a pause run here. The pause window
is reported as measured where the commit ran (`SyncReport.pause_seconds`).

If a commit fails part-way the workers have already restored their unfinished layers, but the
layers they had finished keep their new weights: a mix. They report those layers, and a server
with the middleware then refuses to generate (HTTP 503, for every client; `EngineFencedError`
here) until a full sync completes; a server without it, and a multiprocess ``LLM``, serve the
mix, labelled `UNKNOWN_BASE`. The engine is resumed, the base is marked lost (only a full
restore may follow) and the error is raised. If even that recovery fails the engine is left
paused -- never resume a broken engine -- and `EngineBrokenError` says so; an engine that no
longer answers at all (a dead Ray actor or engine core) raises `EngineUnavailableError`.

The engine's facts (`EngineFacts`) come from the worker extension, read from the model vLLM
built, not from the caller; a server without the extension is a `StockServerEngine`
(``stock.py``), which overrides what the extension does here.

Which weights produced a rollout: `RemoteVLLMEngine.weights_version`, a version the engine
attests, never one counted on the trainer's side -- the workers' ledger epoch (moved by every
sleep, wake, reload and weight write, by anyone) and the adapter ids the workers hold (adapter
loads do not move the epoch). Each completed write also records the version attested at its end,
while the engine is still paused (by the commit, wherever it ran) (`RemoteVLLMEngine.written_version`): that is the version of
what the write put there, read once, and what `weightsync.Syncer` reports, so a sync costs no
second round of calls for its version. It is also what the trainer's record of the write is
checked against: another client's write that lands after a commit (between the base commit and
the adapter's, or before the record is taken) moves the epoch, and the write is then not
recorded as what the engine holds (`RemoteVLLMEngine._written_at`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path
from typing import Any

import torch

from ... import errors, timing
from ...errors import (
    AdapterError,
    EngineBrokenError,
    EngineUnavailableError,
    NoCheckpointError,
    WeightSyncError,
)
from ...plan import Adapter, Bucket
from ...wire import format as fmt
from ...wire.files import sign_file
from ...wire.protocol import EngineFacts, Outcome, raise_failures
from ...wire.scratch import private_dir, scratch_dir
from ...wire.tags import Signer
from ..base import Attestation, Engine, register
from ..contract import Staged
from .control import (
    UNKNOWN_BASE,
    WORKER_EXTENSION,
    Commit,
    Committed,
    Control,
    LLMControl,
    WeightsSpan,
    adapter_ids,
    adapter_window,
    attestation,
    base_label,
    run_commit,
    since_arg,
    version_label,
    weights_spans,
)
from .transports import Transport, make_transport
from .transports.base import StagedCalls


class RemoteVLLMEngine(Engine):
    """A vLLM engine in other processes, reached through ``control``, bytes via ``transport``.

    Args:
        control: the control plane (`HTTPControl`, `LLMControl`).
        transport: ``"tmpfs"`` (same host), ``"gloo"`` (any host), or a
            `Transport`.
        adapter_dir: where adapter versions are written; the engine must read it at the same
            path. Defaults to a fresh ``/dev/shm/weightsync-*`` folder, removed by `close`, or,
            with the gloo transport, a folder on the engine's host the adapters are sent to.
        lora_name: the name the served adapter is loaded under (requests use it as ``model``);
            with ``adapter_versions`` above 1, version k is loaded as ``<lora_name>-v<k>``.
        adapter_versions: how many adapter versions stay loaded: the newest (`served_adapter`)
            and the ones before it that rollouts still in flight were admitted under
            (`resident_adapters`), each under a name and id of its own, so a request admitted
            under version k finishes on k; older versions are unloaded and their folders
            deleted. Set it to the framework's staleness bound + 1. The default, 1, loads each
            version under ``lora_name``. Above 1 the engine needs ``--max-loras N`` and
            ``--max-cpu-loras N+1`` (`control.adapter_window`), refused here otherwise.
    """

    name = "vllm-remote"

    def __init__(
        self,
        control: Control,
        *,
        transport: str | Transport = "tmpfs",
        adapter_dir: str | None = None,
        lora_name: str = "weightsync",
        adapter_versions: int = 1,
    ) -> None:
        super().__init__()
        self.control = control
        self._facts = self._read_facts(transport)
        self.adapter_versions = adapter_window(adapter_versions, self._facts.lora)
        self.transport = make_transport(transport)
        self.transport.connect(self.rpc, self._facts.world_size)
        self._adapter_dir = adapter_dir
        self._adapter_root = (
            private_dir(adapter_dir) if adapter_dir else scratch_dir(self, "adapters")
        )
        self.lora_name = lora_name
        #: Where the engine read the served adapter from (on its own host).
        self.adapter_path: str | None = None
        self._remote_adapters = False  # the workers wrote adapter folders: drop them on close
        self._served: str | None = None  # the lora name requests use, None: no adapter
        self._versions: list[Path] = []  # adapter folders the server may still read, oldest first
        self._resident: list[tuple[int, str]] = []  # (version, name) loaded, oldest first
        self._version = 0
        self._loading = 0  # the adapter version a commit's load_lora step loads
        self._written_version: str | None = None
        #: The version the last commit of the write under way attested, and whether a commit
        #: of it found the base moved since the one before (`_written_at`).
        self._commit_version: str | None = None
        self._raced = False
        self._attest(None)  # install the workers' ledger now (asleep already: harm 2)
        # vLLM labels outputs "default" until told: name the weights it serves now instead.
        base = version_label(self.attest().epoch)
        if base is not None:
            self.control.label(base)

    def _read_facts(self, transport: str | Transport) -> EngineFacts:
        """What the engine loads and serves, from the worker extension."""
        try:
            return EngineFacts.from_json(self.rpc("weightsync_facts")[0].value)
        except WeightSyncError:
            raise  # an engine that is gone, or one the workers cannot read (naming it)
        except Exception as e:
            raise RuntimeError(
                "the engine's workers do not answer weightsync_facts: start it with the worker "
                f"extension (--worker-extension-cls {WORKER_EXTENSION}, or "
                f"LLM(worker_extension_cls=...)) and, for a server, VLLM_SERVER_DEV_MODE=1: {e}"
            ) from e

    def rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Outcome]:
        """``control.rpc``: every worker's outcome, raising those that failed (the workers
        return their errors, ``wire.protocol``)."""
        outcomes = [Outcome.from_json(r) for r in self.control.rpc(method, kwargs)]
        raise_failures(method, outcomes)
        return outcomes

    # --- what the engine holds -------------------------------------------------------------

    @property
    def facts(self) -> EngineFacts:
        return self._facts

    def checkpoint_head(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Read from the engine's checkpoint folder when this host sees it at the same path
        (same host or a shared filesystem); ``{}`` otherwise."""
        folder = self._facts.checkpoint
        if not os.path.isdir(folder):
            return {}
        files = self._facts.files  # the files a reload of the engine's checkpoint reads
        if not files:
            raise NoCheckpointError(
                f"this engine was started from {folder}, which holds no weight files "
                "(load_format='dummy'): there is no checkpoint to reload. Use FullSync, or "
                "ReloadWeights(snapshot_dir=...) to reload the trainer's current weights."
            )
        return fmt.heads(files, names)

    @property
    def served_adapter(self) -> str | None:
        """The name requests must use as ``model`` to get the synced adapter, its newest
        version (None: none, or the base may be gone since it was loaded: as in process, a
        name kept from before a level-2 sleep must not come back; the server keeps the names
        loaded until the base restore unloads them)."""
        return self._served if self._served is not None and self._adapters_stand() else None

    @property
    def adapter_version(self) -> int | None:
        """The version of the served adapter (adapter loads counted by this engine adapter;
        the key of `resident_adapters`); None: none."""
        return self._resident[-1][0] if self.served_adapter is not None and self._resident else None

    @property
    def resident_adapters(self) -> dict[int, str]:
        """The name of each adapter version kept loaded (see ``adapter_versions``), by
        version, oldest first; empty as `served_adapter` is None."""
        return dict(self._resident) if self._resident and self._adapters_stand() else {}

    def _adapters_stand(self) -> bool:
        """Whether the adapters loaded still sit on the base they were loaded on: nothing
        harmed the base since the last base restore (an attestation: one call to the engine).
        An engine that attests no epoch (a stock server) counts its base as lost at any time,
        which says nothing about an adapter loaded right after a base restore: its names stand."""
        now = self.attest()
        return now.harm < 2 or now.epoch is None

    # --- writing ------------------------------------------------------------------------------

    @property
    def weights_version(self) -> str | None:
        """The version of the weights the engine serves now, as its workers attest it (see the
        module docstring): equal versions, the same weights. Asked anew at every read (one
        call, two when the engine serves LoRA)."""
        return self._version_now()

    @property
    def written_version(self) -> str | None:
        """The version attested at the end of the last completed write, while the engine was
        still paused; None before one and after a failed one."""
        return self._written_version

    def check_writable(self, *, restores_base: bool, strategy: str) -> Attestation:
        now = super().check_writable(restores_base=restores_base, strategy=strategy)
        self._commit_version, self._raced = None, False  # this write's commits attest anew
        return now

    def _written_at(self, now: Attestation) -> bool:
        """Whether the write that just ended is all the engine holds since it began: its last
        commit attested the workers' epoch while still paused (`written_version`), and the
        epoch now is that one (another client's write after that commit moves it); and no
        commit of it found the epoch moved since the one before as it began (a write between
        the base commit and the adapter's, or between two base commits: a checkpoint reload
        and the ``modules_to_save`` copies sent after it). A base commit's own steps move the
        epoch, so a base commit after another reads it once paused, before its steps
        (`Commit.attest_before`)."""
        if self._raced:
            return False
        if self._commit_version is None:  # nothing attested inside a commit of this write
            return True
        return version_label(now.epoch) == base_label(self._commit_version)

    def _version_now(self) -> str | None:
        """The workers' epoch, the adapter writes they counted and, if LoRA is enabled, the
        adapter ids they hold (vLLM's own ``list_loras`` on every worker: the engine's listing,
        not this adapter's record)."""
        now = self.attest()
        ids = adapter_ids(self.control.rpc("list_loras")) if self.serves_lora else set()
        return version_label(now.epoch, ids, now.adapters)

    def mark_lost(self) -> None:
        """The base may be a mix of old and new layers (a write failed part-way): the tokens
        generated from now until the next completed base write are labelled `UNKNOWN_BASE`."""
        super().mark_lost()
        with contextlib.suppress(Exception):  # an engine that is gone generates nothing more
            self.control.label(UNKNOWN_BASE)

    def weights_spans(self, output: Any, index: int = 0) -> list[WeightsSpan] | None:
        """The base and adapter versions that produced each token of a finished
        ``RequestOutput`` of this engine (`control.weights_spans`)."""
        return weights_spans(output, index)

    #: The workers keep weightsync's ledger and restore what a failed write left unfinished
    #: (`Commit.attest`, `Commit.restore`); a stock server's do neither.
    _attests = True
    _restores = True

    def _paused_write(
        self,
        what: str,
        steps: Iterable[tuple[Any, ...]],
        *,
        base: bool = True,
        write: Callable[[], Any] | None = None,
    ) -> Committed:
        """Commit ``steps`` (a `Commit`; then ``write()``, a write only this side can make:
        a stream it sends) inside one pause, with the version read (`written_version`), the
        prefix-cache reset and resume; the control chooses where it runs (`Control.commit`:
        on the engine's side in one call where that saves round trips, `run_commit` here
        otherwise). The pause window is the one measured where the commit ran. See the module
        docstring for a failed commit (``base``: the steps write base weights)."""
        self._written_version = None
        commit = Commit(
            what,
            tuple(steps),
            base=base,
            lora=self.serves_lora,
            attest=self._attests,
            restore=self._restores,
            # a second base commit of this write: was anything written since the first?
            attest_before=base and self._attests and self._commit_version is not None,
        )
        try:
            if write is None:
                answer = self.control.commit(commit)
            else:
                answer = run_commit(self.control, commit, write)
        except EngineUnavailableError:  # no answer: the commit may have run, whole or not
            if base:
                self.mark_lost()
            raise
        timing.report("pause", answer.pause_s)
        self._committed_steps(commit.steps[: answer.done])
        error = answer.error
        if error is None:
            if answer.version is not None:
                if self._commit_version is not None:
                    # what the engine held as this commit began: the version after, for a
                    # commit that writes no base weights (it moves no epoch)
                    began = answer.version if not base else answer.before
                    if began is not None:
                        self._raced |= base_label(began) != base_label(self._commit_version)
                self._commit_version = answer.version
            self._written_version = answer.version
            return answer
        if base:  # a mix of old and new layers (or a broken engine): only a full restore
            self.mark_lost()
        if answer.recovery is None:  # restored and resumed
            raise error
        if isinstance(answer.recovery, EngineUnavailableError):  # gone: nothing to restore
            raise answer.recovery from error
        raise self._broken(what, error, answer.recovery) from error

    def _broken(
        self, what: str, error: BaseException, recovery: BaseException
    ) -> EngineBrokenError:
        """The error of a write whose recovery failed: the engine is left paused."""
        return EngineBrokenError(
            f"{what} failed ({error}) and restoring the engine's unfinished layers failed "
            f"too ({recovery}); the engine is left paused. Restart it."
        )

    def _committed_steps(self, steps: Iterable[tuple[Any, ...]]) -> None:
        """Follow the adapter loads and unloads a commit completed (all of its steps, or those
        before the one that failed): which adapter versions the engine holds, which it
        serves."""
        for kind, *args in steps:
            if kind == "unload_lora":
                self._resident = [(v, n) for v, n in self._resident if n != args[0]]
                if self._served == args[0]:
                    self._served = None
            elif kind == "load_lora":
                self._resident.append((self._loading, args[0]))
                self._served = args[0]

    def load_weights(self, buckets: Iterable[Bucket]) -> int:
        """Stage ``buckets`` (`stage_weights`) while the engine serves, then apply them in
        one `_paused_write`: a failure while staging leaves the engine untouched."""
        staged = self.stage_weights(buckets)
        try:
            return staged.apply() or 0
        finally:
            staged.drop()

    @property
    def stages_weights(self) -> bool:
        """Whether the transport stages (`Transport.stages`: tmpfs does, a stream does not)."""
        return self.transport.stages

    def stage_weights(self, buckets: Iterable[Bucket]) -> Staged:
        """`Transport.prepare` now, while the engine serves (a failure here leaves the engine
        untouched, and says so: `errors.untouched`); the returned apply commits what was
        staged and unloads the served adapter in one `_paused_write`: the stage's worker calls
        (`StagedCalls`) as the commit's steps, run on the engine's side where the control can,
        or, for a stage that is a stream this side sends, that send inside the pause."""
        try:
            staged = self.transport.prepare(self.rpc, buckets)
        except BaseException as error:
            errors.untouched(error)
            raise

        def commit() -> int:
            if isinstance(staged, StagedCalls):
                calls = [("rpc", method, kwargs) for method, kwargs in staged.calls]
                self._paused_write("load_weights", self._base_steps(calls))
                staged.applied()
            else:
                self._paused_write("load_weights", self._base_steps([]), write=staged.apply)
            return 1

        return Staged(commit, staged.drop, staged.discard)

    def reload_checkpoint(self, path: str | None = None) -> int:
        kwargs = {"path": path or ""}
        self._paused_write(
            "reload_checkpoint", self._base_steps([("rpc", "weightsync_reload_checkpoint", kwargs)])
        )
        return 1

    def _base_steps(self, steps: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """A base write's ``steps``, then the unload of the adapters the engine serves (inside
        the pause; a write that fails before loading anything leaves the adapter served, as
        the rest of what the engine served): vLLM resets its LoRA state on a reload but the
        server would load an adapter again from its folder on the next request by name,
        applying an old adapter to a new base (merged LoRA counted twice, ms-swift#8233).
        With no adapter of its own recorded, the engine's ``lora_name`` is unloaded too: an
        earlier client's."""
        if self.serves_lora:
            names = [name for _, name in self._resident] or [self.lora_name]
            steps = [*steps, *(("unload_lora", name) for name in names)]
        return steps

    def check_adapter(self, adapter: Adapter) -> None:
        lora = self._facts.lora
        if lora is None:
            raise AdapterError(
                "this vLLM engine was started without LoRA (--enable-lora), so it cannot serve "
                "an adapter; merge it instead (FullSync(lora='merge')) or restart the engine "
                "with LoRA enabled"
            )
        if adapter.rank > lora.max_rank:
            raise AdapterError(
                f"adapter {adapter.name!r} has rank {adapter.rank}, above this engine's "
                f"max_lora_rank={lora.max_rank}; restart it with "
                f"--max-lora-rank {adapter.rank} or more"
            )
        targets = {key.split(".lora_")[0].rsplit(".", 1)[-1] for key in adapter.tensors}
        unsupported = sorted(targets - set(lora.modules))
        if unsupported:
            raise AdapterError(
                f"adapter {adapter.name!r} targets {unsupported}, which this vLLM model cannot "
                f"apply LoRA to (it can: {list(lora.modules)}); merge the adapter instead "
                "(FullSync(lora='merge'))"
            )

    def load_adapter(self, adapter: Adapter) -> int:
        """Put the adapter in a new versioned folder and load it (`stage_adapter`, applied)."""
        staged = self.stage_adapter(adapter)
        try:
            return staged.apply() or 0
        finally:
            staged.drop()

    def stage_adapter(self, adapter: Adapter) -> Staged:
        """Put the adapter in a new versioned folder now, while the engine serves; the returned
        `Staged` loads it. With one version kept, the old one is unloaded by name and the new
        one loaded under the same name; old folders are deleted once two newer versions exist:
        a request admitted before a swap may still read its adapter's folder after it. With
        more, the new version is loaded under a name of its own, then the version that fell
        out of the window is unloaded and its folder deleted.

        The folder is written here (``adapter_dir``, or a scratch folder of this host) unless the
        transport carries adapters to the engine's host (gloo, and no ``adapter_dir``). A
        failure while the adapter travels or is checked (a refused frame, a tag that differs)
        comes before any call that loads: it is raised marked `errors.untouched`, and the
        engine goes on serving the adapter it served, under its name. A folder written here
        and never loaded is removed when the stage is dropped."""
        self.check_adapter(adapter)
        self._version += 1
        version = self._version
        try:
            path, local = self._put_adapter(adapter)
        except BaseException as error:
            errors.untouched(error)
            raise
        loaded = False

        def apply() -> int:
            nonlocal loaded
            kept = self.adapter_versions
            name = self.lora_name if kept == 1 else f"{self.lora_name}-v{version}"
            # One version kept: the old one unloaded first, the new loaded under its name; more:
            # the new loaded first, then the versions that fell out of the window unloaded.
            old = [n for _, n in self._resident]
            first = [("unload_lora", name)] if kept == 1 else []
            evicted = [] if kept == 1 else old[: max(0, len(old) + 1 - kept)]
            steps = [*first, ("load_lora", name, path), *(("unload_lora", n) for n in evicted)]
            self._loading = version
            loaded = True  # from here the engine may read the folder: kept, and counted
            if local:
                self._versions.append(Path(path))
            try:
                self._paused_write("load_adapter", steps, base=False)
            finally:
                while len(self._versions) > max(kept, 2):
                    shutil.rmtree(self._versions.pop(0), ignore_errors=True)
            self.adapter_path = path
            return 1

        def drop() -> None:
            if local and not loaded:
                shutil.rmtree(path, ignore_errors=True)

        return Staged(apply, drop)

    def _put_adapter(self, adapter: Adapter) -> tuple[str, bool]:
        """The adapter's bytes where the engine's LoRA loader reads them: its folder's path,
        and whether that folder is on this host (written here) rather than the engine's."""
        if self._adapter_dir is None:
            path = self.transport.put_adapter(
                self.rpc,
                self._version,
                adapter.tensors,
                adapter.config,
                keep=max(self.adapter_versions, 2),
            )
            self._remote_adapters |= path is not None
            if path is not None:
                return path, False
        folder = self._adapter_root / f"adapter-v{self._version:06d}"
        try:
            with timing.span("serialize"):
                fmt.write_adapter(folder, adapter.tensors.items(), adapter.config)
            if self.transport.tagged:
                self._check_folder(folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)  # no later version keeps count of it
            raise
        return str(folder), True

    def _check_folder(self, folder: Path) -> None:
        """Have the workers check the files of ``folder`` against tags made here before vLLM's
        own loader reads them (a `BytesRejectedError` if they differ). vLLM reads the folder
        itself after the check: the owner-only modes (``wire.scratch``) are what keep others
        from rewriting it in between."""
        signer = Signer()
        files = sorted(p.name for p in folder.iterdir())
        tags = [sign_file(signer, folder / f) for f in files]
        kwargs = {"folder": str(folder), "files": files, "key": signer.key_hex, "tags": tags}
        self.rpc("weightsync_check_files", kwargs)

    def greedy_batch(
        self, prompts: list[list[int]], max_tokens: int
    ) -> list[tuple[list[int], list[float]]]:
        return self.control.generate(prompts, max_tokens, self.served_adapter)

    def score_batch(self, prompts: list[list[int]], top_k: int) -> list[list[dict[int, float]]]:
        return self.control.score(prompts, top_k, self.served_adapter)

    # --- lifecycle ----------------------------------------------------------------------------

    def _attest(self, since: Hashable | None) -> Attestation:
        """From the workers' ledgers (``ledger.py``)."""
        try:
            outcomes = self.rpc(
                "weightsync_attest",
                {"since": since_arg(since), "asleep": self.control.is_sleeping()},
            )
        except Exception as e:
            if "weightsync_attest" not in str(e):
                raise
            raise RuntimeError(
                "the engine's worker extension does not attest its epoch (an older weightsync in "
                "the engine?): restart it with this weightsync's worker extension"
            ) from e
        return attestation([o.value for o in outcomes])

    def _engine_sleep(self, level: int) -> None:
        self.control.sleep(level)

    def _engine_wake(self, tags: list[str] | None) -> None:
        self.control.wake_up(tags)

    def close(self) -> None:
        """Release the transport and the adapter folders this engine created (here, and on
        the engine's host if the transport carried them there)."""
        if self._remote_adapters:
            with contextlib.suppress(Exception):  # a server gone took its folders with it
                self.rpc("weightsync_drop_adapters")
            self._remote_adapters = False
        self.transport.close()
        if self._adapter_dir is None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)


@register
class VLLMMultiprocEngine(RemoteVLLMEngine):
    """A ``vllm.LLM`` with vLLM's default multiprocess engine core (tensor parallel or not).

    Tensors cannot travel in ``collective_rpc`` arguments there (they arrive as lists), so the
    bytes go through a transport; create the ``LLM`` with
    ``worker_extension_cls=weightsync.engines.WORKER_EXTENSION``.
    """

    name = "vllm-multiproc"

    @classmethod
    def accepts(cls, obj: Any) -> bool:
        if not (type(obj).__module__.startswith("vllm") and hasattr(obj, "llm_engine")):
            return False
        from vllm.v1.engine.core_client import InprocClient

        return not isinstance(obj.llm_engine.engine_core, InprocClient)

    def __init__(self, llm: Any, *, transport: str | Transport = "tmpfs", **kwargs: Any) -> None:
        super().__init__(LLMControl(llm), transport=transport, **kwargs)
        self.llm = llm
