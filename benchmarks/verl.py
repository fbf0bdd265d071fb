"""verl's own weight sync (``CheckpointEngineManager.update_weights``) through weightsync's backend
(``weightsync.integrations.verl``), beside verl's built-in ``naive`` backend, on one Ray cluster.

    bash .ci/verl-env python -m benchmarks.verl [--model tiny|0.5b] [--runs 3]

The run holds verl's own classes: its manager, its ``ActorRolloutRefWorker.update_weights`` and
``execute_checkpoint_engine`` on two actor ranks (rank 0 sends, rank 1 idle), its
``CheckpointEngineWorker`` on two rollout ranks (two replicas of one rank), built by its
``RayWorkerGroup`` on a ``RayResourcePool(use_gpu=False)``. Two pieces stand in for what verl
cannot run on a CPU: the actor's training engine is a transformers model whose
``get_per_tensor_param`` yields its ``state_dict`` (verl's FSDP engine needs a GPU), and the
rollout's ``ServerAdapter`` is `Recorder`, which keeps a copy of every tensor verl hands it (verl's
vLLM adapter sends them over CUDA IPC to its own worker extension; verl has no CPU platform). For
``naive``, the three CUDA housekeeping calls around verl's colocated hand-over (allocator
settings, synchronize, GPU memory logging) are made to do nothing in the actor's process.

Rows, each the median (min-max) of ``--runs`` syncs after a warm-up, every sync checked bit-exact
on both rollout ranks: ``naive`` (verl's colocated backend: the actor hands its tensors to a
rollout in its own process, no bytes cross a process), ``weightsync`` full (every bucket, each
sync's own key and tags) and ``weightsync`` delta (after a step that changes
``--changed`` of the elements). Seconds are the driver's wall time of ``update_weights``; bytes
are what actor rank 0 put on the wire, from the metrics verl returns. Everything shares these two
cores: a figure taken while anything else runs is not a figure.
"""

from __future__ import annotations

import os

# Before Ray is imported (see ``benchmarks.processes.ray_cluster``): every address on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import argparse
import asyncio
import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch
from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.distributed import initialize_global_process_group_ray
from verl.utils.import_utils import import_external_libs
from verl.workers.config import RolloutConfig
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout import BaseRollout, RolloutReplica

#: What verl's config names the backend and the module that registers it by.
BACKEND, MODULE = "weightsync", "weightsync.integrations.verl"


class Recorder(BaseRollout):
    """Stands in for verl's ``ServerAdapter``: a copy of every tensor handed to it (``last``:
    of the last update; ``weights``: the latest of each name) and the number of updates."""

    def __init__(self, config: Any, model_config: Any) -> None:
        super().__init__(config, model_config, device_mesh=None)
        self.weights: dict[str, torch.Tensor] = {}
        self.last: dict[str, torch.Tensor] = {}
        self.updates = 0

    async def resume(self, tags: list[str]) -> None:
        pass

    async def release(self) -> None:
        pass

    async def update_weights(self, weights: Any, **kwargs: Any) -> None:
        self.updates += 1
        self.last = {}
        if hasattr(weights, "__aiter__"):
            async for name, tensor in weights:
                self.last[name] = tensor.detach().clone()
        else:
            for name, tensor in weights:
                self.last[name] = tensor.detach().clone()
        self.weights.update(self.last)


class Engine:
    """Stands in for verl's training engine: ``get_per_tensor_param`` as its FSDP engine
    yields it (every ``state_dict`` entry under its HF name, tied names each)."""

    is_param_offload_enabled = False

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Any, None]:
        return ((n, t.detach()) for n, t in self.model.state_dict().items()), None


