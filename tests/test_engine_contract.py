"""What an engine adapter takes as the engine's contract, without starting an engine: the files
vLLM's own loader reads (not a glob), hub ids resolved locally, scratch folders never left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import save_file

from weightsync.engines.vllm.in_engine import checkpoint
from weightsync.testing import save_checkpoint, tiny_model
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
    import torch

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
