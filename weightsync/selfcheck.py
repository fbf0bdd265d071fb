"""``python -m weightsync.selfcheck CHECKPOINT``: prove weightsync exact on your own stack before
a long RL job -- your vLLM build, your device, your model, your sleep levels.

It walks the lifecycle your configuration implies, step by step, as a framework drives it: a
real optimizer step on the trainer's model (transformers, with a PEFT LoRA adapter if asked; a
random batch: the point is that the weights move); the canary gap of the engine still holding
the last step's weights (the *stale gap*: what the check would see had the sync been skipped);
vLLM's own sleep at the step's level and the wake of the weights; the sync a `Syncer` chooses
(`weightsync.policy.choose`, or the base restore it puts in place of an adapter sync whose base
is unproven); the wake of the KV cache; then the check: the engine's greedy tokens equal the
trainer's (or, on a half-precision engine, part at a near tie: `StepResult.tokens`), and its
logprobs on the canary prompts are within the engine's tolerance
(`weightsync.verify.canary_gap`, `weightsync.verify.tolerance_for`: the check ``verify=True``
makes). It reports every step, exact or not, with its figures, and exits non-zero if any step
is not exact.

Where the device has no sleep mode (vLLM's is CUDA/ROCm/XPU only; on vLLM-CPU ``sleep`` moves no
memory), vLLM's sleep call is still made, a level-2 discard is simulated by overwriting every
weight with garbage through vLLM (`weightsync.testing.discard_weights`), and the report says
each such sleep was *simulated*: only a device with sleep mode proves the real one.

The walk observes; it repairs nothing: a step that is not exact is followed by the steps the
framework would run next. What each field means, and reports of runs: docs/self-check.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import testing
from .engines.base import Engine
from .errors import WeightSyncError
from .policy import TrainType
from .syncer import Syncer
from .verify import Tolerance, canary_gap, tolerance_for

#: A training step a caller may pass instead of `optimizer_step`: ``(model, step)``.
TrainStep = Callable[[nn.Module, int], None]


@dataclass
class StepResult:
    """One step of the walk.

    Attributes:
        step: its number, from 0.
        sleep_level: the level the engine slept at before the sync (0: it did not sleep).
        sleep: ``"none"``, ``"real"`` (vLLM's sleep on a device with sleep mode) or
            ``"simulated"`` (vLLM's sleep call on a device without it, which moves no memory;
            at level 2 every weight was then overwritten with garbage, as a real one loses them).
        strategy: the strategy the sync ran (the Syncer's choice), or the one it would have
            run if the sync raised.
        reason: why it was chosen.
        exact: after a sync that raised nothing, the canary gap within the tolerance and the
            greedy tokens `tokens`: ``"equal"``, or on a half-precision engine ``"near-tie"``.
        tokens: ``"equal"``: the engine's greedy tokens (`weightsync.testing.PROMPTS`, 8 tokens
            each) are the trainer's; ``"near-tie"``: they differ, on a bfloat16/float16 engine,
            where the trainer scores every token the engine chose within the tolerance's max
            of the engine (``greedy_gap``) -- rounding took the other branch of a near tie,
            which a correct sync does in half precision (the canary, over many positions, is
            the test there); ``"differ"``: anything else.
        greedy_gap: the largest ``|engine - trainer|`` logprob of the engine's greedy tokens.
        mean_gap: mean ``|engine - trainer|`` logprob over the canary positions.
        max_gap: the largest.
        stale_gap: the mean gap after the training step, before the sleep and the sync: what
            the check would have seen had the sync been skipped (a stale engine). At or
            below the tolerance, the step moved the weights too little to prove anything.
        tolerance: the bounds ``mean_gap`` and ``max_gap`` are held to.
        sync_seconds: wall time of the sync (`SyncReport.seconds`; checks included).
        bytes: bytes the sync wrote into the engine.
        error: the error the sync or the check raised, if any.
    """

    step: int
    sleep_level: int
    sleep: str
    strategy: str
    reason: str
    exact: bool
    tokens: str
    greedy_gap: float
    mean_gap: float
    max_gap: float
    stale_gap: float
    tolerance: Tolerance
    sync_seconds: float | None
    bytes: int | None
    error: str | None = None


@dataclass
class Report:
    """What `run` or `walk` found: the set-up, then a `StepResult` per step; ``ok`` when
    every step is exact. ``str(report)`` is the table the command prints."""

    setup: dict[str, Any]
    steps: list[StepResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.steps) and all(s.exact for s in self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "setup": self.setup,
            "steps": [dataclasses.asdict(s) for s in self.steps],
        }

    def __str__(self) -> str:
        lines = ["weightsync self-check"]
        lines += [f"  {key}: {value}" for key, value in self.setup.items()]
        lines.append(
            f"{'step':>4}  {'sleep':<13} {'strategy':<24} {'exact':<5} {'tokens':<8} "
            f"{'mean gap':>9} {'max gap':>9} {'greedy gap':>10} {'stale gap':>9} {'sync s':>7} "
            f"{'MB':>7}"
        )
        for s in self.steps:
            sleep = f"{s.sleep_level} ({s.sleep})" if s.sleep_level else "0"
            seconds = f"{s.sync_seconds:.3f}" if s.sync_seconds is not None else "-"
            mb = f"{s.bytes / 1e6:.2f}" if s.bytes is not None else "-"
            lines.append(
                f"{s.step:>4}  {sleep:<13} {s.strategy:<24} {'yes' if s.exact else 'NO':<5} "
                f"{s.tokens:<8} {s.mean_gap:>9.2e} "
                f"{s.max_gap:>9.2e} {s.greedy_gap:>10.2e} {s.stale_gap:>9.2e} {seconds:>7} {mb:>7}"
            )
            lines.append(f"      why: {s.reason}")
            if s.error:
                lines.append(f"      error: {s.error}")
        weak = [s.step for s in self.steps if not s.stale_gap > s.tolerance.mean]
        if weak:
            lines.append(
                f"note: steps {weak} moved the weights too little for a stale engine to fail "
                "the check (stale gap within the tolerance): raise the learning rate"
            )
        exact = sum(s.exact for s in self.steps)
        verdict = "EXACT" if self.ok else "NOT EXACT"
        lines.append(f"{verdict}: {exact} of {len(self.steps)} steps exact")
        return "\n".join(lines)


def optimizer_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, seed: int, batch: int = 2
) -> None:
    """One real optimizer step: the causal-LM loss of a random token batch, backward, step.
    The batch means nothing; the step moves every trainable weight as training would."""
    peft_or_plain: Any = model
    config = getattr(model, "config", None) or peft_or_plain.get_base_model().config
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(config.vocab_size, (batch, 16), generator=gen).to(device)
    was_training = model.training
    model.train()
    try:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    finally:
        model.train(was_training)


def sleeps_for_real(engine: Engine) -> bool:
    """Whether ``engine`` is a vLLM engine started with sleep mode (which vLLM allows only on
    a device that has it): then its ``sleep`` really offloads (level 1) or discards (level 2)."""
    llm_engine = getattr(engine, "llm_engine", None) or getattr(
        getattr(engine, "llm", None), "llm_engine", None
    )
    config = getattr(llm_engine, "vllm_config", None)
    return bool(config is not None and config.model_config.enable_sleep_mode)


def _check_walk(sleep_levels: Sequence[int], steps: int) -> None:
    if not sleep_levels or any(level not in (0, 1, 2) for level in sleep_levels):
        raise ValueError(f"sleep_levels must be 0, 1 or 2 (vLLM has no other), got {sleep_levels}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")


def walk(
    model: nn.Module,
    engine: Engine,
    *,
    train_type: TrainType,
    sleep_levels: Sequence[int] = (0, 1, 2),
    steps: int = 4,
    train_step: TrainStep | None = None,
    lr: float = 1e-3,
    tolerance: Tolerance | None = None,
    setup: dict[str, Any] | None = None,
) -> Report:
    """Walk ``steps`` steps of an RL job on ``model`` (the trainer's: a transformers model or a
    ``peft.PeftModel``) and ``engine`` (started from the checkpoint ``model`` was loaded from;
    serving LoRA or not, as the job will), and check each (module docstring).

    Args:
        train_type: ``"full"`` or ``"lora"``, as for `Syncer`.
        sleep_levels: the level of each step's sleep, in turn (0: no sleep).
        train_step: ``(model, step)``, your own training step; default: `optimizer_step` with
            AdamW at ``lr`` over the trainable parameters.
        tolerance: the canary bounds; default `tolerance_for` the engine.
        setup: what to print above the steps (`run` fills it).

    Raises:
        ValueError: a sleep level other than 0, 1, 2; or a level 2 to simulate on an engine
            that is not an in-process vLLM engine (the simulation writes through its ``LLM``).
    """
    from .engines import VLLMEngine

    _check_walk(sleep_levels, steps)
    real = sleeps_for_real(engine)
    if 2 in sleep_levels and not real and not isinstance(engine, VLLMEngine):
        raise ValueError(
            f"this {type(engine).__name__} has no sleep mode, and a level-2 discard is simulated "
            "only on an in-process vLLM engine (tensor parallel size 1); run on a device with "
            "sleep mode, or leave level 2 out of sleep_levels"
        )
    limit = tolerance or tolerance_for(engine)
    if train_step is None:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)

        def train_step(m: nn.Module, step: int) -> None:
            optimizer_step(m, optimizer, seed=step)

    syncer = Syncer(engine, train_type=train_type)
    report = Report(setup=dict(setup or {}))
    report.setup.setdefault("engine", f"{engine.facts.architecture}, {engine.dtype}")
    report.setup.setdefault("sleep", "real" if real else "simulated (no sleep mode on this engine)")
    report.setup.setdefault(
        "tolerance", f"mean gap {limit.mean:g}, max gap {limit.max:g} ({engine.dtype})"
    )
    if engine.asleep:  # a framework's engine may be asleep (TRL sleeps it in its __init__):
        engine.wake_up()  # the canaries would wait forever on vLLM's paused scheduler
    for step in range(steps):
        level = sleep_levels[step % len(sleep_levels)]
        train_step(model, step)
        # What the check would see had this step's sync been skipped: a step whose stale gap
        # is within the tolerance moved the weights too little to prove anything.
        stale = canary_gap(model, engine, strict=tolerance is None)[0]
        if level:
            engine.sleep(level)
            if level == 2 and not real:
                testing.discard_weights(engine, seed=step)
            engine.wake_up(["weights"])
        error = None
        strategy = syncer.choose()
        name, reason, seconds, written = strategy.label, strategy.reason, None, None
        try:
            sync = syncer.sync(model)
            name, reason, seconds, written = sync.strategy, sync.reason, sync.seconds, sync.bytes
        except WeightSyncError as err:
            error = f"{type(err).__name__}: {err}"
        finally:
            if engine.asleep:  # the KV cache, woken after the sync as frameworks do (trl#5142)
                engine.wake_up()
        greedy = testing.compare(model, engine)
        mean, largest = canary_gap(model, engine, strict=tolerance is None)
        within = mean <= limit.mean and largest <= limit.max  # NaN fails
        tokens = (
            "equal"
            if greedy["engine"] == greedy["trainer"]
            else "near-tie"
            if engine.dtype != torch.float32 and greedy["max_logprob_diff"] <= limit.max
            else "differ"
        )
        report.steps.append(
            StepResult(
                step=step,
                sleep_level=level,
                sleep=("real" if real else "simulated") if level else "none",
                strategy=name,
                reason=reason,
                exact=error is None and within and tokens != "differ",
                tokens=tokens,
                greedy_gap=greedy["max_logprob_diff"],
                mean_gap=mean,
                max_gap=largest,
                stale_gap=stale,
                tolerance=limit,
                sync_seconds=seconds,
                bytes=written,
                error=error,
            )
        )
    return report


def _lora_rank(r: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds rank ``r``."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    return min((k for k in get_args(MaxLoRARanks) if k >= r), default=r)


def run(
    checkpoint: str,
    *,
    train_type: TrainType = "full",
    lora_r: int = 8,
    lora_alpha: int | None = None,
    lora_target_modules: Sequence[str] | str = "all-linear",
    lora_served: bool = True,
    sleep_levels: Sequence[int] = (0, 1, 2),
    steps: int = 4,
    dtype: str = "auto",
    trainer_dtype: str = "float32",
    tp: int = 1,
    lr: float = 1e-3,
    train_step: TrainStep | None = None,
    engine_args: dict[str, Any] | None = None,
) -> Report:
    """Build the trainer's model and a vLLM engine from ``checkpoint`` as an RL job would, and
    `walk` them.

    The model: transformers' ``AutoModelForCausalLM`` in ``trainer_dtype`` on the first CUDA
    device if there is one, with a PEFT LoRA adapter for ``train_type="lora"`` (rank
    ``lora_r``, alpha ``lora_alpha`` (default ``2 * lora_r``), ``lora_target_modules``, no
    dropout). The engine: an in-process ``vllm.LLM`` in ``dtype`` (`weightsync.testing.make_llm`:
    no tokenizer, eager, a 64 MiB KV cache, ``engine_args`` on top), with sleep mode where the
    device has it, serving the adapter when ``lora_served``; with ``tp > 1`` a multiprocess
    ``LLM`` with weightsync's worker extension (bytes through tmpfs).

    Start it before your job's own engine, or in a process of its own (the command): an
    in-process vLLM engine tears down vLLM's process-wide state when it is collected.
    """
    import vllm
    from vllm.platforms import current_platform

    if train_type not in ("full", "lora"):
        raise ValueError(f"train_type must be 'full' or 'lora', got {train_type!r}")
    _check_walk(sleep_levels, steps)  # before an engine starts
    serve = train_type == "lora" and lora_served
    real = current_platform.is_sleep_mode_available() and any(sleep_levels)
    options: dict[str, Any] = dict(dtype=dtype, enable_sleep_mode=real, **(engine_args or {}))
    if serve:
        options.update(enable_lora=True, max_lora_rank=_lora_rank(lora_r))
    engine = _engine(checkpoint, tp, options)
    try:
        model = _trainer_model(
            checkpoint,
            train_type,
            trainer_dtype,
            lora_r,
            lora_alpha or 2 * lora_r,
            lora_target_modules,
        )
        trainer = "full training"
        if train_type == "lora":
            adapter = "served by the engine" if serve else "merged into the weights"
            trainer = f"LoRA r={lora_r} on {lora_target_modules}, {adapter}"
        setup = {
            "checkpoint": checkpoint,
            "engine": f"{engine.facts.architecture}, {engine.dtype}, tensor parallel {tp}, "
            f"vLLM {vllm.__version__} on {current_platform.device_type or 'cpu'}",
            "trainer": f"{trainer}, {trainer_dtype} on {next(model.parameters()).device}",
            "sleep": "real (vLLM sleep mode)"
            if real
            else "simulated: this device has no vLLM sleep mode; vLLM's sleep call moves no "
            "memory, a level-2 discard overwrites every weight with garbage",
        }
        return walk(
            model,
            engine,
            train_type=train_type,
            sleep_levels=sleep_levels,
            steps=steps,
            train_step=train_step,
            lr=lr,
            setup=setup,
        )
    finally:
        _stop(engine)


def _engine(checkpoint: str, tp: int, options: dict[str, Any]) -> Engine:
    from .engines import WORKER_EXTENSION, VLLMEngine, VLLMMultiprocEngine

    if tp == 1:
        return VLLMEngine(testing.make_llm(checkpoint, **options))
    import vllm.envs
    from vllm import LLM

    kwargs = testing.engine_options(
        checkpoint, tensor_parallel_size=tp, worker_extension_cls=WORKER_EXTENSION, **options
    )
    # vLLM's multiprocess engine core, whatever this process uses for in-process engines
    # (vLLM caches its environment once an engine started: the cache is dropped around it).
    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    vllm.envs.disable_envs_cache()
    try:
        llm = LLM(**kwargs)
    finally:
        if saved is None:
            del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved
        vllm.envs.disable_envs_cache()
    return VLLMMultiprocEngine(llm)


def _stop(engine: Engine) -> None:
    """Stop what `_engine` started beyond this process: a multiprocess engine's transport,
    folders and processes (an in-process engine ends with the process, its folders too)."""
    from .engines import VLLMMultiprocEngine

    if isinstance(engine, VLLMMultiprocEngine):
        engine.close()
        engine.llm.llm_engine.engine_core.shutdown()


def _trainer_model(
    checkpoint: str,
    train_type: str,
    dtype: str,
    r: int,
    alpha: int,
    targets: Sequence[str] | str,
) -> nn.Module:
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype))
    model = model.to(device)
    if train_type == "full":
        return model
    from peft import LoraConfig, get_peft_model

    target: list[str] | str = targets if isinstance(targets, str) else list(targets)
    return get_peft_model(
        model, LoraConfig(r=r, lora_alpha=alpha, target_modules=target, lora_dropout=0.0)
    )


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        levels = []
    if not levels or any(level not in (0, 1, 2) for level in levels):
        raise argparse.ArgumentTypeError(f"a comma-separated list of 0, 1, 2; got {text!r}")
    return levels


def _engine_arg(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m weightsync.selfcheck",
        description="Walk the sleeps and syncs of an RL job on CHECKPOINT with your vLLM and "
        "device, and check after each sync that the engine serves exactly the trainer's model.",
    )
    parser.add_argument(
        "checkpoint", help="a local folder (or hub id) both trainer and engine load"
    )
    parser.add_argument("--train-type", choices=["full", "lora"], default="full")
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--lora-alpha", type=int, default=None, help="default: 2 * r")
    parser.add_argument(
        "--lora-target-modules",
        default="all-linear",
        help="comma-separated module names, or all-linear (the default)",
    )
    served = parser.add_mutually_exclusive_group()
    served.add_argument(
        "--lora-served",
        dest="lora_served",
        action="store_true",
        default=True,
        help="the engine serves the adapter (vLLM enable_lora; the default)",
    )
    served.add_argument(
        "--lora-merged",
        dest="lora_served",
        action="store_false",
        help="the engine gets the adapter merged into its weights",
    )
    parser.add_argument(
        "--sleep-levels", type=_levels, default=[0, 1, 2], help="each step's level, in turn (0,1,2)"
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtype", default="auto", help="the engine's dtype (vLLM --dtype)")
    parser.add_argument(
        "--trainer-dtype", default="float32", choices=["float32", "bfloat16", "float16"]
    )
    parser.add_argument("--tp", type=int, default=1, help="the engine's tensor parallel size")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of each step")
    parser.add_argument(
        "--engine-arg",
        type=_engine_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another vllm.LLM argument (JSON value), e.g. max_model_len=1024; repeatable",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the report as JSON to OUT")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.tp < 1 or args.lora_r < 1:
        parser.error("--steps, --tp and --lora-r must be at least 1")
    targets = args.lora_target_modules
    report = run(
        args.checkpoint,
        train_type=args.train_type,
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_target_modules=targets if targets == "all-linear" else targets.split(","),
        lora_served=args.lora_served,
        sleep_levels=args.sleep_levels,
        steps=args.steps,
        dtype=args.dtype,
        trainer_dtype=args.trainer_dtype,
        tp=args.tp,
        lr=args.lr,
        engine_args=dict(args.engine_arg),
    )
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=2)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
