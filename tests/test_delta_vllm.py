"""Only the changed bytes on the wire (``wire.delta``): a bf16 multiprocess ``vllm.LLM`` synced
over gloo with ``GlooTransport(delta=True)`` from a float32 trainer after a realistic small step
(AdamW, lr 1e-6).

One ``LLM`` (TP=1, engine core and worker in other processes) for the module, reached by two
clients: the delta engine, and a tmpfs engine that plays "another client" and the full sync the
delta must equal. Every process it started is stopped by PID (`benchmarks.processes.multiproc_llm`).
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from conftest import bad_stream, differs, forge_deltas, served

from benchmarks.processes import multiproc_llm
from weightsync import FullSync
from weightsync import testing as T
from weightsync.engines import GlooTransport, VLLMMultiprocEngine
from weightsync.errors import BytesRejectedError
from weightsync.verify import check_engine
from weightsync.wire import delta as delta_mod
from weightsync.wire import format as fmt

pytestmark = pytest.mark.timeout(900)

#: Several buckets (the tiny model's bf16 weights are ~1.3 MB), so deltas are kept per index.
SYNC = FullSync(bucket_bytes=256 << 10, skip_unchanged=False)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model = T.tiny_model("qwen2", dtype=torch.bfloat16)
    checkpoint = T.save_checkpoint(model, tmp_path_factory.mktemp("delta") / "ck")
    with multiproc_llm(checkpoint, dtype="bfloat16") as engine:
        yield engine


@pytest.fixture(scope="module")
def engines(llm):
    delta = VLLMMultiprocEngine(llm, transport=GlooTransport(delta=True))
    other = VLLMMultiprocEngine(llm, transport="tmpfs")
    yield delta, other
    delta.close()
    other.close()
    assert llm.collective_rpc("weightsync_delta_state")[0]["value"] is None  # dropped on close


def trainer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """fp32 master weights and AdamW at lr 1e-6, as an RL trainer holds them."""
    model = T.tiny_model("qwen2")  # float32
    return model, torch.optim.AdamW(model.parameters(), lr=1e-6)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One optimizer step on a random batch."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=gen)
    optimizer.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def sent(engine) -> delta_mod.WireCount:
    count = engine.transport.last_sync
    assert count is not None
    return count


def worker_copies(engine) -> dict[str, str]:
    """Digest of every tensor in the worker's kept copies."""
    return engine.rpc("weightsync_delta_digests")[0].value


def trainer_digests(model, engine) -> dict[str, str]:
    """Digest of every tensor a full sync sends: the trainer's weights cast to the engine's
    bf16 (or to the dtype the engine holds a weight in, `EngineFacts.held`: on a CPU with AMX
    the q/k/v biases, failure-modes row 58), packed by the one writer and read back."""
    state, held = model.state_dict(), engine.facts.held
    bucket = [
        (n, state[n].detach().to(getattr(torch, held.get(n, "bfloat16"))))
        for n in engine.expected_weights
    ]
    return {
        n: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for n, t in fmt.views(fmt.pack(bucket).numpy())
    }


def test_a_small_step_sends_a_few_percent_and_loads_what_a_full_sync_loads(llm, engines):
    delta, other = engines
    model, optimizer = trainer()
    SYNC.sync(model, delta)
    first = sent(delta)
    assert first.delta_buckets == 0 and first.full_buckets > 2  # nothing kept yet: all whole
    step(model, optimizer, seed=1)
    # Another client writes other weights: the engine's state does not matter to a delta (it
    # loads whole patched buckets), only the worker's kept copy does.
    SYNC.sync(T.tiny_model("qwen2", seed=5), other)
    assert differs(model, delta)
    SYNC.sync(model, delta)
    check_engine(model, delta, strategy="delta")  # verified against the trainer (bf16 tolerance)
    count = sent(delta)
    assert count.full_buckets == 0 and count.delta_buckets == first.full_buckets
    assert count.bucket_bytes == first.bucket_bytes
    assert count.wire_bytes <= 0.10 * count.bucket_bytes, count
    # The worker's patched copy is, tensor for tensor, what a full sync packs.
    assert worker_copies(delta) == trainer_digests(model, delta)
    after_delta = served(delta)
    SYNC.sync(model, other)  # a full sync of the same weights, by the other path
    assert served(other) == after_delta  # tokens and logprobs, exactly


def test_a_worker_without_the_copy_gets_every_bucket_whole(llm, engines):
    """Any doubt is a full sync: the worker's copies gone (an engine restart), a failed sync."""
    delta, other = engines
    model, optimizer = trainer()
    SYNC.sync(model, delta)
    step(model, optimizer, seed=2)
    other.rpc("weightsync_delta_drop")  # what a restarted worker holds: nothing
    SYNC.sync(model, delta)
    check_engine(model, delta, strategy="delta")
    assert sent(delta).delta_buckets == 0
    # a sync that fails part-way (the trainer raises): both sides forget, the next is whole
    with pytest.raises(RuntimeError, match="injected"):
        delta.load_weights(bad_stream(model, delta, "trainer"))
    assert llm.collective_rpc("weightsync_delta_state")[0]["value"] is None
    step(model, optimizer, seed=3)
    SYNC.sync(model, delta)
    check_engine(model, delta, strategy="delta")
    assert sent(delta).delta_buckets == 0
    step(model, optimizer, seed=4)
    SYNC.sync(model, delta)
    check_engine(model, delta, strategy="delta")  # and deltas again after it
    assert sent(delta).full_buckets == 0
    assert worker_copies(delta) == trainer_digests(model, delta)


def test_a_forged_delta_is_refused_and_the_next_sync_repairs(llm, engines, monkeypatch):
    """A delta that does not patch the worker's copy into the trainer's bytes (altered on the
    way, or against another base) is refused by the whole bucket's tag while the workers stage
    the stream: nothing of it was loaded (the engine serves what it did, its base still the
    synced one), the kept copies are dropped, and the next sync is whole and exact."""
    delta, other = engines
    model, optimizer = trainer()
    SYNC.sync(model, delta)
    serving = served(delta)
    step(model, optimizer, seed=6)
    forge_deltas(monkeypatch)
    with pytest.raises(BytesRejectedError, match="not the ones the trainer sent"):
        SYNC.sync(model, delta)
    monkeypatch.undo()
    assert served(delta) == serving and not delta.base_discarded
    SYNC.sync(model, delta)
    check_engine(model, delta, strategy="delta")
    assert sent(delta).delta_buckets == 0
    SYNC.sync(model, other)
    assert worker_copies(delta) == trainer_digests(model, delta)
