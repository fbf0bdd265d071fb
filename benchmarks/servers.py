"""``vllm serve`` processes for the out-of-process rows, started once and always stopped, and
the engine each of those rows syncs into.

Each server is a `benchmarks.processes.VLLMServer` (127.0.0.1, a free port, weightsync's worker
extension, dev-mode endpoints, stopped gracefully by PID); `ServerPool.stop` also runs at
interpreter exit, so an interrupted benchmark does not leave servers behind. The servers also run
weightsync's weight-transfer backend, so the same server serves the tmpfs, gloo and
weight-transfer rows, and weightsync's token guard (docs/security.md), as a deployment should:
every row sends the token, and each byte path is measured with its keyed tags on (the default)
and, for tmpfs and gloo, off.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weightsync.engines import (
    TOKEN_MIDDLEWARE,
    GlooTransport,
    HTTPControl,
    Replicas,
    TmpfsTransport,
    VLLMServerEngine,
    WeightTransferFiles,
)

from .models import ModelSpec
from .processes import VLLMServer
from .rows import SERVER_ROWS


class ServerPool:
    """Servers of ``spec``, one per entry of ``binds`` (its ``VLLM_CPU_OMP_THREADS_BIND``: the
    cores its worker computes on), started together and waited for (start-up is the slow part and
    keeps every core busy; its time: docs/benchmarks.md).

    Why the binding is explicit: vLLM-CPU's default binds a server's worker to the first core
    and reserves the rest, so a lone server would compute on one core while the in-process
    engine it is compared with uses every core (measured at 0.5B, a slower FullSync for that
    alone: docs/benchmarks.md), and two servers would both sit on core 0.
    """

    def __init__(self, spec: ModelSpec, binds: list[str], *, logdir: Path) -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_urlsafe(24)
        args = [
            "--weight-transfer-config", json.dumps({"backend": "weightsync"}),
            "--middleware", TOKEN_MIDDLEWARE,
        ]  # fmt: skip
        self.servers = [
            VLLMServer(
                spec.checkpoint,
                logdir / f"server-{i}-cores-{bind}.log",
                dtype=spec.dtype_name,
                args=args,
                env={
                    "VLLM_CPU_OMP_THREADS_BIND": bind,
                    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                    "WEIGHTSYNC_TOKEN": self.token,
                },
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


class ServerEngines:
    """The engine of each out-of-process row (`benchmarks.rows.SERVER_ROWS`), made at its first
    use, on servers started for it.

    The single-server rows get a server on every core, like the in-process engine they are
    compared with; the fan-out rows get two servers on one core each, as replicas on their own
    hardware would be. One pool at a time (rows run in this order): starting the pair stops the
    single server and closes its rows' engines. A failed start fails every later server row.
    """

    def __init__(
        self, spec: ModelSpec, *, logdir: Path, log: Callable[[str], None] = print
    ) -> None:
        self.spec = spec
        self.logdir = logdir
        self.log = log
        self._engines: dict[str, Any] = {}
        self._pools: dict[str, ServerPool] = {}
        self._error: str | None = None

    def engine(self, which: str) -> Any:
        if which not in self._engines:
            self._engines[which] = self._make(which)
        return self._engines[which]

    def _make(self, which: str) -> Any:
        cores = os.cpu_count() or 1
        pool = "pair" if which.startswith("replicas") else "single"
        binds = [str(i % cores) for i in range(2)] if pool == "pair" else [f"0-{cores - 1}"]
        if self._error is not None:
            raise RuntimeError(f"the vllm serve processes did not start: {self._error}")
        if pool not in self._pools:
            self.stop()
            self.log(f"[bench] starting {len(binds)} vllm serve on cores {binds}: {self.spec.name}")
            t = time.perf_counter()
            try:
                self._pools[pool] = ServerPool(self.spec, binds, logdir=self.logdir)
            except Exception as e:
                self._error = f"{type(e).__name__}: {e}"
                raise
            self.log(f"[bench] servers ready in {time.perf_counter() - t:.1f} s")
        urls, token = self._pools[pool].urls, self._pools[pool].token

        def server(url: str, transport: Any) -> VLLMServerEngine:
            return VLLMServerEngine(url, token=token, transport=transport)

        if which == "server_tmpfs":
            return server(urls[0], "tmpfs")
        if which == "server_tmpfs_untagged":
            return server(urls[0], TmpfsTransport(tagged=False))
        if which == "server_tmpfs_fresh":
            return server(urls[0], TmpfsTransport(keep=False))
        if which in ("server_gloo", "server_gloo_untagged"):
            # A server's workers hold one gloo group: the other gloo row's engine goes first.
            other = self._engines.pop(
                "server_gloo_untagged" if which == "server_gloo" else "server_gloo", None
            )
            if other is not None:
                other.close()
            return server(urls[0], GlooTransport(tagged=which == "server_gloo"))
        if which == "server_wt_files":
            client = HTTPControl(urls[0], token=token)
            return server(urls[0], WeightTransferFiles(client))
        first = self._engines.get("replicas_1")
        first = first.engines[0] if first else server(urls[0], "tmpfs")
        if which == "replicas_1":
            return Replicas([first])
        return Replicas([first, server(urls[1], "tmpfs")])

    def stop(self) -> None:
        """Close the engines (their /dev/shm folders, gloo groups), stop the servers."""
        for key in SERVER_ROWS:
            eng = self._engines.pop(key, None)
            for each in getattr(eng, "engines", [eng] if eng else []):
                each.close()  # idempotent: the replicas rows share their first engine
        for pool in self._pools.values():
            pool.stop()
        self._pools.clear()
