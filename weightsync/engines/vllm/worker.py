"""``weightsync.engines.vllm.worker.WeightsyncWorker``: the name to pass as
``--worker-extension-cls`` (or ``LLM(worker_extension_cls=...)``), kept short and stable. The
extension itself is ``in_engine/extension.py``; importing this module imports nothing of the
trainer side (every package ``__init__`` on the way is lazy)."""

from .in_engine.extension import WeightsyncWorker

__all__ = ["WeightsyncWorker"]
