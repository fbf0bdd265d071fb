"""What travels between the trainer and an engine's own processes: runs on both sides (the
trainer's process and vLLM's workers).

Code that vLLM loads into its workers (``weightsync/engines/vllm/in_engine/``) imports from here
and from vLLM, never from the trainer side. Each module holds both halves of one thing:

- ``format``: a bucket of named tensors as safetensors bytes (dtypes, tied names stored once as
  aliases): the one writer and the one reader;
- ``files``: buckets as files in memory, sealed (or in a RAM folder), kept and rewritten in place
  between syncs (the trainer writes, the worker maps);
- ``stage``: a worker's checked tensors held for the commit that claims them, or their expiry;
- ``stream``: one stream of buckets whatever carries it: its frames (bucket, delta, end with
  the count, abort), what each tag covers, the receiver's checks in order;
- ``gloo``: a stream broadcast over a gloo process group (trainer rank 0, workers 1..N);
- ``protocol``: the typed messages: the engine's facts, a worker's outcome, the weight-transfer
  backend's payloads;
- ``checkpoint_names``: checkpoint names and shapes, from transformers' own conversion rules
  (the names every byte travels under);
- ``scratch``: the RAM folders files travel through, swept after a crash.
"""
