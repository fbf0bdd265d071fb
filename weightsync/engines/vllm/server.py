"""vLLM engines in other processes: a ``vllm serve`` server, a multiprocess ``vllm.LLM``.

One engine class, `RemoteVLLMEngine`, with two pluggable halves:

- a *control plane* (`HTTPControl` for a server, `LLMControl` for a multiprocess
  ``LLM``): pause/resume, prefix-cache reset, adapter load/unload by name, generation, sleep,
  and ``collective_rpc`` into weightsync's worker extension (``worker.py``);
- a *transport* for the bytes (``transport.py``): tmpfs files or a gloo process group.

Every write: pause (in-flight requests are kept, not dropped), write, reset the prefix cache,
resume. If the write fails part-way the workers have already restored their unfinished layers,
so the engine serves a mix of old and new weights: it is resumed, the base is marked unsynced
(only a full restore may follow) and the error is raised. If even that recovery fails the
engine is left paused -- never resume a broken engine -- and `EngineBrokenError` says so.

The engine's facts (dtype, expected weights, tied names, LoRA rank limit and modules) come from
the worker extension, read from the model vLLM built, not from the caller.

A *stock* server (no worker extension) is reached too, with ``transport="tmpfs"`` only: its facts
come from its dev-mode ``/server_info`` and the model folder it serves, and bytes go through
vLLM's own ``reload_weights(weights_path=...)``. Every byte is written to tmpfs before the server
is touched; but if vLLM's reload then fails, nothing can restore its unfinished layers, so the
server is left paused (`EngineBrokenError`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

# EngineBrokenError is defined with every other error (distributed.sync raises errors by their
# class name in weightsync.errors); it stays importable from here, where it used to live.
from ...errors import (
    AdapterError,
    EngineBrokenError,
    EngineUnavailableError,
    NoCheckpointError,
    WeightSyncError,
)
from ...plan import Adapter, Bucket
from ..base import Attestation, Engine, register
from . import checkpoint as ckpt
from .inprocess import attestation, since_arg
from .transport import TmpfsTransport, Transport, _tmpfs, make_transport
from .worker import shared_parameter_names, tied_weights

#: What to pass as ``--worker-extension-cls`` / ``LLM(worker_extension_cls=...)``.
WORKER_EXTENSION = "weightsync.engines.vllm.worker.WeightsyncWorker"


def _token_id(key: str) -> int:
    """A logprobs key of a server without a tokenizer: ``"123"`` or ``"token_id:123"``."""
    return int(key.rsplit(":", 1)[-1])


class Control(ABC):
    """The calls a remote engine needs, whatever carries them."""

    @abstractmethod
    def rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run a worker(-extension) method on every worker; their results in rank order."""

    @abstractmethod
    def pause(self) -> None: ...

    @abstractmethod
    def resume(self) -> None: ...

    @abstractmethod
    def reset_prefix_cache(self) -> None: ...

    @abstractmethod
    def load_lora(self, name: str, path: str) -> None: ...

    @abstractmethod
    def unload_lora(self, name: str) -> None: ...

    @abstractmethod
    def generate(
        self, prompts: list[list[int]], max_tokens: int, lora: str | None
    ) -> list[tuple[list[int], list[float]]]:
        """Greedy-decode each prompt (with the adapter loaded under ``lora``, if given)."""

    @abstractmethod
    def score(
        self, prompts: list[list[int]], top_k: int, lora: str | None
    ) -> list[list[dict[int, float]]]:
        """Prompt logprobs (see `Engine.score_batch`), with the adapter under ``lora``."""

    @abstractmethod
    def is_sleeping(self) -> bool: ...

    @abstractmethod
    def sleep(self, level: int) -> None: ...

    @abstractmethod
    def wake_up(self, tags: list[str] | None) -> None: ...


