"""The allowlist without an engine: the docs table is the code's, unknown options and layer types
are refused, quantized parameters are refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from weightsync import peft_support
from weightsync.errors import UnsupportedModelError
from weightsync.testing import tiny_model
from weightsync.trainer import tensors


def test_docs_table_is_the_code_table():
    doc = (Path(__file__).parents[1] / "docs" / "peft-support.md").read_text()
    assert peft_support.options_table() in doc, (
        "regenerate docs/peft-support.md from options_table()"
    )


def test_every_option_of_this_peft_is_classified():
    """Not required for safety (an unknown option is refused when set), but a new peft option
    deserves a decision: this fails to say one is due."""
    unknown = [f.name for f in dataclasses.fields(LoraConfig) if f.name not in peft_support.OPTIONS]
    assert unknown == [], f"classify these LoraConfig options in peft_support.OPTIONS: {unknown}"


def test_defaults_pass_in_both_modes():
    model = get_peft_model(tiny_model("llama"), LoraConfig(target_modules=["q_proj"]))
    for mode in ("merge", "serve"):
        assert peft_support.check(model, mode).adapters == ("default",)


@pytest.mark.parametrize(
    "option,value",
    [("layer_replication", [[0, 1]]), ("use_qalora", True), ("ensure_weight_tying", True)],
)
def test_refused_options_name_themselves(option, value):
    config = LoraConfig(target_modules=["q_proj"])
    object.__setattr__(config, option, value)  # set after validation: only the check matters here
    with pytest.raises(UnsupportedModelError, match=option):
        peft_support.check(_with_config(config), "merge")


def _with_config(config):
    model = get_peft_model(tiny_model("llama"), LoraConfig(target_modules=["q_proj"]))
    model.peft_config["default"] = config
    return model


def test_quantized_parameter_refused():
    model = tiny_model("llama")
    layer = model.model.layers[0].mlp.down_proj
    layer.weight = torch.nn.Parameter(layer.weight.data.to(torch.int8), requires_grad=False)
    with pytest.raises(UnsupportedModelError, match="int8"):
        tensors.base_tensors(model, merge_lora=False)
