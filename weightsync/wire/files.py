"""Buckets as safetensors files in memory both sides map: the trainer's half writes, the
worker's half reads.

Three ways, chosen by the trainer's transport:

- sealed kept files (`KeptFiles` without a folder, the default): memory files (``memfd``) the
  trainer creates, maps writable, then seals (`SEALS`) before a byte is written: from then on no
  process can open them for writing, map them writable or resize them, so the trainer's own
  mapping is their only writer. The workers open them as ``/proc/<trainer pid>/fd/<n>``,
  refuse any file not so sealed, and check every tag while the engine serves: nobody else can
  change what was checked before the commit loads it. Nothing of them is in any folder, so
  nothing is left behind when the trainer dies (the kernel frees a file with its last user).
- kept files in a RAM folder (`KeptFiles` with a folder; `MappedFiles`), for workers that
  cannot open the trainer's files (another PID namespace): any process of the same user can
  rewrite these, so the workers check their tags inside the commit, just before loading.
- a folder per sync (`write_folder`): every bucket a fresh file, removed after the load (vLLM's
  own loaders read these).

Kept files stay between syncs, both sides keep them mapped, and a bucket whose layout is the
previous sync's at the same index is copied into the same mapped file. Writing a fresh file
allocates and zeroes every page and reading it maps every page again, which is most of what a
fresh file costs over an in-process load (docs/benchmarks.md); a kept file costs one copy on
each side. A kept file is never shrunk in place: a file of another layout is made beside it
and replaces it, so a worker still mapping the old one never reads past its end (SIGBUS), and
the old pages live until the worker drops its mapping.

Given a `Signer`, the writer tags each file's bytes as written (``wire.tags``); the reader,
given the key and the tags, checks every file before it yields the first tensor, so a file
rewritten by someone else refuses the whole sync with nothing loaded. Folders are the owner's
only (``wire.scratch``).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import BytesRejectedError
from . import format as fmt
from .scratch import owner_only, private_dir
from .tags import Signer, check

#: Linux's ``F_SEAL_FUTURE_WRITE`` (5.1; not in Python's ``fcntl``): no new writable mapping
#: and no write, while mappings made before the seal keep writing.
F_SEAL_FUTURE_WRITE = 0x0010

#: The seals on a sealed kept file: its size fixed, no writer but the mappings made before the
#: seal (the trainer's own, made right after the file), the seals themselves fixed.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL


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
    """The trainer's half of kept bucket files (see the module docstring): sealed memory files,
    or files in ``folder``.

    Raises:
        PermissionError: ``folder`` exists and others than its owner may enter it.
    """

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder
        #: bucket name -> (header, the writable mapping, the memory file's fd or -1)
        self._maps: dict[str, tuple[bytes, mmap.mmap, int]] = {}

    def write(
        self,
        buckets: Iterable[fmt.Pairs],
        *,
        around: Around = nullcontext,
        signer: Signer | None = None,
    ) -> Written:
        """Write the buckets (tagged by ``signer`` if given); files of a longer earlier sync
        go. The names returned are what the workers open: file names in `folder`, or the
        ``/proc`` paths of sealed files."""
        if self.folder is not None:
            private_dir(self.folder)
        written = Written([])
        names = []
        for i, bucket in enumerate(buckets):
            names.append(bucket_name(i))
            with around():
                mapped = self._copy_in(names[-1], bucket)
                if signer is not None:
                    # A pass of its own: GMAC runs at ~20 GB/s, cache-hot or not, so tagging
                    # each tensor as it is copied measured no faster (docs/security.md).
                    written.tags.append(signer.sign(mapped))
            fd = self._maps[names[-1]][2]
            written.names.append(names[-1] if fd < 0 else f"/proc/{os.getpid()}/fd/{fd}")
        for stale in set(self._maps) - set(names):
            self._release(stale)
            if self.folder is not None:
                (self.folder / stale).unlink(missing_ok=True)
        return written

    def _copy_in(self, name: str, bucket: fmt.Pairs) -> mmap.mmap:
        """Copy ``bucket`` into the kept file ``name``, replacing the file if its layout
        changed; the file's mapping. The header is written again every time, like the data:
        the tag taken after covers the whole file as this trainer produced it, not a header
        someone rewrote in a kept file since the last sync."""
        header, places = fmt.layout(bucket)
        kept = self._maps.get(name)
        if kept is not None and kept[0] == header:
            kept[1][: len(header)] = header
        else:
            total = fmt.size(header, places)
            mapped, fd = self._new_file(name, total)
            mapped[: len(header)] = header
            if kept is not None:
                self._release(name)
            kept = self._maps[name] = (header, mapped, fd)
        fmt.copy_into(np.frombuffer(kept[1], dtype=np.uint8)[len(header) :], places)
        return kept[1]

    def _new_file(self, name: str, total: int) -> tuple[mmap.mmap, int]:
        """A new file of ``total`` bytes, mapped writable: sealed (`SEALS`) once mapped, or
        written beside the old one in `folder` and renamed over it (the fd then -1)."""
        if self.folder is None:
            fd = os.memfd_create(f"weightsync-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, total)
                mapped = mmap.mmap(fd, total)
                mapped.madvise(mmap.MADV_DONTFORK)  # a forked child is no second writer
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            except BaseException:
                os.close(fd)
                raise
            return mapped, fd
        tmp = self.folder / (name + ".new")
        with open(tmp, "w+b", opener=owner_only) as f:
            f.truncate(total)
            mapped = mmap.mmap(f.fileno(), total)
        os.replace(tmp, self.folder / name)
        return mapped, -1

    def _release(self, name: str) -> None:
        _, mapped, fd = self._maps.pop(name)
        mapped.close()
        if fd >= 0:
            os.close(fd)

    def close(self) -> None:
        """Unmap the files and close the sealed ones (the caller removes a folder)."""
        for name in list(self._maps):
            self._release(name)


class MappedFiles:
    """The worker's half: each kept file stays mapped between syncs and its tensors are views
    into the mapping. A file is mapped again when the trainer replaced it (another inode or
    size)."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[tuple[int, int, int], Any]] = {}

    def read(
        self,
        folder: str,
        files: list[str],
        key: str = "",
        tags: list[str] | None = None,
        *,
        sealed: bool = False,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor view) of every tensor of ``files`` (in ``folder``), aliases included.
        With ``key``, every file is checked against its tag now, before this returns.
        ``sealed``: ``files`` are paths of sealed memory files (`SEALS`), refused unless so.

        Raises:
            BytesRejectedError: see `check_files`; or, ``sealed``, a file that is not.
        """
        paths = [os.path.join(folder, f) for f in files]
        for gone in set(self._maps) - set(paths):
            del self._maps[gone]  # its views are gone with the last reload; unmapped when freed
        mapped = partial(self._mapped, sealed=sealed)
        if key:
            _check_all(files, paths, key, tags or [], mapped)
        elif sealed:
            for path in paths:
                mapped(path)
        return (pair for path in paths for pair in fmt.views(mapped(path)))

    def forget(self) -> None:
        """Drop every mapping (each unmapped once its views are gone)."""
        self._maps.clear()

    def _mapped(self, path: str, sealed: bool = False) -> Any:
        st = os.stat(path)
        key = (st.st_dev, st.st_ino, st.st_size)
        entry = self._maps.get(path)
        if entry is None or entry[0] != key:
            if sealed:
                with open(path, "rb") as f:
                    try:
                        seals = fcntl.fcntl(f.fileno(), fcntl.F_GET_SEALS)
                    except OSError:  # a file system without seals
                        seals = 0
                    if seals & SEALS != SEALS:
                        raise BytesRejectedError(
                            f"bucket file {path} is not sealed against writers (seals "
                            f"{seals:#x}, {SEALS:#x} needed): nothing was loaded"
                        )
                    # private: never a writer; views need a writable buffer, and the
                    # trainer's writes to pages never written here stay visible
                    entry = (key, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
            else:
                with open(path, "r+b") as f:  # shared and writable: torch.frombuffer needs both
                    entry = (key, mmap.mmap(f.fileno(), 0))
            self._maps[path] = entry
        return entry[1]