class HTTPControl(Control):
    """A ``vllm serve`` server started with ``VLLM_SERVER_DEV_MODE=1`` (the ``/collective_rpc``,
    ``/pause``, ``/sleep`` routes), ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` if it serves LoRA,
    and ``--worker-extension-cls weightsync.engines.vllm.worker.WeightsyncWorker``."""

    def __init__(self, base_url: str, *, timeout_s: float = 600.0) -> None:
        import requests

        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._requests = requests
        self._session = requests.Session()
        self.model = self._call("GET", "/v1/models")["data"][0]["id"]

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        """One HTTP call; its JSON (or text) answer.

        Raises:
            EngineUnavailableError: the server refuses the connection, resets it twice, or does
                not answer within ``timeout_s`` (a server that is gone, restarting, or hung).
            RuntimeError: the server answered with an HTTP error.
        """
        try:
            try:
                r = self._session.request(
                    method, self.base_url + path, timeout=self.timeout_s, **kwargs
                )
            except self._requests.ConnectionError:
                # A keep-alive connection the server reset after an error: retry once, fresh.
                self._session = self._requests.Session()
                r = self._session.request(
                    method, self.base_url + path, timeout=self.timeout_s, **kwargs
                )
        except (self._requests.ConnectionError, self._requests.Timeout) as err:
            self._session = self._requests.Session()
            timed_out = isinstance(err, self._requests.Timeout)
            state = (
                f"no answer within {self.timeout_s:g} s; the server is hung or overloaded"
                if timed_out
                else "connection refused; the server is gone or restarting"
            )
            raise EngineUnavailableError(
                f"the vLLM server at {self.base_url} does not answer ({method} {path}): {state}. "
                f"Nothing more was sent to it. ({type(err).__name__}: {err})"
            ) from err
        if r.status_code >= 400:
            self._session = self._requests.Session()
            raise RuntimeError(
                f"{method} {self.base_url}{path} -> HTTP {r.status_code}: {r.text[:2000]}"
            )
        if not r.content:
            return None
        try:
            return r.json()
        except ValueError:
            return r.text  # the LoRA routes answer in plain text

    def server_info(self) -> dict[str, Any]:
        """The server's ``VllmConfig`` as JSON (dev mode)."""
        return self._call("GET", "/server_info", params={"config_format": "json"})["vllm_config"]

    def rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        body = {"method": method, "kwargs": kwargs or {}}
        return (self._call("POST", "/collective_rpc", json=body) or {}).get("results", [])

    def pause(self) -> None:
        self._call("POST", "/pause", params={"mode": "keep"})

    def resume(self) -> None:
        self._call("POST", "/resume")

    def reset_prefix_cache(self) -> None:
        self._call("POST", "/reset_prefix_cache")

    def load_lora(self, name: str, path: str) -> None:
        # Never load_inplace over HTTP: the server then re-reads the adapter from disk on every
        # decode step, and deleting its folder kills the server (measured, vLLM 0.32).
        self._call("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

    def unload_lora(self, name: str) -> None:
        loaded = [m["id"] for m in self._call("GET", "/v1/models")["data"]]
        if name in loaded:  # loaded by us, or by an earlier client of this server
            self._call("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    def generate(
        self, prompts: list[list[int]], max_tokens: int, lora: str | None
    ) -> list[tuple[list[int], list[float]]]:
        body = {
            "model": lora or self.model,
            "prompt": [list(p) for p in prompts],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        choices = sorted(
            self._call("POST", "/v1/completions", json=body)["choices"], key=lambda c: c["index"]
        )
        return [(list(c["token_ids"]), list(c["logprobs"]["token_logprobs"])) for c in choices]

    def score(
        self, prompts: list[list[int]], top_k: int, lora: str | None
    ) -> list[list[dict[int, float]]]:
        body = {
            "model": lora or self.model,
            "prompt": [list(p) for p in prompts],
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": top_k,
            "return_tokens_as_token_ids": True,
        }
        choices = sorted(
            self._call("POST", "/v1/completions", json=body)["choices"], key=lambda c: c["index"]
        )
        return [
            [
                {_token_id(k): v["logprob"] for k, v in pos.items()}
                for pos in c["prompt_logprobs"][1:]
            ]
            for c in choices
        ]

    def is_sleeping(self) -> bool:
        return bool(self._call("GET", "/is_sleeping")["is_sleeping"])

    def sleep(self, level: int) -> None:
        self._call("POST", "/sleep", params={"level": level, "mode": "keep"})

    def wake_up(self, tags: list[str] | None) -> None:
        self._call("POST", "/wake_up", params=[("tags", t) for t in tags or []])


class LLMControl(Control):
    """A ``vllm.LLM`` with its default multiprocess engine core (any tensor parallel size),
    created with ``worker_extension_cls=WORKER_EXTENSION``. Its ``generate`` is synchronous, so
    no request is in flight while the trainer (the same thread) writes: pausing is not needed.

    Every call raises `EngineUnavailableError` once the engine core died (vLLM's
    ``EngineDeadError``): a dead core never comes back, the ``LLM`` must be created again."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._loras: dict[str, Any] = {}
        self._next_id = 1

    @contextlib.contextmanager
    def _answering(self) -> Iterator[None]:
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            yield
        except EngineDeadError as err:
            model = self.llm.llm_engine.vllm_config.model_config.model
            raise EngineUnavailableError(
                f"the multiprocess vLLM LLM on {model} does not answer: its engine core died "
                f"({err}); create a new LLM (and a new engine adapter for it)"
            ) from err

    def rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        with self._answering():
            return self.llm.collective_rpc(method, kwargs=kwargs or {})

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def reset_prefix_cache(self) -> None:
        with self._answering():
            self.llm.reset_prefix_cache()

    def load_lora(self, name: str, path: str) -> None:
        from vllm.lora.request import LoRARequest

        with self._answering():
            # A fresh id per version (the LLM's add_lora keeps an adapter already loaded under
            # an id), never one another adapter of the LLM holds: loading under it would
            # replace the user's own adapter (vLLM's usual example id is 1).
            loaded = self.llm.llm_engine.list_loras()
            while self._next_id in loaded:
                self._next_id += 1
            request = LoRARequest(name, self._next_id, path)
            self._next_id += 1
            self.llm.llm_engine.add_lora(request)
        self._loras[name] = request

    def unload_lora(self, name: str) -> None:
        request = self._loras.pop(name, None)
        if request is not None:
            with self._answering():
                self.llm.llm_engine.remove_lora(request.lora_int_id)

    def generate(
        self, prompts: list[list[int]], max_tokens: int, lora: str | None
    ) -> list[tuple[list[int], list[float]]]:
        from .inprocess import greedy_generate

        with self._answering():
            return greedy_generate(
                self.llm, prompts, max_tokens, self._loras[lora] if lora else None
            )

    def score(
        self, prompts: list[list[int]], top_k: int, lora: str | None
    ) -> list[list[dict[int, float]]]:
        from .inprocess import score_prompts

        with self._answering():
            return score_prompts(self.llm, prompts, top_k, self._loras[lora] if lora else None)

    def is_sleeping(self) -> bool:
        with self._answering():
            return bool(self.llm.llm_engine.is_sleeping())

    def sleep(self, level: int) -> None:
        with self._answering():
            self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None) -> None:
        with self._answering():
            self.llm.wake_up(tags=tags)


class RemoteVLLMEngine(Engine):
    """A vLLM engine in other processes, reached through ``control``, bytes via ``transport``.

    Args:
        control: the control plane (`HTTPControl`, `LLMControl`).
        transport: ``"tmpfs"`` (same host), ``"gloo"`` (any host), or a
            `Transport`.
        adapter_dir: where adapter versions are written; the engine must read it at the same
            path. Defaults to a fresh ``/dev/shm/weightsync-*`` folder, removed by `close`, or,
            with the gloo transport, a folder on the engine's host the adapters are sent to.
        lora_name: the name the served adapter is loaded under (requests use it as ``model``).
        exclusive: for a stock server (no worker extension, so no attested epoch): the caller
            owns it and every sleep goes through this adapter (`sleep`) or is reported
            (`mark_asleep`), so an adapter-only sync may follow a sync. Without it a stock
            server's base counts as lost at every sync (a full sync each time). Ignored when
            the engine attests its epoch.
    """

    name = "vllm-remote"

    def __init__(
        self,
        control: Control,
        *,
        transport: str | Transport = "tmpfs",
        adapter_dir: str | None = None,
        lora_name: str = "weightsync",
        exclusive: bool = False,
    ) -> None:
        super().__init__()
        self.control = control
        self.exclusive = exclusive
        self.facts: dict[str, Any] = self._read_facts(transport)
        #: No worker extension: writes go through vLLM's own ``reload_weights`` (tmpfs only).
        self.stock = bool(self.facts.get("stock"))
        self._expected = {k: tuple(v) for k, v in self.facts["weights"].items()}
        self.transport = make_transport(transport)
        self.transport.connect(self._rpc, int(self.facts["world_size"]))
        self._adapter_root = Path(
            adapter_dir or tempfile.mkdtemp(prefix="weightsync-", dir=_tmpfs())
        )
        self._remove_adapter_root = (
            weakref.finalize(self, shutil.rmtree, str(self._adapter_root), True)
            if adapter_dir is None
            else None
        )
        self._adapter_dir = adapter_dir
        self.lora_name = lora_name
        #: Where the engine read the served adapter from (on its own host).
        self.adapter_path: str | None = None
        self._remote_adapters = False  # the workers wrote adapter folders: drop them on close
        self._served: str | None = None  # the lora name requests use, None: no adapter
        self._versions: list[Path] = []  # adapter folders the server may still read, oldest first
        self._version = 0
        self._attest(None)  # install the workers' ledger now (asleep already: harm 2)

    def _read_facts(self, transport: str | Transport) -> dict[str, Any]:
        """What the engine loads and serves, from the worker extension."""
        try:
            return self.control.rpc("weightsync_facts")[0]
        except EngineUnavailableError:
            raise  # an engine that is gone, not one without the extension
        except Exception as e:
            raise RuntimeError(
                "the engine's workers do not answer weightsync_facts: start it with the worker "
                f"extension (--worker-extension-cls {WORKER_EXTENSION}, or "
                f"LLM(worker_extension_cls=...)) and, for a server, VLLM_SERVER_DEV_MODE=1: {e}"
            ) from e

    def _rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``control.rpc``, raising the errors the workers return (see ``worker.py``)."""
        results = self.control.rpc(method, kwargs)
        errors = [
            f"worker {i}: {r['weightsync_error']}"
            for i, r in enumerate(results)
            if isinstance(r, dict) and "weightsync_error" in r
        ]
        if errors:
            raise RuntimeError(f"{method} failed in the engine's workers: " + "; ".join(errors))
        return results

    # --- what the engine holds -------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.facts["dtype"])

    @property
    def expected_weights(self) -> Mapping[str, tuple[int, ...]]:
        return self._expected

    @property
    def shared_weights(self) -> list[tuple[str, ...]]:
        return [tuple(group) for group in self.facts["shared"]]

    @property
    def serves_lora(self) -> bool:
        return self.facts["lora"] is not None

    def checkpoint_head(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Read from the engine's checkpoint folder when this host sees it at the same path
        (same host or a shared filesystem); ``{}`` otherwise."""
        folder = self.facts["checkpoint"]
        if not os.path.isdir(folder):
            return {}
        files = self.facts["files"]  # the files a reload of the engine's checkpoint reads
        if not files:
            raise NoCheckpointError(
                f"this engine was started from {folder}, which holds no weight files "
                "(load_format='dummy'): there is no checkpoint to reload. Use FullSync, or "
                "ReloadWeights(snapshot_dir=...) to reload the trainer's current weights."
            )
        return ckpt.heads(files, names)

    @property
    def served_adapter(self) -> str | None:
        """The name requests must use as ``model`` to get the synced adapter (None: none)."""
        return self._served

    # --- writing ------------------------------------------------------------------------------

    def _write(self, what: str, write: Callable[[], Any], *, base: bool = True) -> None:
        """Pause, ``write()``, reset the prefix cache, resume; see the module docstring for
        what happens when ``write`` fails (``base``: it writes base weights)."""
        self.control.pause()
        try:
            write()
        except BaseException as error:
            if self.stock and base:
                self.mark_lost()
                raise EngineBrokenError(
                    f"{what} failed in vLLM's own reload_weights ({error}); this server has no "
                    "weightsync worker extension, so its unfinished layers cannot be restored "
                    "and it is left paused. Restart it, and start it with --worker-extension-cls "
                    f"{WORKER_EXTENSION} to have failed writes recovered."
                ) from error
            try:
                if not self.stock:  # idempotent; the workers did it already
                    self.control.rpc("weightsync_abandon")
                self.control.reset_prefix_cache()
            except Exception as recovery:  # noqa: BLE001 (any failure here: the engine is broken)
                raise EngineBrokenError(
                    f"{what} failed ({error}) and restoring the engine's unfinished layers failed "
                    f"too ({recovery}); the engine is left paused. Restart it."
                ) from error
            if base:  # a mix of old and new layers: only a full restore may follow
                self.mark_lost()
            self.control.resume()
            raise
        self.control.reset_prefix_cache()
        self.control.resume()

    def load_weights(self, buckets: Iterable[Bucket]) -> int:
        if self.stock:
            assert isinstance(self.transport, TmpfsTransport)  # checked in _read_facts
            # Every byte is on tmpfs before the server is touched, each tied tensor under all
            # its names: vLLM's reload restores lm_head apart from embed_tokens.
            self._stock_reload("load_weights", self.transport.stage(buckets, aliases=False))
            return 1
        self._forget_adapter()
        self._write("load_weights", lambda: self.transport.send(self._rpc, buckets))
        return 1

    def reload_checkpoint(self, path: str | None = None) -> int:
        if self.stock:
            self._stock_reload(
                "reload_checkpoint", self._stage_folder(path or self.facts["checkpoint"])
            )
            return 1
        self._forget_adapter()
        self._write(
            "reload_checkpoint",
            lambda: self._rpc("weightsync_reload_checkpoint", {"path": path or ""}),
        )
        return 1

    def _stock_reload(self, what: str, folder: Path) -> None:
        """A write through vLLM's own ``reload_weights`` of a staged ``folder`` in every worker;
        the folder is removed after, whatever happens."""
        kwargs = {"weights_path": str(folder), "is_checkpoint_format": True}
        try:
            self._forget_adapter()
            self._write(what, lambda: self._rpc("reload_weights", kwargs))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _stage_folder(self, source: str) -> Path:
        """A tmpfs folder that vLLM's ``reload_weights`` reads as the weights of ``source``
        with every tied tensor under all its names: links to the files vLLM's loader picks
        from ``source``, plus one file with the names ``source`` stores once (a tied checkpoint
        reloaded as it is leaves lm_head stale)."""
        from safetensors import safe_open
        from safetensors.torch import save_file

        assert isinstance(self.transport, TmpfsTransport)
        files = _weight_files(source)
        folder = self.transport.stage([])
        for f in files:
            (folder / os.path.basename(f)).symlink_to(os.path.abspath(f))
        where = {name: f for f in files for name in ckpt.shapes([f])}
        extra: dict[str, torch.Tensor] = {}
        for group in self.shared_weights:
            stored = [n for n in group if n in where]
            if stored:
                with safe_open(where[stored[0]], framework="pt") as h:
                    tensor = h.get_tensor(stored[0])
                extra.update({n: tensor.clone() for n in group if n not in where})
        if extra:
            save_file(extra, str(folder / "weightsync-tied.safetensors"))
        return folder

    def check_adapter(self, adapter: Adapter) -> None:
        lora = self.facts["lora"]
        if lora is None:
            raise AdapterError(
                "this vLLM engine was started without LoRA (--enable-lora), so it cannot serve "
                "an adapter; merge it instead (FullSync(lora='merge')) or restart the engine "
                "with LoRA enabled"
            )
        if adapter.rank > lora["max_lora_rank"]:
            raise AdapterError(
                f"adapter {adapter.name!r} has rank {adapter.rank}, above this engine's "
                f"max_lora_rank={lora['max_lora_rank']}; restart it with "
                f"--max-lora-rank {adapter.rank} or more"
            )
        targets = {key.split(".lora_")[0].rsplit(".", 1)[-1] for key in adapter.tensors}
        unsupported = sorted(targets - set(lora["modules"]))
        if unsupported:
            raise AdapterError(
                f"adapter {adapter.name!r} targets {unsupported}, which this vLLM model cannot "
                f"apply LoRA to (it can: {lora['modules']}); merge the adapter instead "
                "(FullSync(lora='merge'))"
            )

    def load_adapter(self, adapter: Adapter) -> int:
        """Put the adapter in a new versioned folder, then unload the old one by name and load
        the new one under the same name. Old folders are deleted once two newer versions exist:
        a request admitted before a swap may still read its adapter's folder after it.

        The folder is written here (``adapter_dir``, or this host's tmpfs) unless the transport
        carries adapters to the engine's host (gloo, and no ``adapter_dir``)."""
        import json

        from safetensors.torch import save_file

        self.check_adapter(adapter)
        self._version += 1
        config = json.dumps(adapter.config, default=str)
        tensors = {k: v.contiguous() for k, v in adapter.tensors.items()}
        path = None
        if self._adapter_dir is None:
            path = self.transport.put_adapter(self._rpc, self._version, tensors, config)
            self._remote_adapters |= path is not None
        local = path is None
        if local:
            folder = self._adapter_root / f"adapter-v{self._version:06d}"
            folder.mkdir(parents=True)
            save_file(tensors, str(folder / "adapter_model.safetensors"))
            (folder / "adapter_config.json").write_text(config)
            path = str(folder)
        assert path is not None

        def swap() -> None:
            self._served = None
            self.control.unload_lora(self.lora_name)
            self.control.load_lora(self.lora_name, path)
            self._served = self.lora_name

        self._write("load_adapter", swap, base=False)
        self.adapter_path = path
        if local:
            self._versions.append(Path(path))
            while len(self._versions) > 2:
                shutil.rmtree(self._versions.pop(0), ignore_errors=True)
        return 1

    def _forget_adapter(self) -> None:
        """Unload the served adapter before a base write: vLLM resets its LoRA state on a reload
        but the server would load it again from its folder on the next request by name,
        applying an old adapter to a new base (merged LoRA counted twice, ms-swift#8233)."""
        self._served = None
        if self.serves_lora:
            self.control.unload_lora(self.lora_name)

    def greedy_batch(
        self, prompts: list[list[int]], max_tokens: int
    ) -> list[tuple[list[int], list[float]]]:
        return self.control.generate(prompts, max_tokens, self._served)

    def score_batch(self, prompts: list[list[int]], top_k: int) -> list[list[dict[int, float]]]:
        return self.control.score(prompts, top_k, self._served)

    # --- lifecycle ----------------------------------------------------------------------------

    def _attest(self, since: Hashable | None) -> Attestation:
        """From the workers' ledgers (``ledger.py``). A stock server keeps none: it can say
        only whether it sleeps now (a bool, no level, also true while paused), so its base
        counts as lost at any time -- unless the caller owns it (``exclusive``), when the
        sleeps made through this adapter and those reported are taken as all there were."""
        if self.stock:
            asleep = {"weights", "kv_cache"} if self.control.is_sleeping() else set()
            return Attestation(
                None, frozenset(asleep | self._own_asleep), 0 if self.exclusive else 2
            )
        try:
            reports = self._rpc(
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
        return attestation(reports)

    def _engine_sleep(self, level: int) -> None:
        self.control.sleep(level)

    def _engine_wake(self, tags: list[str] | None) -> None:
        self.control.wake_up(tags)

    def close(self) -> None:
        """Release the transport and the adapter folders this engine created (here, and on
        the engine's host if the transport carried them there)."""
        if self._remote_adapters:
            with contextlib.suppress(Exception):  # a server gone took its folders with it
                self._rpc("weightsync_drop_adapters")
            self._remote_adapters = False
        self.transport.close()
        if self._remove_adapter_root is not None:
            self._remove_adapter_root()


class VLLMServerEngine(RemoteVLLMEngine):
    """A running ``vllm serve`` as a weightsync engine, controlled over HTTP.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        transport: ``"tmpfs"`` (same host or shared filesystem) or ``"gloo"`` (any host).
        **kwargs: see `RemoteVLLMEngine`.
    """

    name = "vllm-server"
    control: HTTPControl

    def __init__(
        self, base_url: str, *, transport: str | Transport = "tmpfs", **kwargs: Any
    ) -> None:
        super().__init__(HTTPControl(base_url), transport=transport, **kwargs)

    def _read_facts(self, transport: str | Transport) -> dict[str, Any]:
        """From the worker extension if the server loaded it, else from the server's config
        and the model folder it serves (a stock server: tmpfs only)."""
        try:
            return self.control.rpc("weightsync_facts")[0]
        except EngineUnavailableError:
            raise
        except RuntimeError as e:
            if "weightsync_facts" not in str(e):
                raise  # not a missing extension (no dev mode, server down): say so as it is
        if not (transport == "tmpfs" or isinstance(transport, TmpfsTransport)):
            raise ValueError(
                f"transport={transport!r} needs weightsync's worker extension in the server, "
                f"which this one did not load: start it with --worker-extension-cls "
                f"{WORKER_EXTENSION}, or use transport='tmpfs' (same host or shared filesystem)"
            )
        return stock_facts(self.control)

    def describe(self) -> str:
        how = "stock server, vLLM's reload_weights" if self.stock else "worker extension"
        return f"{super().describe()} at {self.control.base_url} ({how})"


def _weight_files(folder: str) -> list[str]:
    from vllm.config import LoadConfig

    return ckpt.weight_files(folder, LoadConfig())


def stock_facts(control: HTTPControl) -> dict[str, Any]:
    """The facts of a server without the worker extension: dtype, LoRA limit and world size
    from its ``/server_info`` (dev mode); names and shapes those of the transformers model its
    config builds (on the meta device, no memory) as the files vLLM's loader picks from the
    folder it serves hold them (``checkpoint.loaded_shapes``); tied names from that model.

    Refused: an MoE model on vLLM-CPU (its reload skips the expert re-pack, which only the
    worker extension redoes: wrong outputs after any reload)."""
    from transformers import AutoConfig
    from vllm.config import LoadConfig

    info = control.server_info()
    model_config, load = info["model_config"], info["load_config"]
    load_config = LoadConfig(
        load_format=load["load_format"], ignore_patterns=load["ignore_patterns"]
    )
    if not ckpt.loads_files(load_config):
        raise ValueError(
            f"this server was started with --load-format {load['load_format']} (weights it did "
            "not read from files), and without weightsync's worker extension its weights can "
            "only be written through vLLM's reload from disk, which that loader cannot do; start "
            f"it with --worker-extension-cls {WORKER_EXTENSION}"
        )
    folder = ckpt.local_folder(model_config["model"], model_config.get("revision"))
    trust = model_config["trust_remote_code"]
    model = ckpt.config_model(AutoConfig.from_pretrained(folder, trust_remote_code=trust), trust)
    files = ckpt.weight_files(folder, load_config)
    shapes = {name: list(shape) for name, shape in ckpt.loaded_shapes(model, files).items()}
    if info["device_config"]["device"] == "cpu" and any(".experts." in n for n in shapes):
        raise ValueError(
            "this MoE model runs on vLLM-CPU, whose reload_weights skips the experts' re-pack "
            "(the server would compute wrong outputs after a sync); start the server with "
            f"--worker-extension-cls {WORKER_EXTENSION}, which redoes it"
        )
    shared, twins = tied_weights(shared_parameter_names(model), shapes)
    lora = None
    if info["lora_config"] is not None:
        # vLLM applies LoRA to its linear layers; the transformers model names the same ones.
        # vLLM's own adapter validation has the last word when the adapter is loaded.
        head = model.get_output_embeddings()
        lora = {
            "max_lora_rank": info["lora_config"]["max_lora_rank"],
            "modules": sorted(
                {
                    name.rsplit(".", 1)[-1]
                    for name, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear) and m is not head
                }
            ),
        }
    return {
        "checkpoint": folder,
        "dtype": str(model_config["dtype"]).removeprefix("torch."),
        "weights": shapes,
        "shared": shared,
        "files": files,
        "twins": twins,
        "lora": lora,
        "world_size": info["parallel_config"]["world_size"],
        "stock": True,
    }


@register
class VLLMMultiprocEngine(RemoteVLLMEngine):
    """A ``vllm.LLM`` with vLLM's default multiprocess engine core (tensor parallel or not).

    Tensors cannot travel in ``collective_rpc`` arguments there (they arrive as lists), so the
    bytes go through a transport; create the ``LLM`` with
    ``worker_extension_cls=weightsync.engines.vllm.server.WORKER_EXTENSION``.
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


class _Abort(Exception):
    """Raised inside a replica's bucket stream when the fan-out stops part-way."""


class Replicas(Engine):
    """Several engines serving the same model, synced by one call: a fan-out.

    Every check a strategy makes (names, shapes, adapter rank and modules, sleep state) runs
    against every replica before anything is written, because this engine's facts are the
    replicas' common facts and `check_adapter` / `check_writable` ask each one.
    Each bucket is produced (merged, cast) once and handed to every replica: one thread per
    replica consumes it, at most two buckets in flight. If producing fails, or any replica fails,
    the others are stopped part-way and recover as on any failed write (their base is marked
    unsynced), and the first error is raised.

    Args:
        engines: the replicas (any `Engine`, or raw engines that
            `adapt` accepts); they must agree on dtype, expected
            weights, tied names and whether they serve LoRA.
    """

    name = "replicas"

    def __init__(self, engines: Iterable[Any]) -> None:
        super().__init__()
        from ..base import adapt

        self.engines = [adapt(e) for e in engines]
        if not self.engines:
            raise ValueError("Replicas needs at least one engine")
        first = self.engines[0]
        for i, e in enumerate(self.engines[1:], 1):
            for fact in ("dtype", "expected_weights", "shared_weights", "serves_lora"):
                if getattr(e, fact) != getattr(first, fact):
                    raise ValueError(
                        f"replica {i} differs from replica 0 in {fact}: they do not serve the same "
                        "model the same way, so one sync cannot fit both; sync them apart"
                    )

    @property
    def dtype(self) -> torch.dtype:
        return self.engines[0].dtype

    @property
    def expected_weights(self) -> Mapping[str, tuple[int, ...]]:
        return self.engines[0].expected_weights

    @property
    def shared_weights(self) -> list[tuple[str, ...]]:
        return self.engines[0].shared_weights

    @property
    def serves_lora(self) -> bool:
        return self.engines[0].serves_lora

    @property
    def keeps_unsent_layers(self) -> bool:  # type: ignore[override]
        return all(e.keeps_unsent_layers for e in self.engines)

    def load_weights(self, buckets: Iterable[Bucket]) -> int:
        import queue
        from concurrent.futures import ThreadPoolExecutor

        queues: list[queue.Queue] = [queue.Queue(maxsize=1) for _ in self.engines]
        done = object()

        def stream(q: queue.Queue) -> Iterable[Bucket]:
            while (item := q.get()) is not done:
                if isinstance(item, _Abort):
                    raise item
                yield item

        with ThreadPoolExecutor(len(self.engines), thread_name_prefix="weightsync-replica") as pool:
            futures = [
                pool.submit(e.load_weights, stream(q))
                for e, q in zip(self.engines, queues, strict=True)
            ]

            def put(item: Any) -> None:
                for q, f in zip(queues, futures, strict=True):
                    while not f.done():  # a replica that failed takes nothing more
                        try:
                            q.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue

            try:
                for bucket in buckets:
                    if any(f.done() for f in futures):  # a replica failed part-way: stop all
                        break
                    put(bucket)
            except BaseException as error:
                put(_Abort(f"the fan-out stopped: producing a bucket failed ({error})"))
                raise
            failed = [f for f in futures if f.done() and f.exception() is not None]
            put(_Abort("another replica failed") if failed else done)
            errors = [e for e in (f.exception() for f in futures) if e is not None]
        if errors:
            raise errors[0]
        return sum(f.result() for f in futures)

    def check_adapter(self, adapter: Adapter) -> None:
        for e in self.engines:
            e.check_adapter(adapter)

    def load_adapter(self, adapter: Adapter) -> int:
        return sum(e.load_adapter(adapter) for e in self.engines)

    def reload_checkpoint(self, path: str | None = None) -> int:
        return sum(e.reload_checkpoint(path) for e in self.engines)

    def greedy_batch(
        self, prompts: list[list[int]], max_tokens: int
    ) -> list[tuple[list[int], list[float]]]:
        """Replica 0's results, after checking every replica generates the same tokens."""
        results = [e.greedy_batch(prompts, max_tokens) for e in self.engines]
        for i, other in enumerate(results[1:], 1):
            if [t for t, _ in other] != [t for t, _ in results[0]]:
                raise RuntimeError(
                    f"replica {i} generates other tokens than replica 0: out of sync"
                )
        return results[0]

    def score_batch(self, prompts: list[list[int]], top_k: int) -> list[list[dict[int, float]]]:
        """Replica 0's prompt logprobs (verification then checks replica 0 thoroughly;
        `greedy_batch` checks that every replica agrees with it)."""
        return self.engines[0].score_batch(prompts, top_k)

    # --- lifecycle: each replica attests and keeps its own record; this one combines them --

    def attest(self) -> Attestation:
        """Every replica's own attestation (its harm since *its* last restore): the epoch is
        all of theirs (None if any cannot attest), asleep their union, harm the worst."""
        each = [e.attest() for e in self.engines]
        epochs = tuple(a.epoch for a in each)
        return Attestation(
            epoch=None if None in epochs else epochs,
            asleep=frozenset().union(*(a.asleep for a in each)),
            harm=max(a.harm for a in each),
        )

    def check_writable(self, *, restores_base: bool, strategy: str) -> Attestation:
        for i, e in enumerate(self.engines):
            try:
                e.check_writable(restores_base=restores_base, strategy=strategy)
            except WeightSyncError as err:
                raise type(err)(f"replica {i}: {err}") from err
        return self.attest()

    def skippable(self) -> tuple[Mapping[str, tuple], Hashable | None, str]:
        """What *every* replica still holds, by its own record and epoch: a weight is skipped
        only if each replica attests it (one stream feeds them all)."""
        records = []
        for i, e in enumerate(self.engines):
            record, _, why_not = e.skippable()
            if not record:
                return {}, None, f"replica {i}: {why_not}"
            records.append(record)
        common = {k: v for k, v in records[0].items() if all(r.get(k) == v for r in records[1:])}
        return common, self.attest().epoch, ""

    def remember(self, held: Mapping[str, tuple], *, restored: bool) -> None:
        for e in self.engines:
            e.remember(held, restored=restored)

    def forget(self) -> None:
        for e in self.engines:
            e.forget()

    def mark_lost(self) -> None:
        for e in self.engines:
            e.mark_lost()

    def mark_asleep(self, level: int) -> None:
        for e in self.engines:
            e.mark_asleep(level)

    def mark_awake(self, tags: list[str] | None = None) -> None:
        for e in self.engines:
            e.mark_awake(tags)

    def _engine_sleep(self, level: int) -> None:
        for e in self.engines:
            e.sleep(level)

    def _engine_wake(self, tags: list[str] | None) -> None:
        for e in self.engines:
            e.wake_up(tags)
