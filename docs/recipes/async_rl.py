"""Async RL with weightsync: rollouts stay on the adapter version they were admitted under while
the trainer syncs newer ones, and every token says which weights produced it (docs/async-rl.md).

Run it (a tiny random model, no download; about a minute on a laptop CPU)::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python docs/recipes/async_rl.py

`rollouts_across_syncs` is the part a framework writes; ``tests/test_adapter_versions_vllm.py``
runs it on its own engine, so this file stays runnable.
"""

from __future__ import annotations

from typing import Any

from weightsync import AdapterSync, FullSync
from weightsync.engines import VLLMEngine

PROMPT = [5, 17, 99, 3, 250]


def rollouts_across_syncs(engine: VLLMEngine, model: Any, steps: int = 2) -> list[Any]:
    """Admit one rollout per step under the newest adapter version, step the engine a little,
    sync the next version (the trainer's step, here a nudge of the adapter), and so on; then
    finish every rollout. Returns each finished rollout's ``(tokens, weights spans)``.

    ``engine`` keeps ``adapter_versions`` > ``steps`` versions loaded, so every rollout still
    finds its own version when it finishes (the last sync makes version ``steps + 1``).
    """
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm_engine = engine.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    FullSync(lora="separate").sync(model, engine)  # the base and adapter version 1
    for step in range(steps):
        llm_engine.add_request(
            f"rollout-{step}",
            TokensPrompt(prompt_token_ids=PROMPT),
            params,
            lora_request=engine.lora_request,  # the newest version, at admission
        )
        llm_engine.step()  # the rollout starts generating
        with torch.no_grad():  # the trainer's step
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.add_(0.3 * torch.randn_like(p))
        AdapterSync().sync(model, engine)  # version step + 2, loaded beside the older ones
    done: dict[str, Any] = {}
    while llm_engine.has_unfinished_requests():
        done.update({o.request_id: o for o in llm_engine.step() if o.finished})
    return [
        (list(out.outputs[0].token_ids), engine.weights_spans(out))
        for _, out in sorted(done.items())
    ]


def main() -> None:
    import tempfile

    from peft import LoraConfig, get_peft_model

    from weightsync import testing as T

    folder = tempfile.mkdtemp()
    checkpoint = T.save_checkpoint(T.tiny_model("qwen2"), folder)
    llm = T.make_llm(checkpoint, enable_lora=True, max_loras=3, max_cpu_loras=4)
    engine = VLLMEngine(llm, adapter_versions=3)
    model = get_peft_model(
        T.tiny_model("qwen2"), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    )
    for tokens, spans in rollouts_across_syncs(engine, model):
        for span in spans:
            print(
                f"tokens {span.start}-{span.end} {tokens[span.start : span.end]}: "
                f"base {span.base}, adapter version {span.adapter}"
            )
    print(f"adapter versions kept now: {list(engine.adapter_requests)}")


if __name__ == "__main__":
    main()
