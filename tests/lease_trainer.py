"""A trainer process for tests/test_pause_lease_vllm.py, SIGKILLed at one point of a sync.

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
- ``random-tmpfs:<seed>`` / ``random-gloo:<seed>``: at a random moment of the sync (seeded):
  a second sync of the model the server already holds (the first connects) measures how long
  one takes, ``d``; the
  next sync, of the new model, is killed after a delay drawn from ``[0, 1.2 d)`` -- while
  staging, inside the pause or, past the end, after the sync (then ``SYNCED`` is printed
  first and the trainer waits for its kill).

It prints ``PID <pid>`` first, so the test knows whose scratch folders to look for.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time

import requests
import torch
from transformers import AutoModelForCausalLM

from weightsync import FullSync
from weightsync.engines import VLLMServerEngine
from weightsync.engines.vllm.control import HTTPControl
from weightsync.engines.vllm.transports.gloo import GlooTransport
from weightsync.engines.vllm.transports.tmpfs import TmpfsTransport
from weightsync.wire import gloo


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def killed_at_random(url: str, old: str, new: str, transport: str, seed: int) -> None:
    load = AutoModelForCausalLM.from_pretrained
    engine = VLLMServerEngine(url, transport=GlooTransport() if transport == "gloo" else "tmpfs")
    sync = FullSync(skip_unchanged=False)
    served = load(old, torch_dtype=torch.float32).eval()  # what the server holds: unchanged
    sync.sync(served, engine)  # connects the transport
    start = time.monotonic()
    sync.sync(served, engine)
    took = time.monotonic() - start
    model = load(new, torch_dtype=torch.float32).eval()
    delay = random.Random(seed).uniform(0.0, 1.2 * took)
    print(f"KILL after {delay:.3f} s of a {took:.3f} s sync", flush=True)
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
    transport = GlooTransport() if point == "streaming" else "tmpfs"
    FullSync().sync(model, VLLMServerEngine(url, transport=transport))
    raise SystemExit(f"the sync ended without reaching {point!r}")


if __name__ == "__main__":
    main(*sys.argv[1:5])
