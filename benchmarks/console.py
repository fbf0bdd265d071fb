"""What the demo and the benchmark print: weightsync's own lines, not vLLM's.

vLLM logs every engine start at INFO (dozens of lines an engine) and, on CPU, warnings that are
expected there (sleep mode is a no-op, a tokenizer-less engine has no chat template, threads are
bound already), which bury the lines a reader came for. These programs run vLLM at ERROR unless
``VLLM_LOGGING_LEVEL`` says otherwise. One warning a user's own runs show after every reload
looks like a failure and is not: ``RotaryEmbedding: Failed to load weights`` (docs/quickstart.md
says why).
"""

from __future__ import annotations

import os


def quiet_vllm() -> None:
    """vLLM's own log at ERROR, unless ``VLLM_LOGGING_LEVEL`` is set. Call before vLLM is
    imported: vLLM reads the level when it sets up its logger."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
