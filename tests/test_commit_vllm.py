"""Commit or nothing on real servers (issue 31): a sync over two ``vllm serve`` replicas
commits on both or on neither, and a write that fails part-way leaves a server fenced -- refusing
to generate, for every client -- instead of serving a mix of old and new layers.

Two servers on one tiny model, with weightsync's worker extension and middleware
(``server_lease.py``), started together once for the module. The failures are real ones:

- a stage that fails part-way on one replica: that replica's transport writes files in a folder
  (``TmpfsTransport(root)``) which holds a folder where the third bucket's file must go, so the
  trainer's write of that file fails (``IsADirectoryError``) after two files were written --
  while the other replica had staged everything;
- a stage that succeeded and that another client drops before the commit
  (``weightsync_drop_staged``): one replica commits and the other refuses;
- two trainers staging into one server: each commit and drop touches only its own stage;
- a worker error while applying: a bucket holding a name the model lacks reaches vLLM's loader
  after the embeddings and layer 0's attention were written (``conftest.bad_stream``, through
  files in a folder, which the workers check and load inside the commit: sealed files are
  checked, names included, before the pause).

A separate HTTP client checks what each server answers.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from conftest import bad_stream, one_per_bucket
from lease_trainer import staged_bytes

from benchmarks.processes import VLLMServer, serving
from weightsync import FullSync
from weightsync import testing as T
from weightsync.engines import HTTPControl, Replicas, TmpfsTransport, VLLMServerEngine
from weightsync.engines.contract import Staged
from weightsync.engines.vllm.server_lease import FENCED_HEADER
from weightsync.errors import EngineFencedError, ReplicasSplitError, StageLostError
from weightsync.wire.files import bucket_name
from weightsync.wire.scratch import private_dir

ARCH = "llama"
PROMPTS = T.PROMPTS[:2]
#: Small buckets, so a sync of the tiny model is many files and a stage can fail part-way.
BUCKET = 1 << 14

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("commit")
    checkpoint = T.save_checkpoint(T.tiny_model(ARCH), folder / "ck")
    started = [VLLMServer(checkpoint, folder / f"server-{i}.log") for i in range(2)]
    with serving(*started):
        yield started


def model(seed: int):
    m = T.tiny_model(ARCH)
    T.perturb(m, seed=seed, scale=0.2)
    return m


def trainer_tokens(m) -> list[list[int]]:
    return [T.trainer_greedy(m, p, 8) for p in PROMPTS]


def completions(url: str) -> requests.Response:
    """A separate client's greedy completion request (not weightsync's control)."""
    body = {
        "model": requests.get(url + "/v1/models", timeout=60).json()["data"][0]["id"],
        "prompt": PROMPTS,
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return requests.post(url + "/v1/completions", json=body, timeout=300)


def client_tokens(url: str) -> list[list[int]]:
    r = completions(url)
    assert r.status_code == 200, r.text
    return [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def staged_files(engine: VLLMServerEngine) -> list[str]:
    return sorted(p.name for p in engine.transport.root.rglob("*.safetensors*"))


def test_one_failed_stage_commits_none(servers, tmp_path):
    """Replica 1's stage fails part-way: neither replica is written, both serve the old weights
    at their old versions, nothing of the sync stays staged; then an honest sync commits both."""
    old, new = model(60), model(61)
    fleet = Replicas([VLLMServerEngine(s.url) for s in servers])
    blocked = VLLMServerEngine(servers[1].url, transport=TmpfsTransport(tmp_path / "blocked"))
    engines = [*fleet.engines, blocked]
    try:
        FullSync().sync(old, fleet)
        assert [client_tokens(s.url) for s in servers] == [trainer_tokens(old)] * 2
        before = [e.weights_version for e in fleet.engines]

        # Replica 1, a new trainer-side engine on its server, whose staging folder has a folder
        # where the third bucket's file must go.
        (private_dir(blocked.transport.root / "kept") / bucket_name(2)).mkdir()
        split = Replicas([fleet.engines[0], blocked])
        with pytest.raises(RuntimeError, match="replica 1 failed to stage") as raised:
            FullSync(bucket_bytes=BUCKET).sync(new, split)
        assert isinstance(raised.value.__cause__, IsADirectoryError)
        assert "no replica committed it" in str(raised.value)

        assert [client_tokens(s.url) for s in servers] == [trainer_tokens(old)] * 2
        assert [e.weights_version for e in split.engines] == before  # nothing was written
        assert staged_files(blocked) == [] and not split.engines[0].transport._kept._maps
        assert all(staged_bytes(s.url) == 0 for s in servers)

        FullSync().sync(new, split)  # the failed stage left nothing in the way
        assert [client_tokens(s.url) for s in servers] == [trainer_tokens(new)] * 2
        T.assert_matches(new, split)  # every replica's tokens, replica 0's logprobs
    finally:
        for e in engines:
            e.close()


class DroppedAfterStaging(VLLMServerEngine):
    """A replica whose stage another client drops between the stage and the commit
    (``weightsync_drop_staged``): its workers refuse the commit, nothing loaded."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.other_client = HTTPControl(url)

    def stage_weights(self, buckets):
        staged = super().stage_weights(buckets)

        def commit():
            self.other_client.rpc("weightsync_drop_staged", {})
            return staged.apply()

        return Staged(commit, staged.drop, staged.discard)


