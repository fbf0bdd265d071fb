"""weightsync: keep a rollout engine's weights in step with the model an RL trainer trains.

The whole public surface::

    from weightsync import policy, Syncer                       # choose + sync, with state
    from weightsync import Strategy, FullSync, AdapterSync, ReloadWeights, SyncReport, Plan
    from weightsync.engines import Engine, VLLMEngine, register
    from weightsync import errors, peft_support

A sync is ``strategy.plan(model, engine)`` (every check, nothing written; ``print(plan)``
explains it) then its execution; ``strategy.sync`` does both. Importing weightsync does not
import vLLM.
"""

from . import errors, peft_support, policy
from .plan import Plan
from .state import Syncer
from .strategies import AdapterSync, FullSync, ReloadWeights, Strategy, SyncReport

__all__ = [
    "AdapterSync",
    "FullSync",
    "Plan",
    "ReloadWeights",
    "Strategy",
    "SyncReport",
    "Syncer",
    "errors",
    "peft_support",
    "policy",
]
__version__ = "0.1.0"
