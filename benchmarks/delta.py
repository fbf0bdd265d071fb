"""Only the changed bytes on the wire (``weightsync.wire.delta``) after a realistic training step,
beside the in-process FullSync and the full gloo sync, in one run.

    bash .ci/env python -m benchmarks.delta [--model 0.5b] [--runs 3]

The trainer holds float32 master weights (the model's checkpoint loaded in float32) and takes
one AdamW step (lr 1e-6, a random batch of ``--tokens`` tokens) before every sync, outside the
timer; the engine is a bf16 ``vllm.LLM`` of the same checkpoint, so each sync casts to bf16.
Rows, each the median (min-max) of ``--runs`` syncs after a warm-up (`measure.timed_runs`; the
warm-up of the delta row is its full first sync), the engine checked against the trainer after
the last (``verify.check_engine``, bf16 tolerance):

- in process: `VLLMEngine` in this process (the reference), then released;
- gloo, full: a multiprocess ``LLM`` (engine core and worker in other processes), every bucket
  broadcast over loopback gloo (``GlooTransport()``);
- gloo, delta: the same ``LLM``, ``GlooTransport(delta=True)``;
- with ``--ray``: a bf16 ``vllm.LLM`` in a Ray actor on the second node of a two-node Ray
  cluster on loopback (``ray_cluster``), the bytes through the object store, full
  (``RayObjectStoreTransport()``) and delta (``RayObjectStoreTransport(delta=True)``). The
  actor gets as many torch threads as the in-process engine (Ray gives an actor without CPUs
  one), so the rows compare transports, not thread counts.

Also printed: the fraction of bf16 elements (and bytes) each step changed, and the bytes each
gloo row put on the wire (``GlooTransport.last_sync``). Everything shares this machine's cores
(the trainer, the engine's worker): a figure taken while anything else runs is not a figure.

Memory at 0.5B: the trainer process peaks near 11 GB (fp32 weights 2 GB, AdamW state 4 GB,
gradients 2 GB during a step, a bf16 copy to count the changes, the kept copy of the delta
row), plus ~1.5 GB per engine: run it alone on the machine (it was OOM-killed once beside a
test suite).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
from typing import Any

# Before Ray is imported (vLLM imports it too; see ``ray_cluster``): every address on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


class Stepped:
    """A sync preceded by a training step, outside the sync's own timing (its report's
    seconds): what `measure.timed_runs` times is the sync alone."""

    def __init__(self, sync: Any, step: Any) -> None:
        self.sync_, self.step = sync, step

    def sync(self, model: Any, engine: Any) -> Any:
        self.step()
        return self.sync_.sync(model, engine)


class Trainer:
    """fp32 master weights and AdamW (lr 1e-6); `step` takes one step on a random batch and
    records the fraction of bf16 elements it changed."""

    def __init__(self, model: Any, tokens: int) -> None:
        import torch

        self.model, self.tokens = model, tokens
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        self.changed: list[float] = []
        self._gen = torch.Generator().manual_seed(0)

    def _bf16(self) -> list[Any]:
        import torch

        return [p.detach().to(torch.bfloat16) for p in self.model.parameters()]

    def step(self) -> None:
        import torch

        before = self._bf16()
        ids = torch.randint(0, self.model.config.vocab_size, (1, self.tokens), generator=self._gen)
        self.optimizer.zero_grad(set_to_none=True)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # the gradients' memory back before the sync
        # one parameter's bf16 cast at a time: a second copy of the model would add 1 GB at 0.5B
        params = self.model.parameters()
        changed = sum(
            int((a != p.detach().to(torch.bfloat16)).sum())
            for a, p in zip(before, params, strict=True)
        )
        self.changed.append(changed / sum(a.numel() for a in before))


def _row(label: str, sync: Any, trainer: Trainer, engine: Any, runs: int) -> dict:
    from .measure import verified_row

    row = verified_row(label, Stepped(sync, trainer.step), trainer.model, engine, runs)
    wire = getattr(getattr(engine, "transport", None), "last_sync", None)
    row["wire_bytes"] = wire.wire_bytes if wire is not None else row["bytes"]
    print(
        f"| {label} | {row['median_s']:.3f} ({row['min_s']:.3f}-{row['max_s']:.3f}) "
        f"| {row['bytes']:,} | {row['wire_bytes']:,} |",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.delta", description=__doc__)
    ap.add_argument("--model", default="0.5b", help="a benchmark shape: 0.5b, tiny")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16, help="tokens in a step's random batch")
    ap.add_argument("--ray", action="store_true", help="add the Ray object store rows")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from weightsync import FullSync
    from weightsync import testing as T
    from weightsync.engines import GlooTransport, VLLMEngine, VLLMMultiprocEngine

    from .models import resolve
    from .processes import multiproc_llm

    spec = resolve(args.model)
    model = AutoModelForCausalLM.from_pretrained(spec.checkpoint, dtype=torch.float32)
    trainer = Trainer(model, args.tokens)
    sync = FullSync(skip_unchanged=False)  # every weight, every time
    kv = 256 << 20
    rows = []
    print(
        f"# FullSync after an AdamW step (fp32 master weights, lr 1e-6) into a bf16 engine: "
        f"{spec.name}, {args.runs} runs after a warm-up"
    )
    print("| sync | s median (min-max) | bytes of the buckets | bytes on the wire |")
    print("|---|---|---|---|")
    local = VLLMEngine(T.make_llm(spec.checkpoint, dtype="bfloat16", kv_cache_bytes=kv))
    rows.append(_row("in process (VLLMEngine)", sync, trainer, local, args.runs))
    del local
    gc.collect()
    if args.ray:
        rows += _ray_rows(spec.checkpoint, sync, trainer, args.runs, kv)
    with multiproc_llm(spec.checkpoint, dtype="bfloat16", kv_cache_bytes=kv) as llm:
        for label, delta in (("gloo, full", False), ("gloo, delta", True)):
            engine = VLLMMultiprocEngine(llm, transport=GlooTransport(delta=delta))
            try:
                rows.append(_row(label, sync, trainer, engine, args.runs))
            finally:
                engine.close()
    changed = statistics.median(trainer.changed)
    print(
        f"# each step changed {changed:.4%} of the bf16 elements (median of "
        f"{len(trainer.changed)} steps; min {min(trainer.changed):.4%}, max "
        f"{max(trainer.changed):.4%})"
    )
    base = rows[0]
    for row in rows[1:]:
        if "delta" in row["sync"]:
            print(f"# {row['sync']} sent {row['wire_bytes'] / row['bytes']:.2%} of the bytes")
    for row in rows[1:]:
        print(f"# {row['sync']}: {row['median_s'] / base['median_s']:.2f}x in process")
    return rows


def _ray_rows(checkpoint: str, sync: Any, trainer: Trainer, runs: int, kv: int) -> list[dict]:
    """The object store rows: one actor on the second node of a loopback Ray cluster."""
    import ray
    import torch
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from weightsync.engines.vllm.ray import RayObjectStoreTransport, RayVLLMEngine

    from .processes import ray_cluster
    from .ray import rollout_class

    weights = sum(p.numel() * 2 for p in trainer.model.parameters())  # bf16 on the wire
    rows = []
    with ray_cluster(2, object_store_bytes=3 * weights + (512 << 20)) as nodes:
        threads = {"env_vars": {"OMP_NUM_THREADS": str(torch.get_num_threads())}}
        cls = ray.remote(num_cpus=0, max_restarts=0, runtime_env=threads)(rollout_class())
        where = NodeAffinitySchedulingStrategy(nodes[1], soft=False)
        actor = cls.options(scheduling_strategy=where).remote(checkpoint, "bfloat16", kv)
        try:
            for label, delta in (
                ("Ray, other node, full", False),
                ("Ray, other node, delta", True),
            ):
                transport = RayObjectStoreTransport(delta=delta)
                engine = RayVLLMEngine(actor, timeout_s=1800, transport=transport)
                try:
                    rows.append(_row(label, sync, trainer, engine, runs))
                finally:
                    engine.close()
        finally:
            ray.kill(actor)
    return rows


if __name__ == "__main__":
    main()
