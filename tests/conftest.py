"""After every test, each engine it used is made usable again, so one failing test stays one
failure instead of hanging the tests after it.

Two states outlive a failed test on a shared (module-scoped) in-process ``vllm.LLM``:

- a sleep: vLLM pauses its scheduler on ``sleep`` (also on CPU, where the memory part is a
  no-op) and resumes it only once every tag is awake. Recording the wake (``mark_awake``) is not
  enough: the next ``generate`` would wait forever.
- a request left in the scheduler by a ``generate`` that raised (or was interrupted by the
  per-test timeout): in-process, the next ``generate`` spins on it forever
  (docs/failure-modes.md, row 5). Aborting it is the recovery.

``tests/test_reliability.py::test_a_failure_while_asleep_stays_one_failure`` runs failing tests
in a nested pytest session against a real engine to prove this.

Below that, what several test modules share (``from conftest import ...``, as pytest puts this
folder on ``sys.path``): the trainer-side models, the LoRA set-up the servers are started for,
the sync-and-check step, weight streams that fail part-way, and the engine fixtures a module
makes on its own ``checkpoint`` fixture. What one module alone uses stays in that module.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest
import torch

from benchmarks.processes import stretched
from weightsync import Syncer
from weightsync import testing as T
from weightsync.engines import WORKER_EXTENSION, Engine, VLLMEngine, adapt
from weightsync.testing import TEXT, build_tokenizer  # noqa: F401 (the trainer tests' imports)

pytest_plugins = ["pytester"]

# vLLM names its ZMQ sockets ``ipc://<VLLM_RPC_BASE_PATH>/<uuid>`` (default: /tmp) and nobody
# removes the files: a full run left ~500 in /tmp. Every test process (and the servers, engine
# cores and workers it starts, which inherit the environment) puts them in a folder of its own,
# removed when the process exits.
_RPC_DIR = tempfile.mkdtemp(prefix=f"weightsync-tests-rpc-{os.getpid()}-")
os.environ.setdefault("VLLM_RPC_BASE_PATH", _RPC_DIR)
atexit.register(shutil.rmtree, _RPC_DIR, True)


# --- running the suite on two workers (pytest-xdist, ``-n 2`` in pyproject's addopts) -----------
#
# Most of the suite's time is one process waiting on another (a `vllm serve` or an engine core
# starting, a Ray node, a trainer subprocess importing torch), so two workers on a 2-core machine
# finish in about two thirds of the time of one. Three rules keep that safe:
# - a module is a unit of work: its engine, server or cluster fixtures are module-scoped, and
#   splitting a module across workers would start them twice;
# - modules that start a Ray cluster run on one worker, one after the other: a cluster's fixture
#   fails if Ray left files in /dev/shm when it stopped, and another live cluster's files would
#   be counted;
# - the longest modules start first (longest-first keeps the two workers' ends close), the rest
#   in file order;
# - tests whose engines run tensor-parallel run alone (`ALONE`, and the ``tp2`` tests of
#   `TP2_ALONE`): their workers busy-wait on each other, and a process beside them on two cores
#   stalls both (seen in a full run: a TP=2 server's two workers at 100% each while the other
#   worker's in-process engine got 2%), and so does the module whose rollouts must still be
#   decoding when a commit lands (beside another module's engine, a server's API process got
#   the CPU to stream a rollout's first token only once its engine core had generated all 160:
#   no rollout crossed the write). They are one unit, the last: the other worker, which waits
#   while it runs, has then nothing left to do anyway. A module split across the two (its TP=1
#   tests beside other modules) starts each server when a test first asks for it
#   (`ServersOnDemand`).

#: Modules that must not run beside each other: one unit of work, in this order.
SERIAL = {"ray": ("test_ray_vllm.py", "test_recipes_ray.py")}
#: The longest units (measured in a full run, 2026-12-06: 360 s down to 170 s), started first,
#: longest first: a long unit left for the end keeps the alone unit waiting.
LONGEST = (
    "ray",
    "test_lifecycle_fuzz.py",
    "test_quantized_vllm.py",
    "test_trl.py",
    "test_core_vllm.py",
    "test_weight_transfer_vllm.py",
    "test_soak.py",
    "test_server_stock_vllm.py",
    "test_reliability.py",
    "test_swift.py",
    "test_edges_vllm.py",
    "test_adapter_memory_vllm.py",
    "test_server_vllm.py",
)


#: Modules that run with no other module beside them (a lock every worker takes: shared for
#: the others, exclusive for these; see `pytest_runtest_protocol`).
ALONE = (
    "test_multiproc_vllm.py",
    "test_async_rl_server_vllm.py",
    "test_suite_hygiene.py",
)
#: Modules whose tests with ``tp2`` in their id run alone, the others beside other modules.
TP2_ALONE = ("test_server_vllm.py", "test_weight_transfer_vllm.py")


def _alone(nodeid: str) -> bool:
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return module in ALONE or (module in TP2_ALONE and "tp2" in nodeid.partition("[")[2])


def _unit(nodeid: str) -> str:
    if _alone(nodeid):
        return "alone"
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return next((group for group, names in SERIAL.items() if module in names), module)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the collected tests by unit (see above); within a unit, as collected."""
    first = {unit: i for i, unit in enumerate(LONGEST)}
    rank = {"alone": (len(first) + 1, 0)}  # the last unit
    for i, item in enumerate(items):
        rank.setdefault(_unit(item.nodeid), (first.get(_unit(item.nodeid), len(first)), i))
    members = {g: {m: j for j, m in enumerate(names)} for g, names in SERIAL.items()}

    def key(item: pytest.Item) -> tuple:
        unit = _unit(item.nodeid)
        module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
        return (*rank[unit], members.get(unit, {}).get(module, 0))

    items.sort(key=key)


