"""A stock ``vllm serve`` server: no weightsync worker extension, so no epoch of its own
(`StockServerEngine`).

Reached with ``transport="tmpfs"`` only. Its facts come from its dev-mode ``/server_info`` and
the model folder it serves (`facts`), and bytes go through vLLM's own
``reload_weights(weights_path=...)`` of a folder staged in RAM (every tied tensor under all its
names: vLLM's reload restores ``lm_head`` apart from ``embed_tokens``). Every byte is written to
tmpfs before the server is touched; but if vLLM's reload then fails, nothing can restore its
unfinished layers, so the server is left paused (`broken`). With no ledger, its base counts as
lost at every sync unless the caller owns it (``exclusive``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Hashable, Iterable
from pathlib import Path
from typing import Any

import torch

from ...errors import EngineBrokenError
from ...plan import Bucket
from ...wire import format as fmt
from ...wire.protocol import EngineFacts, LoraLimits, Quantization
from ..base import Attestation, register
from .control import WORKER_EXTENSION, HTTPControl, WeightsSpan
from .in_engine import checkpoint as ckpt
from .in_engine.model_ops import fold_tied, tied_parameter_names
from .server import VLLMServerEngine
from .transports import TmpfsTransport, Transport


@register
class StockServerEngine(VLLMServerEngine):
    """A ``vllm serve`` without weightsync's worker extension, synced through vLLM's own
    ``reload_weights`` of a folder staged in RAM (``transport="tmpfs"`` only: same host or a
    shared filesystem).

    What it cannot do, having no extension in its workers: attest an epoch (nothing is ever
    skipped; its base counts as lost at every sync, so every sync is a full one, unless
    ``exclusive``), report a version (`weights_version` is None), check the bytes' tags, or
    restore the layers of a reload that failed part-way (it is left paused: `broken`).

    Args:
        base_url: as for `VLLMServerEngine` (so are ``token`` and ``allow_unauthenticated``,
            passed in ``kwargs``).
        exclusive: the caller owns the server and every sleep goes through this adapter
            (`sleep`) or is reported (`mark_asleep`), so an adapter-only sync may follow a
            sync. Without it the base counts as lost at every sync.
        **kwargs: as for `VLLMServerEngine` (``transport`` must be ``"tmpfs"`` or a
            `TmpfsTransport`).
    """

    name = "vllm-stock-server"
    writes_through = "stock server, vLLM's reload_weights"
    #: No ledger, and nothing can restore the layers vLLM's own reload failed to finish: a
    #: failed base write leaves the server paused (`broken`); a failed adapter swap changed
    #: no layer and resumes.
    _attests = False
    _restores = False
    transport: TmpfsTransport

    def __init__(self, base_url: str, *, exclusive: bool = False, **kwargs: Any) -> None:
        self.exclusive = exclusive
        super().__init__(base_url, **kwargs)

    def _read_facts(self, transport: str | Transport) -> EngineFacts:
        if not (transport == "tmpfs" or isinstance(transport, TmpfsTransport)):
            raise ValueError(
                f"transport={transport!r} needs weightsync's worker extension in the server; a "
                f"stock server is reached with transport='tmpfs' (same host or shared "
                f"filesystem). Start it with --worker-extension-cls {WORKER_EXTENSION} for more"
            )
        return facts(self.control)

    def _version_now(self) -> str | None:
        return None  # no ledger: nothing the server could attest

    def weights_spans(
        self, output: Any, index: int = 0, *, model: str | None = None
    ) -> list[WeightsSpan] | None:
        """None: with no version attested, vLLM's label of every token stays its
        ``"default"``, which names no weights."""
        return None

    def _attest(self, since: Hashable | None) -> Attestation:
        """It can say only whether it sleeps now (a bool, no level, also true while paused),
        so its base counts as lost at any time -- unless the caller owns it (``exclusive``):
        then the sleeps made through this adapter and those reported (which `Engine.attest`
        adds to an attestation without an epoch) are taken as all there were."""
        asleep = {"weights", "kv_cache"} if self.control.is_sleeping() else set()
        return Attestation(None, frozenset(asleep), 0 if self.exclusive else 2)

    @property
    def stages_weights(self) -> bool:
        """Its write is vLLM's own reload of a folder (`load_weights` here), staged and
        applied in one call: `Replicas` holds the stream for it."""
        return False

    def load_weights(self, buckets: Iterable[Bucket]) -> int:
        # Every byte is on tmpfs before the server is touched, each tied tensor under all its
        # names: vLLM's reload restores lm_head apart from embed_tokens.
        self._reload("load_weights", self.transport.stage(buckets, aliases=False)[0])
        return 1

    def reload_checkpoint(self, path: str | None = None) -> int:
        source = path or self.facts.checkpoint
        self._reload(
            "reload_checkpoint", stage_checkpoint(self.transport, source, self.shared_weights)
        )
        return 1

    def _reload(self, what: str, folder: Path) -> None:
        """A write through vLLM's own ``reload_weights`` of a staged ``folder`` in every worker;
        the folder is removed after, whatever happens."""
        kwargs = {"weights_path": str(folder), "is_checkpoint_format": True}
        try:
            self._paused_write(what, self._base_steps([("rpc", "reload_weights", kwargs)]))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _broken(
        self, what: str, error: BaseException, recovery: BaseException
    ) -> EngineBrokenError:
        return broken(what, error)

    def _check_folder(self, folder: Path) -> None:
        """No extension to check an adapter's files: vLLM's loader reads them as they are."""


def facts(control: HTTPControl) -> EngineFacts:
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
    shapes = dict(ckpt.loaded_shapes(model, files))
    if info["device_config"]["device"] == "cpu" and any(".experts." in n for n in shapes):
        raise ValueError(
            "this MoE model runs on vLLM-CPU, whose reload_weights skips the experts' re-pack "
            "(the server would compute wrong outputs after a sync); start the server with "
            f"--worker-extension-cls {WORKER_EXTENSION}, which redoes it"
        )
    quantized = Quantization.read(
        model_config.get("quantization"),
        getattr(model.config, "quantization_config", None),
        (info.get("cache_config") or {}).get("cache_dtype"),
    )
    if info["device_config"]["device"] == "cpu" and quantized is not None and _int8(quantized):
        raise ValueError(
            f"this server runs a {quantized} engine on vLLM-CPU, whose oneDNN kernel keeps a "
            "pointer to the weight scales that vLLM's own reload_weights frees: any reload "
            "serves NaN (docs/quantized.md); start the server with --worker-extension-cls "
            f"{WORKER_EXTENSION}, whose reload keeps them alive"
        )
    tied, _ = fold_tied(tied_parameter_names(model), shapes)
    lora = None
    if info["lora_config"] is not None:
        # vLLM applies LoRA to its linear layers; the transformers model names the same ones.
        # vLLM's own adapter validation has the last word when the adapter is loaded.
        head = model.get_output_embeddings()
        lora = LoraLimits(
            max_rank=info["lora_config"]["max_lora_rank"],
            max_loras=info["lora_config"]["max_loras"],
            max_cpu_loras=info["lora_config"].get("max_cpu_loras")
            or info["lora_config"]["max_loras"],
            modules=tuple(
                sorted(
                    {
                        name.rsplit(".", 1)[-1]
                        for name, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear) and m is not head
                    }
                )
            ),
        )
    return EngineFacts(
        dtype=str(model_config["dtype"]).removeprefix("torch."),
        architecture=(getattr(model.config, "architectures", None) or [""])[0],
        weights=shapes,
        tied=tuple(tied),
        lora=lora,
        quantization=model_config.get("quantization"),
        quantized=quantized,
        attests=False,
        checkpoint=folder,
        files=tuple(files),
        world_size=info["parallel_config"]["world_size"],
    )


def stage_checkpoint(transport: TmpfsTransport, source: str, tied: list[tuple[str, ...]]) -> Path:
    """A tmpfs folder that vLLM's ``reload_weights`` reads as the weights of ``source``
    with every tied tensor under all its names: links to the files vLLM's loader picks
    from ``source``, plus one file with the names ``source`` stores once (a tied checkpoint
    reloaded as it is leaves lm_head stale)."""
    from safetensors import safe_open
    from vllm.config import LoadConfig

    files = ckpt.weight_files(source, LoadConfig())
    folder = transport.stage([])[0]
    for f in files:
        (folder / os.path.basename(f)).symlink_to(os.path.abspath(f))
    where = {name: f for f in files for name in fmt.shapes([f])}
    extra: list[tuple[str, torch.Tensor]] = []
    for group in tied:
        stored = [n for n in group if n in where]
        if stored:
            with safe_open(where[stored[0]], framework="pt") as h:
                tensor = h.get_tensor(stored[0])
            extra += [(n, tensor) for n in group if n not in where]
    if extra:
        fmt.write(extra, folder / "weightsync-tied.safetensors", aliases=False)
    return folder


def broken(what: str, error: BaseException) -> EngineBrokenError:
    """The error for a stock server whose own ``reload_weights`` failed part-way."""
    return EngineBrokenError(
        f"{what} failed in vLLM's own reload_weights ({error}); this server has no "
        "weightsync worker extension, so its unfinished layers cannot be restored "
        "and it is left paused. Restart it, and start it with --worker-extension-cls "
        f"{WORKER_EXTENSION} to have failed writes recovered."
    )


def _int8(quantized: Quantization) -> bool:
    """Whether a pre-quantized scheme runs vLLM-CPU's INT8 oneDNN kernel (W8A8 with int8
    weights): the one whose reload through vLLM alone corrupts the engine."""
    groups = (quantized.config.get("config_groups") or {}).values()
    return any(
        (g.get("weights") or {}).get("type") == "int"
        and (g.get("weights") or {}).get("num_bits") == 8
        and g.get("input_activations")
        for g in groups
    )
