"""Other model families than the two the table tests use: each through all three LoRA paths
on a real vLLM engine (Phi-3 stores q/k/v and gate/up fused in its checkpoint; Gemma-2 has
logit soft-capping and extra norms; Qwen3 has q/k norms)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from weightsync import AdapterSync, FullSync
from weightsync import testing as T
from weightsync.engines import VLLMEngine

FAMILIES = {
    "qwen3": dict(head_dim=32),
    "mistral": {},
    "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gemma2": dict(head_dim=32),
}


def build(family):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, **T.TINY, **FAMILIES[family])
    # eager attention: transformers' SDPA path does not apply Gemma-2's attention soft-capping
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_all_lora_paths(family, tmp_path):
    engine = VLLMEngine(
        T.make_llm(T.save_checkpoint(build(family), tmp_path / "ck"), enable_lora=True)
    )
    model = get_peft_model(build(family), LoraConfig(r=8, target_modules="all-linear"))
    T.perturb(model, seed=1, scale=0.3)
    for step, strategy in enumerate(
        (FullSync(lora="merge"), FullSync(lora="separate"), AdapterSync())
    ):
        T.perturb(model, seed=10 + step, scale=0.3)
        stale = T.compare(model, engine)  # (a random Gemma-2 may repeat one token: use logprobs)
        assert stale["engine"] != stale["trainer"] or stale["max_logprob_diff"] > 0.1
        strategy.sync(model, engine)
        T.assert_matches(model, engine, atol=1e-3)
