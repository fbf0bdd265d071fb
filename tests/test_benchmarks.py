"""The benchmark's code paths on the tiny model: every row present, JSON schema, plot written,
correctness recorded. Timings are reported by the benchmark, never asserted here. The
out-of-process rows (two ``vllm serve`` processes, ~1-2 min of start-up) are skipped here
(``--no-server``); they run in ``python -m benchmarks``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("matplotlib")

from benchmarks.__main__ import parse, run
from benchmarks.rows import ROW_KEYS, SERVER_ROWS
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
            "--no-server",
            "--out",
            str(out),
        ]
    )
    return run(args, command="pytest tests/test_benchmarks.py", quiet=True)


def test_every_row_present_in_order(result):
    assert [r["key"] for r in result["rows"]] == [k for k in ROW_KEYS if k not in SERVER_ROWS]
    assert result["meta"]["untied_model"] == "tiny-untied"  # the like-for-like rows' model


def test_row_selection():
    assert not set(parse(["--no-server"]).rows) & set(SERVER_ROWS)
    assert set(SERVER_ROWS) <= set(parse([]).rows)
    untied = ["full_dense_untied", "vllm_reload_untied", "memcpy_untied"]
    assert not set(parse(["--model", "1.5b"]).rows) & set(untied)  # no untied twin: skipped
    with pytest.raises(SystemExit):
        parse(["--untied-model", "none", "--rows", "full_dense_untied"])


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
        parts = row["phases"]  # where the seconds go: timed parts that add up to the total
        if row["kind"] != "floor":
            assert {"total", "weightsync", "plan", "produce", "serialize", "engine"} <= set(parts)
            assert min(parts.values()) >= 0 and parts["engine"] > 0, (row["key"], parts)
            total = parts["weightsync"] + parts["serialize"] + parts["engine"]
            assert total == pytest.approx(parts["total"], rel=1e-6), (row["key"], parts)
            assert parts["total"] == pytest.approx(s["median"], rel=0.5), (row["key"], parts)
            assert parts["plan"] <= parts["weightsync"] + 1e-9
    by = {r["key"]: r for r in data["rows"]}
    median = {k: r["seconds"]["median"] for k, r in by.items()}
    for key in ("full_dense", "adapter_r16"):  # ratios are of two different rows' medians
        assert by[key]["ratio_to_vllm_native"] == pytest.approx(median[key] / median["vllm_reload"])
        assert by[key]["ratio_to_memcpy"] == pytest.approx(median[key] / median["memcpy"])
    assert by["anchor_per_module_rpc"]["engine_calls"] > by["full_dense"]["engine_calls"] == 1
    assert by["reload_snapshot"]["phases"]["serialize"] > 0  # the snapshot's safetensors writes
    # frozen embeddings: exactly the embedding (under both tied names) is left out
    frozen = by["full_frozen_embed"]
    assert frozen["frozen_bytes"] > 0
    assert frozen["bytes"] == by["full_dense"]["bytes"] - frozen["frozen_bytes"]
    assert by["full_dense_untied"]["model"] == "tiny-untied"
    assert by["full_dense_untied"]["bytes"] == by["vllm_reload_untied"]["bytes"]  # like for like
    assert by["full_dense_untied"]["ratio_to_vllm_native"] == pytest.approx(
        median["full_dense_untied"] / median["vllm_reload_untied"]
    )
    # adapter rows send only the adapter: bytes grow with rank
    assert by["adapter_r8"]["bytes"] < by["adapter_r16"]["bytes"] < by["adapter_r64"]["bytes"]
    assert [m["model"] for m in data["memory"]] == ["tiny"]  # the second size is skipped here
    memory = data["memory"][0]
    assert memory["peak_extra_bytes"]["max"] <= memory["bound_bytes"]  # the README's claim
    assert data["profile_untied"]["full_dense"] > 0  # the like-for-like pair, profiled
    adapter = data["profile_adapter"]  # where AdapterSync r16's seconds go (cProfile)
    assert adapter["median_seconds_unprofiled"] > 0
    assert {"weightsync plan: AdapterSync.plan", "engine: VLLMEngine.load_adapter"} <= set(
        adapter["cumulative_seconds"]
    ), adapter["cumulative_seconds"]
    targets = [t["target"] for t in data["targets"]]
    assert any("untied model" in t for t in targets), targets
    assert any(t.startswith("frozen embeddings") for t in targets), targets
    # issue 32: AdapterSync against base + adapter by their byte ratio, at both max ranks
    by_bytes = [t for t in data["targets"] if "byte ratio" in t["target"]]
    assert len(by_bytes) == 2, targets
    ratio = by["full_lora_separate"]["bytes"] / by["adapter_r16"]["bytes"]
    assert f"({ratio:.1f}x)" in by_bytes[0]["target"]
    speedup = median["full_lora_separate"] / median["adapter_r16"]
    assert by_bytes[0]["margin"] == pytest.approx(speedup / ratio)
    assert by_bytes[0]["met"] == (speedup >= ratio)


def test_correctness_flags(result):
    """Every weightsync row, vLLM's reload and the floor serve exactly the trainer's model. The
    in-place merge anchor pushes the tied embedding once (as ms-swift and TRL do), which leaves
    vLLM's lm_head one training step stale where the engine's head is a copy of its own: the
    same check must fail it there, and pass it where the head reads the embedding (bfloat16 on
    AVX2 CPUs), since nothing is stale then."""
    by = {r["key"]: r for r in result["rows"]}
    for r in result["rows"]:
        assert "error" not in r, r["error"]
        if r["kind"] != "anchor":
            assert r["correct"]["passed"], (r["key"], r["correct"])
        if r["kind"] != "floor":  # recorded for every engine row (not required: bf16 kernels)
            assert isinstance(r["correct"]["greedy_tokens_equal"], bool), r["key"]
        if "control_mean_logprob_diff" in r["correct"]:  # the check can tell a wrong model apart
            c = r["correct"]
            assert c["control_mean_logprob_diff"] > c["tolerance"]["mean"], (r["key"], c)
    stale = by["anchor_inplace_merge"]["correct"]
    if stale["tied_head_is_own_copy"]:
        assert not stale["passed"] and stale["diagnosis"]["stale_tied_lm_head"], stale
    else:
        assert stale["passed"] and "diagnosis" not in stale, stale
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


def test_a_free_port_is_skipped_by_the_os_and_bound_by_the_server():
    """`free_port` (the port a ``vllm serve`` of ours or a gloo group is started on): the OS's
    own picks of a port skip it while the server starts, and a ``SO_REUSEADDR`` bind (vLLM's,
    torch's TCPStore's) takes it."""
    import errno
    import socket

    from benchmarks.processes import free_port

    port = free_port()
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("127.0.0.1", port))  # what a process starting beside the server does
    assert taken.value.errno == errno.EADDRINUSE
    picked = []
    try:
        for _ in range(500):
            picked.append(socket.socket())
            picked[-1].bind(("127.0.0.1", 0))
        assert port not in {s.getsockname()[1] for s in picked}
    finally:
        for s in picked:
            s.close()
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen(1)
