"""The adapter's base, proven (issue 32): on one engine serving LoRA, every order of merged and
served syncs -- by one Syncer, two Syncers, or the strategies called directly -- either serves
exactly what the trainer's peft model generates, or is refused before anything is written.

Before, a merged sync (``FullSync(lora="merge")``: the adapter inside the weights) followed by
an adapter-only sync loaded the adapter onto a base that already held it: counted twice,
silent wrong tokens. Now `AdapterSync` needs proof that the engine holds the trainer's frozen
base (`weightsync.strategies.proof`), and `Syncer` restores the base when there is none.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import ATOL, LORA, lora_model

from weightsync import AdapterSync, FullSync, ReloadWeights, Syncer
from weightsync import testing as T
from weightsync.engines import VLLMEngine
from weightsync.errors import BaseDiscardedError, BaseUnprovenError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return T.save_checkpoint(T.tiny_model("llama"), tmp_path_factory.mktemp("adapter-base") / "ck")


@pytest.fixture(scope="module")
def llm(checkpoint):
    return T.make_llm(checkpoint, enable_lora=True, max_lora_rank=16)


def refused_unwritten(sync, model, engine, match: str) -> None:
    """``sync`` raises `BaseUnprovenError` naming ``match``, with zero engine writes, and the
    engine generates what it generated before."""
    before = engine.greedy_batch(T.PROMPTS, 8)
    with T.count_writes(engine) as writes, pytest.raises(BaseUnprovenError, match=match):
        sync.sync(model, engine)
    assert writes == [], f"refused, but the engine was written: {writes}"
    assert engine.greedy_batch(T.PROMPTS, 8) == before


# The syncs a walk is made of: merged or served, by which entry point.
MERGED = ("merged:strategy", "merged:syncer")
SERVED = ("served:adapter", "served:syncer", "served:full")


def run(kind: str, model, engine, syncers: dict) -> str:
    """One sync of ``kind`` into ``engine``; returns the strategy that ran, or "refused"."""
    if kind == "merged:strategy":
        report = FullSync(lora="merge").sync(model, engine)
    elif kind == "merged:syncer":  # a second Syncer on the same engine, told not to serve LoRA
        report = syncers["merged"].sync(model)
    elif kind == "served:syncer":  # told the base is synced: the policy picks AdapterSync
        report = syncers["served"].sync(model)
    elif kind == "served:full":
        report = FullSync(lora="separate").sync(model, engine)
    else:
        try:
            report = AdapterSync().sync(model, engine)
        except BaseUnprovenError:
            return "refused"
    return report.strategy


def every_pair(kinds: tuple[str, ...]) -> list[str]:
    """A sequence of ``kinds`` in which every ordered pair follows once (a de Bruijn
    sequence of order 2): one walk covers every order of two syncs."""
    n, seq, a = len(kinds), [], [0] * (2 * len(kinds))

    def db(t: int, p: int) -> None:
        if t > 2:
            if 2 % p == 0:
                seq.extend(a[1 : p + 1])
        else:
            a[t] = a[t - p]
            db(t + 1, p)
            for j in range(a[t - p] + 1, n):
                a[t] = j
                db(t + 1, t)

    db(1, 1)
    return [kinds[i] for i in [*seq, seq[0]]]


@pytest.mark.timeout(1800)  # 26 syncs, each checked (714 s at load 40 on 2 cores)
def test_every_order_of_merged_and_served_syncs_is_exact_or_refused(llm):
    kinds = MERGED + SERVED
    walk = every_pair(kinds)
    assert {(a, b) for a, b in itertools.pairwise(walk)} == set(itertools.product(kinds, kinds))
    engine = VLLMEngine(llm)
    model = lora_model("llama", seed=1, config=LORA)
    FullSync(lora="separate").sync(model, engine)  # a known start: base + adapter
    syncers = {
        "merged": Syncer(engine, train_type="lora", rollout_lora=False, base_sync_done=True),
        "served": Syncer(engine, train_type="lora", base_sync_done=True),
    }
    merged_last = False
    for step, kind in enumerate(walk):
        T.perturb(model, seed=10 + step, scale=0.3)
        # what the engine serves, where a sync may be refused (an AdapterSync called directly)
        serving = engine.greedy_batch(T.PROMPTS, 8) if kind == "served:adapter" else None
        with T.count_writes(engine) as writes:
            ran = run(kind, model, engine, syncers)
        where = f"step {step} ({kind}) of {walk}"
        if ran == "refused":
            assert writes == [], where
            assert engine.greedy_batch(T.PROMPTS, 8) == serving, where
            assert merged_last, f"{where}: refused, but the base was the trainer's"
            continue
        T.assert_matches(model, engine, atol=ATOL)
        if kind == "served:syncer" and merged_last:
            assert ran == "FullSync(lora=separate)", f"{where}: the base held the adapter"
        merged_last = kind.startswith("merged")


def test_adapter_sync_after_a_merged_sync_is_refused_naming_it(llm):
    engine = VLLMEngine(llm)
    model = lora_model("llama", seed=2, config=LORA)
    FullSync(lora="merge").sync(model, engine)
    T.perturb(model, seed=3, scale=0.3)
    refused_unwritten(AdapterSync(), model, engine, r"FullSync\(lora=merge\).*adapter merged")
    syncer = Syncer(engine, train_type="lora", base_sync_done=True)
    plan = syncer.plan(model)
    assert plan.strategy == "FullSync(lora=separate)" and "not proven" in plan.reason
    syncer.sync(model)
    T.assert_matches(model, engine, atol=ATOL)
    T.perturb(model, seed=4, scale=0.3)
    assert syncer.sync(model).strategy == "AdapterSync"  # proven again: the base it wrote
    T.assert_matches(model, engine, atol=ATOL)


def test_another_base_is_refused(llm):
    """An adapter trained on another base (here: the base perturbed) may not be sent alone onto
    the base the engine holds, nor onto the engine's own checkpoint."""
    engine = VLLMEngine(llm)
    FullSync(lora="separate").sync(lora_model("llama", seed=5, config=LORA), engine)
    base = T.tiny_model("llama")
    T.perturb(base, seed=6, scale=0.01)
    from peft import LoraConfig, get_peft_model

    other = get_peft_model(base, LoraConfig(**LORA))
    T.perturb(other, seed=7, scale=0.3)
    refused_unwritten(AdapterSync(), other, engine, "frozen base changed")


