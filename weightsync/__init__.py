"""weightsync: keep a rollout engine's weights in step with the model an RL trainer trains.

The whole public surface::

    from weightsync import policy, Syncer                       # choose + sync, with state
    from weightsync import Strategy, FullSync, AdapterSync, ReloadWeights, SyncReport
    from weightsync.engines import Engine, VLLMEngine, register
    from weightsync import errors

Importing weightsync does not import vLLM.
"""

from . import errors, policy
from .state import Syncer
from .strategies import AdapterSync, FullSync, ReloadWeights, Strategy, SyncReport

__all__ = [
    "AdapterSync",
    "FullSync",
    "ReloadWeights",
    "Strategy",
    "SyncReport",
    "Syncer",
    "errors",
    "policy",
]
__version__ = "0.1.0"
