"""The values a plan would write, checked before anything is written: finite, and with data.

A weight holding one NaN or inf is a weight no engine can serve: written, it turns every
token's logits to NaN (greedy decoding then answers token 0), and the NaN it leaves in KV-cache
blocks outlives the write (docs/failure-modes.md). A tensor on the ``meta`` device, or whose
storage was freed (an offloaded or not-yet-gathered parameter), has no values at all; vLLM's
reload would fail on it after the write began. So `check_plan` refuses both, naming the
weight, before the first byte moves.

Why a pass of its own: the stream is lazy (a bucket is produced when the engine's layerwise
reload asks for it, and the layers before it are already loaded by then), so a check riding
production would find a NaN in the last bucket after the first ones were written. The check
reads the *trainer's* tensors instead -- every input a weight is computed from, each once
(tied and fused tensors are shared) -- with one reduction each, and bounds what production
computes from them: a plain weight is the tensor cast to the engine's dtype (finite if its
largest magnitude casts finite), a merged LoRA weight is ``W + s * B @ A``, at most
``max|W| + |s| * r * max|B| * max|A|`` in magnitude; only a weight whose bound does not fit the
engine's dtype is produced here to be checked exactly. An adapter's factors (hundreds of small
tensors) are first checked together, one fused 2-norm per dtype (`_all_fit`), and one by one
only when that cannot vouch for them. What it costs on a 0.5B model is in docs/benchmarks.md.

A sharded tensor (FSDP2's ``DTensor``) is checked on this rank's shard: every rank plans, and
`weightsync.distributed` shares any rank's refusal before anything is written. Not covered
there: a weight computed from tensors the plan does not list (LoRA on a bare parameter,
``target_parameters``), which elsewhere is produced to be checked -- producing it on a sharded
trainer is a gather every rank must join.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch

from ..errors import BadValuesError
from ..plan import Adapter, Plan, Weight

# A 16-bit float is checked on its bits, a chunk at a time: its magnitude bits (sign cleared)
# are an integer that orders as its magnitude, and it is NaN or inf exactly when they reach the
# exponent's all-ones pattern. Integer ops run vectorised on every device and CPU, which
# ``torch.aminmax`` of bfloat16 does not on every CPU, in one pass (the earlier reading of
# bfloat16 pairs as float32 words took four). The chunk's mask stays in cache; much smaller
# chunks pay the ops' per-call cost (docs/benchmarks.md).
_NON_FINITE_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}
_CHUNK = 1 << 20  # elements per masked chunk: the mask buffer stays in cache


def check_plan(plan: Plan) -> None:
    """Raise `BadValuesError` unless every value ``plan`` would write is finite in the engine's
    dtype and every tensor it reads has data; read-only, nothing is written.

    Raises:
        BadValuesError: naming the weight (and, for a computed weight, which of its inputs)
            and what was found.
    """
    seen: dict[int, float] = {}
    for w in plan.weights:
        _check_weight(w, _cast_to(w, plan.dtype), seen)
    if plan.adapter is not None:
        _check_adapter(plan.adapter, plan.dtype, seen)


def _check_weight(w: Weight, dtype: torch.dtype, seen: dict[int, float]) -> None:
    tensors = [x for x in w.inputs if isinstance(x, torch.Tensor)]
    if not tensors:  # computed from tensors the plan does not list: check what it produces
        if not _collective():
            _check_produced(w, dtype)
        return
    peaks = [_peak(w.name, x, seen, _role(w, i)) for i, x in enumerate(tensors)]
    if not w.merged:
        bound = peaks[0]
    else:
        bound = _merged_bound(w.inputs, peaks)
        if bound > torch.finfo(torch.float32).max:  # the merge itself runs in float32
            _check_produced(w, dtype)
            return
    if not _fits(bound, dtype):
        if w.merged:  # the bound is loose: decide on the value itself
            _check_produced(w, dtype)
            return
        raise BadValuesError(
            f"{w.name}: the trainer's tensor holds a value of magnitude {bound:.4g}, beyond what "
            f"the engine's {_short(dtype)} can hold ({torch.finfo(dtype).max:.4g}): it would be "
            "sent as inf. Nothing was written."
        )


def _cast_to(w: Weight, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``w``'s trainer tensor is cast to before it travels: the plan's, except for
    a tensor sent in the dtype the trainer holds it in (a persistent buffer, a float32 router
    the engine holds in float32: `weightsync.trainer.tensors.as_engine_holds`), which is not
    cast at all. A quantized part is bounded in the plan's dtype, which it is computed from."""
    return w.sent if w.sent is not None and w.sent == w.held else dtype