class Actor(ActorRolloutRefWorker):
    """verl's actor worker; `init_model` builds a transformers model in place of verl's
    FSDP engine, and its checkpoint engine exactly as verl's ``init_model`` does."""

    def __init__(self, config: Any, role: str, model_path: str, dtype: str) -> None:
        super().__init__(config, role)
        self.model_path, self.dtype = model_path, dtype

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from transformers import AutoModelForCausalLM

        initialize_global_process_group_ray(timeout_second=None, backend="cpu:gloo")
        model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=getattr(torch, self.dtype)
        )
        self.model = model.eval()
        self.actor = SimpleNamespace(engine=Engine(self.model))
        if self._is_rollout:  # verl's naive backend: the rollout in the actor's process
            rollout = omega_conf_to_dataclass(self.config.rollout, RolloutConfig)
            self.rollout = Recorder(rollout, SimpleNamespace(path=self.model_path))
            self.base_sync_done = "dummy" not in self.config.rollout.load_format  # as verl's
            self.layered_summon, self.peft_merge = False, False
            # Its update_weights(mode="naive") tunes CUDA's allocator and logs GPU memory
            # around the hand-over, which fail without CUDA: those three calls do nothing here.
            import verl.workers.engine_workers as workers

            nothing = SimpleNamespace(empty_cache=lambda: None, synchronize=lambda: None)
            workers.set_expandable_segments = lambda enable: None
            workers.log_gpu_memory_usage = lambda *args, **kwargs: None
            workers.get_torch_device = lambda: nothing
        # verl's init_model, step 4
        checkpoint_engine = omega_conf_to_dataclass(self.config.rollout.checkpoint_engine)
        backend = checkpoint_engine.backend
        import_external_libs(checkpoint_engine.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            backend,
            is_master=(torch.distributed.get_rank() == 0),
            bucket_size=checkpoint_engine.update_weights_bucket_megabytes << 20,
            **checkpoint_engine.engine_kwargs.get(backend, {}),
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def step(self, seed: int, fraction: float) -> int:
        """An optimizer step's stand-in: ``fraction`` of every weight's elements moved
        (the same on every rank); returns the 16-bit words that changed."""
        return step(self.model, seed, fraction)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_element(self, name: str, index: int, value: float) -> float:
        """Set one element of weight ``name`` (a diverged step's NaN); returns the old one."""
        with torch.no_grad():
            flat = self.model.get_parameter(name).view(-1)
            old = float(flat[index])
            flat[index] = value
        return old

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def state(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() for n, t in self.model.state_dict().items()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def received(self) -> tuple[dict, dict, int]:
        return self.rollout.weights, self.rollout.last, self.rollout.updates

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tamper_in_transit(self, bucket: int) -> None:
        """Alter one byte of bucket ``bucket`` of the next sync after it was tagged, as a
        man in the middle of the group would (rank 0 only sends)."""
        from weightsync.wire import gloo

        engine = self.checkpoint_engine
        sent = [0]

        def send_frame(group: Any, frame: Any) -> None:
            if sent[0] == bucket:
                frame.payload[-1] ^= 0x01
                del engine._send_frame  # once
            sent[0] += 1
            gloo.send_frame(group, frame)

        engine._send_frame = send_frame


class Rollout(CheckpointEngineWorker):
    """verl's rollout-side worker with `Recorder` as its server adapter."""

    def __init__(self, rollout_config: Any, model_config: Any) -> None:
        super().__init__(rollout_config, model_config, Recorder(rollout_config, model_config))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def received(self) -> tuple[dict, dict, int]:
        return self.server_adapter.weights, self.server_adapter.last, self.server_adapter.updates


class Replica(RolloutReplica):
    """A replica of rollout workers and no server (verl's manager asks its servers to
    abort, release and resume: there are none to ask)."""

    def __init__(self, rank: int, config: Any, model_config: Any, workers: list) -> None:
        super().__init__(rank, config, model_config)
        self.workers, self.servers = workers, []

    def get_ray_class_with_init_args(self) -> Any:
        raise NotImplementedError

    async def init_hybrid(self, worker_group: Any) -> None:
        raise NotImplementedError

    async def launch_servers(self) -> None:
        raise NotImplementedError


def step(model: Any, seed: int, fraction: float) -> int:
    """Move ``fraction`` of each weight's elements (seeded: the same on every rank); the number
    of 16-bit words (8-bit for 1-byte dtypes) that changed: what a delta must carry."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    words = 0
    with torch.no_grad():
        for p in model.parameters():  # a tied weight once
            flat = p.data.view(-1)
            word = torch.int16 if p.element_size() >= 2 else torch.int8
            before = flat.clone().view(word)
            picked = torch.rand(flat.shape, generator=gen) < fraction
            noise = torch.randn(flat.shape, generator=gen).to(p.dtype) * 0.05
            flat[picked] += noise[picked]
            words += int((flat.view(word) != before).sum())
    return words


class Run:
    """verl's manager over two actor ranks and two one-rank rollout replicas, on the Ray
    cluster this process is connected to (`benchmarks.processes.ray_cluster`).

    Args:
        model_path: a checkpoint folder (the actor loads it; verl's model config reads it).
        backend: ``weightsync`` or ``naive``.
        engine_kwargs: the backend's ``engine_kwargs``.
        dtype: the actor's dtype (``bfloat16``, ``float32``).
        bucket_mb: verl's ``update_weights_bucket_megabytes``.
    """

    def __init__(
        self,
        model_path: str,
        backend: str = BACKEND,
        engine_kwargs: dict | None = None,
        dtype: str = "bfloat16",
        bucket_mb: int = 1,
    ) -> None:
        import ray
        from omegaconf import OmegaConf
        from verl.checkpoint_engine import CheckpointEngineManager
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig, RolloutConfig

        checkpoint_engine = {
            "_target_": "verl.workers.config.CheckpointEngineConfig",
            "backend": backend,
            "update_weights_bucket_megabytes": bucket_mb,
            "custom_backend_module": MODULE if backend == BACKEND else None,
            "engine_kwargs": {backend: dict(engine_kwargs or {})},
        }
        rollout = {"name": "vllm", "checkpoint_engine": checkpoint_engine}
        config = OmegaConf.create(
            {
                "actor": {"strategy": "fsdp", "profiler": {}},
                "rollout": {**rollout, "free_cache_engine": False, "load_format": "auto"},
                "model": {"path": model_path},
            }
        )
        role = "actor_rollout" if backend == "naive" else "actor"
        actor_cls = RayClassWithInitArgs(
            cls=ray.remote(Actor),
            config=config,
            role=role,
            model_path=model_path,
            dtype=dtype,
        )
        self.actor_pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
        self.actors = RayWorkerGroup(resource_pool=self.actor_pool, ray_cls_with_init=actor_cls)
        self.actors.init_model()
        model_config = HFModelConfig(path=model_path)
        rollout_config = omega_conf_to_dataclass(OmegaConf.create(rollout), RolloutConfig)
        self.replicas: list = []
        self.rollouts = self.rollout_pool = None
        if backend != "naive":
            rollout_cls = RayClassWithInitArgs(
                cls=ray.remote(Rollout),
                rollout_config=rollout_config,
                model_config=model_config,
            )
            self.rollout_pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
            self.rollouts = RayWorkerGroup(
                resource_pool=self.rollout_pool, ray_cls_with_init=rollout_cls
            )
            self.replicas = [
                Replica(i, rollout_config, model_config, [w])
                for i, w in enumerate(self.rollouts.workers)
            ]
        self.manager = CheckpointEngineManager(
            omega_conf_to_dataclass(config.rollout.checkpoint_engine),
            self.actors,
            self.replicas,
        )

    def sync(self, global_steps: int | None = None) -> tuple[dict, float]:
        """verl's ``update_weights``: its metrics and the driver's wall seconds."""
        start = time.perf_counter()
        metrics = self.manager.update_weights(global_steps=global_steps)
        if asyncio.iscoroutine(metrics):
            metrics = asyncio.run(metrics)
        return metrics or {}, time.perf_counter() - start

    def trainer(self) -> dict:
        """Actor rank 0's weights."""
        return self.actors.state()[0]

    def received(self) -> list[tuple[dict, dict, int]]:
        """Each rollout rank's `Recorder` (for ``naive``: each actor rank's own)."""
        return (self.rollouts or self.actors).received()

    def close(self) -> None:
        """Stop every worker and free its placement group (the cluster itself is the
        caller's)."""
        import ray
        from ray.util import remove_placement_group

        for pool, group in ((self.actor_pool, self.actors), (self.rollout_pool, self.rollouts)):
            for worker in group.workers if group is not None else []:
                ray.kill(worker)
            for pg in (pool.pgs or []) if pool is not None else []:
                remove_placement_group(pg)


def mismatches(trainer: dict, received: dict) -> list[str]:
    """The names whose received bits differ from the trainer's (or that did not arrive)."""
    import torch

    bad = []
    for name, want in trainer.items():
        got = received.get(name)
        if (
            got is None
            or got.shape != want.shape
            or got.dtype != want.dtype
            or not torch.equal(want.view(-1).view(torch.uint8), got.view(-1).view(torch.uint8))
        ):
            bad.append(name)
    return bad


def measure(run: Run, runs: int, changed: float, check: bool = True) -> list[tuple[dict, float]]:
    """``runs`` syncs, each after a step changing ``changed`` of the elements, each checked
    bit-exact on every rollout rank."""
    out = []
    for i in range(runs):
        run.actors.step(1000 + i, changed)
        metrics, seconds = run.sync(global_steps=i)
        if check:
            want = run.trainer()
            for weights, _, _ in run.received():
                bad = mismatches(want, weights)
                assert not bad, f"the rollout differs from the trainer in {bad[:5]}"
        out.append((metrics, seconds))
    return out


def main(argv: list[str] | None = None) -> None:
    from .models import resolve
    from .processes import ray_cluster

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.verl", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default="tiny", help="a shape of benchmarks.models, or a folder")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--changed", type=float, default=0.01, help="fraction of elements a step moves")
    p.add_argument("--bucket-mb", type=int, default=64)
    args = p.parse_args(argv)

    spec = resolve(args.model)  # bf16
    rows = [
        ("naive", "naive", {}),
        ("weightsync, full", BACKEND, {"delta": False}),
        ("weightsync, delta", BACKEND, {"delta": True}),
    ]
    print(
        f"verl {__import__('verl').__version__}, {spec.name}, {args.runs} syncs per row, "
        f"{args.changed:.0%} of the elements moved before each"
    )
    print("| backend | seconds per sync, median (min-max) | bytes on the wire per sync |")
    print("|---|---|---|")
    with ray_cluster(1, cpus_per_node=8):
        for label, backend, kwargs in rows:
            run = Run(spec.checkpoint, backend, kwargs, bucket_mb=args.bucket_mb)
            try:
                measure(run, 1, args.changed)  # warm-up (and the delta's first, full sync)
                results = measure(run, args.runs, args.changed)
            finally:
                run.close()
            seconds = [s for _, s in results]
            wire = [m.get("checkpoint_engine/weightsync_bytes", 0.0) for m, _ in results]
            print(
                f"| {label} | {statistics.median(seconds):.3f} ({min(seconds):.3f}-"
                f"{max(seconds):.3f}) | {statistics.median(wire) / 1e6:.2f} MB |",
                flush=True,
            )


if __name__ == "__main__":
    # Under its importable name, so that Ray's workers import these classes instead of
    # receiving them pickled by value (verl's worker classes do not pickle).
    from benchmarks.verl import main as run_main

    run_main()
