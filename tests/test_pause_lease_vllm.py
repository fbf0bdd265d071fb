"""A trainer killed in the middle of a sync never leaves a ``vllm serve`` server stuck.

A real server with weightsync's worker extension and pause lease (``server_lease.py``, a short
lease here), a real trainer process (``tests/lease_trainer.py``) SIGKILLed at one point of a
FullSync over tmpfs: before the server is touched (staging), and inside the commit the server
runs by itself in one call (committing: the server finishes it and resumes at once, not by the
lease); and over gloo, part-way through the stream the workers stage while they serve (streaming);
and at a random moment of a sync over each transport (``random-*``: staging, the pause or
after the end, wherever the seeded delay lands; more seeds with ``WEIGHTSYNC_KILL_SEEDS``).
A separate client's greedy tokens must then come within a bounded time and be exactly the old
weights' -- or the new weights', where the load had completed -- the next honest sync (by a new
trainer) must be exact, and nothing of the dead trainer may stay in /dev/shm. A trainer that
is only slow inside its pause learns that the lease ran out (`PauseExpiredError`) and the
server serves meanwhile. A trainer killed once its gloo stage was complete, before its commit,
leaves every worker holding that stage until its expiry (a short `STAGE_EXPIRY_S` here), then
nothing; a commit that comes after the expiry is refused (`StageExpiredError`).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import requests
from conftest import one_per_bucket
from lease_trainer import answered, kill_seeds, run, staged_bytes, watch_stage

from benchmarks.processes import VLLMServer, serving
from weightsync import FullSync
from weightsync import testing as T
from weightsync.engines import GlooTransport, VLLMServerEngine
from weightsync.engines.vllm.server_auth import BUSY_HEADER, TOKEN_ENV
from weightsync.engines.vllm.server_lease import COMMIT_PATH, PauseLease
from weightsync.errors import EngineBusyError, PauseExpiredError, StageExpiredError

LEASE_S = 3.0
#: How long the workers keep a completed stage nobody commits (``WEIGHTSYNC_STAGE_EXPIRY_S``).
STAGE_EXPIRY_S = 6.0
#: How long a client may wait for its answer once the trainer is dead: the lease, the
#: middleware's tick, the recovery calls, and slack for a loaded 2-core machine.
BOUND_S = LEASE_S + 30.0
PROMPTS = T.PROMPTS[:2]

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lease")
    checkpoint = T.save_checkpoint(T.tiny_model("llama"), folder / "ck")
    started = VLLMServer(
        checkpoint,
        folder / "server.log",
        env={
            "WEIGHTSYNC_PAUSE_LEASE_S": str(LEASE_S),
            "WEIGHTSYNC_STAGE_EXPIRY_S": str(STAGE_EXPIRY_S),
            # vLLM's default, which a run that quieted vLLM (benchmarks.console) overrides: the
            # lease logs under vLLM's logger, and a test reads its warnings from the log
            "VLLM_LOGGING_LEVEL": "INFO",
        },
    )
    with serving(started):
        yield started


def greedy(model) -> list[list[int]]:
    return [T.trainer_greedy(model, p, 8) for p in PROMPTS]


#: Kills at a random moment (``random-<transport>:<seed>``); WEIGHTSYNC_KILL_SEEDS=a-b runs
#: more of them (each ~10 s): `tests/lease_trainer.py` says how the moment is drawn.
RANDOM_KILLS = [
    (f"random-{transport}:{seed}", "either")
    for seed in kill_seeds()
    for transport in ("tmpfs", "gloo")
]


@pytest.mark.parametrize(
    "point, serves",
    [
        ("staging", "old"),
        ("streaming", "old"),
        ("committing", "new"),
        *RANDOM_KILLS,
    ],
)
def test_a_trainer_killed_mid_sync_leaves_a_serving_server(server, point, serves, tmp_path):
    old, new, newer = (T.tiny_model("llama") for _ in range(3))
    for seed, model in enumerate((old, new, newer), start=40):
        T.perturb(model, seed=seed, scale=0.2)
    first = VLLMServerEngine(server.url)
    FullSync().sync(old, first)
    first.close()
    assert answered(server.url, PROMPTS, BOUND_S)[0] == greedy(old)

    new_folder = T.save_checkpoint(new, tmp_path / "new")
    # "either": the trainer first syncs the old weights again, to time a sync
    old_folder = T.save_checkpoint(old, tmp_path / "old") if serves == "either" else ""
    said, pid = run(server.url, new_folder, point, old_folder)

    tokens, waited = answered(server.url, PROMPTS, BOUND_S)
    if serves == "either":  # never a mix: the old weights whole, or the new whole
        print(f"{point}: {said.splitlines()[1:]}, answered in {waited:.1f} s")
        expected = [greedy(old), greedy(new)]
        if "SYNCED" in said:
            expected = [greedy(new)]
        assert tokens in expected, f"killed at {point}: {said}"
    else:
        assert tokens == greedy(old if serves == "old" else new), f"killed at {point}"
    assert waited < BOUND_S
    if point in ("staging", "streaming"):  # never paused: answered at once
        assert waited < LEASE_S
    if point == "committing":  # the server finished the commit and resumed by itself, at once
        assert "INSIDE" in said, said
        assert waited < LEASE_S, f"answered after {waited:.1f} s: the lease resumed it"

    honest = VLLMServerEngine(server.url)  # a new trainer: its scratch folder sweeps the dead's
    try:
        FullSync().sync(newer, honest)
        T.assert_matches(newer, honest)
    finally:
        honest.close()
    assert not list(Path("/dev/shm").glob(f"weightsync-{pid}-*"))


def test_a_stage_nobody_commits_is_dropped_after_its_expiry(server, tmp_path):
    """A trainer SIGKILLed once every worker staged its whole gloo stream, before the commit
    (the server never paused): the workers hold the stage (``weightsync_staged_bytes``) until
    the expiry, then nothing, and a separate client gets the old weights throughout. A live
    trainer whose commit comes after the expiry is refused with nothing loaded, and its next
    sync is exact."""
    old, new, newer = (T.tiny_model("llama") for _ in range(3))
    for seed, model in enumerate((old, new, newer), start=50):
        T.perturb(model, seed=seed, scale=0.2)
    first = VLLMServerEngine(server.url)
    FullSync().sync(old, first)
    first.close()

    said, _ = run(server.url, T.save_checkpoint(new, tmp_path / "new"), "staged-gloo")
    ended = float(said.split("STAGED ")[1].split()[0])
    readings = watch_stage(server.url, PROMPTS, ended + STAGE_EXPIRY_S + 30.0)
    print([(round(when - ended, 1), held) for when, held, _ in readings])
    assert all(tokens == greedy(old) for _, _, tokens in readings)
    held = [b for when, b, _ in readings if when < ended + STAGE_EXPIRY_S - 0.5]
    assert held and all(held), "the stage was not held until its expiry (or not read before it)"
    when, last, _ = readings[-1]
    assert last == 0, f"still {last} bytes staged {when - ended:.1f} s after the stage ended"

    engine = VLLMServerEngine(server.url, transport=GlooTransport())
    try:
        staged = engine.stage_weights(one_per_bucket(newer, engine))
        try:
            assert staged_bytes(server.url) > 0
            time.sleep(STAGE_EXPIRY_S + 1.0)
            with pytest.raises(StageExpiredError, match="no commit claimed it within 6 s"):
                staged.apply()
        finally:
            staged.drop()
        assert answered(server.url, PROMPTS, BOUND_S)[0] == greedy(old)
        FullSync().sync(newer, engine)
        T.assert_matches(newer, engine)
    finally:
        engine.close()


def test_a_slow_trainer_learns_its_lease_ran_out(server):
    """Alive but silent inside its pause for longer than the lease: the server resumes without
    it, answers others meanwhile, and the late call is refused, not run."""
    engine = VLLMServerEngine(server.url)
    try:
        model = T.tiny_model("llama")
        T.perturb(model, seed=44, scale=0.2)
        FullSync().sync(model, engine)
        engine.control.pause()
        # waits for the lease, then is served
        tokens, waited = answered(server.url, PROMPTS, BOUND_S)
        assert tokens == greedy(model) and waited < BOUND_S
        # and the server's log says so (the operator's view of a dead trainer's pause)
        assert "weightsync: resumed on the weights the workers hold" in server.log.read_text()
        with pytest.raises(PauseExpiredError, match=r"lease .* is over: it expired"):
            engine.control.reset_prefix_cache()
        assert engine.control.lease is None
        engine.control.pause()  # a new pause is a new lease
        engine.control.resume()
        T.perturb(model, seed=45, scale=0.2)
        FullSync().sync(model, engine)
        T.assert_matches(model, engine)
    finally:
        engine.close()


def test_while_a_trainer_holds_the_pause_no_other_caller_writes_resumes_or_finishes(server):
    """A pause is one caller's: while a trainer holds it, another trainer's sync and every
    weight-changing route called without the pause's lease -- vLLM's own weight-transfer
    routes, ``/resume``, ``/pause``, a worker call that abandons -- are refused (409, nothing
    run); reads are served and do not keep the pause alive, so a holder that goes silent is
    still resumed by its lease. Then the other trainer syncs, exactly."""
    holder, other = VLLMServerEngine(server.url), VLLMServerEngine(server.url)
    try:
        mine, theirs = T.tiny_model("llama"), T.tiny_model("llama")
        T.perturb(mine, seed=46, scale=0.2)
        T.perturb(theirs, seed=47, scale=0.2)
        FullSync().sync(mine, holder)
        holder.control.pause()
        with pytest.raises(EngineBusyError, match="holds this server's pause"):
            FullSync().sync(theirs, other)
        for path, body in (
            ("/resume", None),
            ("/pause", None),
            ("/start_weight_update", None),
            ("/finish_weight_update", None),
            ("/reset_prefix_cache", None),
            ("/collective_rpc", {"method": "weightsync_abandon"}),
        ):
            r = requests.post(server.url + path, json=body, timeout=60)
            assert r.status_code == 409 and r.headers.get(BUSY_HEADER) == "1", (path, r.text)
            assert f"POST {path} was not run" in r.json()["error"]
        assert other.control.rpc("weightsync_attest", {})  # a read of another caller: served
        start = time.monotonic()
        while requests.get(server.url + "/is_paused", timeout=60).json()["is_paused"]:
            assert time.monotonic() - start < BOUND_S, "reads kept a silent holder's pause"
            time.sleep(0.25)
        tokens, _ = answered(server.url, PROMPTS, BOUND_S)
        assert tokens == greedy(mine)  # nothing another caller sent was run
        with pytest.raises(PauseExpiredError):
            holder.control.resume()
        FullSync().sync(theirs, other)
        T.assert_matches(theirs, other)
    finally:
        holder.close()
        other.close()


def test_a_commit_running_turns_away_writes_and_serves_reads():
    """While a commit runs on the server, a worker call that writes is refused without
    reaching vLLM, and a read reaches it with its body intact."""
    reached: list[bytes] = []

    async def app(scope, receive, send):
        reached.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    lease = PauseLease(app)
    lease._commit = object()  # a commit in flight
    answers: list[dict] = []

    async def send(message):
        answers.append(message)

    for method in ("weightsync_abandon", "weightsync_attest"):
        body = b'{"method": "%s", "kwargs": {}}' % method.encode()

        async def receive(body=body):
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {"type": "http", "path": "/collective_rpc", "method": "POST", "headers": []}
        asyncio.run(lease(scope, receive, send))
    refused, served = answers[0], answers[2]
    assert refused["status"] == 409 and (BUSY_HEADER.encode(), b"1") in refused["headers"]
    assert b"commit runs on this server" in answers[1]["body"]
    assert served["status"] == 200 and reached == [b'{"method": "weightsync_attest", "kwargs": {}}']


def test_the_commit_route_asks_for_the_token_itself(monkeypatch):
    """``--middleware`` order may put the lease outside the token guard: its commit route then
    checks the token itself, before reading the commit or touching the engine."""
    monkeypatch.setenv(TOKEN_ENV, "a-token-of-sixteen-chars")
    reached: list[str] = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    lease = PauseLease(app)
    answers: list[dict] = []

    async def send(message):
        answers.append(message)

    async def receive():
        raise AssertionError("the commit was read")

    for headers in ([], [(b"x-weightsync-token", b"not-the-token-of-sixteen")]):
        scope = {"type": "http", "path": COMMIT_PATH, "method": "POST", "headers": headers}
        asyncio.run(lease(scope, receive, send))
        assert answers[-2]["status"] == 401 and b"token required" in answers[-1]["body"]
    assert not reached and lease._commit is None
