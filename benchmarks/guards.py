"""What the guards cost (docs/security.md): syncs into one guarded ``vllm serve`` with the keyed
tags on and off, alternated on the same engine.

    bash .ci/env python -m benchmarks.guards [--model 0.5b] [--pairs 6]

Why alternated and not two benchmark rows: on these 2-core machines a server's sync time drifts
by more than the tags cost over a run (the first rows after a server starts are slower), so two
rows one after the other measure mostly their order. Here each tagged sync is followed by an
untagged one on the same engine and transport, and the medians of each are compared. The token
is sent on every call either way (one header compared per request).
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import tempfile
import time
from pathlib import Path

from transformers import AutoModelForCausalLM

from weightsync import FullSync
from weightsync.engines import TOKEN_MIDDLEWARE, GlooTransport, VLLMServerEngine
from weightsync.verify import check_engine

from .models import resolve
from .processes import VLLMServer, serving


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.guards", description=__doc__)
    p.add_argument("--model", default="0.5b", help="shape (tiny, 0.5b, ...) or a model folder")
    p.add_argument("--pairs", type=int, default=6, help="tagged/untagged pairs per transport")
    args = p.parse_args(argv)
    spec = resolve(args.model)
    token = secrets.token_urlsafe(24)
    model = AutoModelForCausalLM.from_pretrained(spec.checkpoint, dtype=spec.dtype)
    sync = FullSync(skip_unchanged=False)  # a full push every time
    log = Path(tempfile.mkdtemp(prefix="weightsync-guards-")) / "server.log"
    server = VLLMServer(
        spec.checkpoint,
        log,
        dtype=str(spec.dtype).removeprefix("torch."),
        args=["--middleware", TOKEN_MIDDLEWARE],
        env={"WEIGHTSYNC_TOKEN": token, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
        start_timeout_s=600,
    )
    print(f"# Keyed tags on and off: {spec.name}, FullSync into a guarded vllm serve")
    print("| transport | tags on: s median (min-max) | tags off: s median (min-max) | cost |")
    print("|---|---|---|---|")
    with serving(server):
        for name, transport in (("tmpfs", "tmpfs"), ("gloo", GlooTransport())):
            engine = VLLMServerEngine(server.url, token=token, transport=transport)
            try:
                for _ in range(2):  # warm-up: the kept files, the mappings, the group
                    sync.sync(model, engine)
                times: dict[bool, list[float]] = {True: [], False: []}
                for i in range(2 * args.pairs):
                    engine.transport.tagged = i % 2 == 0
                    t = time.perf_counter()
                    sync.sync(model, engine)
                    times[engine.transport.tagged].append(time.perf_counter() - t)
                check_engine(model, engine, strategy="FullSync")  # raises if not the trainer's
            finally:
                engine.close()
            on, off = (statistics.median(times[k]) for k in (True, False))
            print(
                f"| {name} | {on:.3f} ({min(times[True]):.3f}-{max(times[True]):.3f}) "
                f"| {off:.3f} ({min(times[False]):.3f}-{max(times[False]):.3f}) "
                f"| {(on - off) * 1000:+.0f} ms |",
                flush=True,
            )


if __name__ == "__main__":
    main()
