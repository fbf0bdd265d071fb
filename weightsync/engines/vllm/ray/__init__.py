"""vLLM inside a Ray actor, synced from a trainer anywhere in the Ray cluster. Both halves, like
vLLM's own weight-transfer backends: ``actor.py`` runs inside the framework's actor, where vLLM
runs (`WeightsyncActor`, `AsyncWeightsyncActor`, `actor_llm`); ``engine.py`` in the trainer's
process (`RayVLLMEngine`, its control and its object-store transport). Importing this package
imports neither Ray nor vLLM. docs/ray.md.
"""

from .actor import AsyncWeightsyncActor, WeightsyncActor, actor_llm
from .engine import RayControl, RayObjectStoreTransport, RayVLLMEngine

__all__ = [
    "AsyncWeightsyncActor",
    "RayControl",
    "RayObjectStoreTransport",
    "RayVLLMEngine",
    "WeightsyncActor",
    "actor_llm",
]
