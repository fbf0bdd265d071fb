"""The typed messages between the trainer and an engine's workers (JSON on the way).

- `EngineFacts`: what an engine loads and serves, produced by every engine (read from the model
  vLLM built, inside its workers, or from a stock server's config) and planned against;
- `Outcome`: how a worker reports the result of a call, or its error. Workers return errors
  instead of raising them (vLLM's multiprocess executor stops reading replies at the first
  failed worker, so with TP>1 the other workers' replies would stay queued and answer the next
  calls), and one outcome travels back whichever way the bytes came: an RPC's return value, a
  result file, or a gloo all-gather. `raise_failures` reads them all;
- `InitInfo`, `UpdateInfo`: the payloads of the ``"weightsync"`` weight-transfer backend.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import errors


@dataclass(frozen=True)
class LoraLimits:
    """What adapters an engine serving LoRA accepts.

    Attributes:
        max_rank: the engine's ``max_lora_rank``.
        modules: the module names (last path component) it can apply LoRA to.
        max_loras: the engine's ``max_loras``: how many adapters one batch can apply.
        max_cpu_loras: the engine's ``max_cpu_loras``: how many adapters it keeps loaded.
    """

    max_rank: int
    modules: tuple[str, ...]
    max_loras: int = 1
    max_cpu_loras: int = 1


@dataclass(frozen=True)
class Quantization:
    """How an engine quantizes its weights: a fact of the engine, as its config states it.

    Attributes:
        method: vLLM's quantization method (``"fp8_per_channel"``, ``"compressed-tensors"``).
        prequantized: the engine loads quantized tensors (``weight_scale``, ``weight_packed``):
            its checkpoint holds them, and a sync must send them (``trainer/quantize.py``).
            False for an online method, which quantizes whatever bf16 weights it loads.
        config: the checkpoint's ``quantization_config`` (compressed-tensors: its config groups
            with targets and arguments, ``ignore``, ``format``); empty for an online method,
            except torchao: ``{"torchao": config_to_dict(<the config vLLM runs>)}``, which
            verification simulates (``trainer/quantize.py``).
        kv_cache: the KV cache dtype (``"auto"``: the model's; ``"fp8"``).
        modules: the modules the engine holds quantized, by checkpoint name
            (``model.layers.0.self_attn.q_proj``), as its workers read them from the model vLLM
            built; empty when not known (a stock server).
        unrunnable: why the engine's workers cannot run its quantized layers (a kernel their
            CPU build lacks), as a worker found by running one; empty when they can or it is
            not known.
    """

    method: str
    prequantized: bool = False
    config: Mapping[str, Any] = field(default_factory=dict)
    kv_cache: str = "auto"
    modules: tuple[str, ...] = ()
    unrunnable: str = ""

    @classmethod
    def read(
        cls,
        method: str | None,
        hf_quant_config: Mapping[str, Any] | None,
        kv_cache: str | None,
        modules: tuple[str, ...] = (),
    ) -> Quantization | None:
        """The record from what vLLM's configs hold (the same read in a worker and for a stock
        server); None for an unquantized engine with a model-dtype KV cache."""
        kv = str(kv_cache or "auto")
        if not method and kv == "auto":
            return None
        config = dict(hf_quant_config or {})
        return cls(method or "none", bool(config), config, kv, tuple(modules))

    def __str__(self) -> str:
        """A short name for plans, logs and errors: ``pre-quantized compressed-tensors W8A8
        (int channel, dynamic activations)``, ``fp8_per_channel (online ...)``."""
        kv = f", KV cache {self.kv_cache}" if self.kv_cache != "auto" else ""
        if self.method == "none":
            return f"KV cache {self.kv_cache} (weights unquantized)"
        if not self.prequantized:
            return f"{self.method} (online: the engine quantizes what it loads){kv}"
        parts = []
        for group in (self.config.get("config_groups") or {}).values():
            w, a = group.get("weights") or {}, group.get("input_activations") or {}
            size = f" {w['group_size']}" if w.get("group_size") else ""
            dynamic = ", dynamic activations" if a.get("dynamic") else ""
            parts.append(
                f"W{w.get('num_bits')}A{a.get('num_bits', 16)} "
                f"({w.get('type')} {w.get('strategy')}{size}{dynamic})"
            )
        scheme = " + ".join(parts) or str(self.config.get("format", "unknown scheme"))
        return f"pre-quantized {self.method} {scheme}{kv}"


@dataclass(frozen=True)
class EngineFacts:
    """What an engine loads and serves: the contract a sync is planned against.

    Attributes:
        dtype: the dtype the engine computes in (a torch dtype's name: ``"bfloat16"``).
        architecture: the architecture its model config names (``"Qwen2ForCausalLM"``); empty
            when not known. Whether weightsync has proven it exact (``weightsync.proven``).
        weights: checkpoint name -> shape of every weight the engine loads.
        tied: groups of names the engine holds as one tensor (tied embeddings).
        lora: the adapters it serves (None: it serves none).
        quantization: the engine's quantization method (None: unquantized).
        quantized: how it quantizes (`Quantization`); None: unquantized.
        attests: the engine keeps an epoch of its own (``ledger.py``); without one nothing it
            holds may be skipped, and its base counts as lost at any time.
        keeps_unsent_layers: a write that leaves layers out leaves them as they were (False on
            vLLM-CPU MoE engines, which re-pack every MoE layer after any load).
        checkpoint: the folder the engine was started from, on the engine's host.
        files: the weight files vLLM's loader reads there (empty: none to reload).
        world_size: how many workers the engine has.
        cpu: on a CPU engine, the instruction set its workers' kernels run on, as torch names it
            (``"AVX2"``, ``"AVX512"``); empty on a GPU or when not known (a stock server).
        held: checkpoint name -> the dtype (a torch dtype's name) the engine holds that weight
            in, for each weight it holds in a floating dtype other than ``dtype``: vLLM builds
            some routers in float32 inside a bfloat16 model (Ernie 4.5 MoE's ``gate.weight``
            and ``e_score_correction_bias``), and a weight sent in ``dtype`` would arrive
            rounded there. Empty when there is none or it is not known (a stock server, an
            extension older than this field): weights then travel in ``dtype``.
    """

    dtype: str
    weights: Mapping[str, tuple[int, ...]]
    tied: tuple[tuple[str, ...], ...] = ()
    lora: LoraLimits | None = None
    quantization: str | None = None
    quantized: Quantization | None = None
    attests: bool = True
    keeps_unsent_layers: bool = True
    checkpoint: str = ""
    files: tuple[str, ...] = ()
    world_size: int = 1
    cpu: str = ""
    architecture: str = ""
    held: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EngineFacts:
        lora = data.get("lora")
        return cls(
            dtype=data["dtype"],
            weights={k: tuple(v) for k, v in data["weights"].items()},
            tied=tuple(tuple(g) for g in data.get("tied", ())),
            lora=(
                LoraLimits(
                    int(lora["max_rank"]),
                    tuple(lora["modules"]),
                    int(lora.get("max_loras", 1)),
                    int(lora.get("max_cpu_loras", lora.get("max_loras", 1))),
                )
                if lora
                else None
            ),
            quantization=data.get("quantization"),
            quantized=(
                Quantization(
                    **{**data["quantized"], "modules": tuple(data["quantized"]["modules"])}
                )
                if data.get("quantized")
                else None
            ),
            attests=bool(data.get("attests", True)),
            keeps_unsent_layers=bool(data.get("keeps_unsent_layers", True)),
            checkpoint=data.get("checkpoint", ""),
            files=tuple(data.get("files", ())),
            world_size=int(data.get("world_size", 1)),
            cpu=str(data.get("cpu", "")),
            architecture=str(data.get("architecture", "")),
            held={str(k): str(v) for k, v in (data.get("held") or {}).items()},
        )


#: The key of a worker's report of what a weight write did (`Outcome.value` of weightsync's
#: reloads and of ``weightsync_abandon``): ``{"written": [layer, ...]}`` after a failure (the
#: layers it had finished, which keep their new weights: a mix when not empty),
#: ``{"complete": bool}`` after a success (every weight of the engine loaded: a full restore).
#: A server's middleware reads it from ``/collective_rpc`` answers (``server_lease.py``).
RELOAD_REPORT = "weightsync_reload"

#: Marks an RPC result as an `Outcome` (vLLM hands back whatever a worker method returns).
_KIND = "weightsync.outcome"


@dataclass(frozen=True)
class Outcome:
    """One worker's result of one call.

    Attributes:
        error: what went wrong (``"TypeName: message"``), "" when the call succeeded.
        rank: the worker's rank.
        value: what the call returns on success (JSON: an adapter folder's path, ...).
        exception: in process only (never sent): the exception itself, so that the caller
            re-raises the original error, not a description of it.
    """

    error: str = ""
    rank: int = 0
    value: Any = None
    exception: BaseException | None = field(default=None, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        return not self.error

    @classmethod
    def failed(cls, error: BaseException | str, rank: int = 0) -> Outcome:
        if isinstance(error, str):
            return cls(error=error, rank=rank)
        return cls(error=f"{type(error).__name__}: {error}", rank=rank, exception=error)

    def to_json(self) -> dict[str, Any]:
        return {_KIND: 1, "error": self.error, "rank": self.rank, "value": self.value}

    @classmethod
    def from_json(cls, data: Any) -> Outcome:
        """An outcome from an RPC result; a result that is none (a worker method returning
        nothing, or a reply without the marker) is a success."""
        if not isinstance(data, Mapping) or _KIND not in data:
            return cls()
        return cls(error=data.get("error", ""), rank=int(data.get("rank", 0)), value=data["value"])

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json()).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Outcome:
        if not data:
            return cls()
        try:
            return cls.from_json(json.loads(data.decode(errors="replace")))
        except ValueError:  # cut at its size limit: the text is all there is
            return cls(error=data.decode(errors="replace"))


def raise_failures(what: str, outcomes: list[Outcome], *, hint: str = "") -> None:
    """Raise an error naming every worker whose outcome is an error: ``RuntimeError``, or the
    ``weightsync.errors`` class a worker raised (a `BytesRejectedError` stays one across the
    wire, so the trainer can tell a refused bucket from a failed load)."""
    failed = [o for o in outcomes if not o.ok]
    if not failed:
        return
    kind: type[Exception] = RuntimeError
    for o in failed:
        found = getattr(errors, o.error.partition(":")[0], None)
        if isinstance(found, type) and issubclass(found, errors.WeightSyncError):
            kind = found
            break
    text = "; ".join(f"worker {o.rank}: {o.error}" for o in failed)
    raise kind(f"{what} failed in the engine's workers{hint}: {text}")


@dataclass
class InitInfo:
    """``init_weight_transfer_engine`` payload of the ``"weightsync"`` backend.

    Attributes:
        host: gloo rendezvous address (the trainer's ``TCPStore``); empty for files only.
        port: the rendezvous port.
        world_size: the gloo group's size: 1 (the trainer) + every worker of the engine.
        timeout_s: how long a gloo operation waits for a peer.
        secret: the rendezvous' secret (``wire.gloo``): only a worker told it finds the group.
        protocol: a field only this backend knows, so a server running another backend
            rejects the init instead of misreading it.
    """

    host: str = ""
    port: int = 0
    world_size: int = 0
    timeout_s: float = 300.0
    secret: str = ""
    protocol: int = 1


@dataclass
class UpdateInfo:
    """``update_weights`` payload (one chunk) of the ``"weightsync"`` backend.

    Attributes:
        folder: the folder of ``files``.
        files: bucket files in ``folder`` to check (every tag, name and shape) and then load,
            in order.
        gloo: load what the trainer broadcasts over the gloo group until its END frame (with
            ``stage``: receive it into host memory instead).
        abort: the trainer failed part-way (the reason): abandon this update.
        key: this sync's tag key (``wire.tags``), "" when the trainer sends no tags.
        tags: the tag of each of ``files``, in order (gloo: the tags travel in the stream).
        delta: gloo: the trainer sends deltas (``wire.delta``) and this is the id the update
            leaves in the workers' kept copies once it has loaded ("" = no deltas).
        stage: gloo: start receiving the stream into host memory in a thread and return at
            once (`gloo.Staging`); nothing is loaded.
        max_bytes: with ``stage``, the most a worker may stage (None: no bound).
        staged: wait for the staged stream's END and check every name and shape in it.
        commit: load what was staged (and checked).
        final: this call carries the rest of the update: once its load ends without an error,
            the update is whole as the trainer declared it, though it may load only some of
            the engine's weights (a sync that skipped what the engine provably holds). A pause
            lease may then finish it for a trainer that died before its finish
            (``WeightsyncWorker.weightsync_settle``). Without it, only a load of every weight
            the engine loads counts as whole: a trainer may send an update in several calls.
    """

    folder: str = ""
    files: list[str] = field(default_factory=list)
    gloo: bool = False
    abort: str = ""
    key: str = ""
    tags: list[str] = field(default_factory=list)
    delta: str = ""
    stage: bool = False
    max_bytes: int | None = None
    staged: bool = False
    commit: bool = False
    final: bool = False
