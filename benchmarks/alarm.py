"""The rollout alarm (`weightsync.alarm`) on sampled tokens: does the gap between the engine's and
the trainer's logprobs separate healthy rollouts from stale or corrupted ones, and what does a
check cost?

A hand-written loop on a real in-process vLLM engine, per engine dtype (the trainer in float32):
every round syncs the trainer's model, samples a batch at temperature 1, and scores it in four
conditions:

- **healthy**: right after the sync (the false-alarm rate is the share of these that alarm);
- **stale by one step**: the trainer takes one real optimizer step (Adam on a policy-gradient
  loss of the batch, at each learning rate of ``--lrs``) and the engine is not synced: the gap a
  one-step-stale rollout shows at that step size;
- **stale by ten steps** at the largest learning rate;
- **one corrupted layer**: one decoder layer's MLP in the engine overwritten through vLLM itself
  (bypassing weightsync), the rest intact.

    bash .ci/env python -m benchmarks.alarm                     # fp32 and bf16 engines
    bash .ci/env python -m benchmarks.alarm --rounds 20 --out /tmp/alarm.json
    bash .ci/env python -m benchmarks.alarm --dtypes bfloat16+fp8_per_channel  # a quantized engine

The TRL rows (a real GRPOTrainer, healthy and with every sync after the first skipped) are
`tests/test_alarm_vllm.py`'s; this module holds the pieces both use.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import Any

import torch

from weightsync import FullSync
from weightsync import testing as T
from weightsync.alarm import rollout_gap
from weightsync.engines import VLLMEngine
from weightsync.verify import tolerance_for

from .console import quiet_vllm


def sample(
    engine: VLLMEngine, prompts: list[list[int]], max_tokens: int, seed: int
) -> tuple[list[list[int]], torch.Tensor]:
    """Sample one completion per prompt at temperature 1 with the engine's logprob of every
    sampled token; returns the completions and a ``(prompts, max_tokens)`` tensor of logprobs
    (NaN past a completion's end)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(
        temperature=1.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=0,
        seed=seed,
        detokenize=False,
    )
    outputs = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    completions, logprobs = [], torch.full((len(prompts), max_tokens), math.nan)
    for i, out in enumerate(outputs):
        c = out.outputs[0]
        completions.append(list(c.token_ids))
        for j, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs or [], strict=False)):
            logprobs[i, j] = lp[tok].logprob
    return completions, logprobs


def trainer_logprobs(
    model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], width: int
) -> torch.Tensor:
    """The trainer's logprob of every sampled token (one forward pass per sequence, with
    gradients: the benchmark's optimizer step uses them); ``(prompts, width)``, 0 past an end."""
    rows = []
    for prompt, completion in zip(prompts, completions, strict=True):
        ids = torch.tensor([prompt + completion])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
        rows.append(torch.nn.functional.pad(lp, (0, width - lp.numel())))
    return torch.stack(rows)


def optimizer_step(model: torch.nn.Module, logprobs: torch.Tensor, lr: float, seed: int) -> None:
    """One Adam step on a policy-gradient loss of the batch (random advantages): a real
    optimizer step of the size ``lr`` gives, not noise of a chosen size."""
    gen = torch.Generator().manual_seed(seed)
    advantages = torch.randn(logprobs.shape[0], 1, generator=gen)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    opt.zero_grad()
    (-(advantages * logprobs).mean()).backward()
    opt.step()


def corrupt_layer(engine: VLLMEngine, layer: int, seed: int) -> None:
    """Overwrite one decoder layer's MLP in the engine through vLLM itself (not a sync)."""
    gen = torch.Generator().manual_seed(seed)
    prefix = f"model.layers.{layer}.mlp."
    garbage = [
        (name, (torch.randn(shape, generator=gen) * 0.1).to(engine.dtype))
        for name, shape in engine.expected_weights.items()
        if name.startswith(prefix)
    ]
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": garbage})
    engine.llm.reset_prefix_cache()


def gap_of(model, engine, prompts, max_tokens, seed, bound) -> tuple[Any, list[list[int]]]:
    """Sample a batch on the engine and score it on the trainer: the gap and the completions."""
    completions, engine_lp = sample(engine, prompts, max_tokens, seed)
    with torch.no_grad():
        trainer_lp = trainer_logprobs(model, prompts, completions, max_tokens)
    return rollout_gap(trainer_lp, engine_lp, ~torch.isnan(engine_lp), bound=bound), completions


