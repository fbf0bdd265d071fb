"""AdapterSync: push only the LoRA adapter."""

from __future__ import annotations

from torch import nn

from ..engines.base import Attestation, Engine
from ..errors import BaseUnprovenError
from ..plan import Adapter, Plan, Weight
from ..trainer.tensors import DEFAULT_BUCKET_BYTES, adapter, trained_copies
from .base import Strategy, check_names, in_engine_format
from .proof import adapter_base


class AdapterSync(Strategy):
    """Replace the engine's adapter with the trainer's, leaving the base alone.

    Right only when the engine holds the exact base the adapter was trained against, and that
    is proven before anything is written (`weightsync.strategies.proof`): the base weightsync
    last wrote into the engine, recorded by content and attested untouched since (a level-1
    sleep keeps it; a level-2 sleep, a write by anyone, a restart do not), equals the trainer's
    frozen base now; or weightsync wrote nothing and the engine's own checkpoint is the
    trainer's base (checked as `ReloadWeights` checks it). After a merged sync
    (``FullSync(lora="merge")``: the adapter is inside the weights), a base from another model,
    or a frozen base changed on the trainer's side, it refuses with `BaseUnprovenError`;
    `weightsync.Syncer` plans a base restore (FullSync base + adapter) instead.

    The adapter replaces the engine's copy in place under a stable id. ``modules_to_save``
    copies (say, a trained ``lm_head``) are full weights the engine holds as base weights, so
    they are sent too, through the same checked weight path.

    Cost: the adapter's bytes (for rank 16 on a 0.5B model, about 1% of the model) plus one
    adapter load, plus the proof: a check that no frozen base tensor was written since the
    last proof (`weightsync.strategies.proof`; a tensor written since is fingerprinted and, if
    changed, hashed again; the first proof against an engine's own checkpoint hashes the whole
    base once), and one attestation of the engine before planning and one before writing.
    """

    name = "AdapterSync"
    restores_base = False
    default_reason = "adapter-only sync requested"

    def _plan(self, model: nn.Module, engine: Engine, now: Attestation) -> Plan:
        served, copies, sent = adapter_part(model, engine)
        base, why = adapter_base(model, engine, sent, now)
        if base is None:
            raise BaseUnprovenError(
                f"{self.label}: nothing was written: the adapter would land on a base it was not "
                f"trained against -- {why}. Restore the base with the adapter: "
                "FullSync(lora='separate') (Syncer plans it by itself).",
                why,
            )
        return Plan(
            strategy=self.label,
            reason=self.reason,
            engine=engine.describe(),
            dtype=engine.dtype,
            weights=tuple(copies),
            adapter=served,
            bucket_bytes=DEFAULT_BUCKET_BYTES,
            base_after=base,
        )


def adapter_part(model: nn.Module, engine: Engine) -> tuple[Adapter, list[Weight], list[str]]:
    """The adapter of ``model`` and its ``modules_to_save`` copies, checked against ``engine``
    (as the engine loads them), and the copies' checkpoint names."""
    served = adapter(model)
    engine.check_adapter(served)
    trained = trained_copies(model)
    copies = in_engine_format(trained, engine)
    check_names(copies, engine, complete=False)
    return served, copies, [t.name for t in trained]
