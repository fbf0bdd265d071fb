"""Rollouts in flight across a write, and the check of their labels (issue 33), shared by the
async-RL tests of every engine that reports versions: an ``AsyncLLM`` (test_async_rl_vllm), a
``vllm serve`` (test_async_rl_server_vllm) and an ``AsyncLLM`` in a Ray actor (test_ray_vllm).

Each engine admits requests its own way (a coroutine on the AsyncLLM's loop, an HTTP stream, an
actor call): a `Rollouts` of that engine. `across` admits requests before a write pauses the
engine, while it is paused and after it; `check` regenerates each labelled span of a finished `Rollout` with the trainer's model
of exactly that (base, adapter) version from the span's prefix (prompt + the tokens before it)
and requires the same tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from weightsync import testing as T
from weightsync.engines.vllm.control import WeightsSpan
from weightsync.engines.vllm.remote import RemoteVLLMEngine

#: Tokens each rollout generates: long enough to be stepped across a write.
TOKENS = 40
#: Two prompts sharing a 70-token prefix: two whole KV blocks (of 32) a prefix cache keeps.
PREFIX = [(7 * i + 3) % 1000 + 1 for i in range(70)]
PROMPTS = [[*PREFIX, 11, 12], [*PREFIX, 13]]


@dataclass
class Rollout:
    """A finished request: what it was given, what it generated, the spans of (base, adapter)
    version its engine's ``weights_spans`` read from the engine's answer, and when its last
    token reached the test (``time.monotonic``, one clock for every process of the machine).
    ``crossed``: it was generating when a write paused the engine (`across`) and its last
    token came after the engine was resumed, so it was in flight across the write."""

    name: str
    prompt: list[int]
    tokens: list[int]
    spans: list[WeightsSpan] | None
    ended: float
    crossed: bool = False


class Rollouts(Protocol):
    """Requests generating on an engine while the test's thread syncs it."""

    def admit(self, prompt: list[int], adapter: Any) -> None:
        """Start `TOKENS` greedy tokens from ``prompt`` under ``adapter`` (the engine's own
        handle of an adapter version; None: the base) and return at once."""

    def wait_started(self) -> None:
        """Return once every request admitted so far has generated its first tokens."""

    def finished(self) -> list[Rollout]:
        """Every request admitted, run to its end, in the order admitted."""


def across(
    rollouts: Rollouts,
    engine: RemoteVLLMEngine,
    write: Callable[[], Any],
    before: list[tuple[list[int], Any]],
    after: Callable[[], list[tuple[list[int], Any]]],
) -> list[Rollout]:
    """Run ``write()`` on ``engine`` in a thread with requests in flight: ``before``
    (prompt, adapter) admitted and generating just before the write pauses the engine, one more
    (``before[0]`` again) admitted while it is paused, then the requests ``after()`` returns
    once it ended; all of them finished, in that order, those of ``before`` marked ``crossed``
    if their last token came after the engine was resumed.

    Why at the pause: a write stages its bytes before pausing, and a server decodes a rollout
    of the tiny model faster than that (every rollout admitted before the sync started had
    finished by its pause). So the engine's ``control.pause`` (and ``control.commit``, for an
    engine that pauses inside its own commit call) is wrapped for the write's duration: the
    write's own path is unchanged, the requests are running when it lands.
    """
    control = engine.control
    pause, resume, commit = control.pause, control.resume, control.commit
    paused, window = threading.Event(), {"resumed": float("inf")}

    def admit_first() -> None:
        if not paused.is_set():  # the write's first pause (FullSync(lora='separate') has two)
            for prompt, adapter in before:
                rollouts.admit(prompt, adapter)
            rollouts.wait_started()

    def admit_then_pause() -> None:
        admit_first()
        pause()
        paused.set()

    def note_then_resume() -> None:
        window["resumed"] = min(window["resumed"], time.monotonic())
        resume()

    def admit_then_commit(what: Any) -> Any:
        # A server with the pause lease, a Ray actor: the engine pauses and resumes inside this
        # one call (its resume is noted at the call's end, a bound on the late side).
        admit_first()
        paused.set()
        done = commit(what)
        window["resumed"] = min(window["resumed"], time.monotonic())
        return done

    failed: list[BaseException] = []

    def run() -> None:
        try:
            write()
        except BaseException as e:  # noqa: BLE001 (raised in the test's thread below)
            failed.append(e)

    control.pause, control.resume = admit_then_pause, note_then_resume
    control.commit = admit_then_commit
    try:
        writer = threading.Thread(target=run)
        writer.start()
        while not paused.wait(0.1) and writer.is_alive():
            pass
        if paused.is_set():
            rollouts.admit(*before[0])  # while the engine is paused
        writer.join(300)
        assert not writer.is_alive(), "the write did not end within 300 s"
    finally:
        del control.pause, control.resume, control.commit  # the class's own again
    if failed:
        raise failed[0]
    assert paused.is_set(), "the write never paused the engine"
    for prompt, adapter in after():
        rollouts.admit(prompt, adapter)
    done = rollouts.finished()
    for rollout in done[: len(before)]:
        rollout.crossed = rollout.ended > window["resumed"]
    return done


def check(
    rollout: Rollout, models: Mapping[tuple[str, int | None], Any], tokens: int = TOKENS
) -> list[WeightsSpan]:
    """Each span of ``rollout`` (``tokens`` tokens) is what the trainer's model of its (base,
    adapter) version generates from the span's prefix; returns the spans."""
    spans = rollout.spans
    generated = rollout.tokens
    assert spans and spans[0].start == 0 and spans[-1].end == len(generated) == tokens, spans
    for span in spans:
        model = models[(span.base, span.adapter)]
        prefix = rollout.prompt + generated[: span.start]
        regenerated = T.trainer_greedy(model, prefix, span.end - span.start)
        assert generated[span.start : span.end] == regenerated, (rollout.name, span)
    return spans
