"""The tmpfs transport's kept files, both halves, without vLLM: the trainer's `KeptFiles` and
the worker's `MappedFiles` (the real servers read them in ``test_server_vllm.py``), in a folder
and sealed."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from weightsync.engines import TmpfsTransport
from weightsync.errors import BytesRejectedError
from weightsync.wire import format as fmt
from weightsync.wire.files import SEALS, KeptFiles, MappedFiles, bucket_name
from weightsync.wire.tags import Signer


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


@pytest.fixture
def sealed():
    files = KeptFiles()
    yield files
    files.close()


def test_sealed_files_round_trip_in_place_and_are_in_no_folder(sealed):
    """Sealed kept files: read through the ``/proc`` paths the workers open, every tensor as
    written; the same layout is rewritten in place (the worker's views show it without
    mapping again); the trainer's files are its open descriptors, in no folder."""
    names = sealed.write(buckets(0)).names
    assert names == [f"/proc/{os.getpid()}/fd/{fd}" for _, _, fd in sealed._maps.values()]
    assert all(fcntl.fcntl(fd, fcntl.F_GET_SEALS) == SEALS for _, _, fd in sealed._maps.values())
    worker = MappedFiles()
    views = dict(worker.read("", names, sealed=True))
    for name, tensor in flat(buckets(0)).items():
        assert torch.equal(views[name], tensor), name
    assert sealed.write(buckets(1)).names == names
    for name, tensor in flat(buckets(1)).items():
        assert torch.equal(views[name], tensor), name
    shorter = sealed.write([buckets(2, width=3)[0]]).names
    assert len(shorter) == 1 and sorted(sealed._maps) == [bucket_name(0)]
    got = dict(worker.read("", shorter, sealed=True))
    assert torch.equal(got["model.norm.weight"], flat(buckets(2, width=3))["model.norm.weight"])


OTHER_PROCESS = """
import mmap, os, sys
for what, attempt in [
    ("write", lambda f: (f.write(b"x"), f.flush())),
    ("map", lambda f: mmap.mmap(f.fileno(), 0)),
    ("resize", lambda f: os.ftruncate(f.fileno(), 1)),
]:
    try:
        with open(sys.argv[1], "r+b") as f:
            attempt(f)
        print(what, "done")
    except OSError as e:
        print(what, e.strerror)
"""


def test_no_other_process_writes_a_sealed_file_and_the_trainers_change_is_caught(sealed):
    """Another process of the same user, with the path the workers open, can neither write,
    map writable nor resize a sealed file. The trainer's own mapping still writes (the next
    sync's bytes): a change made through it after the tag -- what a writer that mapped the
    file before its seal could do -- fails the workers' check, before any tensor is read."""
    signer = Signer()
    written = sealed.write(buckets(0), signer=signer)
    said = subprocess.run(
        [sys.executable, "-c", OTHER_PROCESS, written.names[0]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    assert said[:3] == [
        "write Operation not permitted",
        "map Operation not permitted",
        "resize Operation not permitted",
    ]
    sealed._maps[bucket_name(1)][1][-1] ^= 0x55
    with pytest.raises(BytesRejectedError, match=f"bucket file {written.names[1]}"):
        MappedFiles().read("", written.names, signer.key_hex, written.tags, sealed=True)


READER = """
import sys
from weightsync.wire.files import MappedFiles
try:
    MappedFiles().read("", [sys.argv[1]], sys.argv[2], [sys.argv[3]], sealed=True)
    print("read")
except Exception as e:
    print(type(e).__name__, e)
"""


def test_a_reader_in_another_pid_namespace_cannot_open_the_sealed_files(sealed):
    """What `TmpfsTransport.connect`'s probe meets when the engine runs in a PID namespace of
    its own (a container): the ``/proc`` path the trainer names is no process there (or,
    with small PIDs on both sides, another one, whose file fails the probe's tag), so the
    transport goes to files in a folder. The same reader in the trainer's namespace reads it."""
    signer = Signer()
    written = sealed.write(buckets(0), signer=signer)
    reader = [sys.executable, "-c", READER, written.names[0], signer.key_hex, written.tags[0]]
    here = subprocess.run(reader, capture_output=True, text=True, check=True, timeout=120)
    assert here.stdout.strip() == "read"
    own = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", *reader]
    try:
        there = subprocess.run(own, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        pytest.skip("no unshare(1) on this machine")
    if there.returncode != 0 and "unshare failed" in there.stderr:
        pytest.skip(f"this user cannot create a PID namespace: {there.stderr.strip()}")
    assert there.returncode == 0, there.stderr
    assert there.stdout.startswith("FileNotFoundError"), there.stdout


def test_a_file_that_is_not_sealed_is_refused_as_sealed(kept):
    """A reader told the files are sealed refuses one that is not: whoever can write it could
    change it between the workers' check and the commit."""
    names = kept.write(buckets(0)).names
    with pytest.raises(BytesRejectedError, match="not sealed against writers"):
        MappedFiles().read(str(kept.folder), names, sealed=True)
