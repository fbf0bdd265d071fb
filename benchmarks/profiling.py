"""Where the seconds of FullSync dense, of vLLM's own reload and of AdapterSync r16 go: each
part timed without the profiler, then cProfile's cumulative seconds of the functions that make
up those parts (inflated by the profiler's own overhead: compare within a column).
"""

from __future__ import annotations

import cProfile
import functools
import io
import pstats
import time
from typing import Any

from weightsync import AdapterSync, FullSync
from weightsync.engines.vllm.in_engine import model_ops
from weightsync.trainer.tensors import DEFAULT_BUCKET_BYTES, base_tensors, buckets

from . import anchors


def full_sync(engine: Any, model: Any) -> dict[str, Any]:
    """Where the seconds of FullSync dense of ``model`` into ``engine`` (in-process) go, and
    those of vLLM's own reload of the engine's checkpoint (the like-for-like pair on an untied
    model), and what the KV-cache clear every completed reload makes costs alone.

    Three splits, each timed without the profiler: the trainer side alone (plan + check +
    materialising the buckets, no engine), vLLM's processing alone (reload_weights of an
    already materialised in-memory list), and the full sync. Then one cProfile of each,
    whose cumulative times per function say which part of vLLM the time is spent in.
    """
    checkpoint = engine.checkpoint
    out: dict[str, Any] = {}

    def stream_only() -> None:
        ts = base_tensors(model, merge_lora=False, expected=engine.expected_weights)
        for _ in buckets(ts, engine.dtype, DEFAULT_BUCKET_BYTES):
            pass

    pairs = anchors.trainer_pairs(model, engine)

    def vllm_only() -> None:
        engine.llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": iter(pairs), "is_checkpoint_format": True},
        )

    def clear_kv() -> None:
        engine.llm.collective_rpc(model_ops.clear_kv_cache)

    full = lambda: FullSync(skip_unchanged=False).sync(model, engine)  # noqa: E731
    reload = lambda: anchors.vllm_reload(engine, checkpoint)  # noqa: E731
    for name, fn in [
        ("trainer_stream_only", stream_only),
        ("vllm_reload_weights_in_memory_list", vllm_only),
        ("full_dense", full),
        ("vllm_reload_from_checkpoint", reload),
        ("clear_kv_cache", clear_kv),
    ]:
        fn()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        out[name] = sorted(times)[1]
    out["functions"] = {}
    for name, fn in [("full_dense", full), ("vllm_reload_from_checkpoint", reload)]:
        prof = cProfile.Profile()
        prof.enable()
        fn()
        prof.disable()
        out["functions"][name] = _top_functions(prof)
    FullSync().sync(model, engine)  # leave the engine in a known state
    return out


def adapter_sync(engine: Any, peft: Any, syncs: int = 10) -> dict[str, Any]:
    """Where the seconds of AdapterSync r16 of ``peft`` into ``engine`` go: ``syncs`` syncs
    under cProfile, with each function's cumulative seconds per sync, and the same syncs'
    median without the profiler. The base is restored first: the rows before may have left
    the engine on another base (a checkpoint reload, while the in-place merge anchor drifted the
    trainer's), and an adapter is sent alone only onto the base it was trained against."""
    peft.set_adapter("r16")
    FullSync(lora="separate").sync(peft, engine)
    sync = functools.partial(AdapterSync().sync, peft, engine)
    sync()
    times = []
    for _ in range(syncs):
        t = time.perf_counter()
        sync()
        times.append(time.perf_counter() - t)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(syncs):
        sync()
    prof.disable()
    top = _top_functions(prof, _ADAPTER_INTERESTING, per_call=syncs, sort="tottime")
    return {"syncs": syncs, "median_seconds_unprofiled": sorted(times)[syncs // 2], **top}


# (label, ("file fragment:function", ...)); without a fragment, the function of that name in
# vLLM, weightsync or safetensors.
_INTERESTING = [
    ("weightsync: plan + check (base_tensors, check_names)", ("base_tensors", "check_names")),
    ("weightsync: materialise buckets", ("buckets",)),
    ("vLLM: initialize_layerwise_reload", ("initialize_layerwise_reload",)),
    ("vLLM: model.load_weights (buffer + per-layer process)", ("load_weights",)),
    ("vLLM: _layerwise_process (materialise, load, repack, copy back)", ("_layerwise_process",)),
    ("vLLM: process_weights_after_loading (CPU repack)", ("process_weights_after_loading",)),
    ("vLLM: _copy_and_restore_kernel_tensors", ("_copy_and_restore_kernel_tensors",)),
    ("vLLM: finalize_layerwise_reload", ("finalize_layerwise_reload",)),
    ("safetensors read (disk / page cache)", ("safetensors_weights_iterator", "get_all_weights")),
    ("reset_prefix_cache", ("reset_prefix_cache",)),
]


# (label, ("file fragment:function", ...)): the adapter path, outermost first.
_ADAPTER_INTERESTING = [
    ("weightsync plan: AdapterSync.plan", ("strategies/adapter.py:_plan",)),
    ("  peft_support.check (allowlist walk)", ("peft_support.py:check",)),
    ("  stream._adapter_parameters (the factors)", ("trainer/tensors.py:_adapter_parameters",)),
    ("  stream.trained_copies (modules_to_save walk)", ("trainer/tensors.py:trained_copies",)),
    ("  engine.check_adapter (vLLM's PEFTHelper)", ("inprocess.py:check_adapter",)),
    ("engine: VLLMEngine.load_adapter", ("inprocess.py:load_adapter",)),
    ("  lora.install_adapter (in vLLM's worker)", ("lora.py:install_adapter",)),
    ("    lora._refresh (a new version written in place)", ("lora.py:_refresh",)),
    ("      copy into vLLM's LoRAModel", ("~:<built-in method torch._foreach_copy_>",)),
    ("    lora.build_lora_model", ("lora.py:build_lora_model",)),
    ("      Tensor.to (the factors' copy)", ("~:<method 'to' of 'torch._C.TensorBase' objects>",)),
    ("      vLLM LoRAModel.from_lora_tensors", ("lora_model.py:from_lora_tensors",)),
    ("      lora._check_modules (vLLM's key check)", ("lora.py:_check_modules",)),
    (
        "    vLLM add_adapter (pack q/k/v, gate/up)",
        ("model_manager.py:_create_merged_loras_inplace",),
    ),
    ("    vLLM activate_adapter (set_lora per module)", ("model_manager.py:activate_adapter",)),
    ("      vLLM reset_lora (zero the max-rank slot)", ("base_linear.py:reset_lora",)),
    ("  reset_prefix_cache", ("llm.py:reset_prefix_cache",)),
]


def _top_functions(
    prof: cProfile.Profile,
    interesting: list[tuple[str, tuple[str, ...]]] | None = None,
    *,
    per_call: int = 1,
    sort: str = "cumulative",
) -> dict[str, Any]:
    stats = pstats.Stats(prof)
    total = max(ct for (_, _, _, ct, _) in stats.stats.values())
    picked: dict[str, float] = {}
    for label, names in interesting or _INTERESTING:
        best = 0.0
        for (file, _, func), (_, _, _, ct, _) in stats.stats.items():
            for name in names:
                where, _, want = name.rpartition(":")
                if func != want:
                    continue
                if (
                    file.endswith(where)
                    if where
                    else any(k in file for k in ("vllm", "weightsync", "safetensors"))
                ):
                    best = max(best, ct)
        if best:
            picked[label] = best / per_call
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(25)
    return {
        "total_profiled_seconds": total / per_call,
        "cumulative_seconds": picked,
        "top25": buf.getvalue(),
    }
