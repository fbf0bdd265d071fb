"""FullSync: push every weight from trainer memory."""

from __future__ import annotations

from typing import Literal

from torch import nn

from ..engines.base import Attestation, Engine
from ..errors import AdapterError
from ..plan import Plan, Weight
from ..trainer import peft_support
from ..trainer.tensors import DEFAULT_BUCKET_BYTES, adapter, base_tensors, is_peft
from .base import Strategy, check_names, in_engine_format, quantization_note, unchanged
from .proof import base_keys

LoraMode = Literal["merge", "separate"]


class FullSync(Strategy):
    """Stream every weight the engine loads from the trainer's memory, a bucket at a time.

    Right after full training, after a level-2 sleep, and for the first sync. For a
    ``peft.PeftModel`` it has two modes:

    - ``lora="merge"``: the engine does not serve LoRA. Each targeted weight is sent as
      ``W + scale * B @ A`` (summed over the active adapters), computed out of place in float32
      and cast once; the trainer's weights are untouched. A layer merged in place by the caller
      (``merge_adapter()``) is sent as it is: that is what the trainer computes.
    - ``lora="separate"``: the engine serves LoRA. The base is sent unmerged, then the adapter
      is loaded in place -- never merged *and* applied (LoRA counted twice, ms-swift#8233).

    ``lora=None`` picks ``separate`` when the engine serves LoRA, else ``merge``.

    Cost: every byte of the model once, plus the engine's own post-load processing. Extra
    memory on the trainer side: one bucket of merged tensors (none for a dense model whose
    dtype matches the engine's: the engine reads the trainer's tensors directly).

    Args:
        lora: how to send a LoRA model (ignored for a model without adapters).
        bucket_bytes: size of the groups tensors are materialised and sent in.
        skip_unchanged: leave out the layers the engine still holds exactly: every input
            frozen (``requires_grad=False``) with the same content (xxh3-128 of its bytes) as
            at the last completed sync into this engine -- frozen embeddings, frozen layers, a
            vision tower, the base of a merged LoRA's untargeted layers -- and the engine
            attests that nothing touched its weights since (its epoch). Never after a sleep
            the caller reports, a failed sync, a checkpoint reload, or into an engine that
            cannot attest. See `content_key` and `unchanged`.
        reason: why this strategy was chosen, for logs.
    """

    name = "FullSync"
    restores_base = True
    default_reason = "full sync requested"

    def __init__(
        self,
        *,
        lora: LoraMode | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        skip_unchanged: bool = True,
        reason: str | None = None,
    ) -> None:
        super().__init__(reason=reason)
        self.skip_unchanged = skip_unchanged
        if lora not in (None, "merge", "separate"):
            raise ValueError(f"lora must be 'merge', 'separate' or None, got {lora!r}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.lora = lora
        self.bucket_bytes = bucket_bytes

    @property
    def label(self) -> str:
        return f"FullSync(lora={self.lora})" if self.lora else "FullSync"

    def _plan(self, model: nn.Module, engine: Engine, now: Attestation) -> Plan:
        mode = self.lora or ("separate" if engine.serves_lora else "merge")
        peft = is_peft(model)
        served = None
        notes: tuple[str, ...] = ()
        if peft:
            notes = peft_support.check(model, "serve" if mode == "separate" else "merge").notes
        if peft and mode == "separate":
            if not engine.serves_lora:
                raise AdapterError(
                    "FullSync(lora='separate') sends base and adapter apart, but the engine does "
                    "not serve LoRA; use lora='merge' or create the engine with enable_lora=True"
                )
            served = adapter(model)
            engine.check_adapter(served)
        tensors = base_tensors(
            model, merge_lora=peft and mode == "merge", expected=engine.expected_weights
        )
        # What an adapter sent alone later must find (strategies/proof.py): recorded only where
        # one can be (an engine serving LoRA). With skip_unchanged, every frozen tensor is
        # hashed anew here anyway, and the skip below reuses those digests.
        base = base_keys(tensors, fresh=self.skip_unchanged) if engine.serves_lora else None
        tensors = in_engine_format(tensors, engine)
        notes += quantization_note(engine)
        check_names(tensors, engine, complete=True)
        skip = unchanged(
            tensors, engine, enabled=self.skip_unchanged, digests=_digests(tensors, base)
        )
        return Plan(
            strategy=self.label,
            reason=self.reason,
            engine=engine.describe(),
            dtype=engine.dtype,
            weights=tuple(skip.send),
            adapter=served,
            restores_base=True,
            bucket_bytes=self.bucket_bytes,
            notes=notes,
            skipped=tuple(skip.skipped),
            skipped_groups=tuple(skip.groups),
            skip_note=skip.note,
            attested=skip.attested,
            held_after=skip.held_after,
            base_after=base,
        )


def _digests(tensors: list[Weight], base: dict[str, tuple] | None) -> dict[int, tuple]:
    """The content digests ``base`` holds, by input tensor, as `unchanged` caches them."""
    if not base:
        return {}
    out = {}
    for t in tensors:
        key = base.get(t.name)
        if key is not None and key[0] == "content":
            out[id(t.inputs[0])] = key[1]
    return out
