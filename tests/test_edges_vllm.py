"""Engines and trainers at the edges (issue 19): each either syncs exactly or is refused before
anything is written, with a weightsync error that says why.

- an engine started with ``load_format="dummy"`` (verl's default: random weights, the first sync
  fills them), in process, and a server with weightsync's worker extension;
- adapters named ``"0"``, ``"1"`` (one per policy index), which also spell ``layers.0.``;
- the user's own adapter under vLLM's usual id 1, beside weightsync's;
- a checkpoint holding ``rotary_emb.inv_freq`` buffers (older Llama exports), which vLLM skips;
- a ``torch.compile``d trainer model (names under ``_orig_mod.``), plain and PEFT;
- a dead engine (a killed ``vllm serve``, a multiprocess ``LLM`` whose engine core died), also
  through ``weightsync.distributed.sync``, and ``EngineBrokenError`` through it;
- a checkpoint folder with a stray shard its safetensors index does not list.

Engines are module-scoped: two in-process ``LLM``s, two ``vllm serve`` processes (the second
started after the first was killed), one multiprocess ``LLM``; every process is stopped by PID.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from benchmarks.processes import VLLMServer, free_port, left_behind, multiproc_llm, serving
from weightsync import AdapterSync, FullSync, ReloadWeights, distributed
from weightsync import testing as T
from weightsync.engines import TmpfsTransport, VLLMEngine, VLLMMultiprocEngine, VLLMServerEngine
from weightsync.engines.vllm.control import greedy_generate
from weightsync.errors import (
    AdapterError,
    EngineBrokenError,
    EngineUnavailableError,
    NoCheckpointError,
)

pytestmark = pytest.mark.timeout(900)

ARCH = "llama"
LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "2"]


def lora_model(seed: int, *, name: str = "default", base_seed: int = 0):
    model = get_peft_model(
        T.tiny_model(ARCH, seed=base_seed), LoraConfig(**LORA), adapter_name=name
    )
    T.perturb(model, seed=seed, scale=0.3)
    return model


# --- checkpoints ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def config_only(tmp_path_factory) -> str:
    """A model folder with a config and no weights: what a dummy engine starts from."""
    folder = T.save_checkpoint(T.tiny_model(ARCH), tmp_path_factory.mktemp("dummy") / "ck")
    os.remove(Path(folder) / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def with_inv_freq(tmp_path_factory) -> str:
    """A tiny Llama checkpoint that also stores each layer's ``rotary_emb.inv_freq``."""
    folder = T.save_checkpoint(T.tiny_model(ARCH), tmp_path_factory.mktemp("inv") / "ck")
    path = Path(folder) / "model.safetensors"
    tensors = load_file(str(path))
    for i in range(T.TINY["num_hidden_layers"]):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.rand(16)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def with_stray_shard(tmp_path_factory) -> str:
    """A checkpoint whose index lists one shard, beside a stray older file the index does not
    list, holding an ``lm_head`` of another shape (vLLM's loader never reads it)."""
    root = tmp_path_factory.mktemp("stray")
    folder = T.save_checkpoint(T.tiny_model(ARCH), root / "ck")
    shard = Path(folder) / "model-00001-of-00001.safetensors"
    (Path(folder) / "model.safetensors").rename(shard)
    names = list(load_file(str(shard)))
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, shard.name)}
    (Path(folder) / "model.safetensors.index.json").write_text(json.dumps(index))
    stale = {"lm_head.weight": torch.zeros(2 * T.TINY["vocab_size"], T.TINY["hidden_size"])}
    save_file(stale, str(Path(folder) / "model-old.safetensors"), metadata={"format": "pt"})
    return folder


# --- in-process engines ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def dummy_engine(config_only):
    llm = T.make_llm(config_only, load_format="dummy", enable_lora=True, max_loras=2)
    return VLLMEngine(llm)


@pytest.fixture(scope="module")
def inv_freq_engine(with_inv_freq):
    return VLLMEngine(T.make_llm(with_inv_freq))


def test_dummy_engine_is_filled_by_the_first_sync(dummy_engine):
    model = T.tiny_model(ARCH, seed=3)
    assert dict(dummy_engine.expected_weights) == {
        name: tuple(p.shape) for name, p in model.named_parameters()
    }
    FullSync().sync(model, dummy_engine)
    T.assert_matches(model, dummy_engine)