_locked: dict[tuple[str, bool], Any] = {}  # (module, alone) -> its open lock, while it runs


def _module(item: pytest.Item | None) -> tuple[str, bool]:
    """The lock's key: a module, or the part of it that runs alone."""
    return ("", False) if item is None else (item.nodeid.split("::", 1)[0], _alone(item.nodeid))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under xdist, hold a lock on pyproject.toml while a module runs: shared by most modules,
    exclusive for the tests that run alone (`_alone`). Taken outside pytest-timeout's timer (this wrapper runs first), so a
    module waiting for another does not time out; released after the module's last test (its
    module fixtures are torn down by then). Each worker holds one lock at a time: no deadlock.
    The lock is queued for through a turnstile (this file, locked exclusively while waiting):
    otherwise the other worker, releasing its shared lock and taking it again for its next
    module, could keep an `ALONE` module waiting to the end of the run."""
    import fcntl

    module = _module(item)
    if hasattr(item.config, "workerinput") and module not in _locked:
        lock = open(item.config.rootpath / "pyproject.toml", "rb")  # noqa: SIM115 (held across calls)
        with open(__file__, "rb") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            fcntl.flock(lock, fcntl.LOCK_EX if module[1] else fcntl.LOCK_SH)
        _locked[module] = lock
    yield
    if module in _locked and _module(nextitem) != module:
        _locked.pop(module).close()  # closing the file releases the lock


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's per-scope scheduler with a unit of work per module (or `SERIAL` group), handed
    out in collection order (`pytest_collection_modifyitems`)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False
    return ByUnit(config, log)


# --- /dev/shm: what the run leaves behind is a leak ----------------------------------------------
#
# A segment nobody maps once the run has ended (a vLLM ring buffer, a semaphore), or a folder of
# weightsync's whose process is gone, stays in RAM until the machine reboots. Every test appends
# the entries that appeared while it ran to a log shared by the workers (with two workers, both
# running tests are named: either may have made it); at the run's end, entries new since its
# start that no process uses are reported with those names, removed, and fail the run. With
# another test run alive on the machine nothing is judged (its entries look like this run's, and
# a semaphore it reopens by name must stay).

_SHM = Path("/dev/shm")
_SHM_LOG = "WEIGHTSYNC_TESTS_SHM_LOG"
_shm_start = pytest.StashKey[set]()


def _shm_entries() -> set[str]:
    return set(os.listdir(_SHM)) if _SHM.is_dir() else set()


def pytest_sessionstart(session: pytest.Session) -> None:
    # The controller, or the only process; not a worker, nor a session a test nests in this one.
    if not hasattr(session.config, "workerinput") and _SHM_LOG not in os.environ:
        _clear_after_killed_runs(session)
        session.config.stash[_shm_start] = _shm_entries()
        fd, log = tempfile.mkstemp(prefix=f"weightsync-tests-shm-{os.getpid()}-", suffix=".log")
        os.write(fd, f"#started\t{time.time()}\n".encode())
        os.close(fd)
        # the workers, and every process the run starts (servers, engine cores, Ray nodes),
        # inherit both
        os.environ[_SHM_LOG] = log
        os.environ[_RUN] = str(os.getpid())


# --- a run killed before its end ---------------------------------------------------------------
#
# A run SIGKILLed as a whole (a CI job cancelled and retried, an OOM kill, a closed terminal's
# process group) runs none of its stops: `vllm serve` servers and trainers started in sessions
# of their own outlive it, and the ring buffers of the engines it ran stay in /dev/shm (seen at
# the start of three sessions: 400 MiB of vLLM ring buffers and a semaphore, left by a first CI
# attempt killed at its second minute). The run's log (named with its controller's PID) says it
# died; the next run on the machine, at its start, stops what the dead run started (every such
# process carries its PID in `_RUN`) and removes what it left in /dev/shm that nobody maps, and
# says so. It does not fail for it: the leak was the dead run's, and is gone.

_RUN = "WEIGHTSYNC_TESTS_RUN"


def _clear_after_killed_runs(session: pytest.Session) -> None:
    import signal

    from benchmarks.processes import shm_mapped

    report = session.config.pluginmanager.get_plugin("terminalreporter")
    for log in Path(tempfile.gettempdir()).glob("weightsync-tests-shm-*-*.log"):
        pid = log.name.split("-")[3]
        if not pid.isdigit() or psutil.pid_exists(int(pid)):
            continue  # alive, or a name of another form
        first = log.read_text().partition("\n")[0].split("\t")
        started = float(first[1]) if first[0] == "#started" else None
        mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
        orphans = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.pid not in mine and p.environ().get(_RUN) == pid:
                    orphans.append(p)
        for p in orphans:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(orphans, timeout=stretched(10))
        left = []
        if started is not None and not _other_test_runs():  # else: theirs and its look alike
            mapped = shm_mapped(int(n) for n in os.listdir("/proc") if n.isdigit())
            for name in sorted(_shm_entries() - mapped):
                path = _SHM / name
                with contextlib.suppress(OSError):
                    if path.stat().st_ctime >= started and not _owned_by_another_live_process(name):
                        shutil.rmtree(path) if path.is_dir() else path.unlink()
                        left.append(name)
        for rpc in Path(tempfile.gettempdir()).glob(f"weightsync-tests-rpc-{pid}-*"):
            shutil.rmtree(rpc, ignore_errors=True)
        log.unlink(missing_ok=True)
        if orphans or left:
            report.write_sep("-", f"a test run killed before its end (PID {pid}) left behind")
            for p in orphans:
                report.write_line(f"  process {p.pid} (stopped now)")
            for name in left:
                report.write_line(f"  /dev/shm/{name} (removed now)")


@pytest.fixture(autouse=True)
def _shm_made_during(request):
    before = _shm_entries()
    yield
    made = _shm_entries() - before
    if made and os.environ.get(_SHM_LOG):
        with open(os.environ[_SHM_LOG], "a") as log:
            log.writelines(f"{name}\t{request.node.nodeid}\n" for name in sorted(made))


def _owned_by_another_live_process(name: str) -> bool:
    """A ``weightsync-<pid>-*`` folder of a live process other than this one (a folder is not
    mapped: its owner's PID says whether it is in use; another test run's, for example)."""
    owner = name.split("-")[1] if name.startswith("weightsync-") else ""
    return owner.isdigit() and int(owner) != os.getpid() and psutil.pid_exists(int(owner))


def _is_pytest(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return "pytest" in " ".join(process.cmdline())
    return False


def _other_test_runs() -> list[int]:
    """PIDs of pytest processes outside this run's own line: itself, its ancestors, and every
    process under the outermost pytest among them (a run nested in another sees that run's
    xdist workers, whose titles say pytest, as its own line, not as other runs)."""
    me = psutil.Process()
    line = [me, *me.parents()]
    top = next((p for p in reversed(line) if _is_pytest(p)), me)
    mine = {p.pid for p in line} | {c.pid for c in top.children(recursive=True)}
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.info["pid"] not in mine and "pytest" in " ".join(p.info["cmdline"] or ()):
            found.append(p.info["pid"])
    return found


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _shm_start not in session.config.stash:
        return
    from benchmarks.processes import shm_mapped

    log = Path(os.environ.pop(_SHM_LOG))
    made_by: dict[str, set[str]] = {}
    for line in log.read_text().splitlines():
        if line.startswith("#"):
            continue
        name, _, test = line.partition("\t")
        made_by.setdefault(name, set()).add(test)
    log.unlink()
    others = _other_test_runs()
    if others:  # their entries cannot be told from this run's: nothing is judged or removed
        report = session.config.pluginmanager.get_plugin("terminalreporter")
        report.write_line(f"/dev/shm not checked: other test runs are alive (PIDs {others})")
        return
    new = _shm_entries() - session.config.stash[_shm_start]
    deadline = time.monotonic() + stretched(5)  # an owner's own late unlink (`left_behind`)
    while True:
        mapped = shm_mapped(int(pid) for pid in os.listdir("/proc") if pid.isdigit())
        left = {n for n in new & _shm_entries() if n not in mapped}
        left = {n for n in left if not _owned_by_another_live_process(n)}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if left:
        report = session.config.pluginmanager.get_plugin("terminalreporter")
        report.write_sep("-", "the run left /dev/shm entries nobody uses (removed now)", red=True)
        for name in sorted(left):
            report.write_line(f"  {name} (appeared during {sorted(made_by.get(name, {'?'}))})")
            path = _SHM / name
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def recover(engine: Engine) -> list[str]:
    """Wake ``engine`` for real and abort requests a failed ``generate`` left behind; return
    what was done (empty if the engine was fine)."""
    done = []
    # VLLMEngine's LLMEngine (whatever it was given), or a multiprocess LLM's
    llm = getattr(engine, "llm_engine", None) or getattr(
        getattr(engine, "llm", None), "llm_engine", None
    )
    if engine.asleep or (llm is not None and llm.is_sleeping()):
        engine.wake_up()
        done.append("woke the engine")
    if llm is not None:
        left = list(llm.output_processor.request_states)
        if left:
            llm.abort_request(left, internal=True)
            done.append(f"aborted {len(left)} request(s) left in vLLM's scheduler")
    return done


@pytest.fixture(scope="module", autouse=True)
def _engines_end_with_their_module():
    """Every in-process engine a module starts lives to the module's end, and dies there.

    An in-process vLLM engine tears down vLLM's process-wide parallel state when it is collected
    (its client's finalizer runs ``EngineCore.shutdown`` -> ``cleanup_dist_env_and_memory``),
    whichever engines still use that state. An engine that started and then failed in a test (a
    W4A16 engine on a CPU whose vLLM build lacks its kernel) is left in a reference cycle
    through its traceback, and the next engine to start collects it during its own start-up:
    that engine, and every other engine of the module, then fail with "tensor model parallel
    group is not initialized", as do the next module's. So the engine clients a module makes
    are held here until its end, then collected together (vLLM ``gc.freeze()``s what is alive
    when an engine starts: unfrozen first), before the next module starts its own
    (tests/test_reliability.py::test_a_failed_engine_breaks_no_other_engine)."""
    import gc
    import weakref

    from vllm.v1.engine.core_client import InprocClient

    made: list[Any] = []
    init = InprocClient.__init__

    def held(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    InprocClient.__init__ = held
    try:
        yield
    finally:
        InprocClient.__init__ = init
        held_on = [weakref.ref(client) for client in made]
        made.clear()
        gc.unfreeze()
        gc.collect()
        # One something still holds (seen: a bf16 Falcon-H1 engine of test_proven_vllm, the
        # holder not found) is shut down now, not torn down in the next module's start-up;
        # vLLM's shutdown detaches its finalizer, so its later collection does nothing.
        for ref in held_on:
            client = ref()
            if client is not None:
                client.shutdown()


@pytest.fixture(autouse=True)
def _recover_engines(request):
    yield
    for value in list(request.node.funcargs.values()):
        if isinstance(value, Engine):
            recover(value)


# --- shared by several test modules -----------------------------------------------------------

#: Engine and trainer agree when greedy tokens are equal and float32 logprobs within this.
ATOL = 1e-3
#: The LoRA set-up most modules train (attention and MLP, not every projection).
LORA = {
    "r": 8,
    "lora_alpha": 16,
    "target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
}
#: ``vllm serve`` arguments for a server that serves one LoRA adapter at a time.
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "1"]


def full_model(arch: str, seed: int) -> torch.nn.Module:
    """The tiny ``arch`` model the checkpoints hold, trained: every weight perturbed."""
    model = T.tiny_model(arch)
    T.perturb(model, seed=seed)
    return model


def lora_model(arch: str, seed: int, config: Mapping[str, Any] = LORA, **cfg: Any) -> Any:
    """The checkpoints' base with a trained (perturbed) LoRA adapter: ``config`` (the module's
    own LoRA set-up; ``LORA`` by default), updated with ``cfg``."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(T.tiny_model(arch), LoraConfig(**{**config, **cfg}))
    T.perturb(model, seed=seed, scale=0.3)
    return model


