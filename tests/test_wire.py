"""The wire both sides speak, without vLLM: the one format (any safetensors reader reads it),
the typed messages (a JSON round trip loses nothing), and gloo framing over loopback (two ranks
in two threads: a bucket stream, an abort part-way, the outcome all-gather), and the stream
protocol every carrier shares (``wire.stream``), carried by a plain list."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
import torch
from safetensors import safe_open

from weightsync.errors import BytesRejectedError, StageExpiredError, WeightSyncError
from weightsync.wire import delta as delta_mod
from weightsync.wire import format as fmt
from weightsync.wire import gloo, stream
from weightsync.wire.protocol import EngineFacts, LoraLimits, Outcome, raise_failures
from weightsync.wire.stage import DEFAULT_STAGE_EXPIRY_S, STAGE_EXPIRY_ENV, stage_expiry_s
from weightsync.wire.tags import Signer


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


def test_a_kept_file_rewritten_between_syncs_is_tagged_as_the_trainer_wrote_it(tmp_path):
    """Another process of the same user swaps two same-shape names in a kept file's header
    between syncs: the next sync writes (and tags) the file whole again, so the workers load
    the trainer's tensors under their own names, never the swapped ones."""
    from weightsync.wire.files import KeptFiles, MappedFiles

    a, b = torch.full((4, 4), 1.0), torch.full((4, 4), 2.0)
    kept = KeptFiles(tmp_path / "kept")
    try:
        kept.write([[("a.weight", a), ("b.weight", b)]])
        path = kept.folder / "bucket-00000.safetensors"
        data = path.read_bytes()
        swapped = data.replace(b'"a.weight"', b'"x.weight"').replace(b'"b.weight"', b'"a.weight"')
        path.write_bytes(swapped.replace(b'"x.weight"', b'"b.weight"'))  # same size, in place
        assert dict(fmt.read([path]))["a.weight"].eq(2.0).all()  # the attack took on disk
        signer = Signer()
        written = kept.write([[("a.weight", a), ("b.weight", b)]], signer=signer)
        got = dict(
            MappedFiles().read(str(kept.folder), written.names, signer.key_hex, written.tags)
        )
        assert torch.equal(got["a.weight"], a) and torch.equal(got["b.weight"], b)
    finally:
        kept.close()


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
        with pytest.raises(WeightSyncError, match="aborted this weight update part-way"):
            for name, _ in receiver:
                names.append(name)
        return names, receiver.finished

    received = pool.submit(receive)
    with pytest.raises(RuntimeError, match="ran out of memory"):  # the trainer's error, the cause
        gloo.send(trainer, buckets(), received)
    assert received.result() == (["a"], True)


def test_a_join_that_fails_at_once_is_raised_at_once():
    """The workers' join fails fast (a worker without the extension, a host it cannot reach):
    rank 0 raises their error as soon as the join future holds it, not after its rendezvous
    timeout, and leaves neither the store's port nor its waiting thread behind."""
    ports: list[int] = []

    def join(port: int, secret: str):
        ports.append(port)
        failed: Future = Future()
        failed.set_exception(WeightSyncError("weightsync_join_gloo: no such method on worker 0"))
        return failed

    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="no such method on worker 0"):
        gloo.open_group("127.0.0.1", 0, 2, 60.0, join)
    took = time.monotonic() - start
    print(f"raised after {took:.2f} s (rendezvous timeout 60 s)")
    assert took < 30.0
    assert not [t for t in threading.enumerate() if t.name == "weightsync-rendezvous"]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", ports[0]), timeout=5.0).close()


def _staged(trainer, worker, sent, expire_s: float) -> gloo.Staging:
    """``sent`` staged whole on the worker's side, its expiry ``expire_s``."""
    stage = gloo.Staging(worker, expire_s=expire_s)
    gloo.send(trainer, sent, None)
    stage.wait(30.0)
    return stage