def test_a_commit_failing_on_one_replica_names_what_each_holds(servers):
    """Both staged; replica 1's commit is refused (its stage was dropped by another client):
    the error names both replicas and their versions; the next honest sync restores both."""
    old, new, newer = model(62), model(63), model(64)
    plain = Replicas([VLLMServerEngine(s.url) for s in servers])
    rewritten = DroppedAfterStaging(servers[1].url)
    engines = [*plain.engines, rewritten]
    try:
        FullSync().sync(old, plain)
        fleet = Replicas([plain.engines[0], rewritten])
        with pytest.raises(ReplicasSplitError) as raised:
            FullSync().sync(new, fleet)
        said = str(raised.value)
        version = fleet.engines[0].weights_version
        assert "replica(s) [1] after replica(s) [0] committed" in said, said
        assert f"replica 0: committed, serves the new weights (version {version!r})" in said
        assert "replica 1: its commit failed (" in said and "no longer held" in said, said
        assert client_tokens(servers[0].url) == trainer_tokens(new)
        assert client_tokens(servers[1].url) == trainer_tokens(old)  # refused whole: no mix

        FullSync().sync(newer, plain)
        assert [client_tokens(s.url) for s in servers] == [trainer_tokens(newer)] * 2
    finally:
        for e in engines:
            e.close()


def test_a_commit_or_a_drop_touches_only_its_own_stage(servers):
    """Two trainers sync one server (sealed files): its workers hold one stage at a time, and
    every commit and drop names its own. A's stage replaced by B's: A's commit is refused
    (`StageLostError`), nothing loaded -- before, it loaded B's weights and A recorded its
    own -- and B's commit loads B's. A trainer failing part-way through writing its files
    while B's stage is held drops nothing of B's -- before, its drop took B's stage, and B's
    commit failed in the pause (a Ray actor's stage of a killed trainer failing after a live
    trainer staged, `tests/test_ray_vllm.py` kill seed 32)."""
    url = servers[0].url
    old, a_model, b_model, c_model = model(65), model(66), model(67), model(68)
    a, b = VLLMServerEngine(url), VLLMServerEngine(url)
    try:
        FullSync(skip_unchanged=False).sync(old, a)
        stage_a = a.stage_weights(one_per_bucket(a_model, a))
        stage_b = b.stage_weights(one_per_bucket(b_model, b))
        with pytest.raises(StageLostError, match="no longer held"):
            stage_a.apply()
        stage_a.drop()
        assert client_tokens(url) == trainer_tokens(old)  # neither A's nor B's loaded
        stage_b.apply()
        stage_b.drop()
        assert client_tokens(url) == trainer_tokens(b_model)

        stage_b = b.stage_weights(one_per_bucket(c_model, b))
        with pytest.raises(RuntimeError, match="injected: the trainer failed"):
            a.stage_weights(bad_stream(a_model, a, "trainer"))
        stage_b.apply()
        stage_b.drop()
        assert client_tokens(url) == trainer_tokens(c_model)
        assert staged_bytes(url) == 0
    finally:
        a.close()
        b.close()


def test_a_write_failing_part_way_fences_the_server(servers, tmp_path):
    """A worker error while applying, after layers were written: every client gets 503 with
    the reason (the trainer `EngineFencedError`) -- a request admitted before the failure too --
    health stays up, a write that is not a full restore keeps the fence, and a full sync lifts
    it with exactly the new weights."""
    url = servers[0].url
    old, new = model(65), model(66)
    engine = VLLMServerEngine(url, transport=TmpfsTransport(tmp_path / "files"))
    try:
        FullSync().sync(old, engine)
        assert client_tokens(url) == trainer_tokens(old)

        # A separate client's request, admitted while the server serves whole weights and held
        # by a pause until the failed write's recovery resumes the server: it is answered 503
        # too (it would run on the mix).
        engine.control.pause()
        with ThreadPoolExecutor(1) as pool:
            admitted = pool.submit(completions, url)
            time.sleep(2)  # it reaches the server and waits for the pause to end
            assert not admitted.done()
            with pytest.raises(RuntimeError, match="not_a_weight"):
                engine.load_weights(bad_stream(new, engine, "engine"))
            late = admitted.result(timeout=300)
        assert late.status_code == 503 and late.headers.get(FENCED_HEADER) == "1", late.text

        refused = completions(url)
        assert refused.status_code == 503 and refused.headers.get(FENCED_HEADER) == "1"
        reason = refused.json()["error"]
        assert "mix of old and new layers" in reason and "model.embed_tokens" in reason, reason
        assert "until a full weight sync" in reason
        chat = requests.post(url + "/v1/chat/completions", json={"messages": []}, timeout=60)
        assert chat.status_code == 503
        assert requests.get(url + "/health", timeout=60).status_code == 200
        with pytest.raises(EngineFencedError, match="mix of old and new layers"):
            engine.greedy_batch(PROMPTS, 8)

        engine.load_weights(one_per_bucket(new, engine)[:3])  # completes, but is not all of it
        assert completions(url).status_code == 503

        FullSync().sync(new, engine)
        assert client_tokens(url) == trainer_tokens(new)
        T.assert_matches(new, engine)
    finally:
        engine.close()
