"""What travels between the trainer side and the engine side, and the plan of one sync.

A sync is two steps: a strategy *plans* it (every name, shape and dtype that will be written,
which tensors are merged, the adapter and its config as the engine will load it), checking the
plan against the engine; then the plan is *executed*. Every refusal happens while planning, so
a refused sync has written nothing and the engine still serves what it had. ``print(plan)`` is
the short explanation a person debugging a run wants to read.

These types import nothing from the engine side or the trainer side, so both can use them, and
so can code loaded inside an engine's own processes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Literal

import torch

#: What a weight stream is cut into: (checkpoint name, tensor) pairs materialised together.
Bucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Weight:
    """One tensor the engine will receive: its checkpoint name, shape, and how to produce it.

    ``produce(dtype)`` materialises it when its bucket is reached (a merged LoRA weight is
    computed then, not at planning time). ``source`` identifies the trainer tensor it comes
    from: names that share one (tied embeddings) share it. ``held`` is the dtype of a tensor
    the trainer holds as it is; ``produce(held)`` then reads the trainer's memory, no copy.
    ``inputs`` are the trainer tensors (and scales) the value is computed from: a tensor whose
    inputs have the same content as when the engine received it need not be sent again, if the
    engine attests it still holds it (see `content_key`); without inputs it is always sent.
    ``sent`` is the dtype a tensor travels in whatever the plan's (a quantized weight and its
    scale, `weightsync.trainer.quantize`); None: the plan's dtype.
    """

    name: str
    shape: tuple[int, ...]
    produce: Callable[[torch.dtype], torch.Tensor]
    merged: bool = False
    source: int = 0
    held: torch.dtype | None = None  # the dtype the trainer holds it in (None: computed)
    inputs: tuple[torch.Tensor | float, ...] = ()  # what its value is computed from
    sent: torch.dtype | None = None  # the dtype it travels in (None: the plan's)


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter in PEFT's on-disk form, as the engine will load it.

    ``tensors`` are keyed as in ``adapter_model.safetensors``
    (``base_model.model.<module>.lora_A.weight``) and share storage with the trainer. ``config``
    is the ``adapter_config.json`` the engine reads: the trainer's config translated to what the
    engine serves (see `weightsync.peft_support`). ``modules_to_save`` copies are not part
    of it: they are full weights, sent through the weight stream.
    """

    name: str
    config: dict
    tensors: dict[str, torch.Tensor]
    rank: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def content_key(t: Weight, digests: dict[int, tuple] | None = None) -> tuple | None:
    """What ``t``'s value is computed from, by *content*, or None when it is always sent.

    Only a tensor computed from frozen (``requires_grad=False``) plain CPU tensors gets a key:
    each input tensor contributes its dtype, shape and the xxh3-128 digest of its bytes, each
    scale its value. Identity and version counters are not used: writes through ``.data``
    (PEFT's own ``merge_adapter`` / ``unmerge_adapter``, ``p.data.copy_``) change neither, and
    fused optimizers write without bumping the version. A trainable input makes the key None
    (an optimizer step changes it almost always, and hashing it would cost more than it could
    save); so does a sharded or non-CPU tensor (hashing it would need a gather or a device
    copy). ``digests`` caches digests by tensor identity within one plan (tied tensors).
    """
    tensors = [x for x in t.inputs if isinstance(x, torch.Tensor)]
    if not t.inputs or any(x.requires_grad or not _plain_cpu(x) for x in tensors):
        return None
    cache = {} if digests is None else digests
    parts: list[object] = [t.merged]
    for x in t.inputs:
        if isinstance(x, torch.Tensor):
            if id(x) not in cache:
                cache[id(x)] = digest(x)
            parts.append(cache[id(x)])
        else:
            parts.append(x)
    return tuple(parts)


def digest(x: torch.Tensor) -> tuple:
    """(dtype, shape, xxh3-128 of the bytes) of a plain CPU tensor."""
    import xxhash

    data = x.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return (str(x.dtype), tuple(x.shape), xxhash.xxh3_128_hexdigest(data.data))


