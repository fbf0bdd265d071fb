"""The engine contract: what an engine adapter takes as the engine's contract (the files vLLM's
own loader reads, not a glob; hub ids resolved locally; scratch folders never left behind), and
the contract every engine must pass (`weightsync.testing.check_engine_contract`), run on a minimal
third-party engine written here and on a real in-process vLLM engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightsync.engines import Engine, EngineFacts, VLLMEngine
from weightsync.engines.vllm.in_engine import checkpoint
from weightsync.errors import AdapterError
from weightsync.testing import check_engine_contract, make_llm, save_checkpoint, tiny_model
from weightsync.wire import format as fmt
from weightsync.wire import scratch


def test_weight_files_follow_the_safetensors_index(tmp_path):
    """A stray shard the index does not list is not what vLLM loads: it must not be expected."""
    from vllm.config import LoadConfig

    folder = save_checkpoint(tiny_model("llama"), tmp_path / "ck")
    (tmp_path / "ck" / "model.safetensors").rename(
        tmp_path / "ck" / "model-00001-of-00001.safetensors"
    )
    names = list(fmt.shapes([str(tmp_path / "ck" / "model-00001-of-00001.safetensors")]))
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")}
    (tmp_path / "ck" / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({"stale.weight": torch.zeros(2)}, str(tmp_path / "ck" / "model-old.safetensors"))
    files = checkpoint.weight_files(folder, LoadConfig())
    assert [os.path.basename(f) for f in files] == ["model-00001-of-00001.safetensors"]
    assert "stale.weight" not in fmt.shapes(files)


def test_an_id_never_downloaded_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="pass checkpoint=<folder"):
        checkpoint.local_folder("some-org/never-downloaded")


def test_scratch_folders_of_dead_processes_are_swept(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)
    (tmp_path / f"weightsync-{pid}-adapter-x").mkdir()
    (tmp_path / f"weightsync-{os.getpid()}-adapter-y").mkdir()
    (tmp_path / "weightsync-unrelated").mkdir()  # no owner pid: not ours to judge
    removed = scratch.sweep(str(tmp_path))
    assert removed == [str(tmp_path / f"weightsync-{pid}-adapter-x")]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"weightsync-{os.getpid()}-adapter-y",
        "weightsync-unrelated",
    ]


def test_scratch_folder_goes_with_its_owner():
    class Owner:
        pass

    owner = Owner()
    folder = scratch.scratch_dir(owner, "test")
    assert folder.is_dir() and folder.name.startswith(f"weightsync-{os.getpid()}-test-")
    del owner
    assert not folder.exists()


# --- the contract a new engine implements (docs/engine-contract.md) ----------------------------


class TorchEngine(Engine):
    """A minimal third-party engine: a transformers causal LM in this process, generating with
    its own forward. It attests nothing (no epoch), so weightsync skips nothing it holds and
    treats every sleep as a possible discard; a level-2 sleep really discards its weights."""

    name = "torch-contract-example"

    def __init__(self, checkpoint: str) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__()
        self.checkpoint = checkpoint
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        shapes = {n: tuple(t.shape) for n, t in self.model.state_dict().items()}
        self._facts = EngineFacts(dtype="float32", weights=shapes, attests=False)

    @property
    def facts(self) -> EngineFacts:
        return self._facts

    @torch.no_grad()
    def load_weights(self, buckets):
        held = self.model.state_dict()
        calls = 0
        for bucket in buckets:
            for name, tensor in bucket:
                held[name].copy_(tensor)
            calls += 1
        return calls

    def check_adapter(self, adapter):
        raise AdapterError("this engine serves no adapter")

    load_adapter = check_adapter

    @torch.no_grad()
    def reload_checkpoint(self, path=None):
        from safetensors.torch import load_file

        folder = Path(path or self.checkpoint)
        for file in sorted(folder.glob("*.safetensors")):
            self.model.load_state_dict(load_file(str(file)), strict=False)
        return 1

    @torch.no_grad()
    def greedy_batch(self, prompts, max_tokens):
        out = []
        for prompt in prompts:
            ids, tokens, logprobs = list(prompt), [], []
            for _ in range(max_tokens):
                logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                token = int(logits.argmax())
                logprobs.append(float(torch.log_softmax(logits, -1)[token]))
                tokens.append(token)
                ids.append(token)
            out.append((tokens, logprobs))
        return out

    @torch.no_grad()
    def score_batch(self, prompts, top_k):
        out = []
        for prompt in prompts:
            logits = self.model(input_ids=torch.tensor([prompt])).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            positions = []
            for i in range(1, len(prompt)):
                keep = {*lp[i - 1].topk(top_k).indices.tolist(), prompt[i]}
                positions.append({t: float(lp[i - 1, t]) for t in keep})
            out.append(positions)
        return out

    @torch.no_grad()
    def _engine_sleep(self, level):
        if level == 2:  # what a level-2 sleep does on a GPU: the weights are gone
            for p in self.model.parameters():
                p.normal_()

    def _engine_wake(self, tags):
        pass


def test_a_minimal_third_party_engine_passes_the_contract(tmp_path):
    checkpoint = save_checkpoint(tiny_model("llama", seed=1), tmp_path / "ck")
    check_engine_contract(TorchEngine(checkpoint), tiny_model("llama", seed=1))


def test_an_engine_that_breaks_the_promise_fails_the_contract(tmp_path):
    """The contract check can fail: an engine whose writes are lost (a load that returns
    without loading) is caught at the first sync."""

    class Forgetful(TorchEngine):
        def load_weights(self, buckets):
            return sum(1 for _ in buckets)

    checkpoint = save_checkpoint(tiny_model("llama", seed=1), tmp_path / "ck")
    with pytest.raises(AssertionError, match="not serving the trainer's weights"):
        check_engine_contract(Forgetful(checkpoint), tiny_model("llama", seed=1))


def test_vllm_passes_the_contract(tmp_path):
    checkpoint = save_checkpoint(tiny_model("llama", seed=1), tmp_path / "ck")
    engine = VLLMEngine(make_llm(checkpoint))
    try:
        check_engine_contract(engine, tiny_model("llama", seed=1))
    finally:
        del engine
