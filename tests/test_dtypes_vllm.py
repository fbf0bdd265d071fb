"""A bfloat16 engine fed by a float32 or bfloat16 trainer: weights are cast once, on the trainer
side, and the engine agrees with the trainer within bfloat16's tolerance (verify.TOLERANCE)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from weightsync import AdapterSync, FullSync
from weightsync import testing as T
from weightsync.engines import VLLMEngine
from weightsync.verify import TOLERANCE, check_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    ck = T.save_checkpoint(T.tiny_model("qwen2", dtype=torch.bfloat16), tmp_path_factory.mktemp("bf16") / "ck")
    return VLLMEngine(T.make_llm(ck, dtype="bfloat16", enable_lora=True))


@pytest.mark.parametrize("trainer_dtype", [torch.float32, torch.bfloat16])
def test_bf16_engine(engine, trainer_dtype):
    assert engine.dtype == torch.bfloat16
    model = get_peft_model(T.tiny_model("qwen2", dtype=trainer_dtype), LoraConfig(r=8, target_modules="all-linear"))
    T.perturb(model, seed=7, scale=0.3)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    merged = FullSync(lora="merge").sync(model, engine, verify=True)
    separate = FullSync(lora="separate").sync(model, engine, verify=True)
    T.perturb(model, seed=8, scale=0.3)
    adapter = AdapterSync().sync(model, engine, verify=True)

    for report in (merged, separate, adapter):
        assert report.verified_logprob_diff is not None and report.verified_logprob_diff <= TOLERANCE[torch.bfloat16]
    # the stream sent bfloat16: 2 bytes per base parameter, the tied embedding under both names
    base_params = sum(t.numel() for n, t in model.get_base_model().named_parameters() if "lora_" not in n)
    assert merged.bytes == 2 * base_params + 2 * model.get_base_model().lm_head.weight.numel()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if "lora_" not in k)
    # a garbage engine is caught at this tolerance
    T.discard_weights(engine)
    with pytest.raises(Exception, match="differ from the trainer's"):
        check_engine(model, engine, strategy="test")