def test_reloading_a_dummy_engine_without_files_is_refused_while_planning(dummy_engine):
    model = lora_model(seed=4, base_seed=3)
    FullSync(lora="separate").sync(model, dummy_engine)
    T.assert_matches(model, dummy_engine)
    with T.count_writes(dummy_engine) as writes:
        with pytest.raises(NoCheckpointError, match="holds no weight files"):
            ReloadWeights().sync(model, dummy_engine)
        with pytest.raises(NoCheckpointError, match="no checkpoint to reload"):
            dummy_engine.reload_checkpoint()
    assert writes == []
    T.assert_matches(model, dummy_engine)


@pytest.mark.parametrize("name", ["0", "1"])
def test_adapters_named_by_numbers(dummy_engine, name):
    model = lora_model(seed=5 + int(name), name=name, base_seed=3)
    FullSync(lora="separate").sync(model, dummy_engine)
    T.assert_matches(model, dummy_engine)
    T.perturb(model, seed=50 + int(name), scale=0.3)  # the adapter trains, the base does not
    AdapterSync().sync(model, dummy_engine)
    T.assert_matches(model, dummy_engine)


def test_the_users_own_adapter_under_id_1_is_never_replaced(dummy_engine, tmp_path):
    from vllm.lora.request import LoRARequest

    FullSync().sync(T.tiny_model(ARCH, seed=3), dummy_engine)
    mine = lora_model(seed=60, base_seed=3)
    mine.save_pretrained(str(tmp_path / "mine"))
    request = LoRARequest("mine", 1, str(tmp_path / "mine"))
    llm = dummy_engine.llm

    def users_tokens() -> list[list[int]]:
        return [t for t, _ in greedy_generate(llm, T.PROMPTS, 8, request)]

    before = users_tokens()
    assert before == [T.trainer_greedy(mine, p, 8) for p in T.PROMPTS]
    assert 1 in llm.llm_engine.list_loras()

    # An id the caller names that another adapter holds is refused while planning.
    fixed = VLLMEngine(llm, lora_id=1)
    trained = lora_model(seed=61, base_seed=3)
    with (
        T.count_writes(fixed) as writes,
        pytest.raises(AdapterError, match="lora_id=1 is held by an adapter"),
    ):
        FullSync(lora="separate").sync(trained, fixed)
    assert writes == []
    assert users_tokens() == before

    # The default id is a free one: both adapters serve what their trainers compute.
    FullSync(lora="separate").sync(trained, dummy_engine)
    T.assert_matches(trained, dummy_engine)
    assert dummy_engine.lora_request.lora_int_id != 1
    assert users_tokens() == before
    T.perturb(trained, seed=62, scale=0.3)
    AdapterSync().sync(trained, dummy_engine)
    T.assert_matches(trained, dummy_engine)
    assert users_tokens() == before


def test_inv_freq_buffers_in_the_checkpoint_are_not_expected(inv_freq_engine, with_inv_freq):
    assert not [n for n in inv_freq_engine.expected_weights if "inv_freq" in n]
    model = T.tiny_model(ARCH, seed=9)
    FullSync().sync(model, inv_freq_engine)
    T.assert_matches(model, inv_freq_engine)
    inv_freq_engine.reload_checkpoint()  # vLLM's own reload of that checkpoint
    T.assert_matches(T.tiny_model(ARCH), inv_freq_engine)


def test_a_compiled_model_syncs_exactly(inv_freq_engine, dummy_engine):
    """The compiled forward is never run: the engine is compared with the uncompiled model,
    whose weights the compiled one shares."""
    model = T.tiny_model(ARCH, seed=12)
    FullSync().sync(torch.compile(model), inv_freq_engine)
    T.assert_matches(model, inv_freq_engine)

    peft = lora_model(seed=13, base_seed=3)
    FullSync(lora="merge").sync(torch.compile(peft), inv_freq_engine)
    T.assert_matches(peft, inv_freq_engine)
    FullSync(lora="separate").sync(torch.compile(peft), dummy_engine)
    T.assert_matches(peft, dummy_engine)
    T.perturb(peft, seed=14, scale=0.3)
    AdapterSync().sync(torch.compile(peft), dummy_engine)
    T.assert_matches(peft, dummy_engine)


