"""NeMo-RL's actor layout, synced by weightsync: a runnable mimic (NeMo-RL is not installed).

NeMo-RL (``nemo_rl/models/generation/``) reaches vLLM through a *generation interface*:
``VllmGeneration``, a driver-side object over a group of ``VllmGenerationWorker`` Ray actors,
with ``generate``, ``prepare_for_generation`` (wake: weights first, the KV cache after the
refit) and ``finish_generation`` (release memory while the policy trains, colocated). The GRPO
loop *refits* the generation from the policy after each training step
(``refit_policy_generation``): wake the weights, stream them through one of its synchronizers
(CUDA IPC, NCCL, ...), wake the KV cache.

Here the same shape, the refit handed to weightsync: ``VllmGeneration.refit`` calls
``Syncer.sync`` on `Replicas` of `RayVLLMEngine` over the workers' handles and checks the
promise (every worker's greedy tokens equal the policy's). The policy trains a LoRA adapter that
the workers do not serve, so each refit sends the weights with the adapter merged into them,
computed out of place (the policy's base is never touched); the workers sleep at level 2 while
the policy trains, so every refit restores every weight.

How to run it: docs/recipes.md.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

# Ray on loopback only (benchmarks.processes.ray_cluster); read when Ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import ray
from torch import nn

from benchmarks.processes import ray_cluster
from weightsync import Syncer
from weightsync import testing as T
from weightsync.engines import Replicas
from weightsync.engines.vllm.ray import RayVLLMEngine, WeightsyncActor, actor_llm


class VllmGenerationWorker(WeightsyncActor):
    """One vLLM engine of the generation cluster, with weightsync's mixin."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.llm = actor_llm(**options)
        self.weightsync_attach(self.llm)

    def wake_up(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)

    def sleep(self) -> None:
        self.llm.sleep(level=2)  # on a GPU: the weights are discarded, a refit restores them

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return [t for t, _ in self.weightsync_call("generate", prompts, max_tokens, None)]


class VllmGeneration:
    """The generation interface, in the driver, over the workers' handles."""

    def __init__(self, checkpoint: str, workers: int = 1) -> None:
        worker = ray.remote(num_cpus=0)(VllmGenerationWorker)
        self.workers = [worker.remote(T.engine_options(checkpoint)) for _ in range(workers)]
        self.engine = Replicas([RayVLLMEngine(w) for w in self.workers])
        self.syncer = Syncer(self.engine, train_type="lora", rollout_lora=False)

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        return list(ray.get(self.workers[0].generate.remote(prompts, 8)))

    def prepare_for_generation(self, tags: list[str]) -> None:
        ray.get([w.wake_up.remote(tags) for w in self.workers])

    def finish_generation(self) -> None:
        ray.get([w.sleep.remote() for w in self.workers])

    def refit(self, policy: nn.Module) -> str:
        """``refit_policy_generation``: weights awake, sync, KV cache awake, promise checked."""
        self.prepare_for_generation(["weights"])
        report = self.syncer.sync(policy)
        self.prepare_for_generation(["kv_cache"])
        T.assert_matches(policy, self.engine)
        return report.strategy

    def shutdown(self) -> None:
        for engine in self.engine.engines:
            engine.close()
        for w in self.workers:
            ray.kill(w)


def main(*, steps: int = 3) -> list[str]:
    """NeMo-RL's GRPO loop on a tiny random model, with Ray already initialised; the strategy
    of every refit (each one checked against the policy)."""
    from peft import LoraConfig, get_peft_model

    chosen = []
    base = T.tiny_model("qwen2")
    with tempfile.TemporaryDirectory(prefix="weightsync-nemo-rl-") as folder:
        generation = VllmGeneration(T.save_checkpoint(base, folder))
        try:
            lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
            policy = get_peft_model(base, lora)
            for step in range(steps):
                rollouts = generation.generate(T.PROMPTS)
                generation.finish_generation()
                T.perturb(policy, seed=step, scale=0.3)  # policy.train(): a stand-in step
                chosen.append(generation.refit(policy))
                print(f"step {step}: rollouts {rollouts[0]}, then {chosen[-1]}")
        finally:
            generation.shutdown()
    return chosen


if __name__ == "__main__":
    with ray_cluster(1):
        print(main())
