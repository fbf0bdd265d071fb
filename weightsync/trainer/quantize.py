"""The trainer side of a sync into a pre-quantized engine: each weight quantized to the engine's
scheme where it lives, in the stream, one bucket at a time.

A pre-quantized engine (a compressed-tensors checkpoint: ``quantization_config`` in its
``config.json``) does not load bfloat16 weights: it loads the checkpoint's quantized tensors
(``weight`` in int8 or float8 with its ``weight_scale``) and rebuilds everything derived from
them (oneDNN's prepacked weight, its scales) in its own post-load processing. Sending it bf16
weights is silent garbage (vLLM casts them and leaves ``weight_scale`` as it was; vllm#19020),
so a sync into it must send what a checkpoint of the trainer's weights quantized to that scheme
would hold. That is what this module produces, and the correctness oracle of such a sync is an
engine started from exactly that checkpoint (the tests' and benchmarks' oracle,
``benchmarks/quantized.py``).

Schemes are an allowlist (`SCHEMES`), keyed on the compressed-tensors parameters that decide the
tensors' bytes; a config with anything else (another strategy, asymmetric weights, static input
scales, a group size not listed, several config groups) is refused by `scheme_of`, naming it,
before anything is written. The math is symmetric absmax in float32, per output channel or per
group of input columns:

- ``W8A8-INT8 per-channel``: ``scale = absmax / 127``, ``weight = round(w / scale)``, int8, with a
  float32 ``weight_scale`` of shape ``(out, 1)``; the engine quantizes activations per token.
- ``FP8 per-channel``: ``scale = absmax / 448``, ``weight = w / scale`` cast to
  ``float8_e4m3fn``; scales and activations as above. (vLLM's online ``fp8_per_channel``
  computes the same tensors: measured, the same logprobs.)
- ``W4A16 group G``: ``scale = absmax / 7.5`` per group of G columns, stored in the engine's
  dtype, ``round(w / scale)`` clamped to ``[-8, 7]`` and packed eight to an int32
  (``weight_packed``, as compressed-tensors' ``pack_to_int32``), with ``weight_shape``.

A checkpoint made by llm-compressor need not be byte-equal to these (compressed-tensors'
``calculate_qparams`` divides int8 by 127.5, for one): the engine may start from it, but after a
sync it serves the trainer's current weights quantized here, and the oracle of a sync is an
engine started from exactly that.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import WeightMismatchError
from ..plan import Weight
from ..wire.protocol import Quantization


@dataclass(frozen=True)
class Scheme:
    """A quantization scheme weightsync reproduces exactly.

    Attributes:
        name: as messages and docs name it (``"W8A8-INT8 per-channel"``).
        dtype: the dtype the quantized values are held in before packing (int8, float8_e4m3fn).
        lo, hi: the grid's range (int8: -128..127, e4m3: -448..448, int4: -8..7).
        divisor: the scale is ``absmax / divisor`` (int8 127, e4m3 448, int4 7.5).
        weight: the compressed-tensors ``weights`` arguments that identify it.
        activations: its ``input_activations`` arguments (dynamic, per token), or None for a
            weight-only scheme (activations stay in the engine's dtype).
        format: the compressed-tensors ``format`` of its checkpoints.
    """

    name: str
    dtype: torch.dtype
    lo: float
    hi: float
    divisor: float
    weight: Mapping[str, Any]
    activations: Mapping[str, Any] | None
    format: str

    @property
    def weight_only(self) -> bool:
        """Activations stay in the engine's dtype (W4A16)."""
        return self.activations is None

    @property
    def packed(self) -> bool:
        """Values narrower than a byte, packed 32 bits at a time (``weight_packed``)."""
        return int(self.weight["num_bits"]) < 8

    def layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, tuple, Any]]:
        """(part, shape, dtype) of what the engine loads for a weight of ``shape`` in an
        engine of ``dtype``, in the order they are sent."""
        n, k = shape
        if not self.packed:
            return [("weight", (n, k), self.dtype), ("weight_scale", (n, 1), torch.float32)]
        per = 32 // int(self.weight["num_bits"])
        groups = k // int(self.weight["group_size"])
        return [
            ("weight_packed", (n, k // per), torch.int32),
            ("weight_scale", (n, groups), dtype),
            ("weight_shape", (2,), torch.int64),
        ]

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether a weight of ``shape`` splits into this scheme's groups and words."""
        if len(shape) != 2:
            return False
        if not self.packed:
            return True
        return shape[1] % int(self.weight["group_size"]) == 0 and shape[1] % 32 == 0

    def _grid(self, x: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(values on the grid in ``dtype``, scale per row and group in ``scale_dtype``) of the
        2-D ``x``: symmetric absmax in float32; the scale is rounded to its stored dtype first
        and the values computed with the rounded scale, so that ``values * scale`` is what the
        engine computes with."""
        n, k = x.shape
        size = int(self.weight.get("group_size") or k)
        g = x.detach().float().reshape(n, k // size, size)
        absmax = g.abs().amax(dim=2, keepdim=True)
        scale = torch.where(absmax > 0, absmax / self.divisor, torch.ones_like(absmax))
        scale = scale.to(scale_dtype).float()
        q = (g / scale).clamp(self.lo, self.hi)
        if not self.dtype.is_floating_point:
            q = q.round()
        return q.reshape(n, k).to(self.dtype), scale.reshape(n, k // size).to(scale_dtype)

    def quantize(self, w: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of the 2-D weight ``w`` (any float dtype, any device) for an
        engine of ``dtype``, by part name (`layout`)."""
        scale_dtype = {name: d for name, _, d in self.layout(tuple(w.shape), dtype)}["weight_scale"]
        q, scale = self._grid(w, scale_dtype)
        if not self.packed:
            return {"weight": q, "weight_scale": scale}
        bits = int(self.weight["num_bits"])
        per = 32 // bits
        n, k = w.shape
        # compressed-tensors' pack_to_int32: offset to unsigned, value j of each word at bits
        # j * num_bits (the sum wraps as int32)
        unsigned = (q.to(torch.int32) + (1 << (bits - 1))).reshape(n, k // per, per)
        shifts = torch.arange(per, dtype=torch.int32, device=w.device) * bits
        packed = (unsigned << shifts).sum(dim=2, dtype=torch.int32)
        shape = torch.tensor([n, k], dtype=torch.int64, device=w.device)
        return {"weight_packed": packed, "weight_scale": scale, "weight_shape": shape}

    def dequantized(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``w`` as an engine of ``dtype`` holds it after quantization, back in float32."""
        n, k = w.shape
        scale_dtype = {name: d for name, _, d in self.layout((n, k), dtype)}["weight_scale"]
        q, scale = self._grid(w, scale_dtype)
        size = k // scale.shape[1]
        return (q.float().reshape(n, -1, size) * scale.float().unsqueeze(2)).reshape(n, k)

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Activations ``x`` as the engine quantizes them at run time (dynamic, symmetric absmax
        per token, vLLM's divisor: 127 for int8, 448 for e4m3), back in float32; as they are
        for a weight-only scheme."""
        if self.activations is None:
            return x
        rows = x.reshape(-1, x.shape[-1]).float()
        absmax = rows.abs().amax(dim=1, keepdim=True)
        scale = torch.where(absmax > 0, absmax / self.hi, torch.ones_like(absmax))
        q = (rows / scale).clamp(self.lo, self.hi)
        if not self.dtype.is_floating_point:
            q = q.round()
        return (q.to(self.dtype).float() * scale).reshape(x.shape)

    def linear(self, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x @ w.T`` as an engine of ``dtype`` computes it: the weight quantized and the input
        quantized per token (W8A8), both dequantized, in float32."""
        return torch.nn.functional.linear(self.tokens(x.float()), self.dequantized(w, dtype))

    def config(self, ignore: Iterable[str] = ("lm_head",)) -> dict[str, Any]:
        """The ``quantization_config`` of a checkpoint in this scheme (what `scheme_of`
        recognises)."""
        group: dict[str, Any] = {"targets": ["Linear"], "weights": dict(self.weight)}
        if self.activations is not None:
            group["input_activations"] = dict(self.activations)
        return {
            "quant_method": "compressed-tensors",
            "format": self.format,
            "quantization_status": "compressed",
            "ignore": list(ignore),
            "config_groups": {"group_0": group},
        }


def _args(
    kind: str, strategy: str, dynamic: bool, bits: int = 8, group: int | None = None
) -> dict[str, Any]:
    return {
        "num_bits": bits,
        "type": kind,
        "symmetric": True,
        "strategy": strategy,
        "dynamic": dynamic,
        "group_size": group,
    }


def _per_channel(
    name: str, dtype: torch.dtype, lo: float, hi: float, kind: str, form: str
) -> Scheme:
    """A W8A8 scheme: weights per output channel (``scale = absmax / hi``), activations
    quantized per token by the engine."""
    return Scheme(
        name, dtype, lo, hi, hi, _args(kind, "channel", False), _args(kind, "token", True), form
    )


#: The allowlist: every scheme weightsync quantizes to, by name. Each has a test on a real
#: vLLM engine against the fresh-engine oracle (tests/test_quantized_vllm.py, docs/quantized.md).
SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        _per_channel("W8A8-INT8 per-channel", torch.int8, -128.0, 127.0, "int", "int-quantized"),
        _per_channel(
            "FP8 per-channel", torch.float8_e4m3fn, -448.0, 448.0, "float", "float-quantized"
        ),
        *(
            Scheme(
                f"W4A16 group {size}",
                torch.int8,
                -8.0,
                7.0,
                7.5,
                _args("int", "group", False, bits=4, group=size),
                None,
                "pack-quantized",
            )
            for size in (32, 64, 128)
        ),
    )
}

#: Online methods whose arithmetic is one of `SCHEMES` (vLLM's ``fp8_per_channel`` quantizes a
#: loaded bf16 weight exactly as the pre-quantized FP8 scheme does: measured, the same logprobs).
ONLINE: dict[str, str] = {"fp8_per_channel": "FP8 per-channel"}

#: torchao configs (vLLM's online ``quantization="torchao"``) whose arithmetic verification runs
#: on the trainer side, by name -> whether it is weight-only. Only each config at its defaults
#: (per-row scales, symmetric): what was measured (``benchmarks/verification.py``) and tested.
TORCHAO: dict[str, bool] = {
    "Float8WeightOnlyConfig": True,
    "Int8DynamicActivationInt8WeightConfig": False,
}


@dataclass(frozen=True)
class TorchAO:
    """The arithmetic of an online torchao engine, run by torchao itself on the trainer side.

    vLLM's torchao method (``model_executor/layers/quantization/torchao.py``) quantizes each
    loaded linear weight with ``torchao.quantization.quantize_`` and computes
    ``F.linear(x, weight)`` with the tensor subclass it gets: torchao's own kernels decide the
    arithmetic (an int8 dynamic config quantizes ``x`` per token inside that call). Re-deriving it
    here (its scales divide by 127.5, not compressed-tensors' 127, for one) would drift from
    torchao's next release; calling the same code does not. Per-row scales make a fused module
    (``qkv_proj``) quantize as its parts do, so the trainer's unfused layers compute the same.

    Attributes:
        name: as messages and tolerances name it (``"torchao Float8WeightOnlyConfig"``).
        config: the config the engine runs, as ``torchao.core.config.config_to_dict`` writes it.
        weight_only: activations stay in the engine's dtype.
    """

    name: str
    config: Mapping[str, Any]
    weight_only: bool

    def linear(self, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x @ w.T`` as the engine computes it: ``w`` in the engine's dtype quantized by
        torchao as vLLM quantizes it (``torchao_quantize_param_data``), ``x`` in that dtype."""
        from torchao.core.config import config_from_dict  # type: ignore[import-untyped, unused-ignore]
        from torchao.quantization import quantize_  # type: ignore[import-untyped, unused-ignore]

        config = config_from_dict(dict(self.config))
        if hasattr(config, "set_inductor_config"):
            # The flag sets torch._inductor's process-wide options (the trainer's compiles);
            # the arithmetic does not depend on it.
            config = replace(config, set_inductor_config=False)
        with torch.device("meta"):
            holder = torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0], bias=False))
        holder[0].weight = torch.nn.Parameter(w.to(dtype), requires_grad=False)
        quantize_(holder, config)
        return torch.nn.functional.linear(x.to(dtype), holder[0].weight)


#: What `simulated` runs: a scheme weightsync quantizes to, or torchao's own code.
Arithmetic = Scheme | TorchAO


def torchao_of(q: Quantization) -> TorchAO | None:
    """The torchao arithmetic of an online torchao engine whose config is one of `TORCHAO` at
    its defaults; None otherwise (another config or other arguments, no config reported, or
    torchao not installed in the trainer's environment)."""
    reported = q.config.get("torchao") if q.method == "torchao" and not q.prequantized else None
    if not isinstance(reported, Mapping) or reported.get("_type") not in TORCHAO:
        return None
    name = str(reported["_type"])
    try:
        import torchao.quantization  # type: ignore[import-untyped, unused-ignore]
        from torchao.core.config import config_to_dict  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        return None
    default = config_to_dict(getattr(torchao.quantization, name)())
    if json.dumps(reported, sort_keys=True, default=str) != json.dumps(
        default, sort_keys=True, default=str
    ):
        return None
    return TorchAO(f"torchao {name}", reported, TORCHAO[name])


def named(q: Quantization) -> str:
    """``str(q)`` with the torchao config an online torchao engine reports, for messages (the
    record's own name says only ``torchao (online ...)``)."""
    reported = q.config.get("torchao") if q.method == "torchao" else None
    if not isinstance(reported, Mapping):
        return str(q)
    arguments = json.dumps(reported.get("_data", {}), sort_keys=True, default=str)
    return f"{q}, config {reported.get('_type')} {arguments}"


#: The compressed-tensors arguments that change the bytes; others (observer, block_structure
#: None, actorder None) do not, and are not compared.
_COMPARED = ("num_bits", "type", "symmetric", "strategy", "dynamic", "group_size")


def scheme_of(q: Quantization) -> Scheme:
    """The allowlisted scheme of a pre-quantized engine.

    Raises:
        WeightMismatchError: the engine's scheme is not one weightsync reproduces exactly;
            the message names it, says why, and what to do.
    """
    config = q.config
    groups = list((config.get("config_groups") or {}).values())
    found = None
    if q.method == "compressed-tensors" and len(groups) == 1:
        group = groups[0]
        for scheme in SCHEMES.values():
            if (
                list(group.get("targets") or []) == ["Linear"]
                and _same(group.get("weights"), scheme.weight)
                and _same(group.get("input_activations"), scheme.activations)
                and config.get("format") == scheme.format
            ):
                found = scheme
    if found is None:
        raise WeightMismatchError(
            f"the engine is quantized: {q}, a scheme weightsync does not reproduce "
            f"exactly (it quantizes the trainer's weights to {sorted(SCHEMES)}, as compressed-"
            "tensors checkpoints with one config group targeting Linear layers); nothing was "
            "written. Start the engine from the unquantized checkpoint with an online method "
            "(quantization='fp8_per_channel'), or in one of those schemes "
            "(see docs/quantized.md)."
        )
    return found


def arithmetic(q: Quantization) -> Arithmetic | None:
    """The arithmetic the engine runs (to simulate it on the trainer side): a scheme of
    `SCHEMES`, or `TorchAO`; None when weightsync does not know it."""
    if q.prequantized:
        try:
            return scheme_of(q)
        except WeightMismatchError:
            return None
    if q.method == "torchao":
        return torchao_of(q)
    return SCHEMES.get(ONLINE.get(q.method, ""))


@contextlib.contextmanager
def simulated(
    model: torch.nn.Module, scheme: Arithmetic, weights: Mapping[str, Weight], dtype: torch.dtype
) -> Iterator[None]:
    """Run ``model`` (the transformers model; a PEFT model's adapters disabled when the engine
    received merged weights, active when it serves the adapter: PEFT then adds the LoRA term to
    the hooked ``base_layer``'s output, as vLLM's LoRA layers add it to the quantized base's) as a
    quantized engine computes: every linear layer named in ``weights`` (checkpoint module name
    -> the `Weight` the engine received for it: a merged LoRA weight merged) computes
    ``scheme.linear`` of its input and that weight (`Scheme`: input quantized per token for a
    W8A8 scheme, weight quantized, both dequantized, in float32; `TorchAO`: torchao's own code).
    The model is not modified: forward hooks replace the layers' outputs, and are removed on
    exit. What stays between this and the engine is kernel rounding -- and, with 8-bit
    activations, the grid roundings that rounding flips (docs/quantized.md measures both)."""
    hooks = []
    for name, module in model.named_modules():
        weight = weights.get(name.replace(".base_layer", ""))
        if isinstance(module, torch.nn.Linear) and weight is not None:
            hooks.append(module.register_forward_hook(_engine_like(scheme, weight, dtype)))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _engine_like(
    scheme: Arithmetic, weight: Weight, dtype: torch.dtype
) -> Callable[..., torch.Tensor]:
    def forward(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> Any:
        y = scheme.linear(args[0], weight.produce(dtype), dtype).float()
        bias: torch.Tensor | None = getattr(module, "bias", None)
        if bias is not None:
            y = y + bias.float()
        return y.to(out.dtype)

    return forward


def _same(args: Mapping[str, Any] | None, expected: Mapping[str, Any] | None) -> bool:
    """Both absent, or equal in every argument that changes the bytes."""
    if not args or not expected:
        return not args and not expected
    return all(args.get(k) == expected.get(k) for k in _COMPARED)


def quantized_modules(expected: Mapping[str, tuple[int, ...]]) -> set[str]:
    """The modules the engine holds quantized: those it loads a ``weight_scale`` for (the
    engine's own contract says it, whatever the architecture)."""
    return {n.removesuffix(".weight_scale") for n in expected if n.endswith(".weight_scale")}


class _Parts:
    """One weight's quantized tensors, computed once when the first is produced and handed out
    one at a time, so that ``weight`` and ``weight_scale`` -- entries of the stream that may
    fall in two buckets -- cost one quantization and live no longer than until all were sent."""

    def __init__(self, scheme: Scheme, source: Weight) -> None:
        self.scheme, self.source = scheme, source
        self.parts: dict[str, torch.Tensor] = {}

    def take(self, part: str, dtype: torch.dtype) -> torch.Tensor:
        if not self.parts:
            self.parts = self.scheme.quantize(self.source.produce(dtype), dtype)
        return self.parts.pop(part)


def quantized(
    tensors: list[Weight], scheme: Scheme, modules: set[str], dtype: torch.dtype
) -> list[Weight]:
    """``tensors`` as an engine of ``dtype`` loads them: each ``<module>.weight`` of a quantized
    module replaced by its tensors in ``scheme`` (`Scheme.layout`: ``weight`` and
    ``weight_scale``, or ``weight_packed``, ``weight_scale`` and ``weight_shape``; in place, so
    layer order is kept), everything else as it was.

    A quantized weight is computed when its bucket is reached from the tensor a checkpoint in
    the engine's dtype would hold (the trainer's weight cast once, a merged LoRA weight merged in
    float32 and cast once): what quantizing a ``save_pretrained`` checkpoint of the trainer gives,
    so an engine started from that checkpoint quantized is the oracle.
    Its ``inputs`` are the source's, so skipping unchanged layers works as for unquantized ones.

    Raises:
        WeightMismatchError: a weight's shape does not split into the scheme's groups.
    """
    out: list[Weight] = []
    for t in tensors:
        module = t.name.removesuffix(".weight")
        if module == t.name or module not in modules:
            out.append(t)
            continue
        if not scheme.fits(t.shape):
            raise WeightMismatchError(
                f"{t.name} {list(t.shape)} does not split into {scheme.name}'s groups; nothing "
                "was written"
            )
        parts = _Parts(scheme, t)
        for part, shape, sent in scheme.layout(t.shape, dtype):
            out.append(
                Weight(
                    f"{module}.{part}",
                    shape,
                    _taker(parts, part),
                    merged=t.merged,
                    source=hash((t.source, part)),
                    inputs=t.inputs,
                    sent=sent,
                )
            )
    return out


def _taker(parts: _Parts, part: str) -> Callable[[torch.dtype], torch.Tensor]:
    # ``dtype`` is the engine's: the weight is produced in it, then quantized.
    return lambda dtype: parts.take(part, dtype)