def _check_adapter(adapter: Adapter, dtype: torch.dtype, seen: dict[int, float]) -> None:
    if _all_fit(adapter.tensors.values(), dtype):
        return
    for key, t in adapter.tensors.items():
        peak = _peak(f"adapter {adapter.name!r} tensor {key}", t, seen, "")
        if not _fits(peak, dtype):
            raise BadValuesError(
                f"adapter {adapter.name!r} tensor {key} holds a value of magnitude {peak:.4g}, "
                f"beyond what the engine's {_short(dtype)} can hold: the engine would apply inf. "
                "Nothing was written."
            )


def _all_fit(tensors: Iterable[torch.Tensor], dtype: torch.dtype) -> bool:
    """Whether every tensor has data and every value is finite in ``dtype``, by one cheap
    test; False says only that the exact check (`_peak`, per tensor) must decide and name the
    tensor.

    An adapter is hundreds of small factors, which the exact check reads one reduction and
    several Python calls apiece. Here the factors of each dtype go through one fused
    ``torch._foreach_norm`` (the 2-norm): a factor's norm is NaN or inf when it holds a NaN or
    an inf (squares do not cancel, as +inf and -inf do in a sum), and it bounds the factor's
    largest magnitude, so a norm within half the dtype's range (slack for the rounding of the
    sum of squares) proves every value fits. A norm that overflows although the values are
    finite (their squares exceed float32) only sends the factors to the exact check.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        local = t.detach()
        if not local.is_floating_point() or hasattr(local, "to_local") or not _has_data(local):
            return False
        if local.numel():
            groups.setdefault((local.dtype, local.device), []).append(local)
    for group in groups.values():
        top = float(torch.stack(torch._foreach_norm(group, 2)).max())
        if not math.isfinite(top) or not _fits(2 * top, dtype):
            return False
    return True


def _has_data(t: torch.Tensor) -> bool:
    """Whether ``t`` is on a real device and its storage holds all of its elements."""
    if t.device.type == "meta":
        return False
    extent = t.numel() if t.is_contiguous() else _extent(t)
    return (
        not t.numel()
        or t.untyped_storage().nbytes() >= (t.storage_offset() + extent) * t.element_size()
    )


def _role(w: Weight, i: int) -> str:
    """How input ``i`` of ``w`` enters it, for the message."""
    if not w.merged or i == 0:
        return "" if len([x for x in w.inputs if isinstance(x, torch.Tensor)]) == 1 else " (base)"
    return " (one of its LoRA factors)"


def _peak(name: str, t: torch.Tensor, seen: dict[int, float], role: str) -> float:
    """The largest magnitude in ``t`` (this rank's shard of a sharded one), checked to have
    data and to be finite; each tensor is read once per plan."""
    if id(t) in seen:
        return seen[id(t)]
    local = t.to_local() if hasattr(t, "to_local") else t
    local = local.detach()
    if local.device.type == "meta":
        raise BadValuesError(
            f"{name}{role} is on the meta device: it has a shape but no values (a parameter not "
            "loaded yet, or offloaded, e.g. by accelerate's init_empty_weights or device_map "
            "offload). Load or gather it onto a real device before syncing. Nothing was written."
        )
    needed = (local.storage_offset() + _extent(local)) * local.element_size()
    if local.numel() and local.untyped_storage().nbytes() < needed:
        raise BadValuesError(
            f"{name}{role} has no data: its storage holds "
            f"{local.untyped_storage().nbytes()} bytes, its shape {list(local.shape)} needs "
            f"{needed} (storage freed, as FSDP does to an unsharded parameter outside its "
            "forward, or offloaded). Gather it before syncing. Nothing was written."
        )
    peak = _largest(local) if local.numel() else 0.0
    if peak != peak or peak == float("inf"):
        nan = int(torch.isnan(local).sum())
        inf = int(torch.isinf(local).sum())
        raise BadValuesError(
            f"{name}{role} holds {nan} NaN and {inf} inf value(s) (of {local.numel()}); an "
            "engine serving it would generate garbage. Nothing was written. Find where the "
            "training step diverged (a learning rate too high, a loss without a guard)."
        )
    seen[id(t)] = peak
    return peak


def _extent(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to its last, inclusive (its strides allowed)."""
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))