def test_a_stage_nobody_commits_is_dropped_after_its_expiry(ranks):
    """A trainer that died between its stage and its commit: the worker lets the bytes go after
    the expiry, and a commit that comes later is refused, nothing of it handed out."""
    trainer, worker, _ = ranks
    sent = [[("a", torch.randn(64, 64))], [("b", torch.randn(32))]]
    stage = _staged(trainer, worker, sent, expire_s=0.3)
    assert stage.held == (64 * 64 + 32) * 4
    deadline = time.monotonic() + 10.0
    while stage.held and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stage.held == 0
    with pytest.raises(StageExpiredError, match=r"no commit claimed it within 0.3 s .*STAGE_EXP"):
        stage.claim()
    with pytest.raises(StageExpiredError):
        stage.wait(0.0)


def test_a_commit_racing_the_expiry_gets_the_whole_stage_or_nothing(ranks):
    """Claims spread around the expiry: each gets every tensor (and the stage then never
    expires) or is refused with nothing left held -- never a stage dropped in part."""
    trainer, worker, _ = ranks
    sent = [[(f"w{i}", torch.full((256,), float(i)))] for i in range(4)]
    expire_s, seen = 0.05, {"claimed": 0, "refused": 0}
    for attempt in range(24):
        stage = _staged(trainer, worker, sent, expire_s)
        time.sleep(expire_s * attempt / 12)  # from at once to twice the expiry
        try:
            pairs = stage.claim()
        except StageExpiredError:
            seen["refused"] += 1
            assert stage.held == 0
            continue
        seen["claimed"] += 1
        time.sleep(2 * expire_s)  # past the expiry: a claimed stage is kept whole
        assert [(n, t[0].item()) for n, t in pairs] == [(f"w{i}", i) for i in range(4)]
        assert stage.held == 4 * 256 * 4
        stage.drop()
        assert stage.held == 0
    print(seen)  # both, on this machine; which one each claim gets is the scheduler's call


def test_the_stage_expiry_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(STAGE_EXPIRY_ENV, raising=False)
    assert stage_expiry_s() == DEFAULT_STAGE_EXPIRY_S
    monkeypatch.setenv(STAGE_EXPIRY_ENV, "2.5")
    assert stage_expiry_s() == 2.5
    for bad in ("0", "-1", "soon", "inf"):
        monkeypatch.setenv(STAGE_EXPIRY_ENV, bad)
        with pytest.raises(
            ValueError, match=f"WEIGHTSYNC_STAGE_EXPIRY_S must be a positive.*{bad}"
        ):
            stage_expiry_s()


# --- the stream protocol (wire.stream), whatever carries it ----------------------------------


def _frames(buckets, signer, copies=None):
    """A stream as a carrier would move it: each bucket's frame, then the END."""
    out = [stream.frame(b, signer, copies) for b in buckets]
    return out, stream.end_tag(signer, len(out))


def test_every_frame_is_checked_in_order_and_the_end_carries_the_count():
    buckets = [[("a", torch.randn(7))], [("b", torch.randn(2, 3))]]
    signer = Signer()
    frames, end = _frames(buckets, signer)
    checker = stream.Checker(signer.key_hex)
    got = dict(p for f in frames for p in fmt.views(checker.bucket(*f)))
    checker.end(len(frames), end)
    assert all(torch.equal(got[n], t) for b in buckets for n, t in b)

    def refused(frames, count, end, match, key=signer.key_hex):
        checker = stream.Checker(key)
        with pytest.raises(BytesRejectedError, match=match):
            for f in frames:
                checker.bucket(*f)
            checker.end(count, end)

    altered = frames[0].payload.copy()
    altered[-1] ^= 1
    refused([frames[0]._replace(payload=altered)], 0, end, "bucket 0 of the stream: its bytes")
    refused([frames[1], frames[0]], 2, end, "bucket 0 of the stream: arrived out of order")
    refused(frames[:1], 2, end, "the stream's end: arrived out of order")  # one dropped
    refused(frames, 1, end, "the stream's end: its bytes are not")  # the count changed
    refused([frames[0]._replace(kind=7)], 1, end, "unknown kind 7")
    honest = Signer()  # a trainer that tags an END claiming more than it sent
    one = [stream.frame(buckets[0], honest)]
    refused(one, 2, stream.end_tag(honest, 2), "ended after 1 of 2 buckets", honest.key_hex)
    with pytest.raises(WeightSyncError, match="aborted this weight update part-way: oom"):
        stream.Checker().abort("oom")


