"""A vLLM engine in other processes: a ``vllm serve`` server or a multiprocess ``vllm.LLM``.

One engine class, `RemoteVLLMEngine`, with two pluggable halves:

- a *control plane* (``control.py``: `HTTPControl` for a server, `LLMControl` for a
  multiprocess ``LLM``): pause/resume, prefix-cache reset, adapters by name, generation, sleep,
  and ``collective_rpc`` into weightsync's worker extension (``in_engine/extension.py``);
- a *transport* for the bytes (``transports/``): tmpfs files, a gloo group, vLLM's
  weight-transfer API.

Every write: stage what the transport can stage while the engine serves (tmpfs: every bucket's
file, written and tagged), then pause (in-flight requests are kept, not dropped), apply, reset
the prefix cache, resume; the pause window is reported (`SyncReport.pause_seconds`). A server
started with weightsync's pause lease (``server_lease.py``) ends a pause nobody completes by
itself, so a trainer killed inside it does not leave the server stuck. If the write fails
part-way the workers have already restored their unfinished layers, but the layers they had
finished keep their new weights: a mix. They report those layers, and a server with that
middleware then refuses to generate (HTTP 503, for every client; `EngineFencedError` here) until
a full sync completes; a server without it, and a multiprocess ``LLM``, serve the mix. The engine
is resumed, the base is marked lost (only a full restore may follow) and the error is raised.
If even that recovery fails the engine is left paused -- never resume a broken engine -- and
`EngineBrokenError` says so; an engine that no longer answers at all (a dead Ray actor or
engine core) raises `EngineUnavailableError`.

The engine's facts (`EngineFacts`) come from the worker extension, read from the model vLLM
built, not from the caller; a server without the extension is a `StockServerEngine`
(``stock.py``), which overrides what the extension does here.

Which weights produced a rollout: `RemoteVLLMEngine.weights_version`, a version the engine
attests, never one counted on the trainer's side -- the workers' ledger epoch (moved by every
sleep, wake, reload and weight write, by anyone) and the adapter ids the workers hold (adapter
loads do not move the epoch). Each completed write also records the version attested at its end,
while the engine is still paused (`RemoteVLLMEngine.written_version`): that is the version of
what the write put there, read once, and what `weightsync.Syncer` reports, so a sync costs no
second round of calls for its version.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Hashable, Iterable
from functools import partial
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
    Control,
    LLMControl,
    WeightsSpan,
    adapter_ids,
    adapter_window,
    attestation,
    base_label,
    since_arg,
    version_label,
    weights_spans,
)
from .transports import Transport, make_transport


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
        self._written_version: str | None = None
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
        version (None: none)."""
        return self._served

    @property
    def adapter_version(self) -> int | None:
        """The version of the served adapter (adapter loads counted by this engine adapter;
        the key of `resident_adapters`); None: none."""
        return self._resident[-1][0] if self._served is not None and self._resident else None

    @property
    def resident_adapters(self) -> dict[int, str]:
        """The name of each adapter version kept loaded (see ``adapter_versions``), by
        version, oldest first."""
        return dict(self._resident)

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

    def _version_now(self) -> str | None:
        """The workers' epoch, the adapter writes they counted and, if LoRA is enabled, the
        adapter ids they hold (vLLM's own ``list_loras`` on every worker: the engine's listing,
        not this adapter's record)."""
        now = self.attest()
        ids = adapter_ids(self.control.rpc("list_loras")) if self.serves_lora else set()
        return version_label(now.epoch, ids, now.adapters)

    def _written(self, version: str | None) -> None:
        """Called at the end of every completed write, while the engine is still paused, with
        the version it attested then: vLLM's weight-version label becomes its base part
        (`control.base_label`), before the engine resumes, so the tokens generated after the
        write carry it. An adapter write leaves the label as it was: vLLM's label is
        engine-wide, and each request keeps the adapter it was admitted with
        (`control.weights_spans` adds it)."""
        if version is not None:
            self.control.label(base_label(version))

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

    def _paused_write(self, what: str, write: Callable[[], Any], *, base: bool = True) -> None:
        """Pause, ``write()``, record the version it left (`written_version`), reset the prefix
        cache, resume; see the module docstring for what happens when ``write`` fails
        (``base``: it writes base weights)."""
        self._written_version = None
        with timing.span("pause"):
            self.control.pause()
            try:
                write()
                self._written_version = self._version_now()
                self._written(self._written_version)
            except BaseException as error:
                self._recover(what, error, base=base)
                raise
            self.control.reset_prefix_cache()
            self.control.resume()

    def _recover(self, what: str, error: BaseException, *, base: bool) -> None:
        """After ``write`` failed in `_paused_write`: restore the unfinished layers (idempotent:
        the workers did it already), reset the prefix cache and resume serving what the engine
        holds; the caller raises ``error`` then. If the engine cannot be restored it is left
        paused and `EngineBrokenError` is raised instead."""
        try:
            self._abandon()
            self.control.reset_prefix_cache()
        except EngineUnavailableError:  # gone (a dead actor or core): nothing to restore
            self.mark_lost()
            raise
        except Exception as recovery:  # noqa: BLE001 (any failure here: the engine is broken)
            raise EngineBrokenError(
                f"{what} failed ({error}) and restoring the engine's unfinished layers failed "
                f"too ({recovery}); the engine is left paused. Restart it."
            ) from error
        if base:  # a mix of old and new layers: only a full restore may follow
            self.mark_lost()
        self.control.resume()

    def _abandon(self) -> None:
        """Have the workers restore the layers a failed write left unfinished."""
        self.rpc("weightsync_abandon")

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
        untouched, and says so: `errors.untouched`); the returned apply applies what was staged
        and unloads the served adapter in one `_paused_write` (`_base_written`)."""
        try:
            staged = self.transport.prepare(self.rpc, buckets)
        except BaseException as error:
            errors.untouched(error)
            raise

        def commit() -> int:
            self._paused_write("load_weights", lambda: self._base_written(staged.apply))
            return 1

        return Staged(commit, staged.drop, staged.discard)

    def reload_checkpoint(self, path: str | None = None) -> int:
        reload = partial(self.rpc, "weightsync_reload_checkpoint", {"path": path or ""})
        self._paused_write("reload_checkpoint", lambda: self._base_written(reload))
        return 1

    def _base_written(self, write: Callable[[], Any]) -> None:
        """``write()`` the base, then unload the served adapter (`_forget_adapter`), inside the
        pause: a write that fails before loading anything leaves the adapter served, as the
        rest of what the engine served."""
        write()
        self._forget_adapter()

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
        """Put the adapter in a new versioned folder and load it. With one version kept, the
        old one is unloaded by name and the new one loaded under the same name; old folders are
        deleted once two newer versions exist: a request admitted before a swap may still read
        its adapter's folder after it. With more, the new version is loaded under a name of
        its own, then the version that fell out of the window is unloaded and its folder
        deleted.

        The folder is written here (``adapter_dir``, or a scratch folder of this host) unless the
        transport carries adapters to the engine's host (gloo, and no ``adapter_dir``)."""
        self.check_adapter(adapter)
        self._version += 1
        path = None
        if self._adapter_dir is None:
            path = self.transport.put_adapter(
                self.rpc,
                self._version,
                adapter.tensors,
                adapter.config,
                keep=max(self.adapter_versions, 2),
            )
            self._remote_adapters |= path is not None
        local = path is None
        if local:
            folder = self._adapter_root / f"adapter-v{self._version:06d}"
            with timing.span("serialize"):
                fmt.write_adapter(folder, adapter.tensors.items(), adapter.config)
            if self.transport.tagged:
                self._check_folder(folder)
            path = str(folder)
        assert path is not None

        version = self._version
        kept = self.adapter_versions
        name = self.lora_name if kept == 1 else f"{self.lora_name}-v{version}"

        def swap() -> None:
            if kept == 1:
                self._served = None
                self.control.unload_lora(name)
                self._resident.clear()
            self.control.load_lora(name, path)
            self._served = name
            self._resident.append((version, name))
            while len(self._resident) > kept:
                self.control.unload_lora(self._resident.pop(0)[1])

        self._paused_write("load_adapter", swap, base=False)
        self.adapter_path = path
        if local:
            self._versions.append(Path(path))
            while len(self._versions) > max(kept, 2):
                shutil.rmtree(self._versions.pop(0), ignore_errors=True)
        return 1

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

    def _forget_adapter(self) -> None:
        """Unload the served adapter before a base write: vLLM resets its LoRA state on a reload
        but the server would load it again from its folder on the next request by name,
        applying an old adapter to a new base (merged LoRA counted twice, ms-swift#8233)."""
        self._served = None
        if self.serves_lora:
            names = [name for _, name in self._resident] or [self.lora_name]
            for name in names:
                self.control.unload_lora(name)
        self._resident.clear()

    def greedy_batch(
        self, prompts: list[list[int]], max_tokens: int
    ) -> list[tuple[list[int], list[float]]]:
        return self.control.generate(prompts, max_tokens, self._served)

    def score_batch(self, prompts: list[list[int]], top_k: int) -> list[list[dict[int, float]]]:
        return self.control.score(prompts, top_k, self._served)

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