def moe_model(family: str = "qwen3_moe", seed: int = 0) -> torch.nn.Module:
    """A tiny MoE in the shape of ``T.TINY`` (4 experts, 2 a token): Qwen3-MoE or Mixtral, whose
    checkpoints name experts differently (``mlp.experts.0.gate_proj``, ``experts.0.w1``), or
    GLM-4-MoE (layer 0 dense, layer 1 MoE; its router's ``e_score_correction_bias`` is a
    persistent buffer, zero until set)."""
    from transformers import AutoModelForCausalLM, Glm4MoeConfig, MixtralConfig, Qwen3MoeConfig

    torch.manual_seed(seed)
    common = {**T.TINY, "num_experts_per_tok": 2, "head_dim": 32}
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(num_experts=4, moe_intermediate_size=64, **common)
    elif family == "mixtral":
        cfg = MixtralConfig(num_local_experts=4, **common)
    elif family == "glm4_moe":
        cfg = Glm4MoeConfig(
            n_routed_experts=4,
            moe_intermediate_size=64,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            **common,
        )
    else:
        raise ValueError(f"family must be 'qwen3_moe', 'mixtral' or 'glm4_moe', got {family!r}")
    return AutoModelForCausalLM.from_config(cfg).float().eval()


def differs(model, engine) -> bool:
    """The engine does not (yet) serve ``model``: otherwise a test would prove nothing."""
    answers = adapt(engine).greedy_batch(T.PROMPTS, 8)
    return not all(
        T.trainer_scores(model, prompt, tokens)[1]
        for prompt, (tokens, _) in zip(T.PROMPTS, answers, strict=True)
    )


