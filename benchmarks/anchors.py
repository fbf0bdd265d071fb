"""The approaches weightsync is measured against. They live here only: none is a strategy.

Each is named after the practice it imitates and returns ``(bytes_sent, engine_calls, None,
phases)``: the phases of benchmarks/phases.py, timed around the trainer-side work and the
engine calls.

- `per_module_rpc` -- TRL / OpenRLHF: one engine call per parameter. Their call is
  ``model.load_weights([(name, tensor)])`` straight into the engine's model, which fails on the
  CPU backend (repacked parameters have shape ``(0,)``) and corrupts post-processed weights on
  GPU (vllm#42821). The valid equivalent is one ``collective_rpc("reload_weights")`` per call.
  vLLM's layerwise reload processes a *layer* (one vLLM module) once every one of its elements
  has arrived, and puts the old tensors back into any module that received nothing. So a call
  must carry all tensors of one vLLM module: q/k/v weight and bias travel together (they are
  one ``qkv_proj``), gate/up together (``gate_up_proj``), every other tensor alone. That is
  one call per vLLM parameter group (146 calls for 290 tensors on the 0.5B shape): as close to
  per-tensor as vLLM allows, and each call pays vLLM's per-reload set-up over the whole model,
  which is exactly the per-call overhead per-tensor RPC trainers pay.
- `inplace_merge_push` -- ms-swift / TRL: ``merge_adapter()`` into the trainer's own
  weights, push the base, ``unmerge_adapter()``. In bf16 the round trip does not restore the
  weights exactly (trl#6688): see the drift figure.
- `vllm_reload` -- vLLM's own ``reload_weights`` from its (page-cached) checkpoint folder:
  the fastest full restore vLLM itself offers, and the same code path every push goes through.
- `memcpy_floor` -- copy the same bytes into preallocated tensors: the memory-bandwidth
  floor no sync can beat.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from weightsync.trainer.tensors import base_tensors

Row = tuple[int, int, None, dict[str, float]]  # bytes sent, engine calls, no report, phases

_QUIET = [
    "vllm.model_executor.model_loader.reload.layerwise",  # "Failed to load weights" per module
    "vllm.model_executor.model_loader.reload.inplace",  # "weights were not loaded" per call
]


@contextmanager
def _quiet_partial_reload() -> Iterator[None]:
    """A partial reload is intended here: silence vLLM's per-module 'not loaded' warnings."""
    saved = [(name, logging.getLogger(name).level) for name in _QUIET]
    for name, _ in saved:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, level in saved:
            logging.getLogger(name).setLevel(level)


def packed_modules(llm) -> dict[str, str]:
    """HF module name -> the vLLM module it is fused into (``q_proj`` -> ``qkv_proj``)."""
    mapping = llm.apply_model(lambda m: dict(getattr(m, "packed_modules_mapping", {}) or {}))[0]
    return {part: fused for fused, parts in mapping.items() for part in parts}


def module_groups(names_tensors: list[tuple[str, torch.Tensor]], packed: dict[str, str]):
    """Split an ordered stream into runs that belong to one vLLM module."""
    groups: list[list[tuple[str, torch.Tensor]]] = []
    last = None
    for name, t in names_tensors:
        module, _, _ = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        key = f"{parent}.{packed.get(leaf, leaf)}"
        if key != last:
            groups.append([])
            last = key
        groups[-1].append((name, t))
    return groups


def trainer_pairs(model: nn.Module, engine) -> list[tuple[str, torch.Tensor]]:
    """The trainer's base weights under checkpoint names, in layer order, in the engine dtype."""
    return [
        (t.name, t.produce(engine.dtype))
        for t in base_tensors(model, merge_lora=False, expected=engine.expected_weights)
    ]


def _phases(start: float, trainer_side: float) -> dict[str, float]:
    total = time.perf_counter() - start
    return {
        "total": total,
        "weightsync": trainer_side,  # the trainer-side work of the practice imitated
        "plan": 0.0,
        "produce": trainer_side,
        "serialize": 0.0,
        "engine": total - trainer_side,
    }


@torch.no_grad()
def per_module_rpc(model: nn.Module, engine, packed: dict[str, str]) -> Row:
    start = time.perf_counter()
    groups = module_groups(trainer_pairs(model, engine), packed)
    trainer_side = time.perf_counter() - start
    sent = 0
    with _quiet_partial_reload():
        for group in groups:
            engine.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": group, "is_checkpoint_format": True}
            )
            sent += sum(t.numel() * t.element_size() for _, t in group)
    engine.llm.reset_prefix_cache()
    return sent, len(groups), None, _phases(start, trainer_side)


def _inplace_pairs(peft_model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    # What these trainers do by hand: the state of the (now merged) base under checkpoint names.
    for name, p in peft_model.get_base_model().named_parameters():
        if ".lora_" in name:
            continue
        yield name.replace(".base_layer.", "."), p.detach()


@torch.no_grad()
def inplace_merge_push(peft_model: nn.Module, engine) -> Row:
    start = time.perf_counter()
    peft_model.merge_adapter()
    try:
        pairs = list(_inplace_pairs(peft_model))
        t = time.perf_counter()
        engine.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(pairs), "is_checkpoint_format": True}
        )
        engine.llm.reset_prefix_cache()
        in_engine = time.perf_counter() - t
    finally:
        peft_model.unmerge_adapter()
    total = time.perf_counter() - start
    # trainer side: merge_adapter + unmerge_adapter (the push reads the merged weights in place)
    parts = _phases(start, total - in_engine)
    return sum(t.numel() * t.element_size() for _, t in pairs), 1, None, parts


@torch.no_grad()
def inplace_merge_cycle(peft_model: nn.Module) -> None:
    """One merge + unmerge without a push: what the drift loop repeats."""
    peft_model.merge_adapter()
    peft_model.unmerge_adapter()


def vllm_reload(engine, checkpoint: str) -> Row:
    start = time.perf_counter()
    # weights_path is given explicitly: vLLM repoints its model path at any folder it reloaded
    # from (a snapshot row earlier in the run), and this row must read the original checkpoint.
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": checkpoint})
    engine.llm.reset_prefix_cache()
    itemsize = torch.empty((), dtype=engine.dtype).element_size()
    sent = sum(itemsize * math.prod(s) for s in engine.expected_weights.values())
    return sent, 1, None, _phases(start, 0.0)  # all of it in vLLM (disk read included)


class MemcpyFloor:
    """Preallocated destinations for the trainer's tensors; `__call__` copies into them."""

    def __init__(self, model: nn.Module, engine) -> None:
        self.src = [t for _, t in trainer_pairs(model, engine)]
        self.dst = [torch.empty_like(t) for t in self.src]
        for d in self.dst:  # touch the pages now, so the timed copy is bandwidth only
            d.zero_()

    @torch.no_grad()
    def __call__(self) -> tuple[int, int]:
        for d, s in zip(self.dst, self.src, strict=True):
            d.copy_(s)
        return sum(t.numel() * t.element_size() for t in self.src), 0

    def exact(self) -> bool:
        return all(torch.equal(d, s) for d, s in zip(self.dst, self.src, strict=True))
