"""Buckets as safetensors files in a RAM folder both sides see: the trainer's half writes, the
worker's half reads.

Two ways, chosen by the trainer's transport:

- a folder per sync (`write_folder`): every bucket a fresh file, removed after the load;
- kept files (`KeptFiles`, `MappedFiles`): the files stay between syncs, both sides keep them
  mapped, and a bucket whose layout is the previous sync's at the same index is copied into the
  same mapped file. Writing a fresh tmpfs file allocates and zeroes every page and reading it
  maps every page again, which is most of what a fresh file costs over an in-process load
  (docs/benchmarks.md); a kept file costs one copy on each side.

A kept file is never shrunk in place: a file of another layout is written beside it and renamed
over it, so a worker still mapping the old one never reads past its end (SIGBUS), and the old
pages live until the worker drops its mapping.

Given a `Signer`, the writer tags each file's bytes as written (``wire.tags``); the reader,
given the key and the tags, checks every file before it yields the first tensor, so a file
rewritten by someone else refuses the whole sync with nothing loaded. Folders are the owner's
only (``wire.scratch``).
"""

from __future__ import annotations

import mmap
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import BytesRejectedError
from . import format as fmt
from .scratch import owner_only, private_dir
from .tags import Signer, check


def bucket_name(index: int) -> str:
    """The file name of the ``index``-th bucket of a sync."""
    return f"bucket-{index:05d}.safetensors"


#: Wraps each bucket's write (the trainer side times them: ``weightsync.timing``).
Around = Callable[[], AbstractContextManager]


@dataclass
class Written:
    """The files of one sync, in load order, and their tags (empty: written without a signer)."""

    names: list[str]
    tags: list[str] = field(default_factory=list)


def sign_file(signer: Signer, path: Path) -> str:
    """``signer``'s tag of the file at ``path`` (read through a read-only mapping)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return signer.sign(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return signer.sign(mapped)


def write_folder(
    buckets: Iterable[fmt.Pairs],
    folder: Path,
    *,
    aliases: bool = True,
    around: Around = nullcontext,
    signer: Signer | None = None,
) -> Written:
    """Write every bucket as a new file in the new folder ``folder`` (owner-only), tagged by
    ``signer`` if given. The folder is removed if writing fails (a trainer-side failure touches
    nothing else)."""
    folder.mkdir(mode=0o700, parents=True)
    written = Written([])
    try:
        for i, bucket in enumerate(buckets):
            written.names.append(bucket_name(i))
            with around():
                fmt.write(bucket, folder / written.names[-1], aliases=aliases)
                if signer is not None:
                    written.tags.append(sign_file(signer, folder / written.names[-1]))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return written


def check_files(folder: str, files: list[str], key: str, tags: list[str]) -> None:
    """Check each of ``files`` (in ``folder``) against its tag before anything reads them.

    Raises:
        BytesRejectedError: a file differs from what the trainer wrote, or the tags do not
            match the files one to one.
    """
    _check_all(files, [os.path.join(folder, f) for f in files], key, tags, _read_only)


def _read_only(path: str) -> Any:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _check_all(
    files: list[str], paths: list[str], key: str, tags: list[str], mapped: Callable[[str], Any]
) -> None:
    if len(tags) != len(files):
        raise BytesRejectedError(
            f"{len(files)} bucket files came with {len(tags)} tags: nothing was loaded"
        )
    for name, path, tag in zip(files, paths, tags, strict=True):
        check(key, tag, f"bucket file {name}", mapped(path))


class KeptFiles:
    """The trainer's half of kept bucket files in ``folder`` (see the module docstring).

    Raises:
        PermissionError: ``folder`` exists and others than its owner may enter it.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._maps: dict[str, tuple[bytes, mmap.mmap]] = {}

    def write(
        self,
        buckets: Iterable[fmt.Pairs],
        *,
        around: Around = nullcontext,
        signer: Signer | None = None,
    ) -> Written:
        """Write the buckets (tagged by ``signer`` if given); files of a longer earlier sync
        go."""
        private_dir(self.folder)
        written = Written([])
        for i, bucket in enumerate(buckets):
            written.names.append(bucket_name(i))
            with around():
                mapped = self._copy_in(written.names[-1], bucket)
                if signer is not None:
                    # A pass of its own: GMAC runs at ~20 GB/s, cache-hot or not, so tagging
                    # each tensor as it is copied measured no faster (docs/security.md).
                    written.tags.append(signer.sign(mapped))
        for stale in set(self._maps) - set(written.names):
            self._maps.pop(stale)[1].close()
            (self.folder / stale).unlink(missing_ok=True)
        return written

    def _copy_in(self, name: str, bucket: fmt.Pairs) -> mmap.mmap:
        """Copy ``bucket`` into the kept file ``name``, replacing the file if its layout
        changed; the file's mapping. The header is written again every time, like the data:
        the tag taken after covers the whole file as this trainer produced it, not a header
        someone rewrote in the kept file since the last sync."""
        header, places = fmt.layout(bucket)
        kept = self._maps.get(name)
        if kept is not None and kept[0] == header:
            kept[1][: len(header)] = header
        else:
            total = fmt.size(header, places)
            tmp = self.folder / (name + ".new")
            with open(tmp, "w+b", opener=owner_only) as f:
                f.truncate(total)
                mapped = mmap.mmap(f.fileno(), total)
            mapped[: len(header)] = header
            os.replace(tmp, self.folder / name)
            if kept is not None:
                kept[1].close()
            kept = self._maps[name] = (header, mapped)
        fmt.copy_into(np.frombuffer(kept[1], dtype=np.uint8)[len(header) :], places)
        return kept[1]

    def close(self) -> None:
        """Unmap the files (the caller removes the folder)."""
        for _, mapped in self._maps.values():
            mapped.close()
        self._maps.clear()


class MappedFiles:
    """The worker's half: each kept file stays mapped between syncs and its tensors are views
    into the mapping. A file is mapped again when the trainer replaced it (another inode or
    size)."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[tuple[int, int], Any]] = {}

    def read(
        self, folder: str, files: list[str], key: str = "", tags: list[str] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor view) of every tensor of ``files`` (in ``folder``), aliases included.
        With ``key``, every file is checked against its tag now, before this returns.

        Raises:
            BytesRejectedError: see `check_files`.
        """
        paths = [os.path.join(folder, f) for f in files]
        for gone in set(self._maps) - set(paths):
            del self._maps[gone]  # its views are gone with the last reload; unmapped when freed
        if key:
            _check_all(files, paths, key, tags or [], self._mapped)
        return (pair for path in paths for pair in fmt.views(self._mapped(path)))

    def _mapped(self, path: str) -> Any:
        st = os.stat(path)
        key = (st.st_ino, st.st_size)
        entry = self._maps.get(path)
        if entry is None or entry[0] != key:
            with open(path, "r+b") as f:  # shared and writable: torch.frombuffer needs both
                entry = (key, mmap.mmap(f.fileno(), 0))
            self._maps[path] = entry
        return entry[1]
