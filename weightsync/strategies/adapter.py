"""AdapterSync: push only the LoRA adapter."""

from __future__ import annotations

from torch import nn

from ..engines.base import Engine
from ..plan import Adapter, Plan, Weight
from ..trainer.tensors import DEFAULT_BUCKET_BYTES, adapter, trained_copies
from .base import Strategy, check_names, in_engine_format


class AdapterSync(Strategy):
    """Replace the engine's adapter with the trainer's, leaving the base alone.

    Right when the engine serves LoRA and already holds the trainer's base: after the first
    full sync, and after sleeps that kept the weights (level 0 or 1). Wrong after a level-2
    sleep -- the base is gone -- so it refuses to run then.

    The adapter replaces the engine's copy in place under a stable id. ``modules_to_save``
    copies (say, a trained ``lm_head``) are full weights the engine holds as base weights, so
    they are sent too, through the same checked weight path.

    Cost: the adapter's bytes (for rank 16 on a 0.5B model, about 1% of the model) plus one
    adapter load.
    """

    name = "AdapterSync"
    restores_base = False
    default_reason = "adapter-only sync requested"

    def _plan(self, model: nn.Module, engine: Engine) -> Plan:
        served, copies = adapter_part(model, engine)
        return Plan(
            strategy=self.label,
            reason=self.reason,
            engine=engine.describe(),
            dtype=engine.dtype,
            weights=tuple(copies),
            adapter=served,
            bucket_bytes=DEFAULT_BUCKET_BYTES,
        )


def adapter_part(model: nn.Module, engine: Engine) -> tuple[Adapter, list[Weight]]:
    """The adapter of ``model`` and its ``modules_to_save`` copies, checked against ``engine``."""
    served = adapter(model)
    engine.check_adapter(served)
    copies = in_engine_format(trained_copies(model), engine)
    check_names(copies, engine, complete=False)
    return served, copies
