"""vLLM engines. The tree says which code runs where:

- the trainer's process: ``inprocess.py`` (an ``LLM`` in this process), ``remote.py`` (one in
  other processes: a multiprocess ``LLM``, or a server through ``server.py``, ``stock.py``),
  ``control.py`` (the calls besides bytes), ``transports/`` (how bytes reach the workers, one
  file per transport);
- vLLM's API server process: ``server_auth.py`` (the token middleware) and ``server_lease.py``
  (the pause lease), both loaded with ``--middleware``;
- vLLM's worker processes: ``in_engine/`` (the worker extension, the weight-transfer backend,
  the operations on the model vLLM built, the epoch's ledger), which imports only
  ``weightsync.wire`` and vLLM;
- both: ``weightsync.wire`` (the format of every byte and message between them).

This package's ``__init__`` imports nothing, so vLLM importing the worker extension
(``worker.WeightsyncWorker``) in its workers loads only what they need. The public names are
``weightsync.engines``'.
"""