# --- distributed.sync: a rank's error is raised as its own class ------------------------------


@pytest.fixture(scope="module")
def group():
    """A one-process gloo group (in-process vLLM already made the default group)."""
    if dist.is_initialized():
        yield dist.new_group(ranks=[dist.get_rank()], backend="gloo")
        return
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


class BreaksOnWrite(VLLMEngine):
    """An engine whose write fails beyond recovery (what a dead server's recovery meets)."""

    def load_weights(self, buckets):
        raise EngineBrokenError("the engine is left paused. Restart it.")


def test_engine_broken_error_survives_distributed_sync(inv_freq_engine, group):
    engine = BreaksOnWrite(inv_freq_engine.llm)
    with pytest.raises(EngineBrokenError, match="rank 0: EngineBrokenError: the engine is left"):
        distributed.sync(FullSync(), T.tiny_model(ARCH, seed=15), engine, group=group)


# --- servers: a dummy one, killed; a new one on a checkpoint with a stray shard -------------


def kill(server: VLLMServer) -> None:
    """SIGKILL the server's processes by PID (psutil handles: never a reused PID)."""
    procs = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(True)]
    for p in procs:
        p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=30)


@pytest.fixture(scope="module")
def dummy_server(config_only, tmp_path_factory):
    server = VLLMServer(
        config_only,
        tmp_path_factory.mktemp("logs") / "dummy-server.log",
        args=["--load-format", "dummy", *LORA_ARGS],
    )
    try:
        server.wait()
        yield server
    finally:
        server.stop()  # killed by its test: removes what it left, which is expected then


def test_a_dummy_server_is_filled_by_the_first_sync(dummy_server):
    engine = VLLMServerEngine(dummy_server.url)
    try:
        model = lora_model(seed=20, base_seed=3)
        FullSync(lora="separate").sync(model, engine)
        T.assert_matches(model, engine)
        with pytest.raises(NoCheckpointError, match="holds no weight files"):
            ReloadWeights().sync(model, engine)
        T.assert_matches(model, engine)
    finally:
        engine.close()


#: A trainer that syncs into kept tmpfs files (no engine: the RPC answers nothing) -- sealed
#: ones, and files in a folder (the transport's fallback when its workers cannot open the sealed
#: ones, here a probe that fails) --, says where both transports' folders are, and waits to be
#: killed.
KEPT_FILES_TRAINER = """
import sys, time, torch
from weightsync.engines import TmpfsTransport
def unreachable(method, kwargs):
    raise FileNotFoundError("/proc/<trainer>/fd: another PID namespace")
sealed, folder = TmpfsTransport(), TmpfsTransport()
folder.connect(unreachable, 1)
for transport in (sealed, folder):
    transport.send(lambda method, kwargs: [], [[("w", torch.ones(1 << 16))]])
print(sealed.root, folder.root, flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def killed(dummy_server):
    """The dummy server killed while it held an adapter folder its worker wrote (over gloo),
    with a trainer process killed while it held kept bucket files; and an engine adapter made
    on the server before it died. Yields (that engine, the adapter folder, the kept folder)."""
    import subprocess
    import sys

    engine = VLLMServerEngine(dummy_server.url)
    served = VLLMServerEngine(dummy_server.url, transport="gloo")
    trainer = subprocess.Popen(
        [sys.executable, "-c", KEPT_FILES_TRAINER], stdout=subprocess.PIPE, text=True
    )
    try:
        FullSync(lora="separate").sync(lora_model(seed=24), served)
        assert served.adapter_path is not None
        adapters = Path(served.adapter_path).parent  # the worker's scratch folder, its host's
        assert trainer.stdout is not None
        sealed, kept = map(Path, trainer.stdout.readline().split())
        # Checked while their owners live: once they are dead, any weightsync process starting
        # on this machine may sweep them (another test worker's, too).
        assert adapters.name.startswith("weightsync-") and adapters.is_dir()
        assert (kept / "kept" / "bucket-00000.safetensors").is_file()
        assert sealed.is_dir() and not list(sealed.rglob("*"))  # sealed files are in no folder
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        kill(dummy_server)
        yield engine, adapters, kept
    finally:
        trainer.kill()
        served.close()
        engine.close()


def test_a_crash_leaves_no_scratch_folder_behind(killed):
    """Kill a trainer holding kept bucket files and a server holding the adapter folder its
    worker wrote; the next weightsync start (any scratch folder made) sweeps both."""
    _, adapters, kept = killed  # both held by their (now dead) owners when they were killed
    TmpfsTransport().close()  # the next weightsync start (or another test worker's, before it)
    assert not adapters.exists() and not kept.exists()


def test_a_killed_server_raises_engine_unavailable(killed, dummy_server, group):
    engine, _, _ = killed
    model = T.tiny_model(ARCH, seed=21)
    with pytest.raises(EngineUnavailableError) as raised:
        FullSync().sync(model, engine)
    assert dummy_server.url in str(raised.value)
    assert "connection refused; the server is gone or restarting" in str(raised.value)
    with pytest.raises(EngineUnavailableError, match="rank 0: EngineUnavailableError"):
        distributed.sync(FullSync(), model, engine, group=group)
    with pytest.raises(EngineUnavailableError, match=dummy_server.url):
        VLLMServerEngine(dummy_server.url)


@pytest.fixture(scope="module")
def new_server(with_stray_shard, tmp_path_factory):
    """Started when its test needs it: after the dummy server's tests killed that one."""
    server = VLLMServer(with_stray_shard, tmp_path_factory.mktemp("logs") / "new-server.log")
    with serving(server):
        yield server


