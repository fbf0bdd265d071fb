"""weightsync: keep a rollout engine's weights in step with the model an RL trainer trains.

The whole public surface::

    from weightsync import policy, Syncer                       # choose + sync, with state
    from weightsync import Strategy, FullSync, AdapterSync, ReloadWeights, SyncReport, Plan
    from weightsync.engines import Engine, VLLMEngine, register
    from weightsync import errors, peft_support

A sync is ``strategy.plan(model, engine)`` (every check, nothing written; ``print(plan)``
explains it) then its execution; ``strategy.sync`` does both. Importing weightsync does not
import vLLM, and imports nothing until a name is used (PEP 562): vLLM's workers import the
worker extension below this package without loading the trainer side. Each folder's docstring
says what lives there and which process runs it (the tree: docs/architecture.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import lazy

if TYPE_CHECKING:
    from . import errors as errors
    from . import policy as policy
    from .plan import Plan as Plan
    from .strategies import AdapterSync as AdapterSync
    from .strategies import FullSync as FullSync
    from .strategies import ReloadWeights as ReloadWeights
    from .strategies import Strategy as Strategy
    from .strategies import SyncReport as SyncReport
    from .syncer import Syncer as Syncer
    from .trainer import peft_support as peft_support

_EXPORTS = {
    ".strategies": (
        "AdapterSync",
        "FullSync",
        "ReloadWeights",
        "Strategy",
        "SyncReport",
    ),
    ".plan": ("Plan",),
    ".syncer": ("Syncer",),
    ".errors": ("errors",),
    ".policy": ("policy",),
    ".trainer.peft_support": ("peft_support",),
}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__ = lazy.exports(__name__, _EXPORTS)
__version__ = "0.1.0"
