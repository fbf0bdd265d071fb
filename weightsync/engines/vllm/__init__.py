"""vLLM engines, side by side: the in-process ``vllm.LLM`` adapter, and the code for engines
out of process (a ``vllm serve`` server, a multiprocess ``LLM``) with their transports and the
worker-side extension vLLM loads into its own processes."""

from .inprocess import VLLMEngine
from .server import Replicas, VLLMMultiprocEngine, VLLMServerEngine

__all__ = ["Replicas", "VLLMEngine", "VLLMMultiprocEngine", "VLLMServerEngine"]
