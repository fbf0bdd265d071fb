"""vLLM engines, side by side: the in-process ``vllm.LLM`` adapter, and the code for engines
out of process (a ``vllm serve`` server, a multiprocess ``LLM``) with their transports and the
worker-side extension vLLM loads into its own processes."""

# worker first: it registers the "weightsync" weight-transfer backend by importing
# weight_transfer, which imports transport, which imports worker's constants.
from . import worker  # noqa: F401
from .inprocess import VLLMEngine
from .server import Replicas, VLLMMultiprocEngine, VLLMServerEngine
from .transport import GlooTransport, TmpfsTransport
from .weight_transfer import LLMWeightSyncClient, VLLMBackendTransport, WeightTransferTransport

__all__ = [
    "GlooTransport",
    "LLMWeightSyncClient",
    "Replicas",
    "TmpfsTransport",
    "VLLMBackendTransport",
    "VLLMEngine",
    "VLLMMultiprocEngine",
    "VLLMServerEngine",
    "WeightTransferTransport",
]
