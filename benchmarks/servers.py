"""``vllm serve`` processes for the out-of-process rows, started once and always stopped.

Each is a `weightsync.testing.VLLMServer` (127.0.0.1, a free port, weightsync's worker
extension, dev-mode endpoints, stopped gracefully by PID); `ServerPool.stop` also runs at
interpreter exit, so an interrupted benchmark does not leave servers behind. The servers also run
weightsync's weight-transfer backend, so the same server serves the tmpfs, gloo and
weight-transfer rows.
"""

from __future__ import annotations

import atexit
import json
from pathlib import Path

from weightsync.testing import VLLMServer

from .models import ModelSpec


class ServerPool:
    """Servers of ``spec``, one per entry of ``binds`` (its ``VLLM_CPU_OMP_THREADS_BIND``: the
    cores its worker computes on), started together and waited for (start-up is the slow part:
    ~40 s of both cores each).

    Why the binding is explicit: vLLM-CPU's default binds a server's worker to the first core
    and reserves the rest, so a lone server would compute on one core while the in-process
    engine it is compared with uses every core (measured at 0.5B: 1.9 s vs 1.5 s per FullSync),
    and two servers would both sit on core 0.
    """

    def __init__(self, spec: ModelSpec, binds: list[str], *, logdir: Path) -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        args = [
            "--kv-cache-memory-bytes", str(64 << 20),  # as the in-process engines
            "--weight-transfer-config", json.dumps({"backend": "weightsync"}),
        ]  # fmt: skip
        self.servers = [
            VLLMServer(
                spec.checkpoint,
                logdir / f"server-{i}-cores-{bind}.log",
                dtype=spec.dtype_name,
                args=args,
                env={"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
                start_timeout_s=600,
            )
            for i, bind in enumerate(binds)
        ]
        atexit.register(self.stop)
        try:
            for s in self.servers:
                s.wait()
        except BaseException:
            self.stop()
            raise

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def stop(self) -> None:
        """Stop every server by its PID; idempotent."""
        for s in self.servers:
            s.terminate()
        for s in self.servers:
            s.join()
