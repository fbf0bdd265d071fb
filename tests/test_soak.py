"""Soak: 200 RL-style steps against two real vLLM engines, the Syncer choosing every time.

Two engines on the same tiny Llama checkpoint: one serving LoRA, one not (LoRA merged). Each
takes every other step. Its trainer switches between full training and LoRA training every
PHASE of its steps (a new run: a new Syncer, which starts with base_sync_done False), and every
step goes through a seeded-random sleep level: 0, 1 (weights kept), or 2 (weights discarded,
simulated with ``T.discard_weights`` since sleep is a no-op on CPU vLLM). After every step the
engine's greedy tokens must equal the trainer's (logprobs within 1e-3), and verify.check_engine
(one prefill of the canary prompts) must pass.
Resident memory after step 200 must be within 10% of after step 20.

Run alone: ``bash .ci/env pytest -q -s -m soak tests/test_soak.py`` (-s prints the figures).
"""

from __future__ import annotations

import collections
import gc
import random
import time

import psutil
import pytest
from conftest import ATOL, LORA
from peft import LoraConfig, get_peft_model

from weightsync import Syncer
from weightsync import testing as T
from weightsync.engines import VLLMEngine
from weightsync.verify import check_engine, trainer_logprobs

STEPS = 200
PHASE = 10  # steps of one engine before its trainer switches between full and LoRA training
PROMPT = [1, 2, 3, 4, 5]
TOKENS = 3  # one vLLM-CPU generate costs ~0.2 s per token here: it dominates a step


def rss_mb() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


class Lane:
    """One engine and the trainer feeding it."""

    def __init__(self, name, engine, seed):
        self.name, self.engine = name, engine
        self.models = {
            "full": T.tiny_model("llama"),
            "lora": get_peft_model(T.tiny_model("llama"), LoraConfig(**LORA)),
        }
        self.rng = random.Random(seed)
        self.steps = 0
        self.syncer = None
        self.train_type = None

    def step(self, global_step):
        # A new run every PHASE steps, alternating full and LoRA training.
        train_type = ("full", "lora")[(self.steps // PHASE) % 2]
        if train_type != self.train_type:
            self.train_type = train_type
            self.syncer = Syncer(self.engine, train_type=train_type)
        model = self.models[train_type]
        T.perturb(model, seed=global_step, scale=0.01 if train_type == "full" else 0.02)

        level = self.rng.choice((0, 1, 2))
        if level:
            self.engine.sleep(level)
            if level == 2:
                T.discard_weights(self.engine, seed=global_step)
            self.engine.wake_up(["weights"])
        report = self.syncer.sync(model)
        if level:
            self.engine.wake_up(["kv_cache"])  # trl#5142 order: weights, load, KV cache
        check_engine(model, self.engine, strategy=report.strategy, step=global_step)
        self.steps += 1

        tokens, logprobs = self.engine.greedy(PROMPT, TOKENS)
        expected = T.trainer_greedy(model, PROMPT, TOKENS)
        assert tokens == expected, (
            f"step {global_step} ({self.name}, {train_type}, sleep {level}, {report.strategy}): "
            f"engine {tokens} != trainer {expected}"
        )
        diff = max(
            abs(a - b)
            for a, b in zip(logprobs, trainer_logprobs(model, PROMPT, tokens), strict=True)
        )
        assert diff <= ATOL, f"step {global_step}: logprob diff {diff}"
        return f"{self.name}/{train_type}/sleep{level}: {report.strategy}"


@pytest.mark.soak
def test_soak_200_steps(tmp_path):
    start = time.perf_counter()
    checkpoint = T.save_checkpoint(T.tiny_model("llama"), tmp_path / "llama")
    lanes = [
        Lane("lora-engine", VLLMEngine(T.make_llm(checkpoint, enable_lora=True)), seed=1),
        Lane("plain-engine", VLLMEngine(T.make_llm(checkpoint)), seed=2),
    ]
    ready = time.perf_counter()

    counts = collections.Counter()
    rss = {}
    for step in range(1, STEPS + 1):
        counts[lanes[step % 2].step(step)] += 1
        if step in (20, STEPS):
            rss[step] = rss_mb()
    done = time.perf_counter()

    print(
        f"\nsoak: {STEPS} steps in {done - ready:.1f} s ({(done - ready) / STEPS * 1e3:.0f} ms/step), "
        f"engines started in {ready - start:.1f} s"
    )
    print(
        f"soak: RSS after step 20 {rss[20]:.0f} MiB, after step {STEPS} {rss[STEPS]:.0f} MiB "
        f"({(rss[STEPS] / rss[20] - 1) * 100:+.1f}%)"
    )
    for key, n in sorted(counts.items()):
        print(f"soak: {n:4d} x {key}")

    # Every combination was exercised.
    for lane in ("lora-engine", "plain-engine"):
        for train_type in ("full", "lora"):
            for level in (0, 1, 2):
                assert any(k.startswith(f"{lane}/{train_type}/sleep{level}:") for k in counts), (
                    lane,
                    train_type,
                    level,
                )
    assert any(k.endswith("AdapterSync") for k in counts)
    assert any(k.endswith("FullSync(lora=separate)") for k in counts)
    assert any(k.endswith("FullSync(lora=merge)") for k in counts)
    assert rss[STEPS] <= 1.10 * rss[20], f"RSS grew from {rss[20]:.0f} to {rss[STEPS]:.0f} MiB"
