"""The three ways to sync (trainer process): what each plans and writes. See each class's
docstring for when it is right and what it costs."""

from .adapter import AdapterSync
from .base import Strategy, SyncReport
from .full import FullSync
from .reload import ReloadWeights

__all__ = ["AdapterSync", "FullSync", "ReloadWeights", "Strategy", "SyncReport"]