def served(engine, prompts: list[list[int]] = T.PROMPTS) -> list[tuple[list[int], list[float]]]:
    """What ``engine`` serves on ``prompts`` (greedy tokens with their logprobs), to compare
    bitwise: one prompt per request. A batch is not repeatable bitwise on an engine core in
    another process (multiprocess, server, Ray): its requests reach vLLM's scheduler in one step
    or in several, and the bfloat16 matmuls round differently by batch shape (tokens equal,
    logprobs 1e-4 apart in 2-7% of batches with the weights unchanged). One request alone is."""
    return [engine.greedy_batch([prompt], 8)[0] for prompt in prompts]


def sync_and_check(sync, model, engine):
    """Check ``engine`` differs from the trainer, sync ``model`` with ``sync`` (a strategy, or a
    ``Syncer`` driving ``engine``), then check the engine serves exactly ``model``; returns the
    sync's report."""
    assert differs(model, engine), "the engine already matched the trainer: the test proves nothing"
    report = sync.sync(model) if isinstance(sync, Syncer) else sync.sync(model, engine)
    T.assert_matches(model, engine, atol=ATOL)
    return report


def discard(engine, *, seed: int = 1234) -> None:
    """What a level-2 sleep does to the weights on a GPU, which vLLM's CPU sleep does not do:
    overwrite every weight with random values, behind weightsync's bookkeeping (not a sync)."""
    gen = torch.Generator().manual_seed(seed)
    engine.load_weights(
        [
            [
                (name, torch.randn(shape, generator=gen))
                for name, shape in engine.expected_weights.items()
            ]
        ]
    )