def _largest(t: torch.Tensor) -> float:
    """max |t|, NaN if ``t`` holds NaN or inf (16-bit) or NaN (wider), inf if a wider ``t``
    holds inf and no NaN."""
    if t.dtype in _NON_FINITE_BITS:
        return _largest_bits(t)
    if not t.is_floating_point():
        return float(t.abs().max())
    lo, hi = torch.aminmax(t)
    lo_, hi_ = float(lo), float(hi)
    if lo_ != lo_ or hi_ != hi_:
        return float("nan")
    return max(-lo_, hi_)


def _largest_bits(t: torch.Tensor) -> float:
    bits = t.contiguous().reshape(-1).view(torch.int16)
    buf = torch.empty(min(_CHUNK, bits.numel()), dtype=torch.int16, device=bits.device)
    top = 0
    for start in range(0, bits.numel(), _CHUNK):
        part = bits[start : start + _CHUNK]
        out = buf[: part.numel()]
        torch.bitwise_and(part, 0x7FFF, out=out)
        top = max(top, int(out.max()))
    if top >= _NON_FINITE_BITS[t.dtype]:
        return float("nan")
    return abs(float(torch.tensor([top], dtype=torch.int16).view(t.dtype)))


def _merged_bound(inputs: Iterable[torch.Tensor | float], peaks: list[float]) -> float:
    """A bound on ``|W + sum_a s_a * B_a @ A_a|`` from the magnitudes of its inputs, laid out as
    ``weightsync.trainer.tensors`` lists them: the base, then per adapter its factors (A first,
    ``(r, ...)``; B; B's bias if any) and its scale."""
    it = iter(peaks)
    bound = next(it)
    group: list[tuple[torch.Tensor, float]] = []
    items = list(inputs)[1:]
    for x in items:
        if isinstance(x, torch.Tensor):
            group.append((x, next(it)))
            continue
        if group:
            (a, pa), *rest = group
            rank = a.shape[0] if a.dim() else 1
            pb = rest[0][1] if rest else 1.0
            extra = sum(p for _, p in rest[1:])
            bound += abs(float(x)) * (rank * pa * pb + extra)
        group = []
    return bound


def _check_produced(w: Weight, dtype: torch.dtype) -> None:
    value = w.produce(dtype)
    peak = _largest(value.detach()) if value.is_floating_point() and value.numel() else 0.0
    if peak != peak or peak == float("inf"):
        raise BadValuesError(
            f"{w.name}: computed on the trainer's side (a merged LoRA weight), it is not "
            f"finite in the engine's {_short(dtype)} although its inputs are: the adapter's "
            "contribution overflows. Nothing was written."
        )


def _collective() -> bool:
    """Whether producing a weight may be a collective (ranks of a sharded trainer plan apart and
    agree afterwards; one rank producing alone would wait for the others forever)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _fits(peak: float, dtype: torch.dtype) -> bool:
    """Whether a value of magnitude ``peak`` stays finite cast to ``dtype``."""
    if not dtype.is_floating_point:
        return True
    limit = _overflow(dtype)
    if limit is None:  # a format whose overflow torch decides (float8 kinds): ask it
        return bool(torch.isfinite(torch.tensor([peak], dtype=torch.float64).to(dtype)).all())
    return peak < limit


@functools.cache
def _overflow(dtype: torch.dtype) -> float | None:
    """The smallest magnitude a cast to ``dtype`` rounds to inf (IEEE formats with inf); inf
    for float64. Plain float arithmetic: a torch cast per tensor was a sixth of an adapter
    sync's plan (hundreds of factors)."""
    if dtype == torch.float64:
        return math.inf
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    info = torch.finfo(dtype)
    _, exponent = math.frexp(info.max)
    # half an ulp above max rounds up (max's mantissa is odd, so the tie goes to inf too)
    limit = info.max + 2.0 ** (exponent - 1) * info.eps / 2
    if dtype != torch.float32:
        # torch casts a wider value to 16 bits through float32: a value within half a float32
        # ulp below the limit rounds up to it there, then to inf
        limit -= 2.0 ** (exponent - 1) * torch.finfo(torch.float32).eps / 2
    return limit


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
