"""Engine adapters. ``VLLMEngine`` wraps an in-process ``vllm.LLM``; another engine is one
`Engine` subclass decorated with `register`.

Importing this package does not import vLLM: the adapter imports it when it is constructed.
"""

from .base import Engine, adapt, register
from .vllm import Replicas, VLLMEngine, VLLMMultiprocEngine, VLLMServerEngine

__all__ = [
    "Engine",
    "Replicas",
    "VLLMEngine",
    "VLLMMultiprocEngine",
    "VLLMServerEngine",
    "adapt",
    "register",
]
