"""One benchmark run: each row's sync timed (`benchmarks.measure`), then its correctness check.

`Bench` holds the run's trainer models (`benchmarks.trainers`) and its engines, started lazily,
only if a selected row needs them: in-process (`benchmarks.inprocess`) and ``vllm serve``
servers (`benchmarks.servers`). What each row does is in `benchmarks.rows`.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from weightsync import AdapterSync, FullSync, ReloadWeights

from . import anchors, correctness
from .inprocess import InProcessEngines
from .measure import measure
from .models import ModelSpec
from .phases import timed_sync
from .rows import FLOOR_ROWS, SERVER_ROWS, Row, adapter_of
from .servers import ServerEngines
from .trainers import Trainers


class Bench:
    """The models and engines of one benchmark run.

    ``untied``: the untied twin of ``spec`` (its rows are skipped without one). Servers for the
    out-of-process rows are started at the first such row and stopped by ``servers.stop()``.
    """

    def __init__(
        self,
        spec: ModelSpec,
        *,
        workdir: Path,
        log: Callable[[str], None] = print,
        untied: ModelSpec | None = None,
    ) -> None:
        self.workdir = workdir
        self.log = log
        self.trainers = Trainers(spec, untied=untied, log=log)
        self.inprocess = InProcessEngines(spec, untied=untied, log=log)
        self.servers = ServerEngines(spec, logdir=workdir / "server-logs", log=log)
        self._packed: dict[str, str] | None = None
        self._memcpy: dict[str, anchors.MemcpyFloor] = {}

    def engine(self, which: str) -> Any:
        if which in SERVER_ROWS:
            return self.servers.engine(which)
        return self.inprocess.engine(which)

    def close(self) -> None:
        self.servers.stop()
        self.inprocess.close()
        self._memcpy.clear()
        gc.collect()

    # --- one row --------------------------------------------------------------------------------

    def call(self, row: Row) -> Callable[[], tuple[int, int, Any, dict[str, float]]]:
        """A zero-argument callable doing one sync of ``row``: returns (bytes, calls, report,
        phases); see phases.py for the phases."""
        eng = self.engine(row.engine) if row.engine else None
        trainers = self.trainers

        def sync(strategy: Any, model: torch.nn.Module) -> Callable[[], Any]:
            def one() -> tuple[int, int, Any, dict[str, float]]:
                rep, parts = timed_sync(strategy, model, eng)
                return rep.bytes, rep.engine_calls, rep.to_dict(), parts

            return one

        if row.model == "peft" or row.key == "reload_checkpoint":
            trainers.peft.set_adapter(adapter_of(row.key))
        k = row.key
        # FullSync rows measure a full push: skipping layers the engine already holds (frozen
        # embeddings, the frozen base of a LoRA model) would make them measure nothing.
        full = FullSync(skip_unchanged=False)
        if k in ("full_dense", "full_dense_untied", *SERVER_ROWS):
            return sync(full, trainers.of(row))
        if k == "full_frozen_embed":
            return sync(FullSync(), trainers.dense)  # skip_unchanged=True, the default
        if k == "full_lora_merge":
            return sync(FullSync(lora="merge", skip_unchanged=False), trainers.peft)
        if k.startswith("full_lora_separate"):
            return sync(FullSync(lora="separate", skip_unchanged=False), trainers.peft)
        if k.startswith("adapter_r"):
            return sync(AdapterSync(), trainers.peft)
        if k == "reload_checkpoint":
            return sync(ReloadWeights(), trainers.peft)
        if k == "reload_snapshot":
            return sync(ReloadWeights(snapshot_dir=self.workdir / "snapshot"), trainers.dense)
        if k == "anchor_per_module_rpc":
            if self._packed is None:
                self._packed = anchors.packed_modules(eng.llm)
            return lambda: anchors.per_module_rpc(trainers.dense, eng, self._packed)
        if k == "anchor_inplace_merge":
            return lambda: anchors.inplace_merge_push(trainers.peft, eng)
        if k in ("vllm_reload", "vllm_reload_untied"):
            return lambda: anchors.vllm_reload(eng, trainers.spec_of(row).checkpoint)
        if k in FLOOR_ROWS:
            which = "untied" if row.spec == "untied" else "plain"
            floor = anchors.MemcpyFloor(
                trainers.of(row),
                self.inprocess.engine(which)
                if self.inprocess.started(which)
                else _DtypeOnly(trainers.spec_of(row)),
            )
            self._memcpy[k] = floor
            return lambda: (*floor(), None, {})
        raise KeyError(k)

    def _row_fields(self, row: Row) -> dict[str, Any]:
        """What identifies a row in the results, whether it ran or raised."""
        return {
            "key": row.key,
            "label": row.label,
            "kind": row.kind,
            "engine": row.engine,
            "spec": row.spec,
            "model": self.trainers.model_name(row),
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
                    dense = self.trainers.dense
                    extra["frozen_bytes"] = stack.enter_context(frozen_embeddings(dense))
                    before = training_step(dense)
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

    def check(self, row: Row) -> dict[str, Any]:
        """``row``'s correctness check (`benchmarks.correctness`), right after its syncs."""
        if row.key in FLOOR_ROWS:
            ok = self._memcpy.pop(row.key).exact()  # its copies are not needed any more
            return {"passed": ok, "method": "torch.equal on every copied tensor"}
        return correctness.check(row, self.engine(row.engine), self.trainers)


@contextmanager
def frozen_embeddings(model: torch.nn.Module) -> Iterator[int]:
    """Freeze the input embedding (a tied lm_head is the same parameter) for the block; yields
    the bytes a full sync sends for it (under each name the engine loads)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    names = 2 if head is not None and head.weight is emb else 1
    emb.requires_grad_(False)
    try:
        yield names * emb.numel() * emb.element_size()
    finally:
        emb.requires_grad_(True)


def training_step(model: torch.nn.Module) -> Callable[[], None]:
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


class _DtypeOnly:
    """Stands in for an engine when only the memcpy row runs (no vLLM needed)."""

    def __init__(self, spec: ModelSpec) -> None:
        self.dtype = spec.dtype
        self.expected_weights = None
