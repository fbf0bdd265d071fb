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
    bash .ci/env python -m benchmarks.alarm --dtypes float32 --rounds 1 --trl 8  # + TRL GRPO runs

With ``--trl STEPS``: real TRL ``GRPOTrainer`` runs (a tiny Llama trained in float32, the engine
colocated in float32 and in bfloat16, ``--trl-lrs``), healthy and with every sync after the first
skipped (trl#5312), scored by weightsync's TRL integration itself: the gap TRL logs for every
batch (``weightsync/rollout_logp_gap``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import Any

import torch

from weightsync import FullSync
from weightsync import testing as T
from weightsync.alarm import rollout_gap
from weightsync.engines import VLLMEngine
from weightsync.verify import TOLERANCE, tolerance_for

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


def trl_run(folder: str, steps: int, lr: float, skip_syncs: bool, dtype: str) -> list[float]:
    """A real TRL ``GRPOTrainer`` (a tiny Llama trained in float32, vLLM colocated in this
    process in ``dtype``) with
    weightsync's integration and its alarm logging: the mean gap of every batch. ``skip_syncs``:
    every sync after the first does nothing (the trl#5312 kind of bug: rollouts from stale
    weights)."""
    import socket

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation import vllm_generation as trl_vllm

    from weightsync.integrations.trl import use_weightsync

    tokenizer = T.build_tokenizer(f"{folder}/tokenizer")
    checkpoint = f"{folder}/checkpoint"
    model = T.tiny_model(
        "llama", eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    T.save_checkpoint(model, checkpoint)
    tokenizer.save_pretrained(checkpoint)
    with socket.socket() as s:  # the trainer's process group, on loopback
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    make_llm = trl_vllm.LLM
    cpu = dict(dtype=dtype, enforce_eager=True, kv_cache_memory_bytes=32 << 20)
    trl_vllm.LLM = lambda *args, **kwargs: make_llm(*args, **{**kwargs, **cpu})
    trainer = None
    try:
        args = GRPOConfig(
            output_dir=f"{folder}/out",
            use_vllm=True,
            vllm_mode="colocate",
            vllm_max_model_length=128,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=8,
            max_steps=steps,
            learning_rate=lr,
            gradient_checkpointing=False,
            bf16=False,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            seed=0,
            model_init_kwargs={"dtype": torch.float32},
        )
        trainer = GRPOTrainer(
            model=checkpoint,
            reward_funcs=lambda completions, **_: [float(len(set(c))) for c in completions],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": T.TEXT * 3}),
            processing_class=tokenizer,
        )
        use_weightsync(trainer, alarm="log")
        if skip_syncs:
            vg = trainer.vllm_generation
            sync_weights, synced = vg.sync_weights, []

            def first_sync_only() -> None:
                if not synced:
                    sync_weights()
                synced.append(True)

            vg.sync_weights = first_sync_only
        trainer.train()
        key = "weightsync/rollout_logp_gap"
        return [h[key] for h in trainer.state.log_history if key in h]
    finally:
        trl_vllm.LLM = make_llm
        if trainer is not None:
            trainer.vllm_generation.llm.llm_engine.engine_core.shutdown()


def trl_rows(folder: str, steps: int, lrs: list[float], dtype: str) -> dict[str, Any]:
    """`trl_run` healthy and with its syncs skipped, at each learning rate: the table's rows."""
    gaps: dict[str, list[float]] = {}
    for lr in lrs:
        for skip in (False, True):
            name = f"{'syncs skipped after the first' if skip else 'healthy'}, lr {lr:g}"
            run = trl_run(f"{folder}/{dtype}-{len(gaps)}", steps, lr, skip, dtype)
            gaps[name] = run if not skip else run[1:]  # the first batch follows a real sync
    bound = TOLERANCE[getattr(torch, dtype)].mean
    return {
        "dtype": f"TRL GRPO, {dtype} engine",
        "bound": bound,
        "rounds": steps,
        "conditions": {
            name: {
                "mean_gap_min": min(v),
                "mean_gap_median": statistics.median(v),
                "mean_gap_max": max(v),
                "alarm_rate": sum(g > bound for g in v) / len(v),
                "batches": len(v),
            }
            for name, v in gaps.items()
            if v
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
                f"{c['alarm_rate']:.0%} of {c.get('batches', res['rounds'])} |"
            )
    return "\n".join(lines)


def main() -> None:
    import tempfile

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    quiet_vllm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-5, 1e-4, 1e-3])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument(
        "--trl",
        type=int,
        default=0,
        metavar="STEPS",
        help="also STEPS-step TRL GRPO runs, healthy and with syncs skipped (at --trl-lrs)",
    )
    parser.add_argument("--trl-lrs", nargs="+", type=float, default=[1e-3, 2e-2])
    parser.add_argument("--trl-dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="weightsync-alarm-") as folder:
        results = [run(d, args.rounds, args.lrs, folder) for d in args.dtypes]
        if args.trl:
            for dtype in args.trl_dtypes:
                results.append(trl_rows(f"{folder}/trl", args.trl, args.trl_lrs, dtype))
    print(table(results))
    for res in results:
        if "check_seconds_median" in res:
            seconds = res["check_seconds_median"]
            print(f"{res['dtype']}: one check of 8 x 16 tokens {seconds * 1e6:.0f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
