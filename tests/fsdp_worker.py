"""One rank of the FSDP2 sync test (tests/test_fsdp_vllm.py): run under
``torchrun --nproc_per_node 2 tests/fsdp_worker.py <checkpoint>``.

Every rank builds the same tiny model, shards it with FSDP2 (``fully_shard`` per layer, then
the root) and trains it (noise added shard by shard). Rank 0 also keeps an unsharded copy that
receives the same noise: the trainer the engine must match. Rank 0 holds a real in-process vLLM
engine. Each case prints ``CASE <name> OK rank <r> <seconds>``; any failure exits non-zero.

vLLM initialises torch.distributed itself (a world of one) when the LLM is created. Created
after the trainer's group it joins that group and waits for rank 1 forever; so rank 0 creates
the LLM first, then drops vLLM's default group (vLLM keeps its own group objects, which a world
of one never uses for communication) and joins the trainer's gloo group.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from contextlib import nullcontext

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from weightsync import FullSync, ReloadWeights, Syncer, distributed, errors, testing
from weightsync.engines.base import adapt
from weightsync.trainer.tensors import inner_model

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def shard(model: torch.nn.Module) -> torch.nn.Module:
    for layer in inner_model(model).model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


@torch.no_grad()
def train(model: torch.nn.Module, reference: torch.nn.Module | None, seed: int) -> None:
    """Stand in for an optimizer step on the sharded model; the same step on the reference."""
    gen = torch.Generator().manual_seed(seed)
    ref = dict(reference.named_parameters()) if reference is not None else {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        noise = torch.randn(p.shape, generator=gen) * 0.05
        p.add_(distribute_tensor(noise, p.device_mesh, p.placements))
        if name in ref:
            ref[name].add_(noise)


def build(
    rank: int, seed: int | None, *, lora_rank: int | None = None, dora: bool = False, **overrides
):
    """(sharded model, unsharded reference on rank 0) after one training step (none when
    ``seed`` is None: a step is collective, and ranks holding different models cannot take it)."""
    model = testing.tiny_model("qwen2", seed=0, **overrides)
    if lora_rank is not None:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=lora_rank, lora_alpha=16, target_modules=LORA_TARGETS, use_dora=dora)
        model = get_peft_model(model, config)
    reference = copy.deepcopy(model) if rank == 0 else None
    shard(model)
    if seed is not None:
        train(model, reference, seed)
    return model, reference


def tokens(reference, engine) -> tuple[list, list]:
    result = testing.compare(reference, engine)
    return result["engine"], result["trainer"]


def refused(rank, strategy, model, engine) -> str:
    """The message the sync raised on this rank; checks every rank got the same one."""
    try:
        distributed.sync(strategy, model, engine)
    except errors.WeightSyncError as exc:
        message = str(exc)
    else:
        raise AssertionError("the sync was not refused")
    messages: list = [None, None]
    dist.all_gather_object(messages, message)
    assert messages[0] == messages[1], messages
    return message


def main(checkpoint: str) -> None:
    rank = int(os.environ["RANK"])
    engine = None
    if rank == 0:
        engine = adapt(testing.make_llm(checkpoint, enable_lora=True, max_lora_rank=16))
        dist.destroy_process_group()  # vLLM's world of one; see the module docstring
    dist.init_process_group("gloo")
    mine = engine if rank == 0 else None

    synced: list[float] = []  # seconds of each successful sync, for the log

    def sync(*args):
        report = distributed.sync(*args)
        synced.append(report.seconds)
        return report

    def case(name: str, started: float) -> None:
        dist.barrier()
        took = time.perf_counter() - started
        syncs = " ".join(f"{s:.3f}" for s in synced)
        print(f"CASE {name} OK rank {rank} {took:.2f}s, syncs {syncs}s", flush=True)
        synced.clear()

    # Full training: the engine differs before, matches the unsharded trainer after.
    t = time.perf_counter()
    model, ref = build(rank, seed=1)
    if rank == 0:
        before, trainer = tokens(ref, engine)
        assert before != trainer, "the engine already matched before the sync"
    report = sync(FullSync(), model, mine)
    assert report.tensors > 0 and report.strategy == "FullSync", report
    if rank == 0:
        testing.assert_matches(ref, engine)
    case("full", t)

    # A refusal both ranks see while planning (shapes differ): same error, nothing written.
    t = time.perf_counter()
    wrong, _ = build(rank, seed=1, intermediate_size=512)
    with testing.count_writes(engine) if rank == 0 else nullcontext([]) as writes:
        message = refused(rank, FullSync(), wrong, mine)
    assert message.startswith("rank 0: WeightMismatchError"), message
    assert "shape mismatch" in message, message
    if rank == 0:
        assert writes == [], writes
        testing.assert_matches(ref, engine)
    case("refused-shapes", t)

    # The engine fails on rank 0 part-way through the stream: rank 1, waiting for the next
    # gather, raises the same error instead of hanging; the next sync restores everything.
    t = time.perf_counter()
    train(model, ref, seed=2)
    if rank == 0:
        load = engine.load_weights

        def failing(buckets):
            def stream():
                for i, bucket in enumerate(buckets):
                    if i == 2:
                        raise OSError("simulated engine failure at bucket 2")
                    yield bucket

            return load(stream())

        engine.load_weights = failing
    try:
        distributed.sync(FullSync(bucket_bytes=64 << 10), model, mine)
    except OSError as exc:
        assert "rank 0: OSError: simulated engine failure at bucket 2" in str(exc), exc
    else:
        raise AssertionError("the failing sync did not raise")
    if rank == 0:
        del engine.load_weights
    report = sync(FullSync(bucket_bytes=64 << 10), model, mine)
    assert report.buckets > 3, report
    if rank == 0:
        testing.assert_matches(ref, engine)
    case("abort-mid-stream", t)

    # LoRA merged: the factors are DTensors too, gathered before the float32 merge.
    t = time.perf_counter()
    lora, lora_ref = build(rank, seed=3, lora_rank=8)
    if rank == 0:
        before, trainer = tokens(lora_ref, engine)
        assert before != trainer, "the engine already matched before the merged sync"
    report = sync(FullSync(lora="merge"), lora, mine)
    assert report.strategy == "FullSync(lora=merge)", report
    if rank == 0:
        testing.assert_matches(lora_ref, engine)
    case("lora-merged", t)

    # LoRA served, through a Syncer on rank 0: first base + adapter, then the adapter alone.
    t = time.perf_counter()
    syncer = Syncer(engine, train_type="lora") if rank == 0 else None
    train(lora, lora_ref, seed=4)
    report = sync(syncer, lora, None)
    assert report.strategy == "FullSync(lora=separate)", report
    if rank == 0:
        testing.assert_matches(lora_ref, engine)
    train(lora, lora_ref, seed=5)
    if rank == 0:
        before, trainer = tokens(lora_ref, engine)
        assert before != trainer, "the engine already matched before the adapter sync"
    report = sync(syncer, lora, None)
    assert report.strategy == "AdapterSync", report
    if rank == 0:
        testing.assert_matches(lora_ref, engine)
        assert syncer.base_sync_done
    case("lora-served", t)

    # ReloadWeights: the engine re-reads its checkpoint (the LoRA base is untouched) and loads
    # the gathered adapter; then a snapshot of the merged weights, written by rank 0 only.
    t = time.perf_counter()
    train(lora, lora_ref, seed=7)
    report = sync(ReloadWeights(), lora, mine)
    assert report.strategy == "ReloadWeights(checkpoint)", report
    if rank == 0:
        testing.assert_matches(lora_ref, engine)
    snapshot = os.path.join(os.path.dirname(checkpoint), "snapshot")
    report = sync(ReloadWeights(snapshot_dir=snapshot), model, mine)
    assert report.strategy == "ReloadWeights(snapshot)", report
    if rank == 0:
        testing.assert_matches(ref, engine)
    case("reload", t)

    # A refusal only the engine rank can see (adapter rank above the engine's max_lora_rank).
    t = time.perf_counter()
    big, _ = build(rank, seed=6, lora_rank=32)
    with testing.count_writes(engine) if rank == 0 else nullcontext([]) as writes:
        message = refused(rank, FullSync(lora="separate"), big, mine)
    assert message.startswith("rank 0: AdapterError") and "max_lora_rank" in message, message
    if rank == 0:
        assert writes == [], writes
        testing.assert_matches(ref, engine)  # still the snapshot's weights
    case("refused-adapter-rank", t)

    # A refusal only rank 1 sees (its adapter is DoRA, rank 0's is not): rank 0 raises it too.
    t = time.perf_counter()
    odd, _ = build(rank, None, lora_rank=8, dora=rank == 1)
    with testing.count_writes(engine) if rank == 0 else nullcontext([]) as writes:
        message = refused(rank, FullSync(lora="merge"), odd, mine)
    assert message.startswith("rank 1: UnsupportedModelError") and "DoRA" in message, message
    if rank == 0:
        assert writes == [], writes
        testing.assert_matches(ref, engine)
    case("refused-on-rank-1", t)

    # A caller mistake on rank 1 (an engine passed where only rank 0 holds one) fails both.
    t = time.perf_counter()
    try:
        distributed.sync(FullSync(), model, mine if rank == 0 else object())
    except ValueError as exc:
        assert str(exc) == "rank 1: ValueError: rank 1 was given an engine; only rank 0 holds one"
    else:
        raise AssertionError("an engine on rank 1 was accepted")
    case("engine-on-rank-1", t)

    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
