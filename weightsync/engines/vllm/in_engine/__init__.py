"""Runs inside vLLM's worker processes (for an in-process ``LLM``, in the trainer's process
through ``collective_rpc``): the worker extension, the weight-transfer backend, the operations on
the model vLLM built, the epoch's ledger, adapters from memory.

It imports only ``weightsync.wire``, torch, safetensors, transformers and vLLM: never the
trainer side (``tests/test_layout.py`` checks it in a fresh interpreter)."""
