"""Engine adapters. ``VLLMEngine`` wraps an in-process ``vllm.LLM``; another engine is one
`Engine` subclass decorated with `register`.

Importing this package does not import vLLM: the adapter imports it when it is constructed.
"""

from .base import Engine, adapt, register
from .vllm import (
    GlooTransport,
    LLMWeightSyncClient,
    Replicas,
    TmpfsTransport,
    VLLMBackendTransport,
    VLLMEngine,
    VLLMMultiprocEngine,
    VLLMServerEngine,
    WeightTransferTransport,
)

__all__ = [
    "Engine",
    "GlooTransport",
    "LLMWeightSyncClient",
    "Replicas",
    "TmpfsTransport",
    "VLLMBackendTransport",
    "VLLMEngine",
    "VLLMMultiprocEngine",
    "VLLMServerEngine",
    "WeightTransferTransport",
    "adapt",
    "register",
]
