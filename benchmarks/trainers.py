"""The trainer models the rows sync from, and what each computes (the correctness check's
references, `benchmarks.correctness`).

- ``dense``: the checkpoint plus noise on every weight, as after a full training step.
- ``peft``: the untouched checkpoint with LoRA adapters r8, r16, r64 whose B factors are
  non-zero, r16 active unless a row picks another.
- ``dense_untied``: as ``dense``, on the untied twin of the model (its rows are skipped
  without one).

What a checkpoint computes is kept before its model moves: the reload rows must match it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

from weightsync.testing import perturb, trainer_greedy
from weightsync.verify import canary_prompt, canary_prompts, trainer_prompt_logprobs

from .models import ModelSpec, load_trainer, with_adapters
from .rows import RANKS, Row

GREEDY_TOKENS = 8


def canary(vocab_size: int) -> list[int]:
    """The short prompt whose greedy tokens are recorded after each row."""
    return canary_prompt(vocab_size, 16)


def greedy(model: torch.nn.Module) -> list[int]:
    return trainer_greedy(model, canary(model.config.vocab_size), GREEDY_TOKENS)


def _trained(spec: ModelSpec) -> tuple[torch.nn.Module, Any, list[int]]:
    """``spec``'s model after a "training step" (every weight moves), with its checkpoint's
    logprobs and greedy tokens, taken before it moved."""
    model = load_trainer(spec)
    logprobs = trainer_prompt_logprobs(model, canary_prompts(model.config.vocab_size))
    tokens = greedy(model)
    for p in model.parameters():
        p.requires_grad_(True)
    perturb(model, seed=7, scale=0.02)
    return model, logprobs, tokens


class Trainers:
    """The trainer models of one benchmark run; ``peft`` and ``dense_untied`` load at first use."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        untied: ModelSpec | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.spec = spec
        self.untied = untied
        self.log = log
        log(f"[bench] loading trainer models from {spec.checkpoint}")
        self.dense, self._checkpoint_lp, self._checkpoint_greedy = _trained(spec)
        self._peft: Any = None
        self._dense_untied: torch.nn.Module | None = None
        self._untied_checkpoint_lp: Any = None
        self._untied_checkpoint_greedy: list[int] = []

    @property
    def peft(self) -> Any:
        """The checkpoint with LoRA adapters r8, r16, r64 (r16 active)."""
        if self._peft is None:
            self._peft = with_adapters(load_trainer(self.spec), RANKS)
            self._peft.set_adapter("r16")
        return self._peft

    @property
    def dense_untied(self) -> torch.nn.Module:
        """The untied twin after a "training step"."""
        if self._dense_untied is None:
            assert self.untied is not None
            self.log(f"[bench] loading trainer model from {self.untied.checkpoint}")
            model, self._untied_checkpoint_lp, self._untied_checkpoint_greedy = _trained(
                self.untied
            )
            self._dense_untied = model
        return self._dense_untied

    def release(self, remaining: list[Row]) -> None:
        """Free the untied model once no remaining row needs it (the server rows that come
        after start two more engines). Its engine stays (`benchmarks.inprocess`)."""
        if self._dense_untied is not None and not any(r.spec == "untied" for r in remaining):
            self._dense_untied = None
            gc.collect()

    def spec_of(self, row: Row) -> ModelSpec:
        if row.spec == "untied":
            if self.untied is None:
                raise ValueError(f"{self.spec.name} has no untied twin (models.UNTIED)")
            return self.untied
        return self.spec

    def model_name(self, row: Row) -> str | None:
        return self.spec.name if row.spec == "main" else getattr(self.untied, "name", None)

    def of(self, row: Row) -> torch.nn.Module:
        """The model ``row`` syncs from."""
        if row.spec == "untied":
            return self.dense_untied
        return self.peft if row.model == "peft" else self.dense

    @property
    def vocab_size(self) -> int:
        return self.dense.config.vocab_size

    def reference(self, row: Row, prompts: Any) -> tuple[Any, Any]:
        """(trainer logprobs the engine must match, those of a model it must not match)."""
        if row.spec == "untied":
            dense = trainer_prompt_logprobs(self.dense_untied, prompts)
            ckpt = self._untied_checkpoint_lp
            return (ckpt, dense) if row.model == "checkpoint" else (dense, ckpt)

        def lp(which: str) -> Any:
            if which == "checkpoint":
                return self._checkpoint_lp
            return trainer_prompt_logprobs(self.peft if which == "peft" else self.dense, prompts)

        other = {"dense": "checkpoint", "peft": "dense", "checkpoint": "dense"}[row.model]
        return lp(row.model), lp(other)

    def reference_greedy(self, row: Row) -> list[int]:
        """The trainer's greedy tokens on the short canary prompt, for the model ``row`` must
        serve."""
        if row.model == "checkpoint":
            return (
                self._untied_checkpoint_greedy if row.spec == "untied" else self._checkpoint_greedy
            )
        return greedy(self.of(row))