def enter_sleep(engine, level: int) -> None:
    """Sleep the server at ``level`` through its ``/sleep`` and wake it; after level 2 its
    weights are garbage."""
    if level == 0:
        return
    engine.sleep(level)
    assert engine.control.is_sleeping()
    engine.wake_up()
    assert engine.sleep_level >= level and engine.base_discarded == (level == 2)
    if level == 2:
        discard(engine)


def walk(
    syncer: Syncer,
    model,
    engine,
    levels: Sequence[int],
    *,
    train: Callable[[int], None] | None = None,
) -> list[str]:
    """A framework's loop against a server: per step, train (``train(step)``), sleep at the
    step's level and wake, then ``syncer.sync``; returns the strategy each step ran."""
    chosen = []
    for step, level in enumerate(levels):
        if train is not None:
            train(step)
        enter_sleep(engine, level)
        report = sync_and_check(syncer, model, engine)
        chosen.append(report.strategy)
        assert syncer.base_sync_done and not engine.base_discarded
    return chosen


def one_per_bucket(model, engine) -> list[list[tuple[str, torch.Tensor]]]:
    """The model's weights in checkpoint (module) order, one tensor a bucket."""
    state = model.state_dict()
    return [[(name, state[name].detach())] for name in state if name in engine.expected_weights]


