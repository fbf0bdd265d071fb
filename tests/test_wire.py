"""The wire both sides speak, without vLLM: the one format (any safetensors reader reads it),
the typed messages (a JSON round trip loses nothing), and gloo framing over loopback (two ranks
in two threads: a bucket stream, an abort part-way, the outcome all-gather)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors import safe_open

from weightsync.wire import format as fmt
from weightsync.wire import gloo
from weightsync.wire.protocol import EngineFacts, LoraLimits, Outcome, raise_failures


def test_engine_facts_survive_json():
    facts = EngineFacts(
        dtype="bfloat16",
        weights={"a.weight": (4, 8), "b.bias": (4,)},
        tied=(("a.weight", "c.weight"),),
        lora=LoraLimits(16, ("q_proj", "v_proj")),
        quantization="fp8",
        attests=True,
        keeps_unsent_layers=False,
        checkpoint="/ck",
        files=("/ck/model.safetensors",),
        world_size=2,
    )
    assert EngineFacts.from_json(json.loads(json.dumps(facts.to_json()))) == facts


def test_outcomes_carry_errors_every_way():
    failed = Outcome.failed(ValueError("bad shape"), rank=3)
    assert not failed.ok and failed.exception is not None
    for back in (
        Outcome.from_json(json.loads(json.dumps(failed.to_json()))),
        Outcome.from_bytes(failed.to_bytes()),
    ):
        assert (back.ok, back.error, back.rank) == (False, "ValueError: bad shape", 3)
    assert Outcome.from_json(None).ok  # a worker method that returns nothing succeeded
    cut = Outcome.from_bytes(failed.to_bytes()[:30])  # cut at the all-gather's size limit
    assert not cut.ok and "weightsync.outcome" in cut.error
    with pytest.raises(RuntimeError, match=r"load failed in the engine's workers: worker 3: Value"):
        raise_failures("load", [Outcome(rank=0), failed])


def test_one_format_any_reader_reads(tmp_path):
    embed = torch.randn(8, 4, dtype=torch.bfloat16)
    bucket = [("embed.weight", embed), ("head.weight", embed), ("b", torch.arange(3))]
    fmt.write(bucket, tmp_path / "aliased.safetensors")
    with safe_open(str(tmp_path / "aliased.safetensors"), framework="pt") as h:
        assert sorted(h.keys()) == ["b", "embed.weight"]  # the tied tensor stored once
    got = dict(fmt.read([tmp_path / "aliased.safetensors"]))
    assert sorted(got) == ["b", "embed.weight", "head.weight"]
    assert all(torch.equal(got[n], t) for n, t in bucket)
    fmt.write(bucket, tmp_path / "copies.safetensors", aliases=False)  # for vLLM's own reader
    with safe_open(str(tmp_path / "copies.safetensors"), framework="pt") as h:
        assert sorted(h.keys()) == ["b", "embed.weight", "head.weight"]
    viewed = dict(fmt.views(fmt.pack(bucket).numpy()))
    assert all(torch.equal(viewed[n], t) for n, t in bucket)


def test_an_unknown_dtype_is_refused_before_a_byte_is_written(tmp_path):
    with pytest.raises(TypeError, match=r"x: dtype torch\.complex64"):
        fmt.write([("x", torch.zeros(2, dtype=torch.complex64))], tmp_path / "f.safetensors")
    assert not (tmp_path / "f.safetensors").exists()


@pytest.fixture
def ranks():
    """A two-rank gloo group over loopback: (trainer's group, worker's group, a thread pool)."""
    pool = ThreadPoolExecutor(2)
    joined = {}

    def join(port: int, secret: str):
        def run():
            joined["worker"] = gloo.join_group("127.0.0.1", port, 1, 2, 60.0, secret)

        return pool.submit(run)

    trainer = gloo.open_group("127.0.0.1", 0, 2, 60.0, join)
    yield trainer[0], joined["worker"][0], pool
    pool.shutdown(wait=True)


def test_a_stream_arrives_bucket_by_bucket(ranks):
    trainer, worker, pool = ranks
    sent = [[("a", torch.randn(3, 5))], [("b", torch.randn(2)), ("c", torch.ones(4))]]
    received = pool.submit(lambda: [(n, t.clone()) for n, t in gloo.Receiver(worker)])
    gloo.send(trainer, sent, received)
    got = dict(received.result())
    assert all(torch.equal(got[n], t) for bucket in sent for n, t in bucket)
    work, gathered = gloo.gather_outcomes(trainer, 2, Outcome())
    theirs = pool.submit(lambda: gloo.gather_outcomes(worker, 2, Outcome.failed("boom", 1)))
    work.wait()
    theirs.result()[0].wait()
    assert [o.error for o in gloo.outcomes(gathered)] == ["", "boom"]


def test_a_trainer_failure_part_way_aborts_the_workers(ranks):
    trainer, worker, pool = ranks

    def buckets():
        yield [("a", torch.randn(3))]
        raise RuntimeError("the merge ran out of memory")

    def receive():
        receiver = gloo.Receiver(worker)
        names = []
        with pytest.raises(RuntimeError, match="aborted this weight update part-way"):
            for name, _ in receiver:
                names.append(name)
        return names, receiver.finished

    received = pool.submit(receive)
    with pytest.raises(RuntimeError, match="ran out of memory"):  # the trainer's error, the cause
        gloo.send(trainer, buckets(), received)
    assert received.result() == (["a"], True)