@pytest.mark.parametrize("write", ["data", "swapped", "one element"])
@torch.no_grad()
def test_a_frozen_base_rewritten_after_a_proof_is_seen(llm, write):
    """After a proof, what it found is kept (`proof._Proven`); a write to the base since is
    seen: through ``.data`` (no version counter moves: the sampled bytes show it), by swapping
    the tensor's data (its address moves), or to one element no sample reads, through the
    parameter (its version counter moves)."""
    engine = VLLMEngine(llm)
    model = lora_model("llama", seed=8, config=LORA)
    FullSync(lora="separate").sync(model, engine)
    AdapterSync().sync(model, engine)  # proven, keys kept
    AdapterSync().sync(model, engine)  # proven again from what was kept
    w = model.base_model.model.model.layers[0].mlp.up_proj.weight
    noise = 0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(9))
    if write == "data":
        w.data.add_(noise)
    elif write == "swapped":
        w.data = w.data + noise
    else:
        w.view(-1)[1] += 0.5
    refused_unwritten(AdapterSync(), model, engine, "frozen base changed")
    syncer = Syncer(engine, train_type="lora", base_sync_done=True)
    assert syncer.sync(model).strategy == "FullSync(lora=separate)"
    T.assert_matches(model, engine, atol=ATOL)


def test_a_level_2_sleep_during_an_adapter_write_is_seen_by_the_next_sync(llm):
    """An adapter-only write moves no epoch, so its record is the attestation made before it
    (not a second one after it): a level-2 sleep someone else makes while the adapter loads
    lies after that epoch, and the next sync sees it -- the adapter alone is refused, the
    Syncer restores the base."""
    engine = VLLMEngine(llm)
    model = lora_model("llama", seed=12, config=LORA)
    FullSync(lora="separate").sync(model, engine)
    load = engine.load_adapter

    def load_while_another_client_sleeps_the_engine(adapter):
        calls = load(adapter)
        llm.sleep(level=2)
        T.discard_weights(engine)  # what level 2 does to the weights on a GPU
        llm.wake_up()
        return calls

    engine.load_adapter = load_while_another_client_sleeps_the_engine
    T.perturb(model, seed=13, scale=0.3)
    AdapterSync().sync(model, engine)
    del engine.load_adapter
    with pytest.raises(BaseDiscardedError):
        AdapterSync().sync(model, engine)
    syncer = Syncer(engine, train_type="lora", base_sync_done=True)
    assert syncer.sync(model).strategy == "FullSync(lora=separate)"
    T.assert_matches(model, engine, atol=ATOL)


def test_the_engines_own_checkpoint_is_a_proven_base(checkpoint):
    """Nothing written yet: the engine holds its checkpoint, which is the trainer's base."""
    engine = VLLMEngine(T.make_llm(checkpoint, enable_lora=True, max_lora_rank=16))
    model = lora_model("llama", seed=10, config=LORA)
    syncer = Syncer(engine, train_type="lora", base_sync_done=True)
    assert syncer.sync(model).strategy == "AdapterSync"
    T.assert_matches(model, engine, atol=ATOL)
    # after ReloadWeights(checkpoint) too, then after a merged sync it is not
    ReloadWeights().sync(model, engine)
    T.perturb(model, seed=11, scale=0.3)
    assert AdapterSync().sync(model, engine).strategy == "AdapterSync"
    T.assert_matches(model, engine, atol=ATOL)
    FullSync(lora="merge").sync(model, engine)
    refused_unwritten(AdapterSync(), model, engine, "adapter merged")