def test_a_new_server_is_fine_and_a_stray_shard_adds_nothing(new_server, with_stray_shard):
    engine = VLLMServerEngine(new_server.url)
    try:
        assert engine.expected_weights["lm_head.weight"] == (
            T.TINY["vocab_size"],
            T.TINY["hidden_size"],
        )
        model = T.tiny_model(ARCH, seed=22)
        FullSync().sync(model, engine)
        T.assert_matches(model, engine)
        engine.reload_checkpoint()  # the shard the index lists, not the stray file
        T.assert_matches(T.tiny_model(ARCH), engine)
    finally:
        engine.close()


# --- a multiprocess LLM whose engine core dies ------------------------------------------------


def test_a_dead_engine_core_raises_engine_unavailable(with_stray_shard):
    me = psutil.Process()
    before = {p.pid for p in me.children()}
    try:
        with multiproc_llm(with_stray_shard) as llm:
            engine = VLLMMultiprocEngine(llm)
            try:
                assert engine.expected_weights["lm_head.weight"][0] == T.TINY["vocab_size"]
                model = T.tiny_model(ARCH, seed=23)
                FullSync().sync(model, engine)
                T.assert_matches(model, engine)
                cores = [
                    p
                    for p in me.children()
                    if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline())
                ]
                cores += [child for p in cores for child in p.children(recursive=True)]
                for p in cores:
                    p.send_signal(signal.SIGKILL)
                psutil.wait_procs(cores, timeout=30)
                with pytest.raises(EngineUnavailableError, match="its engine core died"):
                    FullSync().sync(model, engine)
            finally:
                engine.close()
    except RuntimeError as err:  # what the killed processes left in /dev/shm, removed now
        assert "left /dev/shm entries" in str(err)


# --- stopping under load: an owner's late unlink is not a leak, a real leak still is ----------


def test_a_late_unlink_is_waited_for_and_a_real_leak_is_reported():
    import threading
    import uuid

    late, leaked = (f"weightsync-test-{uuid.uuid4().hex}" for _ in range(2))
    for name in (late, leaked):
        (Path("/dev/shm") / name).write_bytes(b"x")
    unlink = threading.Timer(0.5, (Path("/dev/shm") / late).unlink)
    unlink.start()
    try:
        assert left_behind([late, leaked], grace_s=2.0) == [leaked]
        assert not (Path("/dev/shm") / leaked).exists()  # removed once reported
    finally:
        unlink.cancel()
        for name in (late, leaked):
            (Path("/dev/shm") / name).unlink(missing_ok=True)
