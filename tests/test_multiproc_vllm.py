"""A ``vllm.LLM`` with vLLM's default multiprocess engine core at tensor_parallel_size=2.

Its workers live in other processes, so tensors cannot go by reference (in ``collective_rpc``
arguments they arrive as lists): :class:`VLLMMultiprocEngine` controls it through
``LLM.collective_rpc`` and moves bytes through a transport, like a server. One LLM per module;
every process it started is stopped by PID at the end.
"""

from __future__ import annotations

import contextlib

import psutil
import pytest
from peft import LoraConfig, get_peft_model
from test_server_vllm import SHM, SHUTDOWN_TIMEOUT_S, shm_mapped

from weightsync import AdapterSync, FullSync
from weightsync import testing as T
from weightsync.engines import VLLMMultiprocEngine, adapt
from weightsync.engines.vllm.server import WORKER_EXTENSION

ATOL = 1e-3
LORA = {
    "r": 8,
    "lora_alpha": 16,
    "target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
}

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    import vllm.envs
    from vllm import LLM

    checkpoint = T.save_checkpoint(T.tiny_model("qwen2"), tmp_path_factory.mktemp("mp") / "ck")
    env = pytest.MonkeyPatch()
    env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the default, which .ci/env turns off
    env.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    env.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # time for the workers to exit on their own: they unlink their shared memory on exit
    env.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(SHUTDOWN_TIMEOUT_S))
    vllm.envs.disable_envs_cache()  # an in-process engine made earlier froze the environment
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    engine = None
    try:
        engine = LLM(
            model=checkpoint,
            tensor_parallel_size=2,
            worker_extension_cls=WORKER_EXTENSION,
            enable_lora=True,
            max_lora_rank=16,
            max_loras=1,
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            max_model_len=256,
            kv_cache_memory_bytes=64 << 20,
            seed=0,
        )
        yield engine
    finally:
        started = [p for p in me.children(recursive=True) if p.pid not in before]
        held = shm_mapped(p.pid for p in started)  # vLLM-CPU's TP communicator: cpushm_<rank>
        if engine is not None:
            # The default gives the engine core 5 s, then kills it and its workers, whose
            # shared memory (vLLM-CPU's TP communicator) then stays in /dev/shm.
            engine.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        for p in started:
            with contextlib.suppress(psutil.NoSuchProcess):  # psutil: never a reused PID
                p.kill()
        psutil.wait_procs(started, timeout=10)
        env.undo()
        vllm.envs.disable_envs_cache()
        left = sorted(n for n in held if (SHM / n).exists())
        for name in left:
            (SHM / name).unlink(missing_ok=True)
        assert not left, f"the LLM's processes left /dev/shm entries (removed now): {left}"
        assert engine is None or any("cpushm" in n for n in held), "nothing was checked"


@pytest.fixture(scope="module")
def engines(llm):
    made = {t: VLLMMultiprocEngine(llm, transport=t) for t in ("tmpfs", "gloo")}
    yield made
    for e in made.values():
        e.close()


def test_adapt_routes_a_multiprocess_llm_here(llm, engines):
    engine = engines["tmpfs"]
    assert engine.facts["world_size"] == 2 and engine.serves_lora
    assert engine.shared_weights == [("model.embed_tokens.weight", "lm_head.weight")]
    assert isinstance(adapt(llm), VLLMMultiprocEngine)


@pytest.mark.parametrize("transport", ["tmpfs", "gloo"])
def test_full_merged_served_and_adapter_only(engines, transport):
    engine = engines[transport]
    seed = 10 * (1 + ["tmpfs", "gloo"].index(transport))
    model = T.tiny_model("qwen2")
    T.perturb(model, seed=seed)
    for strategy, trained in [
        (FullSync(), model),
        (FullSync(lora="merge"), _lora(seed + 1)),
        (FullSync(lora="separate"), lora := _lora(seed + 2)),
        (AdapterSync(), lora),
    ]:
        if strategy.name == "AdapterSync":
            T.perturb(lora, seed=seed + 3, scale=0.3)
        stale = T.compare(trained, engine)
        assert stale["engine"] != stale["trainer"], f"{strategy.label}: engine already matched"
        strategy.sync(trained, engine)
        T.assert_matches(trained, engine, atol=ATOL)


def _lora(seed):
    model = get_peft_model(T.tiny_model("qwen2"), LoraConfig(**LORA))
    T.perturb(model, seed=seed, scale=0.3)
    return model
