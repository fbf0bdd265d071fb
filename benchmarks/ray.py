"""FullSync into vLLM inside Ray actors (``weightsync.engines.vllm.ray``), beside the in-process
FullSync, in one run.

    bash .ci/env python -m benchmarks.ray [--model 0.5b] [--runs 5]

A two-node Ray cluster on this machine (loopback, ``ray_cluster``), the trainer its driver on
the first node; one actor on each node holding a bf16 ``vllm.LLM`` of the model. Rows, each the
median (min-max) of ``--runs`` full syncs after a warm-up, the engine checked against the
trainer after the last (``verify.check_engine``), with the median pause window beside it
(`SyncReport.pause_seconds`: how long the engine answered nothing; none in process):

- in process: `VLLMEngine` in this process (the reference), run first, then released;
- Ray, same node: bytes through the object store's shared memory;
- Ray, other node: the object store, Ray's own transfer between the nodes' stores (loopback
  TCP here: both nodes are this machine, so the transfer protocol is real, the network not);
- Ray, other node, gloo: weightsync's own gloo broadcast to the same actor, for comparison;
- fan-out: `Replicas` over both actors vs one.

Both nodes share these two cores with the trainer: a figure taken while anything else runs is
not a figure.
"""

from __future__ import annotations

import argparse
import gc
import os

# Before Ray is imported (see ``ray_cluster``): every address on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def rollout_class() -> type:
    """The framework's actor: a ``vllm.LLM`` (engine core in the actor) and weightsync's mixin.
    Made in a function so Ray ships the class by value (the actors need not import this)."""
    from weightsync.engines.vllm.ray import WeightsyncActor

    class Rollout(WeightsyncActor):
        def __init__(self, checkpoint: str, dtype: str, kv_cache_bytes: int) -> None:
            from weightsync import testing as T
            from weightsync.engines import WORKER_EXTENSION

            self.llm = T.make_llm(
                checkpoint,
                dtype=dtype,
                kv_cache_bytes=kv_cache_bytes,
                worker_extension_cls=WORKER_EXTENSION,
            )
            self.weightsync_attach(self.llm)

    return Rollout


def _row(label: str, sync, model, engine, runs: int) -> dict:
    from .measure import verified_row

    row = verified_row(label, sync, model, engine, runs)
    pause = "-" if row["pause_s"] is None else f"{row['pause_s']:.3f}"
    print(
        f"| {label} | {row['median_s']:.3f} ({row['min_s']:.3f}-{row['max_s']:.3f}) "
        f"| {pause} | {row['bytes'] / 1e9:.2f} GB |",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ray", description=__doc__)
    ap.add_argument("--model", default="0.5b", help="a benchmark shape: 0.5b, tiny")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from weightsync import FullSync
    from weightsync import testing as T
    from weightsync.engines import GlooTransport, Replicas, VLLMEngine
    from weightsync.engines.vllm.ray import RayVLLMEngine

    from .models import load_trainer, resolve
    from .processes import ray_cluster

    spec = resolve(args.model)
    model = load_trainer(spec)
    sync = FullSync(skip_unchanged=False)  # a full push every time
    dtype = str(spec.dtype).removeprefix("torch.")
    kv = 256 << 20
    rows = []
    print(f"# FullSync into vLLM in Ray actors: {spec.name}, {args.runs} runs after a warm-up")
    print("| sync | s median (min-max) | pause s (median) | bytes sent |")
    print("|---|---|---|---|")
    local = VLLMEngine(T.make_llm(spec.checkpoint, dtype=dtype, kv_cache_bytes=kv))
    rows.append(_row("in process (VLLMEngine)", sync, model, local, args.runs))
    del local
    gc.collect()

    # The object store holds one copy of the weights per sync on the trainer's node, and the
    # other node a copy of what it pulled: twice the model and some room.
    store = 3 * sum(p.numel() * p.element_size() for p in model.parameters()) + (512 << 20)
    with ray_cluster(2, object_store_bytes=store) as nodes:
        # One torch thread per actor (Ray's default for an actor without CPUs): two actors
        # with two threads each on these two cores measured slower (docs/ray.md).
        cls = ray.remote(num_cpus=0, max_restarts=0)(rollout_class())
        actors = [
            cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(
                spec.checkpoint, dtype, kv
            )
            for n in nodes
        ]
        same, other = (RayVLLMEngine(a, timeout_s=1800) for a in actors)
        try:
            rows.append(_row("Ray actor, same node (object store)", sync, model, same, args.runs))
            rows.append(_row("Ray actor, other node (object store)", sync, model, other, args.runs))
            gloo = RayVLLMEngine(actors[1], timeout_s=1800, transport=GlooTransport())
            try:
                label = "Ray actor, other node (weightsync's gloo)"
                rows.append(_row(label, sync, model, gloo, args.runs))
            finally:
                gloo.close()
            fan = Replicas([same, other])
            rows.append(_row("fan-out: 2 actors on 2 nodes", sync, model, fan, args.runs))
        finally:
            same.close()
            other.close()
            for a in actors:
                ray.kill(a)
    base = rows[0]["median_s"]
    for row in rows[1:]:
        print(f"# {row['sync']}: {row['median_s'] / base:.2f}x in process")
    one, two = rows[2]["median_s"], rows[-1]["median_s"]
    print(f"# fan-out to 2 actors on 2 nodes: {two / one:.2f}x one actor on the other node")
    return rows


if __name__ == "__main__":
    main()
