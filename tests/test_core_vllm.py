"""The decision table against a real vLLM engine, for a tied (Qwen2) and an untied (Llama) model.

Every row: the trainer changes (full training or a LoRA step), the engine is put in the row's
sleep state (level 2 simulated by overwriting its weights with garbage, since vLLM's sleep is a
no-op on CPU), and the engine is checked to differ from the trainer. Then policy.choose + sync,
and the engine's greedy tokens must equal the trainer's with float32 logprobs within 1e-3. The
trainer's weights must be bit-identical before and after every sync.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ATOL, full_model, lora_model, sync_and_check

from weightsync import AdapterSync, FullSync, ReloadWeights, Syncer, policy
from weightsync import testing as T

ARCHS = ["qwen2", "llama"]


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(arch, tmp_path_factory):
    return T.save_checkpoint(T.tiny_model(arch), tmp_path_factory.mktemp(arch) / "ck")


@pytest.fixture(scope="module")
def engines(plain_engine, lora_engine):
    """The same checkpoint served twice (conftest's engines on it): without LoRA, and serving
    LoRA adapters."""
    return {False: plain_engine, True: lora_engine}


def enter_sleep(engine, level):
    """Put the engine through a sleep of ``level`` and wake it; level 2 loses the weights."""
    if level == 0:
        return
    engine.sleep(level)
    if level == 2:
        T.discard_weights(engine)
    engine.wake_up()


def sync_and_audit(strategy, model, engine):
    """``sync_and_check``, then the trainer's weights must be bit-identical to before the sync
    and the report filled in."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = sync_and_check(strategy, model, engine)
    after = model.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"sync modified the trainer's weights: {changed[:5]}"
    assert report.strategy == strategy.label and report.tensors > 0 and report.bytes > 0
    return report


def ensure_base(arch, engine):
    """Give a LoRA-serving engine the trainer's base (row 'base never pushed' does this too)."""
    FullSync(lora="separate").sync(lora_model(arch, seed=99), engine)


# --- the decision table ------------------------------------------------------------------------


@pytest.mark.parametrize("rollout_lora", [False, True])
@pytest.mark.parametrize("level", [0, 1, 2])
def test_full_training(arch, engines, rollout_lora, level):
    engine = engines[rollout_lora]
    model = full_model(arch, seed=10 + level + 5 * rollout_lora)
    enter_sleep(engine, level)
    s = policy.choose(
        train_type="full",
        rollout_lora=rollout_lora,
        base_sync_done=True,
        sleep_level=engine.sleep_level,
    )
    assert type(s) is FullSync
    sync_and_audit(s, model, engine)


@pytest.mark.parametrize("base_sync_done", [False, True])
@pytest.mark.parametrize("level", [0, 1, 2])
def test_lora_merged(arch, engines, base_sync_done, level):
    engine = engines[False]
    model = lora_model(arch, seed=20 + level + 5 * base_sync_done)
    enter_sleep(engine, level)
    s = policy.choose(
        train_type="lora",
        rollout_lora=False,
        base_sync_done=base_sync_done,
        sleep_level=engine.sleep_level,
    )
    assert type(s) is FullSync and s.lora == "merge"
    sync_and_audit(s, model, engine)
    assert engine.lora_request is None


@pytest.mark.parametrize("level", [0, 1, 2])
def test_lora_served_first_sync(arch, engines, level):
    engine = engines[True]
    FullSync().sync(full_model(arch, seed=5), engine)  # the engine holds some other base
    model = lora_model(arch, seed=30 + level)
    enter_sleep(engine, level)
    s = policy.choose(
        train_type="lora", rollout_lora=True, base_sync_done=False, sleep_level=engine.sleep_level
    )
    assert type(s) is FullSync and s.lora == "separate"
    report = sync_and_audit(s, model, engine)
    assert report.engine_calls == 2  # base, then adapter: never merged *and* applied
    assert engine.lora_request is not None


def test_lora_served_after_level2(arch, engines):
    engine = engines[True]
    ensure_base(arch, engine)
    model = lora_model(arch, seed=40)
    enter_sleep(engine, 2)
    s = policy.choose(
        train_type="lora", rollout_lora=True, base_sync_done=True, sleep_level=engine.sleep_level
    )
    assert engine.sleep_level == 2 and type(s) is FullSync and s.lora == "separate"
    sync_and_audit(s, model, engine)


@pytest.mark.parametrize("level", [0, 1])
def test_lora_served_adapter_only_follows_every_update(arch, engines, level):
    engine = engines[True]
    ensure_base(arch, engine)
    model = lora_model(arch, seed=50)
    previous = None
    for step in range(4):
        T.perturb(model, seed=500 + step, scale=0.3)
        enter_sleep(engine, level)
        s = policy.choose(
            train_type="lora",
            rollout_lora=True,
            base_sync_done=True,
            sleep_level=engine.sleep_level,
        )
        assert type(s) is AdapterSync
        report = sync_and_audit(s, model, engine)
        assert report.engine_calls == 1 and report.buckets == 0
        tokens = T.compare(model, engine)["engine"]
        assert tokens != previous, "the engine did not follow the adapter update"
        previous = tokens


@pytest.mark.parametrize("base_sync_done,level", [(False, 0), (True, 2)])
def test_prefer_reload_restores_base_from_checkpoint(arch, engines, base_sync_done, level):
    engine = engines[True]
    FullSync().sync(full_model(arch, seed=6), engine)  # engine base differs from the checkpoint
    model = lora_model(arch, seed=60 + level)
    enter_sleep(engine, level)
    s = policy.choose(
        train_type="lora",
        rollout_lora=True,
        base_sync_done=base_sync_done,
        sleep_level=engine.sleep_level,
        prefer_reload=True,
    )
    assert type(s) is ReloadWeights
    sync_and_audit(s, model, engine)


@pytest.mark.parametrize("rollout_lora", [False, True])
def test_reload_from_snapshot(arch, engines, rollout_lora, tmp_path):
    engine = engines[rollout_lora]
    model = lora_model(arch, seed=70 + rollout_lora)
    enter_sleep(engine, 2)
    sync_and_audit(ReloadWeights(snapshot_dir=tmp_path / "snap"), model, engine)


def test_syncer_tracks_base_sync_done(arch, engines):
    engine = engines[True]
    FullSync().sync(full_model(arch, seed=7), engine)
    syncer = Syncer(engine, train_type="lora")
    model = lora_model(arch, seed=80)
    chosen = []
    for step, level in enumerate([0, 1, 0, 2, 1]):
        T.perturb(model, seed=800 + step, scale=0.3)
        enter_sleep(engine, level)
        report = syncer.sync(model)
        chosen.append(report.strategy)
        T.assert_matches(model, engine, atol=ATOL)
        assert syncer.base_sync_done
    assert chosen == [
        "FullSync(lora=separate)",
        "AdapterSync",
        "AdapterSync",
        "FullSync(lora=separate)",
        "AdapterSync",
    ]


def test_a_reload_on_the_cpu_keeps_freed_memory_for_the_next(arch, engines):
    """vLLM's reload frees a model's worth of memory and allocates it anew at every sync; on the
    CPU weightsync keeps freed memory in the engine's process (``in_engine/heap.py``): after a
    reload, a large block freed stays in the process, and the next allocation it fits reuses it
    instead of faulting in fresh pages inside the commit's pause (figures: docs/benchmarks.md).

    Probed with glibc's own ``malloc``: whether a *tensor* of the same size reuses the block
    also depends on the heap around it (PyTorch's aligned allocations ask glibc for a little
    more than the block they freed; ``heap.py``), which a probe in a test process shared with
    other tests cannot control."""
    import ctypes
    import resource

    FullSync().sync(full_model(arch, seed=5), engines[False])  # a reload in this process
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 64 << 20  # above glibc's largest size for blocks mapped on their own (32 MiB)

    def touched_faults() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        assert block
        try:
            ctypes.memset(block, 1, size)
        finally:
            libc.free(block)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    touched_faults()  # allocated, touched, freed
    faults = touched_faults()
    assert faults < size // 4096 // 10, f"{faults} page faults: the freed block went back"