def test_a_frame_in_pieces_is_the_packed_frame_viewed_in_place():
    """``stream.scattered`` (Ray's carrier): the pieces are the header and views of the
    tensors' own bytes (nothing copied before the carrier's own copy), their concatenation is
    the packed frame and its tag is the packed frame's; the receiver checks the tag over the
    pieces and views each tensor inside its piece. Pieces that split the same bytes elsewhere
    are refused before any tensor is read: they could be other tensors."""
    embed = torch.randn(8, 4, dtype=torch.bfloat16)
    bucket = [
        ("embed.weight", embed),
        ("head.weight", embed),  # tied: stored once, viewed under both names
        ("b", torch.arange(3)),
        ("empty", torch.zeros(0, 4)),
        ("strided", torch.randn(4, 6).t()),  # not contiguous: made so, then viewed
    ]
    packed = fmt.pack(bucket).numpy()
    signer = Signer()
    kind, parts, tag = stream.scattered(bucket, signer)
    assert kind == stream.Kind.BUCKET and len(parts) == 5  # the header, 4 stored tensors
    assert np.array_equal(np.concatenate(parts), packed)
    pointers = {p.ctypes.data for p in parts if p.nbytes}
    assert {embed.data_ptr(), bucket[2][1].data_ptr()} <= pointers  # views, not copies
    stream.Checker(signer.key_hex).bucket(kind, packed, tag)  # the packed frame's tag
    checker = stream.Checker(signer.key_hex)
    got = checker.pieces(kind, parts, tag)
    checker.end(1, stream.end_tag(signer, 1))
    assert got == parts
    viewed = dict(fmt.pieces_views(got))
    assert sorted(viewed) == sorted(n for n, _ in bucket)
    assert all(torch.equal(viewed[n], t) for n, t in bucket)
    assert {t.data_ptr() for t in viewed.values() if t.numel()} <= pointers  # in place
    assert dict(fmt.pieces_views([packed])).keys() == viewed.keys()  # one piece: a whole file

    altered = [p.copy() for p in parts]
    altered[1][-1] ^= 1
    with pytest.raises(BytesRejectedError, match="bucket 0 of the stream: its bytes"):
        stream.Checker(signer.key_hex).pieces(kind, altered, tag)
    data = np.concatenate(parts[1:])
    cut = len(parts[1]) - 2  # the same bytes, split elsewhere: the tag passes, the split not
    moved = [parts[0], data[:cut], data[cut : cut + len(parts[2]) + 2], *parts[3:]]
    stream.Checker(signer.key_hex).pieces(kind, moved, tag)
    with pytest.raises(ValueError, match="its piece holds"):
        fmt.pieces_views(moved)
    with pytest.raises(ValueError, match="pieces"):
        fmt.pieces_views(parts[:-1])


def test_a_delta_frame_is_checked_as_the_whole_bucket():
    sent, loaded = delta_mod.SentCopies(), delta_mod.LoadedCopies()
    w = torch.randn(64, 64, dtype=torch.bfloat16)
    for step in range(2):
        signer = Signer()
        sync_id = sent.begin([loaded.synced])
        frames, end = _frames([[("w", w)]], signer, sent)
        assert [f.kind for f in frames] == [stream.Kind.DELTA if step else stream.Kind.BUCKET]
        checker = stream.Checker(signer.key_hex, loaded)
        payload = frames[0].payload
        read_only = payload.copy()
        read_only.flags.writeable = False  # as Ray's store hands it out: kept as a copy
        got = checker.bucket(frames[0].kind, read_only, frames[0].tag)
        checker.end(1, end)
        assert np.array_equal(got, fmt.pack([("w", w)]).numpy())
        sent.commit()
        loaded.commit(sync_id, checker.count)
        w.view(-1)[::97] += 0.5
    with pytest.raises(BytesRejectedError, match="keeps no copies to patch"):
        stream.Checker(signer.key_hex).bucket(*frames[0])
    with pytest.raises(ValueError, match="sign the stream"):
        stream.frame([("w", w)], None, sent)


