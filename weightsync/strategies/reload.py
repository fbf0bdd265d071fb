"""ReloadWeights: let the engine read weights from a checkpoint on disk."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..engines.base import Engine
from ..errors import UnsupportedModelError
from ..stream import DEFAULT_BUCKET_BYTES, Tensor, adapter, base_tensors, buckets, nbytes, numel
from ..stream import _is_peft as is_peft
from .adapter import send_adapter
from .base import Strategy, _Tally, check_names


class ReloadWeights(Strategy):
    """Have the engine reload its weights from disk, then load the adapter if it serves one.

    Two sources:

    - ``snapshot_dir=None``: the engine's *original* checkpoint. Right only when the trainer's
      base is that checkpoint, untouched: LoRA training with the engine serving the adapter.
      It restores a base discarded by a level-2 sleep without sending it from trainer memory.
      With full training or merged LoRA it would silently serve stale weights (trl#5312), so it
      refuses to run then.
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

    def _sync(self, model: nn.Module, engine: Engine, tally: _Tally) -> None:
        separate = is_peft(model) and engine.serves_lora
        if self.snapshot_dir is None:
            if not separate:
                raise UnsupportedModelError(
                    "ReloadWeights from the engine's own checkpoint restores the untouched base, "
                    "but this trainer's base weights change (full training, or LoRA merged into "
                    "the weights): the engine would serve stale weights. Use FullSync, or "
                    "ReloadWeights(snapshot_dir=...) to reload the trainer's current weights."
                )
            engine.check_adapter(adapter(model))
            tally.engine_calls += engine.reload_checkpoint()
            tally.bytes += nbytes_expected(engine)
            tally.tensors += len(engine.expected_weights)
        else:
            tensors = base_tensors(model, merge_lora=not separate, expected=engine.expected_weights)
            check_names(tensors, engine, complete=True)
            if separate:
                engine.check_adapter(adapter(model))
            write_snapshot(tensors, engine, self.snapshot_dir, self.bucket_bytes)
            tally.engine_calls += engine.reload_checkpoint(str(self.snapshot_dir))
            tally.bytes += nbytes(tensors, engine.dtype)
            tally.tensors += len(tensors)
        if separate:
            send_adapter(model, engine, tally)


def nbytes_expected(engine: Engine) -> int:
    """Bytes of every weight the engine loads, in its dtype."""
    itemsize = torch.empty((), dtype=engine.dtype).element_size()
    return sum(numel(shape) * itemsize for shape in engine.expected_weights.values())


def write_snapshot(tensors: list[Tensor], engine: Engine, folder: Path, bucket_bytes: int) -> None:
    """Write ``tensors`` as safetensors shards into ``folder``, replacing earlier shards."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.safetensors"):
        old.unlink()
    # A tied tensor is stored once, under its first name, as a checkpoint stores it (safetensors
    # refuses shared storage); the engine's reload sends it under its other names.
    unique: dict[int, Tensor] = {}
    for t in tensors:
        unique.setdefault(t.source, t)
    for i, bucket in enumerate(buckets(list(unique.values()), engine.dtype, bucket_bytes)):
        save_file({name: t.contiguous() for name, t in bucket}, str(folder / f"weights-{i:05d}.safetensors"))