def _plain_cpu(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and not hasattr(x, "full_tensor")


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def nbytes(tensors: tuple[Weight, ...] | list[Weight], dtype: torch.dtype) -> int:
    """Bytes ``tensors`` occupy when sent: in ``dtype``, or in their own `Weight.sent` dtype."""
    return sum(itemsize(t.sent or dtype) * numel(t.shape) for t in tensors)


def itemsize(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Plan:
    """Everything one sync will write, in order, decided and checked before the first write.

    Executing a plan does, in this order and nothing else: with ``reload="snapshot"``, write
    ``weights`` as a checkpoint into ``snapshot_dir`` and have the engine reload that folder;
    otherwise have the engine reload its own checkpoint (``reload="checkpoint"``), then stream
    ``weights``; last, load ``adapter``. See `weightsync.strategies.base.execute`.

    Attributes:
        strategy: the strategy's label (``FullSync(lora=merge)``).
        reason: why this strategy was chosen.
        engine: a one-line description of the engine the plan was checked against.
        dtype: the dtype weights are cast to, once, on the trainer side.
        weights: the weights streamed (or written to the snapshot), in stream order.
        reload: ``"checkpoint"`` (the engine re-reads the checkpoint it started from),
            ``"snapshot"`` (``weights`` go through a checkpoint folder), or None.
        snapshot_dir: the folder of a ``"snapshot"`` reload.
        adapter: the adapter loaded after the base (None: none).
        restores_base: once executed, every base weight of the engine equals the trainer's.
        bucket_bytes: the size weights are materialised and sent in.
        notes: decisions a reader should see (merged layers, tied names, translated options).
        skipped: weights left out because the engine already holds exactly them.
        skipped_groups: the groups (decoder layers, modules) those weights form.
        skip_note: why the skipped weights are known to be unchanged, or why nothing was
            skipped.
        attested: the engine epoch the skip was decided on; the write is refused (nothing
            written) if the engine's epoch moved before it starts.
        held_after: what the engine holds once the plan is executed (name -> content key), for
            the next plan's skipping; empty when nothing may be skipped next time.
        base_after: the base the engine holds once the plan is executed, by the unmerged
            trainer tensor each name received (name -> `strategies.proof.base_key`; a merged
            or trainable weight has none): what proves an adapter sent alone later lands on
            the base it was trained against. None: unknown (nothing may be sent alone onto it).
    """

    strategy: str
    reason: str
    engine: str
    dtype: torch.dtype
    weights: tuple[Weight, ...] = ()
    reload: Literal["checkpoint", "snapshot"] | None = None
    snapshot_dir: str | None = None
    adapter: Adapter | None = None
    restores_base: bool = False
    bucket_bytes: int = 512 << 20
    notes: tuple[str, ...] = field(default_factory=tuple)
    skipped: tuple[str, ...] = ()
    skipped_groups: tuple[str, ...] = ()
    skip_note: str = ""
    attested: Hashable | None = field(default=None, repr=False)
    held_after: dict = field(default_factory=dict, repr=False)
    base_after: dict | None = field(default=None, repr=False)

    @property
    def weight_bytes(self) -> int:
        return nbytes(self.weights, self.dtype)

    @property
    def writes(self) -> bool:
        """Whether executing this plan writes anything into the engine."""
        return bool(self.weights or self.reload or self.adapter)

    def __str__(self) -> str:
        lines = [f"{self.strategy} into {self.engine}", f"  why: {self.reason}"]
        steps = []
        if self.reload == "checkpoint":
            steps.append("the engine reloads the checkpoint it was started from")
        if self.weights:
            merged = sum(t.merged for t in self.weights)
            how = (
                f"write a snapshot into {self.snapshot_dir} and have the engine reload it"
                if self.reload == "snapshot"
                else "stream"
            )
            steps.append(
                f"{how}: {len(self.weights)} weights, {_mib(self.weight_bytes)} in "
                f"{str(self.dtype).removeprefix('torch.')}"
                + (f", {merged} with LoRA merged in (float32, cast once)" if merged else "")
                + _quantized(self.weights)
            )
        if self.adapter is not None:
            a = self.adapter
            steps.append(
                f"load adapter {a.name!r}: rank {a.rank}, {len(a.tensors)} tensors, "
                f"{_mib(a.nbytes)}, targets {sorted(_targets(a))}"
            )
        if self.skipped:
            groups = self.skipped_groups
            steps.append(
                f"skip {len(self.skipped)} weights in {len(groups)} group(s) "
                f"({', '.join(groups[:4])}{', ...' if len(groups) > 4 else ''}): {self.skip_note}"
            )
        lines += [f"  {i}. {step}" for i, step in enumerate(steps, 1)] or ["  nothing to write"]
        shown = [
            f"{t.name} {list(t.shape)}{' (merged)' if t.merged else ''}" for t in self.weights[:3]
        ]
        if len(self.weights) > 3:
            shown.append(f"... {len(self.weights) - 3} more, in layer order")
        lines += [f"     {line}" for line in shown]
        lines += [f"  note: {n}" for n in self.notes]
        if self.skip_note and not self.skipped and self.weights:
            lines.append(f"  note: nothing skipped: {self.skip_note}")
        return "\n".join(lines)


def _quantized(weights: tuple[Weight, ...]) -> str:
    # a tensor sent in the dtype the trainer holds it in (a persistent buffer) is no quantization
    sent = [str(t.sent).removeprefix("torch.") for t in weights if t.sent not in (None, t.held)]
    own = sum(t.sent is not None and t.sent == t.held for t in weights)
    kinds = ", ".join(f"{sent.count(d)} {d}" for d in dict.fromkeys(sent))
    return (f" (quantized on the trainer side: {kinds})" if sent else "") + (
        f" ({own} in the dtype the trainer holds them in)" if own else ""
    )


def _targets(adapter: Adapter) -> set[str]:
    return {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in adapter.tensors}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
