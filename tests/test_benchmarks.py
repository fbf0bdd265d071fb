"""The benchmark's code paths on the tiny model: every row present, JSON schema, plot written,
correctness recorded. Timings are reported by the benchmark, never asserted here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

# benchmarks/ is a top-level folder of the repo, not part of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytest.importorskip("vllm")
pytest.importorskip("matplotlib")

from benchmarks.__main__ import parse, run
from benchmarks.suite import ROW_KEYS
from weightsync.verify import TOLERANCE


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    args = parse(
        [
            "--model",
            "tiny",
            "--repeats",
            "2",
            "--drift-cycles",
            "5",
            "--memory-model",
            "none",
            "--out",
            str(out),
        ]
    )
    return run(args, command="pytest tests/test_benchmarks.py", quiet=True)


def test_every_row_present_in_order(result):
    assert [r["key"] for r in result["rows"]] == ROW_KEYS


def test_json_schema(result):
    data = json.loads(Path(result["paths"]["json"]).read_text())
    assert {"meta", "rows", "targets", "memory", "drift", "profile", "correct"} <= set(data)
    assert {
        "command",
        "date",
        "model",
        "params",
        "dtype",
        "model_bytes",
        "repeats",
        "vllm",
        "torch",
    } <= set(data["meta"])
    for row in data["rows"]:
        assert {
            "key",
            "label",
            "kind",
            "seconds",
            "peak_extra_bytes",
            "bytes",
            "gbps",
            "engine_calls",
            "ratio_to_vllm_native",
            "ratio_to_memcpy",
            "correct",
        } <= set(row)
        s = row["seconds"]
        assert len(s["runs"]) == 2 and s["min"] <= s["median"] <= s["max"]
        assert s["warmup"] is not None
        assert len(row["peak_extra_bytes"]["runs"]) == 2
        assert row["bytes"] > 0
    by = {r["key"]: r for r in data["rows"]}
    median = {k: r["seconds"]["median"] for k, r in by.items()}
    for key in ("full_dense", "adapter_r16"):  # ratios are of two different rows' medians
        assert by[key]["ratio_to_vllm_native"] == pytest.approx(median[key] / median["vllm_reload"])
        assert by[key]["ratio_to_memcpy"] == pytest.approx(median[key] / median["memcpy"])
    assert by["anchor_per_module_rpc"]["engine_calls"] > by["full_dense"]["engine_calls"] == 1
    # adapter rows send only the adapter: bytes grow with rank
    assert by["adapter_r8"]["bytes"] < by["adapter_r16"]["bytes"] < by["adapter_r64"]["bytes"]
    assert [m["model"] for m in data["memory"]] == ["tiny"]  # the second size is skipped here
    memory = data["memory"][0]
    assert memory["peak_extra_bytes"]["max"] <= memory["bound_bytes"]  # the README's claim
    assert len(data["targets"]) >= 4


def test_correctness_flags(result):
    """Every weightsync row, vLLM's reload and the floor serve exactly the trainer's model. The
    in-place merge anchor pushes the tied embedding once (as ms-swift and TRL do), which leaves
    vLLM's lm_head one training step stale: the same check must fail it."""
    by = {r["key"]: r for r in result["rows"]}
    for r in result["rows"]:
        assert "error" not in r, r["error"]
        if r["kind"] != "anchor":
            assert r["correct"]["passed"], (r["key"], r["correct"])
        if "control_mean_logprob_diff" in r["correct"]:  # the check can tell a wrong model apart
            c = r["correct"]
            assert c["control_mean_logprob_diff"] > c["tolerance"]["mean"], (r["key"], c)
    stale = by["anchor_inplace_merge"]["correct"]
    assert not stale["passed"] and stale["diagnosis"]["stale_tied_lm_head"], stale
    assert result["correct"]


def test_drift(result):
    d = result["drift"]
    assert d["cycles"] == 5 and d["model"] == "tiny"
    assert d["weightsync"]["max_abs_diff"] == 0.0
    assert d["anchor_inplace_merge"]["max_abs_diff"] > 0.0  # bf16 in-place round trip drifts
    assert d["weightsync"]["engine_check_logprob_diff"] <= TOLERANCE[torch.bfloat16].mean


def test_outputs_written(result):
    png = Path(result["paths"]["plot"])
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    md = Path(result["paths"]["markdown"]).read_text()
    for row in result["rows"]:
        assert row["label"] in md
