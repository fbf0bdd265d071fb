"""SkyRL's actor layout, synced by weightsync: a runnable mimic (SkyRL is not installed).

SkyRL (``skyrl_train/inference_engines/``) runs several vLLM engines, each an ``AsyncLLM`` in an
async Ray actor behind a ``RayWrappedInferenceEngine``, and hands the trainer one ``InferenceEngineClient`` over
all of them: it routes generation requests across the engines and fans every control call out
to each (``wake_up``, ``sleep``, ``update_named_weights``). The trainer's
``sync_policy_weights_to_inference_engines`` pushes the policy's weights (or its LoRA adapter)
through that client; with ``colocate_all`` the engines sleep while the policy trains.

Here the same shape, the push handed to weightsync: each engine actor inherits
`AsyncWeightsyncActor` (its ``AsyncLLM``'s engine core a process of its own, the actor's
methods coroutines on one event loop), and the client's ``update_weights`` calls
``Syncer.sync`` on `Replicas` of `RayVLLMEngine` over every engine's handle (every engine's
checks pass before any is written, each tensor produced once) and checks the promise on every
engine. The engines serve the trainer's LoRA adapter and sleep at level 1: the first push sends
base and adapter, every later one the adapter alone.

How to run it: docs/recipes.md.
"""

from __future__ import annotations

import itertools
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
from weightsync.engines.vllm.ray import AsyncWeightsyncActor, RayVLLMEngine


class AsyncVLLMInferenceEngine(AsyncWeightsyncActor):
    """One engine actor (what ``RayWrappedInferenceEngine`` wraps): an ``AsyncLLM``, with
    weightsync's mixin for async actors."""

    def __init__(self, options: dict[str, Any]) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from weightsync.engines import WORKER_EXTENSION

        args = AsyncEngineArgs(**options, worker_extension_cls=WORKER_EXTENSION)
        self.engine = AsyncLLM.from_engine_args(args)
        self.weightsync_attach(self.engine)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.engine.wake_up(tags=tags)

    async def sleep(self, level: int) -> None:
        await self.engine.sleep(level=level)

    async def generate(self, prompt: list[int], lora: str | None) -> list[int]:
        """Greedy tokens of ``prompt`` (with the adapter loaded under ``lora``), through the
        mixin's control, which keeps the ``LoRARequest`` of the synced adapter."""
        return list((await self.weightsync_call("generate", [prompt], 8, lora))[0][0])

    def shutdown(self) -> None:
        """Stop the AsyncLLM's engine core (a process of its own) before the actor goes."""
        self.engine.shutdown()


class InferenceEngineClient:
    """The trainer's one handle on every engine: requests routed, control calls fanned out."""

    def __init__(self, engines: list[Any]) -> None:
        self.engines = engines
        self.weights = Replicas([RayVLLMEngine(e) for e in engines])
        self.syncer = Syncer(self.weights, train_type="lora")

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        lora = self.weights.engines[0].served_adapter
        routed = zip(prompts, itertools.cycle(self.engines), strict=False)
        return list(ray.get([engine.generate.remote(p, lora) for p, engine in routed]))

    def wake_up(self) -> None:
        ray.get([e.wake_up.remote() for e in self.engines])

    def sleep(self) -> None:
        ray.get([e.sleep.remote(1) for e in self.engines])  # level 1: the base survives

    def update_weights(self, policy: nn.Module) -> str:
        report = self.syncer.sync(policy)
        T.assert_matches(policy, self.weights)  # the promise, on every engine
        return report.strategy

    def close(self) -> None:
        for engine in self.weights.engines:
            engine.close()


def main(*, steps: int = 3, engines: int = 2) -> list[str]:
    """SkyRL's training loop (colocate_all) on a tiny random model, with Ray already
    initialised; the strategy of every push (each one checked against the trainer)."""
    from peft import LoraConfig, get_peft_model

    chosen = []
    base = T.tiny_model("qwen2")
    with tempfile.TemporaryDirectory(prefix="weightsync-skyrl-") as folder:
        options = T.engine_options(T.save_checkpoint(base, folder), enable_lora=True)
        actor = ray.remote(num_cpus=0)(AsyncVLLMInferenceEngine)
        handles = [actor.remote(options) for _ in range(engines)]
        try:
            client = InferenceEngineClient(handles)
            lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "o_proj"])
            policy = get_peft_model(base, lora)
            for step in range(steps):
                T.perturb(policy, seed=step, scale=0.3)  # the policy's training step
                # sync_policy_weights_to_inference_engines, then generate the next batch.
                client.wake_up()
                chosen.append(client.update_weights(policy))
                rollouts = client.generate(T.PROMPTS)
                client.sleep()
                print(f"step {step}: {chosen[-1]}, rollouts {rollouts[0]}")
            client.close()
        finally:
            ray.get([handle.shutdown.remote() for handle in handles], timeout=120)
            for handle in handles:
                ray.kill(handle)
    return chosen


if __name__ == "__main__":
    with ray_cluster(1):
        print(main())
