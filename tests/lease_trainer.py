"""A trainer process SIGKILLed at one point of a sync, and the test side that runs it
(tests/test_pause_lease_vllm.py, tests/test_weight_transfer_vllm.py).

``python tests/lease_trainer.py <server url> <checkpoint> <point>`` loads the checkpoint as the
trainer's model and syncs it into the server (FullSync, tmpfs, kept files), killing itself
with SIGKILL -- what an OOM killer or a pre-emption does, no cleanup runs -- at ``point``:

- ``staging``: after the first bucket's file is written, before the server is touched;
- ``streaming``: over gloo (staged: `GlooTransport.prepare`), after the first bucket was
  broadcast to the workers' stages, before the pause;
- ``committing``: inside the commit, which the server runs by itself in one call
  (``server_lease.py``'s commit route): the trainer sends it, watches ``/is_paused`` from
  another connection and is killed as soon as the server is paused (``INSIDE`` printed first;
  ``AFTER`` if the call ended before a pause was seen);
- ``staged-gloo`` / ``staged-wt-gloo``: over gloo, through weightsync's extension or vLLM's
  weight-transfer API, once every worker staged the whole stream and checked it, before the
  commit (``STAGED <unix time>`` printed first): the workers hold the stage with nobody left to
  commit it, until its expiry (``WEIGHTSYNC_STAGE_EXPIRY_S``);
- ``loading-wt-files`` / ``loading-wt-gloo``: through vLLM's weight-transfer API, as the
  ``update_weights`` call that loads the weights inside the trainer's pause was sent (the
  server carries the call out; ``LOADING`` printed first);
- ``random-<transport>:<seed>``: at a random moment of the sync (seeded), over ``tmpfs``,
  ``gloo`` (weightsync's extension) or vLLM's weight-transfer API (``wt-files``, ``wt-gloo``,
  staged): a second sync of the model the server already holds (the first connects) measures
  how long one takes, ``d``; the next sync, of the new model, is killed after a delay drawn
  from ``[0, 1.2 d)`` -- while staging, inside the pause or, past the end, after the sync
  (then ``SYNCED`` is printed first and the trainer waits for its kill). ``AT <where>`` is
  printed as it dies: ``staging`` (no pause asked yet), ``pause`` (from the pause, or the
  commit call, to its end) or ``after``, with the HTTP call in flight or last answered.

It prints ``PID <pid>`` first, so the test knows whose scratch folders to look for.
`run` starts it, `answered` is the separate client the tests ask afterwards, and
`watch_stage` reads what the workers hold staged meanwhile.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import requests
import torch
from transformers import AutoModelForCausalLM

from weightsync import FullSync
from weightsync.engines import VLLMServerEngine, WeightTransferFiles, WeightTransferGloo
from weightsync.engines.vllm.control import HTTPControl
from weightsync.engines.vllm.server_auth import COMMIT_PATH
from weightsync.engines.vllm.transports.gloo import GlooTransport
from weightsync.engines.vllm.transports.tmpfs import TmpfsTransport
from weightsync.errors import EngineFencedError
from weightsync.wire import gloo
from weightsync.wire.protocol import Outcome

#: The HTTP calls of the sync being killed, as they start and end (`traced`); None: not traced.
CALLS: list[tuple[str, str]] | None = None
#: Held by `die` from its report to the kill, so that no call starts (or is noted answered)
#: after the report: its print releases the GIL, and the sync once sent ``/pause`` in that gap,
#: reported as killed while staging (seen in a CI run).
NOTING = threading.Lock()


def where() -> str:
    """Where the killed sync is (`CALLS`): ``staging`` before a pause was asked (the
    extension's commit call, or ``/pause``), ``pause`` until the commit call or ``/resume``
    answered, ``after`` then; with the call in flight or the last one answered."""
    calls = CALLS or []
    paused = any(path in ("/pause", COMMIT_PATH) for _, path in calls)
    ended = ("end", "/resume") in calls or ("end", COMMIT_PATH) in calls
    at = "after" if ended else "pause" if paused else "staging"
    if calls:
        edge, path = calls[-1]
        at += f" ({path} {'in flight' if edge == 'start' else 'answered'})"
    return at


def traced(session_request):
    """``requests.Session.request`` noting every call of the traced sync in `CALLS` (vLLM's
    weight-transfer client and weightsync's control both come through it)."""

    def request(self, method, url, *args, **kwargs):
        path = "/" + url.split("/", 3)[3].partition("?")[0] if url.count("/") >= 3 else url
        with NOTING:
            if CALLS is not None:
                CALLS.append(("start", path))
        answer = session_request(self, method, url, *args, **kwargs)
        with NOTING:
            if CALLS is not None:
                CALLS.append(("end", path))
        return answer

    return request


def die() -> None:
    NOTING.acquire()  # never released: the process ends here
    if CALLS is not None:
        print(f"AT {where()}", flush=True)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def transport_for(url: str, name: str):
    """The transport named on the command line (`main`)."""
    if name == "gloo":
        return GlooTransport()
    if name.startswith("wt-"):  # vLLM's weight-transfer API, through vLLM's own client
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

        carrier = WeightTransferFiles if name == "wt-files" else WeightTransferGloo
        return carrier(HTTPVLLMWeightSyncClient(url))
    if name != "tmpfs":
        raise SystemExit(f"unknown transport {name!r}")
    return "tmpfs"


def killed_at_random(url: str, old: str, new: str, transport: str, seed: int) -> None:
    global CALLS
    load = AutoModelForCausalLM.from_pretrained
    engine = VLLMServerEngine(url, transport=transport_for(url, transport))
    sync = FullSync(skip_unchanged=False)
    served = load(old, torch_dtype=torch.float32).eval()  # what the server holds: unchanged
    sync.sync(served, engine)  # connects the transport
    start = time.monotonic()
    sync.sync(served, engine)
    took = time.monotonic() - start
    model = load(new, torch_dtype=torch.float32).eval()
    delay = random.Random(seed).uniform(0.0, 1.2 * took)
    print(f"KILL after {delay:.3f} s of a {took:.3f} s sync", flush=True)
    requests.Session.request = traced(requests.Session.request)
    CALLS = []
    threading.Timer(delay, die).start()
    sync.sync(model, engine)
    print("SYNCED", flush=True)
    time.sleep(3600)  # the timer kills it


def main(url: str, checkpoint: str, point: str, old: str = "") -> None:
    print(f"PID {os.getpid()}", flush=True)
    if point.startswith("random-"):
        transport, _, seed = point.removeprefix("random-").partition(":")
        return killed_at_random(url, old, checkpoint, transport, int(seed))
    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    if point == "staging":
        prepare = TmpfsTransport.prepare

        def staging(self, rpc, buckets):  # one bucket's file written, then killed
            first = iter(buckets)
            return prepare(self, rpc, [next(first)]) and die()

        TmpfsTransport.prepare = staging
    elif point == "streaming":
        send_frame = gloo.send_frame

        def streaming(group, frame):  # one frame broadcast, then killed
            send_frame(group, frame)
            die()

        gloo.send_frame = streaming
    elif point.startswith("loading-"):
        session_request = requests.Session.request
        paused: list[str] = []

        def loading(self, method, url, *args, **kwargs):  # killed as the load is asked
            if url.endswith("/pause"):
                paused.append(url)
            if paused and url.endswith("/update_weights"):
                call = (self, method, url, *args)
                threading.Thread(target=session_request, args=call, kwargs=kwargs).start()
                time.sleep(0.05)  # the call reached the server, which loads
                print("LOADING", flush=True)
                die()
            return session_request(self, method, url, *args, **kwargs)

        requests.Session.request = loading
        transport = transport_for(url, point.removeprefix("loading-"))
    elif point.startswith("staged-"):
        transport = transport_for(url, point.removeprefix("staged-"))
        prepare = type(transport).prepare

        def staged(self, rpc, buckets):  # every worker staged and checked it all, then killed
            prepare(self, rpc, buckets)
            print(f"STAGED {time.time()}", flush=True)
            die()

        type(transport).prepare = staged
    elif point == "committing":
        post = HTTPControl._session_post

        def committing(self, path, body):  # killed once the server's own commit paused it
            call = threading.Thread(target=post, args=(self, path, body), daemon=True)
            call.start()
            probe = requests.Session()
            while call.is_alive():
                if probe.get(url + "/is_paused", timeout=60).json()["is_paused"]:
                    print("INSIDE", flush=True)
                    die()
            print("AFTER", flush=True)
            die()

        HTTPControl._session_post = committing
    else:
        raise SystemExit(f"unknown point {point!r}")
    if not point.startswith(("loading-", "staged-")):
        transport = GlooTransport() if point == "streaming" else "tmpfs"
    FullSync().sync(model, VLLMServerEngine(url, transport=transport))
    raise SystemExit(f"the sync ended without reaching {point!r}")


# --- the test side --------------------------------------------------------------------------


def kill_seeds() -> list[int]:
    """The seeds of the random kills: ``WEIGHTSYNC_KILL_SEEDS=a-b`` (each ~10-20 s), one in CI."""
    first, _, last = os.environ.get("WEIGHTSYNC_KILL_SEEDS", "1-1").partition("-")
    return list(range(int(first), int(last or first) + 1))


def run(url: str, checkpoint: str, point: str, old: str = "") -> tuple[str, int]:
    """This trainer, in a process of its own, until its SIGKILL: its stdout and PID.

    Raises:
        AssertionError: it ended otherwise (its output says why).
    """
    trainer = subprocess.run(
        [sys.executable, __file__, url, checkpoint, point, *([old] if old else [])],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    if trainer.returncode != -signal.SIGKILL:
        raise AssertionError(f"the trainer was not killed: {trainer.stdout}{trainer.stderr}")
    return trainer.stdout, int(trainer.stdout.split()[1])


def answered(url: str, prompts: list[list[int]], bound_s: float) -> tuple[object, float]:
    """A separate client's greedy tokens of ``prompts`` -- or ``"fenced"`` when the server
    refuses to generate (its weights a mix, `EngineFencedError`) -- and how long it waited."""
    client = HTTPControl(url, timeout_s=bound_s)
    start = time.monotonic()
    try:
        tokens: object = [t for t, _ in client.generate(prompts, 8, None)]
    except EngineFencedError:
        tokens = "fenced"
    return tokens, time.monotonic() - start


def staged_bytes(url: str) -> int:
    """The bytes every worker of the server holds staged for a commit (the extension's
    ``weightsync_staged_bytes``: its gloo stage and its weight-transfer backend's)."""
    answers = HTTPControl(url, timeout_s=60).rpc("weightsync_staged_bytes", {})
    return sum(int(Outcome.from_json(a).value) for a in answers)


def watch_stage(
    url: str, prompts: list[list[int]], until: float
) -> list[tuple[float, int, object]]:
    """What the workers hold staged and a separate client's greedy tokens (`answered`), read in
    turn every half second until nothing is staged or ``until`` (a unix time) passed:
    ``(when, bytes, tokens)`` per reading."""
    readings = []
    while True:
        held = staged_bytes(url)
        readings.append((time.time(), held, answered(url, prompts, 60.0)[0]))
        if held == 0 or time.time() > until:
            return readings
        time.sleep(0.5)


if __name__ == "__main__":
    main(*sys.argv[1:5])
