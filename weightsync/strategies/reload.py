"""ReloadWeights: let the engine read weights from a checkpoint on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from ..engines.base import Attestation, Engine
from ..errors import UnsupportedModelError
from ..plan import Adapter, Plan
from ..trainer import peft_support
from ..trainer.tensors import DEFAULT_BUCKET_BYTES, adapter, base_tensors, is_peft
from .adapter import adapter_part
from .base import Strategy, check_names, in_engine_format, quantization_note
from .proof import base_keys, require_untouched_base


class ReloadWeights(Strategy):
    """Have the engine reload its weights from disk, then load the adapter if it serves one.

    Two sources:

    - ``snapshot_dir=None``: the engine's *original* checkpoint. Right only when the trainer's
      base is that checkpoint, untouched: LoRA training with the engine serving the adapter.
      It restores a base discarded by a level-2 sleep without sending it from trainer memory.
      Whenever the trainer's base can differ from the checkpoint it is refused, so it never
      serves stale weights (trl#5312): full training, merged LoRA, an initialisation that
      rewrote the base (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA), a base parameter left trainable,
      or a base whose sampled values differ from the checkpoint's.
    - ``snapshot_dir=<folder>``: the trainer writes its current weights there as safetensors
      (merged, or base only when the engine serves LoRA), a bucket per file, and the engine
      reloads that folder. Always valid; it costs a write and a read of the model through the
      page cache, and leaves a checkpoint of the current weights behind.

    Cost: vLLM's own load of the checkpoint (plus the snapshot write when one is made).
    """

    name = "ReloadWeights"
    restores_base = True
    default_reason = "reload from checkpoint requested"

    def __init__(
        self,
        *,
        snapshot_dir: str | Path | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        reason: str | None = None,
    ) -> None:
        super().__init__(reason=reason)
        self.snapshot_dir = Path(snapshot_dir) if snapshot_dir is not None else None
        self.bucket_bytes = bucket_bytes

    @property
    def label(self) -> str:
        return "ReloadWeights(snapshot)" if self.snapshot_dir else "ReloadWeights(checkpoint)"

    def _plan(self, model: nn.Module, engine: Engine, now: Attestation) -> Plan:
        separate = is_peft(model) and engine.serves_lora
        common: dict[str, Any] = dict(
            strategy=self.label,
            reason=self.reason,
            engine=engine.describe(),
            dtype=engine.dtype,
            restores_base=True,
            bucket_bytes=self.bucket_bytes,
        )
        served: Adapter | None
        if self.snapshot_dir is None:
            if not separate:
                raise UnsupportedModelError(
                    "ReloadWeights from the engine's own checkpoint restores the untouched base, "
                    "but this trainer's base weights change (full training, or LoRA merged into "
                    "the weights): the engine would serve stale weights. Use FullSync, or "
                    "ReloadWeights(snapshot_dir=...) to reload the trainer's current weights."
                )
            require_untouched_base(model, engine)
            served, copies, sent = adapter_part(model, engine)
            # The reloaded checkpoint is the trainer's base, as far as require_untouched_base
            # checks it (a sample): the trainer's keys become the engine's record of its base.
            unmerged = base_tensors(model, merge_lora=False, expected=engine.expected_weights)
            skip = set(sent)
            return Plan(
                **common,
                reload="checkpoint",
                weights=tuple(copies),
                adapter=served,
                base_after=base_keys(t for t in unmerged if t.name not in skip),
            )
        notes: tuple[str, ...] = ()
        if is_peft(model):
            notes = peft_support.check(model, "serve" if separate else "merge").notes
        served = adapter(model) if separate else None
        if served is not None:
            engine.check_adapter(served)
        tensors = base_tensors(model, merge_lora=not separate, expected=engine.expected_weights)
        base = base_keys(tensors) if engine.serves_lora else None
        tensors = in_engine_format(tensors, engine)
        notes += quantization_note(engine)
        check_names(tensors, engine, complete=True)
        return Plan(
            **common,
            reload="snapshot",
            snapshot_dir=str(self.snapshot_dir),
            weights=tuple(tensors),
            adapter=served,
            notes=notes,
            base_after=base,
        )
