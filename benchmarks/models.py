"""Model shapes the benchmark runs on, built locally with transformers and cached on disk.

No hub downloads: a shape is a ``Qwen2Config``; the first run initialises it randomly (seeded)
and saves it as safetensors under ``~/.cache/weightsync/models/<shape>/``. A user's own model
folder (with ``config.json`` and ``*.safetensors``) is used as it is.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

CACHE = Path(os.environ.get("WEIGHTSYNC_CACHE", Path.home() / ".cache" / "weightsync")) / "models"

# Qwen2 family shapes (tied embeddings). initializer_range is raised above the default 0.02 so
# that a random model's next-token distribution is peaked: with 0.02 every logprob sits near
# -log(vocab) and a wrong weight set would pass a logprob comparison.
SHAPES: dict[str, dict] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
    ),
    "tiny4": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
    ),
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "3b": dict(  # Qwen2.5-3B's shape: the size sweep's largest on a 24 GB machine
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
}
# Untied twins, Llama architecture: the same layer shapes without tied embeddings, so lm_head is
# a weight of its own on disk and in vLLM. On these, FullSync and vLLM's reload from the
# checkpoint move exactly the same tensors (the like-for-like row). 0.5b-untied holds 630 M
# parameters: the 1.26 GB FullSync sends for the tied 0.5b, stored once each.
UNTIED = {f"{shape}-untied": shape for shape in ("tiny", "0.5b")}
INIT_RANGE = {"tiny": 0.1, "tiny4": 0.1, "tiny-untied": 0.1}
DEFAULT_INIT_RANGE = 0.05


@dataclass(frozen=True)
class ModelSpec:
    """A checkpoint folder the engine starts from, and how to describe it."""

    name: str  # shape name, or the folder's name for a user's model
    checkpoint: str  # folder with config.json + *.safetensors
    dtype: torch.dtype
    params: int
    built_here: bool  # random-initialised by the benchmark (vs a user's model)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def _count_params(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for key in h.keys():  # noqa: SIM118 -- a safetensors handle, not a dict
                n = 1
                for s in h.get_slice(key).get_shape():
                    n *= s
                total += n
    return total


def resolve(model: str, *, dtype: torch.dtype = torch.bfloat16, log=print) -> ModelSpec:
    """A shape name (built and cached on first use) or a path to a user's HF model folder."""
    if model in SHAPES or model in UNTIED:
        folder = CACHE / f"{model}-{str(dtype).removeprefix('torch.')}"
        if not (folder / "config.json").exists() or not list(folder.glob("*.safetensors")):
            log(f"[bench] building random-init {model} model in {folder} (once)")
            build(model, folder, dtype)
        return ModelSpec(model, str(folder), dtype, _count_params(folder), True)
    folder = Path(model).expanduser()
    if not (folder / "config.json").exists() or not list(folder.glob("*.safetensors")):
        raise SystemExit(
            f"--model {model!r} is neither a shape ({', '.join([*SHAPES, *UNTIED])}) nor a folder with "
            "config.json and *.safetensors (save your model with save_pretrained(..., "
            "safe_serialization=True))"
        )
    cfg = json.loads((folder / "config.json").read_text())
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    own = getattr(torch, str(name), torch.bfloat16)
    return ModelSpec(folder.name, str(folder), own, _count_params(folder), False)


def build(shape: str, folder: Path, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config_class, tied = (LlamaConfig, False) if shape in UNTIED else (Qwen2Config, True)
    cfg = config_class(
        tie_word_embeddings=tied,
        max_position_embeddings=4096,
        initializer_range=INIT_RANGE.get(shape, DEFAULT_INIT_RANGE),
        torch_dtype=str(dtype).removeprefix("torch."),
        **SHAPES[UNTIED.get(shape, shape)],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    tmp = folder.with_name(folder.name + ".partial")
    model.save_pretrained(str(tmp), safe_serialization=True)
    del model
    tmp.rename(folder)


def load_trainer(spec: ModelSpec) -> nn.Module:
    """The trainer's copy of the model (same weights as the engine's checkpoint), eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec.checkpoint, torch_dtype=spec.dtype)
    return model.eval()


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def with_adapters(
    model: nn.Module, ranks: list[int], *, seed: int = 1, scale: float = 0.05
) -> nn.Module:
    """Wrap ``model`` in a PeftModel with one LoRA adapter per rank (named ``r<rank>``).

    The adapters are perturbed away from PEFT's zero-initialised B, so merged and unmerged
    weights differ and a sync that forgets the adapter is caught by the correctness check.
    """
    from peft import LoraConfig, get_peft_model

    first, *rest = ranks
    peft = get_peft_model(
        model,
        LoraConfig(r=first, lora_alpha=2 * first, target_modules=LORA_TARGETS),
        adapter_name=f"r{first}",
    )
    for r in rest:
        peft.add_adapter(f"r{r}", LoraConfig(r=r, lora_alpha=2 * r, target_modules=LORA_TARGETS))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * scale).to(p.dtype))
    return peft.eval()