def bad_stream(model, engine, kind: str) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The model's buckets, failing part-way through layer 0: the trainer raises
    (``kind="trainer"``), or a tensor the engine cannot load (a name its model lacks) reaches
    the workers mid-reload."""
    stream = one_per_bucket(model, engine)
    yield from stream[:6]
    if kind == "trainer":
        raise RuntimeError("injected: the trainer failed producing the next bucket")
    yield [("model.layers.0.mlp.not_a_weight", torch.zeros(4))]


def sparse_step(model, seed: int) -> None:
    """A step that changes 1% of every weight's elements (a float32 engine would see every
    element of a real AdamW step change; test_delta_vllm.py runs that on bf16)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            where = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 100)]
            flat[where] += 0.5 * torch.randn(len(where), generator=gen)


def forge_deltas(monkeypatch) -> None:
    """From now on (until ``monkeypatch.undo()``) every delta the trainer encodes has its last
    changed word flipped: a delta altered on the way, which the whole bucket's tag must refuse."""
    from weightsync.wire import delta

    honest = delta.encode

    def forged(positions, words, base_tag):
        made = honest(positions, words, base_tag)
        values = made.values.copy()
        values[-1:] ^= 1
        return delta.Delta(made.base, made.size, made.word, made.gaps, values)

    monkeypatch.setattr(delta, "encode", forged)


def forged_delta_is_refused(sync, model, engine, transport, monkeypatch) -> None:
    """A sync whose deltas are altered on the way (`forge_deltas`) is refused with nothing of
    it loaded (``engine`` serves what it served), and the next sync is whole and exact.
    ``model`` must differ from the engine; ``monkeypatch`` is undone."""
    from weightsync.errors import BytesRejectedError

    serving = served(engine)
    forge_deltas(monkeypatch)
    with pytest.raises(BytesRejectedError, match="not the ones the trainer sent"):
        sync.sync(model, engine)
    monkeypatch.undo()
    assert served(engine) == serving  # nothing of it was loaded
    sync_and_check(sync, model, engine)
    assert transport.last_sync.delta_buckets == 0  # the refusal dropped the kept copies


def folders_left(engines) -> list[Path]:
    """The scratch folders closed engines left behind: each adapter folder, the transport's
    folder, and the folder a server's workers wrote an adapter to (over gloo, the server's)."""
    return [
        p
        for e in engines
        for p in (
            e._adapter_root,
            _transport_root(e.transport),
            e.adapter_path and Path(e.adapter_path).parent,
        )
        if p and p.exists()
    ]


def _transport_root(transport: Any) -> Path | None:
    """The folder a transport made (left behind if it still exists), or the one a caller gave
    it (left behind if anything is still in it)."""
    root = getattr(transport, "root", None)
    if root is None or getattr(transport, "_owned", True) or not root.exists():
        return root
    return root if any(root.iterdir()) else None