# --- deltas (wire.delta): only the changed words ---------------------------------------------


def _step(payload: np.ndarray, where: list[int], seed: int = 0) -> np.ndarray:
    """``payload`` with the bytes at ``where`` changed (as a training step changes a few)."""
    new = payload.copy()
    new[where] ^= np.random.default_rng(seed).integers(1, 256, len(where), dtype=np.uint8)
    return new


def _diff(base: np.ndarray, new: np.ndarray, tag: str) -> delta_mod.Delta:
    words = new.view(np.uint16 if new.size % 2 == 0 else np.uint8)
    return delta_mod.encode(np.flatnonzero(base.view(words.dtype) != words), words, tag)


@pytest.mark.parametrize("size", [300_000, 300_001])  # 16-bit words; 8-bit for an odd length
def test_a_delta_patches_the_base_into_the_new_bytes_exactly(size):
    base = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    # changes at both ends and a gap longer than one entry spans (bridged by no-op entries)
    new = _step(base, [0, 1, 7, 8, 9, 200_000, size - 1])
    delta = _diff(base, new, "tag-of-base")
    assert delta.word == (2 if size % 2 == 0 else 1) and delta.size == size
    assert (delta.gaps > 0).all() and len(delta.gaps) <= 7 + size // delta_mod.MAX_GAP
    back = delta_mod.Delta.from_bytes(delta.to_bytes())
    assert back.base == "tag-of-base" and back.nbytes == delta.nbytes < 200
    patched = base.copy()
    back.apply(patched)
    assert np.array_equal(patched, new)
    unchanged = _diff(base, base, "t")
    assert len(unchanged.gaps) == 0
    patched = base.copy()
    unchanged.apply(patched)
    assert np.array_equal(patched, base)


def test_a_delta_that_does_not_fit_is_refused():
    base = np.zeros(64, dtype=np.uint8)
    delta = _diff(base, _step(base, [63]), "t")
    with pytest.raises(BytesRejectedError, match="bucket of 64 bytes arrived for a copy of 32"):
        delta.apply(np.zeros(32, dtype=np.uint8))
    wire = delta.to_bytes()
    with pytest.raises(BytesRejectedError, match="malformed"):
        delta_mod.Delta.from_bytes(wire[:-1])
    # a gap altered on the way: past the end, refused with the copy untouched
    meta = 8 + int.from_bytes(wire[:8].tobytes(), "little")
    wire[meta : meta + 2] = np.frombuffer(np.uint16(0xFFFF).tobytes(), dtype=np.uint8)
    copy = base.copy()
    with pytest.raises(BytesRejectedError, match="past the end"):
        delta_mod.Delta.from_bytes(wire).apply(copy)
    assert not copy.any()


