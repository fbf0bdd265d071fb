"""OpenRLHF's actor layout, synced by weightsync: a runnable mimic (OpenRLHF is not installed).

OpenRLHF (``openrlhf/trainer/ray/``) places each vLLM engine in an ``LLMRayActor`` and the
policy in a group of ``PolicyModelActor`` actors that hold the handles of every engine. The
driver's ``PPOTrainer`` generates on the engines, has the policy group ``fit`` a step, then
``_broadcast_to_vllm``: wakes every engine (``vllm_enable_sleep``), has the policy actor push
its weights to all of them (one Ray call and one NCCL broadcast per parameter, into a raw
``load_weights``), and puts the engines back to sleep. It trains the full model (no LoRA path).

Here the same shape, the push handed to weightsync: ``PolicyModelActor.broadcast_to_vllm``
calls ``Syncer.sync`` on `Replicas` of `RayVLLMEngine` over the engines' handles (every engine's
names and shapes checked before any is written, each tensor produced once, the bytes through
Ray's object store) and checks the promise: every engine's greedy tokens equal the trainer's.

How to run it: docs/recipes.md.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

# Ray on loopback only (benchmarks.processes.ray_cluster); read when Ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import ray

from benchmarks.processes import ray_cluster
from weightsync import testing as T
from weightsync.engines.vllm.ray import WeightsyncActor, actor_llm


class LLMRayActor(WeightsyncActor):
    """One vLLM engine (``openrlhf/trainer/ray/vllm_engine.py``), with weightsync's mixin."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.llm = actor_llm(**options)
        self.weightsync_attach(self.llm)

    def wake_up(self) -> None:
        self.llm.wake_up()

    def sleep(self, level: int = 1) -> None:
        self.llm.sleep(level=level)

    def add_requests_and_get_responses(self, prompts: list[list[int]]) -> list[list[int]]:
        """OpenRLHF queues prompts and collects the responses; one call here."""
        return [t for t, _ in self.weightsync_call("generate", prompts, 8, None)]


class PolicyModelActor:
    """The policy (``openrlhf/trainer/ray/ppo_actor.py``): trains, and pushes to the engines."""

    def __init__(self, checkpoint: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="float32")
        self.engine: Any = None

    def set_vllm_engines(self, engines: list[Any]) -> None:
        from weightsync import Syncer
        from weightsync.engines import Replicas
        from weightsync.engines.vllm.ray import RayVLLMEngine

        self.engine = Replicas([RayVLLMEngine(e) for e in engines])
        self.syncer = Syncer(self.engine, train_type="full")

    def fit(self, step: int) -> None:
        T.perturb(self.model, seed=step)  # a stand-in for the PPO step

    def broadcast_to_vllm(self) -> str:
        report = self.syncer.sync(self.model)  # replaces the per-parameter loop
        T.assert_matches(self.model, self.engine)  # the promise, on every engine
        return report.strategy

    def shutdown(self) -> None:
        for engine in self.engine.engines:
            engine.close()


def main(*, steps: int = 3, engines: int = 1) -> list[str]:
    """OpenRLHF's PPO loop on a tiny random model, with Ray already initialised; the strategy
    of every sync (each one checked against the trainer)."""
    chosen = []
    with tempfile.TemporaryDirectory(prefix="weightsync-openrlhf-") as folder:
        checkpoint = T.save_checkpoint(T.tiny_model("qwen2"), folder)
        llm_actor = ray.remote(num_cpus=0)(LLMRayActor)
        vllm_engines = [llm_actor.remote(T.engine_options(checkpoint)) for _ in range(engines)]
        policy = ray.remote(num_cpus=0)(PolicyModelActor).remote(checkpoint)
        try:
            ray.get(policy.set_vllm_engines.remote(vllm_engines))
            for step in range(steps):
                rollouts = ray.get(
                    [e.add_requests_and_get_responses.remote(T.PROMPTS) for e in vllm_engines]
                )
                ray.get([e.sleep.remote() for e in vllm_engines])
                ray.get(policy.fit.remote(step))
                # _broadcast_to_vllm: wake, push, sleep again until the next generation.
                ray.get([e.wake_up.remote() for e in vllm_engines])
                chosen.append(ray.get(policy.broadcast_to_vllm.remote()))
                print(f"step {step}: rollouts {rollouts[0][0]}, then {chosen[-1]}")
            ray.get(policy.shutdown.remote())
        finally:
            for actor in (policy, *vllm_engines):
                ray.kill(actor)
    return chosen


if __name__ == "__main__":
    with ray_cluster(1):
        print(main())