@contextlib.contextmanager
def closed_leaving_nothing(engines: Mapping[Any, Any] | list[Any]) -> Iterator[None]:
    """Close every engine of ``engines`` at the end (also those added to it meanwhile), even
    after a failure; then, on a normal exit, fail if any left a folder behind."""
    try:
        yield
    finally:
        for e in list(engines.values() if isinstance(engines, Mapping) else engines):
            e.close()
    left = folders_left(engines.values() if isinstance(engines, Mapping) else engines)
    assert not left, f"tmpfs folders left behind: {left}"


class ServersOnDemand(dict):
    """``vllm serve`` servers by key, each started when a test first asks for it (``servers[tp]``)
    and all stopped by `stopped`: a module split across workers (`TP2_ALONE`) starts on each
    only the servers its tests there use, and a TP=2 server only while its tests run alone.

    Args:
        make: the (not yet started) `benchmarks.processes.VLLMServer` of a key.
    """

    def __init__(self, make: Callable[[Any], Any]) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, key: Any) -> Any:
        server = self.make(key)
        try:
            server.wait()
        except BaseException:
            server.stop()  # what it left in /dev/shm removed
            raise
        self[key] = server
        return server

    @contextlib.contextmanager
    def stopped(self) -> Iterator[ServersOnDemand]:
        """Yield this mapping; then stop every server started (`benchmarks.processes.stop_all`:
        fails if a stop was not graceful)."""
        from benchmarks.processes import stop_all

        try:
            yield self
        finally:
            stop_all(*self.values())


@pytest.fixture(scope="module")
def lora_engine(checkpoint):
    """An in-process engine on the module's ``checkpoint``, serving LoRA up to rank 16."""
    return VLLMEngine(T.make_llm(checkpoint, enable_lora=True, max_lora_rank=16))


@pytest.fixture(scope="module")
def plain_engine(checkpoint):
    """An in-process engine on the module's ``checkpoint``, without LoRA (adapters are merged)."""
    return VLLMEngine(T.make_llm(checkpoint))


#: What the trainer tests' tokenizer is trained on, and their prompts.
# --- an AsyncLLM on an event loop of its own (test_asyncllm_vllm, test_async_rl_vllm) ---------

R = TypeVar("R")


def on(loop: asyncio.AbstractEventLoop, coro: Awaitable[R]) -> R:
    """Run ``coro`` on ``loop`` (running in another thread) and wait for it."""

    async def run() -> R:
        return await coro

    return asyncio.run_coroutine_threadsafe(run(), loop).result(stretched(300))


@contextlib.contextmanager
def loop_in_thread() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running in a thread of its own, as an async framework's rollout loop
    (an AsyncLLM created on it belongs to it); stopped and closed at the end."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="asyncllm-loop", daemon=True)
    thread.start()
    yield loop
    on(loop, asyncio.sleep(0.1))  # let the AsyncLLM's cancelled output handler finish
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)
    loop.close()


@contextlib.contextmanager
def running_async_llm(
    loop: asyncio.AbstractEventLoop, checkpoint: str, **options: Any
) -> Iterator[Any]:
    """A real AsyncLLM on ``checkpoint`` created on ``loop``, sized like ``T.make_llm``
    (``options`` as there), with weightsync's worker extension; shut down at the end, and every
    process it started stopped by PID."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        **T.engine_options(checkpoint, worker_extension_cls=WORKER_EXTENSION, **options)
    )
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    llm = None

    async def make() -> Any:  # created on the loop: its output handler runs there
        return AsyncLLM.from_engine_args(args)

    try:
        llm = on(loop, make())
        yield llm
    finally:
        # Python's resource tracker outlives the AsyncLLM (it is this process's, not its).
        started = [
            p
            for p in me.children(recursive=True)
            if p.pid not in before
            and "multiprocessing.resource_tracker" not in " ".join(p.cmdline())
        ]
        if llm is not None:
            llm.shutdown(timeout=stretched(30))
        _, alive = psutil.wait_procs(started, timeout=stretched(10))
        for p in alive:
            p.kill()
        psutil.wait_procs(alive, timeout=10)
