"""FullSync sends only what changed, exactly: frozen embeddings and frozen layers are skipped,
everything else is sent, and nothing is skipped after a level-2 sleep or a failed sync. Bytes
are counted where vLLM consumes them, not from weightsync's report."""

from __future__ import annotations

import pytest
from conftest import ATOL
from peft import LoraConfig, get_peft_model

from weightsync import FullSync
from weightsync import testing as T
from weightsync.engines import VLLMEngine
from weightsync.engines.vllm.in_engine import model_ops


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("changed")
    return {
        arch: VLLMEngine(T.make_llm(T.save_checkpoint(T.tiny_model(arch), root / arch)))
        for arch in ("llama", "qwen2")
    }


class Received:
    """The names and bytes vLLM's reload_weights consumed, recorded inside its iterator (the
    in-process engine hands it to its workers as ``collective_rpc(model_ops.reload, ...)``)."""

    def __init__(self, engine):
        self.names: list[str] = []
        self.bytes = 0
        self._llm, self._rpc = engine.llm, engine.llm.collective_rpc

    def __enter__(self):
        def rpc(method, *args, kwargs=None, **rest):
            if method is model_ops.reload and kwargs and kwargs.get("weights") is not None:
                kwargs = {**kwargs, "weights": self._count(kwargs["weights"])}
            return self._rpc(method, *args, kwargs=kwargs, **rest)

        self._llm.collective_rpc = rpc
        return self

    def _count(self, pairs):
        for name, tensor in pairs:
            self.names.append(name)
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def __exit__(self, *exc):
        del self._llm.collective_rpc


def frozen(arch, prefixes):
    model = T.tiny_model(arch)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(prefixes))
    return model


def step_and_sync(model, engine, seed):
    T.perturb(model, seed=seed)
    stale = T.compare(model, engine)
    assert stale["engine"] != stale["trainer"], "the engine already matched: proves nothing"
    with Received(engine) as got:
        report = FullSync().sync(model, engine)
    T.assert_matches(model, engine, atol=ATOL)
    return report, got


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_frozen_embeddings_are_not_sent_again(engines, arch):
    engine = engines[arch]
    model = frozen(arch, ("model.embed_tokens",))
    first, got_first = step_and_sync(model, engine, seed=1)
    assert first.plan.skipped == ()  # a new model: the engine holds none of it
    second, got = step_and_sync(model, engine, seed=2)
    embedding = ["model.embed_tokens.weight"] + (["lm_head.weight"] if arch == "qwen2" else [])
    assert sorted(second.plan.skipped) == sorted(embedding)  # a tied head goes with it
    assert not set(embedding) & set(got.names)
    emb_bytes = model.model.embed_tokens.weight.numel() * 4 * len(embedding)
    assert got.bytes == got_first.bytes - emb_bytes


def test_frozen_first_layer_is_skipped_whole(engines):
    engine = engines["llama"]
    model = frozen("llama", ("model.embed_tokens", "model.layers.0."))
    step_and_sync(model, engine, seed=3)
    report, got = step_and_sync(model, engine, seed=4)
    assert set(report.plan.skipped) == {
        n
        for n in engine.expected_weights
        if n.startswith(("model.embed_tokens", "model.layers.0."))
    }
    assert not any(n.startswith("model.layers.0.") for n in got.names)


def test_everything_trainable_nothing_skipped(engines):
    engine = engines["llama"]
    model = T.tiny_model("llama")
    step_and_sync(model, engine, seed=5)
    report, got = step_and_sync(model, engine, seed=6)
    assert report.plan.skipped == () and len(got.names) == len(engine.expected_weights)


def test_level2_sleep_sends_everything(engines):
    engine = engines["llama"]
    model = frozen("llama", ("model.embed_tokens",))
    step_and_sync(model, engine, seed=7)
    engine.sleep(2)
    T.discard_weights(engine)
    engine.wake_up()
    report, got = step_and_sync(model, engine, seed=8)
    assert report.plan.skipped == () and "model.embed_tokens.weight" in got.names


def test_failed_sync_sends_everything_next(engines):
    engine = engines["llama"]
    model = frozen("llama", ("model.embed_tokens",))
    step_and_sync(model, engine, seed=9)
    T.perturb(model, seed=10)
    rpc = engine.llm.collective_rpc

    def broken(method, *args, kwargs=None, **rest):
        def cut(pairs):
            for i, pair in enumerate(pairs):
                if i == 5:
                    raise RuntimeError("injected")
                yield pair

        return rpc(
            method,
            *args,
            kwargs={**kwargs, "weights": cut(kwargs["weights"])},
            **rest,
        )

    engine.llm.collective_rpc = broken
    try:
        with pytest.raises(RuntimeError, match="injected"):
            FullSync().sync(model, engine)
    finally:
        del engine.llm.collective_rpc
    report, got = step_and_sync(model, engine, seed=11)
    assert report.plan.skipped == () and "model.embed_tokens.weight" in got.names


def test_merged_lora_resends_only_targeted_layers(engines):
    engine = engines["llama"]
    model = get_peft_model(
        T.tiny_model("llama"), LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
    )
    step_and_sync(model, engine, seed=12)  # LoRA trains: embeddings, norm, head are frozen
    report, _ = step_and_sync(model, engine, seed=13)
    assert set(report.plan.skipped) == {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    }
    assert "FullSync" in str(report.plan) and "skip 3 weights" in str(report.plan)


def test_fused_optimizer_steps_are_always_sent(engines):
    """torch's fused AdamW (transformers' default optimizer) writes parameters without bumping
    their version counter, so a trainable tensor is never skipped, whatever its counter says."""
    import torch

    engine = engines["llama"]
    model = frozen("llama", ("model.embed_tokens",))
    step_and_sync(model, engine, seed=14)
    trainable = [p for p in model.parameters() if p.requires_grad]
    versions = [p._version for p in trainable]
    optimizer = torch.optim.AdamW(trainable, lr=0.05, fused=True)
    model.train()
    model(
        input_ids=torch.tensor([[1, 2, 3, 4, 5, 6]]), labels=torch.tensor([[1, 2, 3, 4, 5, 6]])
    ).loss.backward()
    optimizer.step()
    model.eval()
    assert [p._version for p in trainable] == versions, (
        "fused AdamW bumped the counters: test is moot"
    )
    stale = T.compare(model, engine)
    assert stale["engine"] != stale["trainer"]
    with Received(engine) as got:
        report = FullSync().sync(model, engine)
    T.assert_matches(model, engine, atol=ATOL)
    assert (
        report.plan.skipped == ("model.embed_tokens.weight",)
        and len(got.names) == len(engine.expected_weights) - 1
    )
