"""The tmpfs transport's kept files, both halves, without vLLM: the trainer's `KeptFiles` and
the worker's `MappedFiles` (the real servers read them in ``test_server_vllm.py``)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from weightsync.engines import TmpfsTransport
from weightsync.wire import format as fmt
from weightsync.wire.files import KeptFiles, MappedFiles


def buckets(seed: int, width: int = 5):
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(10, 4, generator=gen)
    return [
        [  # a tied pair (stored once), a bf16 tensor, a 0-dim one
            ("model.embed_tokens.weight", embed),
            ("lm_head.weight", embed),
            ("model.norm.weight", torch.randn(width, generator=gen).bfloat16()),
            ("step", torch.tensor(seed)),
        ],
        [("model.layers.0.mlp.down_proj.weight", torch.randn(width, 3, generator=gen))],
    ]


@pytest.fixture
def kept(tmp_path):
    files = KeptFiles(tmp_path / "kept")
    yield files
    files.close()


def flat(bs):
    return {name: t for b in bs for name, t in b}


def test_round_trip_and_any_reader(kept):
    """What the worker reads is what was written, tied names included; the files are plain
    safetensors (any reader opens them; the tied tensor is stored once)."""
    sent = buckets(0)
    names = kept.write(sent).names
    got = dict(MappedFiles().read(str(kept.folder), names))
    assert got.keys() == flat(sent).keys()
    for name, tensor in flat(sent).items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert got["lm_head.weight"].data_ptr() == got["model.embed_tokens.weight"].data_ptr()
    stored = load_file(kept.folder / names[0])
    assert set(stored) == {"model.embed_tokens.weight", "model.norm.weight", "step"}
    assert dict(fmt.read(kept.folder / n for n in names)).keys() == got.keys()


def test_same_layout_is_rewritten_in_place_and_seen_through_the_mapping(kept):
    """A second sync with the same layout writes into the same files (same inodes): the
    worker's views, mapped once, show the new values without being read again."""
    names = kept.write(buckets(0)).names
    inodes = [os.stat(kept.folder / n).st_ino for n in names]
    worker = MappedFiles()
    views = dict(worker.read(str(kept.folder), names))
    new = flat(buckets(1))
    assert not torch.equal(views["lm_head.weight"], new["lm_head.weight"])
    assert kept.write(buckets(1)).names == names
    assert [os.stat(kept.folder / n).st_ino for n in names] == inodes
    for name, tensor in new.items():
        assert torch.equal(views[name], tensor), name
    again = dict(worker.read(str(kept.folder), names))
    assert again["lm_head.weight"].data_ptr() == views["lm_head.weight"].data_ptr()  # kept map


def test_a_new_layout_replaces_the_file_and_old_views_stay_readable(kept):
    """Another layout gets a new file (never a shrunk one: a worker's old mapping would fault
    past its end); the worker maps the new file, its old views keep their bytes; files of a
    longer previous sync are removed."""
    old = flat(buckets(0))
    names = kept.write(buckets(0)).names
    worker = MappedFiles()
    views = dict(worker.read(str(kept.folder), names))
    first_inode = os.stat(kept.folder / names[0]).st_ino
    shorter = [buckets(2, width=3)[0]]  # other shapes, one bucket
    assert kept.write(shorter).names == names[:1]
    assert sorted(os.listdir(kept.folder)) == names[:1]
    assert os.stat(kept.folder / names[0]).st_ino != first_inode
    got = dict(worker.read(str(kept.folder), names[:1]))
    for name, tensor in flat(shorter).items():
        assert torch.equal(got[name], tensor), name
    assert torch.equal(views["model.norm.weight"], old["model.norm.weight"])


def test_a_dtype_outside_the_table_is_refused(kept):
    with pytest.raises(TypeError, match="complex64"):
        kept.write([[("x", torch.zeros(2, dtype=torch.complex64))]])


def test_transport_folders_are_removed_on_close(tmp_path):
    """``keep`` writes under ``root/kept``; close removes what the transport made, also in a
    root the caller owns."""
    owned = TmpfsTransport()
    owned._kept.write(buckets(0))  # type: ignore[union-attr]
    root = owned.root
    owned.close()
    assert not root.exists()
    given = TmpfsTransport(tmp_path / "given")
    given._kept.write(buckets(0))  # type: ignore[union-attr]
    given.close()
    assert list((tmp_path / "given").iterdir()) == []


def test_mixed_dtypes_with_odd_sizes_are_viewed_in_place(kept):
    """Widest elements first: a 3-element bf16 tensor before a float32 one would leave the
    float32 bytes at an odd offset, which a reader could not view without copying."""
    sent = [
        ("a.bias", torch.randn(3).bfloat16()),
        ("b.weight", torch.randn(5, 3)),
        ("c.mask", torch.tensor([True, False, True])),
        ("d.idx", torch.arange(7)),
    ]
    got = dict(MappedFiles().read(str(kept.folder), kept.write([sent]).names))
    for name, tensor in sent:
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
