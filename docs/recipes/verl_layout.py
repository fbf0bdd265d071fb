"""verl's actor layout, synced by weightsync: a runnable mimic (verl itself is not installed).

verl (``verl/workers/fsdp_workers.py``) trains in a Ray worker group of
``ActorRolloutRefWorker`` actors; each one is a *hybrid engine*: it holds the trained actor
model and drives the rollout, switching between ``trainer_mode`` and ``rollout_mode``. The
rollout replicas are vLLM engines in actors of their own (``verl/workers/rollout/``), woken with
``resume(tags=["weights"])`` before the weights are pushed and ``resume(tags=["kv_cache"])``
after, released (put to sleep) while the actor trains. With unmerged LoRA verl keeps sleep level 1
so the base survives, and ``base_sync_done`` starts True unless the rollout loaded dummy weights:
the first push may be the adapter alone. The sync runs *inside the trainer actor*.

Here the same shape, the sync handed to weightsync: ``ActorRolloutRefWorker.rollout_mode`` wakes
the rollout, calls ``Syncer.sync`` on a `RayVLLMEngine` over the rollout actor's handle (which
chooses the adapter alone while the engine attests its base intact), wakes the KV cache, and
checks the promise: the rollout's greedy tokens equal the trainer's.

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

#: verl's LoRA set-up for the actor (``actor_rollout_ref.model.lora_rank`` and friends).
LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj"]}


class vLLMRollout(WeightsyncActor):
    """A rollout replica: a vLLM engine in its own actor, with weightsync's mixin."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.llm = actor_llm(**options)
        self.weightsync_attach(self.llm)

    def resume(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)

    def release(self) -> None:
        self.llm.sleep(level=1)  # unmerged LoRA: level 1 keeps the base (verl forces it)

    def generate_sequences(self, prompts: list[list[int]], lora: str | None) -> list[list[int]]:
        return [t for t, _ in self.weightsync_call("generate", prompts, 8, lora)]


class ActorRolloutRefWorker:
    """The hybrid worker: the trained model, and the rollout it syncs in ``rollout_mode``."""

    def __init__(self, checkpoint: str, rollout: Any) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from weightsync import Syncer
        from weightsync.engines.vllm.ray import RayVLLMEngine

        base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="float32")
        self.model = get_peft_model(base, LoraConfig(**LORA, init_lora_weights=False))
        self.rollout = rollout
        self.engine = RayVLLMEngine(rollout)
        # verl: base_sync_done = "dummy" not in rollout.load_format (the rollout loaded the
        # checkpoint this model was built from).
        self.syncer = Syncer(self.engine, train_type="lora", base_sync_done=True)

    def rollout_mode(self) -> tuple[str, str | None]:
        ray.get(self.rollout.resume.remote(["weights"]))
        report = self.syncer.sync(self.model)
        ray.get(self.rollout.resume.remote(["kv_cache"]))
        T.assert_matches(self.model, self.engine)  # the promise, after every sync
        return report.strategy, report.weights_version

    def generate_sequences(self, prompts: list[list[int]]) -> list[list[int]]:
        lora = self.engine.served_adapter
        return list(ray.get(self.rollout.generate_sequences.remote(prompts, lora)))

    def trainer_mode(self) -> None:
        ray.get(self.rollout.release.remote())

    def update_actor(self, step: int) -> None:
        T.perturb(self.model, seed=step, scale=0.3)  # a stand-in for the optimizer step

    def shutdown(self) -> None:
        self.engine.close()


def main(*, steps: int = 3) -> list[str]:
    """verl's ``RayPPOTrainer.fit`` loop on a tiny random model, with Ray already initialised;
    the strategy of every sync (each one checked against the trainer)."""
    chosen = []
    with tempfile.TemporaryDirectory(prefix="weightsync-verl-") as folder:
        checkpoint = T.save_checkpoint(T.tiny_model("qwen2"), folder)
        options = T.engine_options(checkpoint, enable_lora=True)
        rollout = ray.remote(num_cpus=0)(vLLMRollout).remote(options)
        worker = ray.remote(num_cpus=0)(ActorRolloutRefWorker).remote(checkpoint, rollout)
        try:
            for step in range(steps):
                strategy, version = ray.get(worker.rollout_mode.remote())
                batch = ray.get(worker.generate_sequences.remote(T.PROMPTS))
                print(f"step {step}: {strategy}, rollouts {batch[0]} from weights {version}")
                ray.get(worker.trainer_mode.remote())
                ray.get(worker.update_actor.remote(step))
                chosen.append(strategy)
            ray.get(worker.shutdown.remote())
        finally:
            for actor in (worker, rollout):
                ray.kill(actor)
    return chosen


if __name__ == "__main__":
    with ray_cluster(1):
        print(main())
