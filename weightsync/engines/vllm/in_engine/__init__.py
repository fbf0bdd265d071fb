"""Code vLLM loads into its own worker processes (and, for an in-process ``LLM``, runs in the
trainer's process through ``collective_rpc``): the worker extension, the weight-transfer backend,
the operations on the model vLLM built, the epoch's ledger, adapters from memory; and, into a
``vllm serve`` API server, the token middleware (``auth.py``).

It imports only ``weightsync.wire``, torch, safetensors, transformers and vLLM: never the
trainer side (``tests/test_layout.py`` checks it in a fresh interpreter)."""