def test_deltas_only_against_the_copy_every_worker_reports():
    """The trainer's half sends a delta only for a bucket of the same layout at the same index,
    after a sync every worker reported with the id it left; any doubt sends the bucket whole.
    The kept copy is updated in place and is, byte for byte, the bucket's full pack."""
    sent = delta_mod.SentCopies()
    sign = lambda data: f"tag-{data.sum()}"  # noqa: E731 (any function of the bytes)
    w = torch.randn(64, 64, dtype=torch.bfloat16)
    first = sent.begin([None])
    _, first_tag, whole = sent.next([("w", w)], sign)
    assert whole is None  # nothing kept yet: whole
    sent.commit()
    assert sent.synced == first
    w.view(-1)[-1] += 1.0
    sent.begin([first])
    payload, tag, delta = sent.next([("w", w)], sign)
    assert delta is not None and delta.base == first_tag and tag == sign(payload)
    assert np.array_equal(payload, fmt.pack([("w", w)]).numpy())
    assert sent.last.delta_buckets == 1 and sent.last.wire_bytes < sent.last.bucket_bytes / 10
    sent.reset()  # a failed sync: whole next time, whatever the workers say
    sent.begin([first])
    assert sent.next([("w", w)], sign)[2] is None
    sent.commit()
    other = torch.randn(32, 128, dtype=torch.bfloat16)  # same size, another layout
    for reported, tensor in [(["someone-else"], w), ([sent.synced], other)]:
        sent.begin(reported)  # another trainer's sync; another layout at the index
        assert sent.next([("w", tensor)], sign)[2] is None
        sent.commit()


@pytest.fixture
def delta_stream(ranks):
    """Send the buckets of each sync over the loopback group with deltas: the trainer's copies,
    the worker's, and ``sync(buckets)`` -> what the worker received (or raises its error)."""
    trainer, worker, pool = ranks
    sent, loaded = delta_mod.SentCopies(), delta_mod.LoadedCopies()

    def receive(key: str, sync_id: str) -> list[tuple[str, torch.Tensor]]:
        receiver = gloo.Receiver(worker, key, loaded)
        loaded.begin()
        try:
            got = [(n, t.clone()) for n, t in receiver]
        except BaseException:
            loaded.clear()
            receiver.drain()
            raise
        loaded.commit(sync_id, receiver.buckets)
        return got

    def sync(buckets):
        signer = Signer()
        sync_id = sent.begin([loaded.synced])
        received = pool.submit(receive, signer.key_hex, sync_id)

        def send_one(group, bucket, signer):
            gloo.send_bucket(group, bucket, signer, sent)

        try:
            gloo.send(trainer, buckets, received, send_one, signer)
        except BaseException:
            sent.reset()
            raise
        sent.commit()
        return dict(received.result())

    return sent, loaded, sync


def test_a_delta_stream_loads_what_a_full_one_does(delta_stream):
    sent, loaded, sync = delta_stream
    gen = torch.Generator().manual_seed(0)
    model = {f"w{i}": torch.randn(96, 64, generator=gen).to(torch.bfloat16) for i in range(3)}
    buckets = lambda: [[(n, model[n])] for n in sorted(model)]  # noqa: E731
    sync(buckets())
    assert sent.last.full_buckets == 3
    for t in model.values():  # a small step: a few elements change
        t.view(-1)[::97] += 0.5
    got = sync(buckets())
    assert (sent.last.full_buckets, sent.last.delta_buckets) == (0, 3)
    assert sent.last.wire_bytes < sent.last.bucket_bytes / 10
    assert all(torch.equal(got[n], t) for n, t in model.items())
    for i, bucket in enumerate(buckets()):  # the worker's copies: byte for byte the full pack
        assert np.array_equal(loaded.copy(i), fmt.pack(bucket).numpy())
    assert loaded.synced == sent.synced is not None


def test_a_forged_delta_is_refused_and_the_next_sync_is_whole(delta_stream, monkeypatch):
    sent, loaded, sync = delta_stream
    model = {"w": torch.randn(128, 64).to(torch.bfloat16)}
    sync([list(model.items())])
    model["w"].view(-1)[::50] += 1.0
    forged = delta_mod.Delta.apply

    def flip_one(self, base):  # an altered delta, or a base that is not what the trainer diffed
        forged(self, base)
        base[-1] ^= 1

    monkeypatch.setattr(delta_mod.Delta, "apply", flip_one)
    with pytest.raises(BytesRejectedError, match="not the ones the trainer sent"):
        sync([list(model.items())])
    monkeypatch.undo()
    assert loaded.synced is None and sent.synced is None and loaded.copy(0) is None
    got = sync([list(model.items())])
    assert sent.last.full_buckets == 1 and torch.equal(got["w"], model["w"])