def step_on(model, prompts, completions, max_tokens, lr, seed) -> None:
    """One optimizer step of ``model`` on a sampled batch."""
    optimizer_step(model, trainer_logprobs(model, prompts, completions, max_tokens), lr, seed)


def run(dtype: str, rounds: int, lrs: list[float], folder: str) -> dict[str, Any]:
    """Every condition of the module docstring, ``rounds`` times, on one engine of ``dtype``
    (``<dtype>+<vLLM quantization>``, e.g. ``bfloat16+fp8_per_channel``: a quantized engine;
    the trainer stays in float32, so its healthy gap holds the quantization's rounding)."""
    dtype_name, _, quantization = dtype.partition("+")
    options = {"quantization": quantization} if quantization else {}
    checkpoint = T.save_checkpoint(T.tiny_model("llama", seed=0), f"{folder}/{dtype}")
    engine = VLLMEngine(T.make_llm(checkpoint, dtype=dtype_name, **options))
    bound = tolerance_for(engine).mean
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(12)] for i in range(8)]
    n = 16  # tokens per completion
    gaps: dict[str, list[float]] = {"healthy": []}
    for lr in lrs:
        gaps[f"stale 1 step, lr {lr:g}"] = []
    gaps[f"stale 10 steps, lr {max(lrs):g}"] = []
    gaps["corrupted layer"] = []
    check_s: list[float] = []
    for r in range(rounds):
        model = T.tiny_model("llama", seed=0)
        T.perturb(model, seed=100 + r, scale=0.02)  # a different trained policy each round
        model.train()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        FullSync(skip_unchanged=False).sync(model, engine)
        gap, completions = gap_of(model, engine, prompts, n, r, bound)
        gaps["healthy"].append(gap.mean)
        _, engine_lp = sample(engine, prompts, n, r)
        t0 = time.perf_counter()
        rollout_gap(engine_lp, engine_lp, ~torch.isnan(engine_lp), bound=bound)
        check_s.append(time.perf_counter() - t0)
        for lr in lrs:
            model.load_state_dict(state)
            step_on(model, prompts, completions, n, lr, seed=r)
            stale, _ = gap_of(model, engine, prompts, n, r, bound)
            gaps[f"stale 1 step, lr {lr:g}"].append(stale.mean)
        model.load_state_dict(state)
        for step in range(10):
            _, batch = gap_of(model, engine, prompts, n, 1000 + step, bound)
            step_on(model, prompts, batch, n, max(lrs), seed=step)
        stale, _ = gap_of(model, engine, prompts, n, r, bound)
        gaps[f"stale 10 steps, lr {max(lrs):g}"].append(stale.mean)
        model.load_state_dict(state)
        corrupt_layer(engine, layer=1, seed=r)
        bad, _ = gap_of(model, engine, prompts, n, r, bound)
        gaps["corrupted layer"].append(bad.mean)
    engine.llm.llm_engine.engine_core.shutdown()
    return {
        "dtype": dtype,
        "bound": bound,
        "rounds": rounds,
        "check_seconds_median": statistics.median(check_s),
        "conditions": {
            name: {
                "mean_gap_min": min(v),
                "mean_gap_median": statistics.median(v),
                "mean_gap_max": max(v),
                "alarm_rate": sum(g > bound for g in v) / len(v),
            }
            for name, v in gaps.items()
        },
    }


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| engine | condition | mean gap median (min-max) | bound | alarms |",
        "|---|---|---|---|---|",
    ]
    for res in results:
        for name, c in res["conditions"].items():
            lines.append(
                f"| {res['dtype']} | {name} | {c['mean_gap_median']:.4g} "
                f"({c['mean_gap_min']:.4g}-{c['mean_gap_max']:.4g}) | {res['bound']:g} | "
                f"{c['alarm_rate']:.0%} of {res['rounds']} |"
            )
    return "\n".join(lines)


def main() -> None:
    import os
    import tempfile

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    quiet_vllm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-5, 1e-4, 1e-3])
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="weightsync-alarm-") as folder:
        results = [run(d, args.rounds, args.lrs, folder) for d in args.dtypes]
    print(table(results))
    for res in results:
        print(
            f"{res['dtype']}: one check of 8 x 16 tokens {res['check_seconds_median'] * 1e6:.0f} us"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
