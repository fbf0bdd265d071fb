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
"""

from __future__ import annotations

import mmap
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import format as fmt


def bucket_name(index: int) -> str:
    """The file name of the ``index``-th bucket of a sync."""
    return f"bucket-{index:05d}.safetensors"


#: Wraps each bucket's write (the trainer side times them: ``weightsync.timing``).
Around = Callable[[], AbstractContextManager]


def write_folder(
    buckets: Iterable[fmt.Pairs],
    folder: Path,
    *,
    aliases: bool = True,
    around: Around = nullcontext,
) -> list[str]:
    """Write every bucket as a new file in the new folder ``folder``; their names, in order.
    The folder is removed if writing fails (a trainer-side failure touches nothing else)."""
    folder.mkdir(parents=True)
    names = []
    try:
        for i, bucket in enumerate(buckets):
            names.append(bucket_name(i))
            with around():
                fmt.write(bucket, folder / names[-1], aliases=aliases)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return names


class KeptFiles:
    """The trainer's half of kept bucket files in ``folder`` (see the module docstring)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._maps: dict[str, tuple[bytes, mmap.mmap]] = {}

    def write(self, buckets: Iterable[fmt.Pairs], *, around: Around = nullcontext) -> list[str]:
        """Write the buckets and return their file names; files of a longer earlier sync go."""
        self.folder.mkdir(parents=True, exist_ok=True)
        names = []
        for i, bucket in enumerate(buckets):
            names.append(bucket_name(i))
            with around():
                self._copy_in(names[-1], bucket)
        for stale in set(self._maps) - set(names):
            self._maps.pop(stale)[1].close()
            (self.folder / stale).unlink(missing_ok=True)
        return names

    def _copy_in(self, name: str, bucket: fmt.Pairs) -> None:
        """Copy ``bucket`` into the kept file ``name``, replacing the file if its layout
        changed."""
        header, places = fmt.layout(bucket)
        kept = self._maps.get(name)
        if kept is None or kept[0] != header:
            total = fmt.size(header, places)
            tmp = self.folder / (name + ".new")
            with open(tmp, "w+b") as f:
                f.truncate(total)
                mapped = mmap.mmap(f.fileno(), total)
            mapped[: len(header)] = header
            os.replace(tmp, self.folder / name)
            if kept is not None:
                kept[1].close()
            kept = self._maps[name] = (header, mapped)
        fmt.copy_into(np.frombuffer(kept[1], dtype=np.uint8)[len(header) :], places)

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

    def read(self, folder: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor view) of every tensor of ``files`` (in ``folder``), aliases included."""
        paths = [os.path.join(folder, f) for f in files]
        for gone in set(self._maps) - set(paths):
            del self._maps[gone]  # its views are gone with the last reload; unmapped when freed
        for path in paths:
            st = os.stat(path)
            key = (st.st_ino, st.st_size)
            entry = self._maps.get(path)
            if entry is None or entry[0] != key:
                with open(path, "r+b") as f:  # shared and writable: torch.frombuffer needs both
                    entry = (key, mmap.mmap(f.fileno(), 0))
                self._maps[path] = entry
            yield from fmt.views(entry[1])
