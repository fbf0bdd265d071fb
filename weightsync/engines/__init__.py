"""Engine adapters, run in the trainer's process (what vLLM loads into its own processes is
under ``vllm/``: ``in_engine/`` in its workers, ``server_auth.py`` and ``server_lease.py`` in its API server).
``VLLMEngine`` wraps an in-process ``vllm.LLM`` (or its ``LLMEngine``, or a framework's object
holding one); another engine is one `Engine` subclass decorated with `register`.

Importing this package imports nothing until a name is used (PEP 562), and never vLLM: an
adapter imports it when it is constructed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import lazy

if TYPE_CHECKING:
    from .base import Engine as Engine
    from .base import EngineFacts as EngineFacts
    from .base import adapt as adapt
    from .base import register as register
    from .replicas import Replicas as Replicas
    from .vllm.asyncllm import AsyncLLMEngine as AsyncLLMEngine
    from .vllm.control import TOKEN_MIDDLEWARE as TOKEN_MIDDLEWARE
    from .vllm.control import WORKER_EXTENSION as WORKER_EXTENSION
    from .vllm.control import HTTPControl as HTTPControl
    from .vllm.inprocess import VLLMEngine as VLLMEngine
    from .vllm.remote import VLLMMultiprocEngine as VLLMMultiprocEngine
    from .vllm.server import VLLMServerEngine as VLLMServerEngine
    from .vllm.stock import StockServerEngine as StockServerEngine
    from .vllm.transports import GlooTransport as GlooTransport
    from .vllm.transports import LLMWeightSyncClient as LLMWeightSyncClient
    from .vllm.transports import TmpfsTransport as TmpfsTransport
    from .vllm.transports import WeightTransferFiles as WeightTransferFiles
    from .vllm.transports import WeightTransferGloo as WeightTransferGloo
    from .vllm.transports import WeightTransferTransport as WeightTransferTransport

_EXPORTS = {
    ".base": (
        "Engine",
        "EngineFacts",
        "adapt",
        "register",
    ),
    ".replicas": ("Replicas",),
    ".vllm.asyncllm": ("AsyncLLMEngine",),
    ".vllm.control": ("HTTPControl", "TOKEN_MIDDLEWARE", "WORKER_EXTENSION"),
    ".vllm.inprocess": ("VLLMEngine",),
    ".vllm.remote": ("VLLMMultiprocEngine",),
    ".vllm.server": ("VLLMServerEngine",),
    ".vllm.stock": ("StockServerEngine",),
    ".vllm.transports": (
        "GlooTransport",
        "LLMWeightSyncClient",
        "TmpfsTransport",
        "WeightTransferFiles",
        "WeightTransferGloo",
        "WeightTransferTransport",
    ),
}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__ = lazy.exports(__name__, _EXPORTS)
