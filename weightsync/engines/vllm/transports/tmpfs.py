"""Buckets as safetensors files in a RAM folder the workers map and load (``wire.files``): the
default transport where the trainer and the engine share a host."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .... import timing
from ....plan import Bucket
from ....wire.files import KeptFiles, Written, write_folder
from ....wire.scratch import private_dir, scratch_dir
from ....wire.tags import Signer
from .base import Rpc, Staged, StagedCalls, Transport, proof_args, signer_for


def _serializing() -> Any:
    return timing.span("serialize")


#: The workers' check and load of a sync's files.
LOAD = "weightsync_load_files"


class TmpfsTransport(Transport):
    """Buckets as safetensors files in a RAM folder the workers can read (``wire.files``).

    Args:
        root: a folder the engine's workers can read at the same path; defaults to a fresh
            scratch folder in ``/dev/shm``, removed by `close` (or when collected, or by the
            next weightsync process after a crash).
        keep: keep the files (and both sides' mappings of them) between syncs and rewrite them
            in place: RAM for one copy of the weights stays taken between syncs, and a sync
            costs about half (``docs/benchmarks.md``). False writes a fresh folder per sync and
            removes it after.
        tagged: tag every file (``wire.tags``); the workers check them all before loading any.

    Raises:
        PermissionError: ``root`` lets others than its owner in (``wire.scratch``).
    """

    name = "tmpfs"
    stages = True

    def __init__(
        self, root: str | Path | None = None, *, keep: bool = True, tagged: bool = True
    ) -> None:
        self._owned = root is None
        self.root = private_dir(root) if root is not None else scratch_dir(self, "tmpfs")
        self.tagged = tagged
        self._updates = 0
        self._kept = KeptFiles(self.root / "kept") if keep else None

    def send(self, rpc: Rpc, buckets: Iterable[Bucket]) -> None:
        staged = self.prepare(rpc, buckets)
        try:
            staged.apply()
        finally:
            staged.drop()

    def prepare(self, rpc: Rpc, buckets: Iterable[Bucket]) -> Staged:
        """Write (and tag) every bucket's file now, while the engine serves; the apply is one
        call, the workers' check of every tag and their load of the files. A trainer that
        fails or dies while writing leaves the engine untouched and never paused (its files
        are swept with its scratch folder); a failure while writing kept files removes them
        (they hold part of a sync nobody will load), as does the stage's `Staged.discard`."""
        signer = signer_for(self.tagged)
        if self._kept is not None:
            try:
                written = self._kept.write(buckets, around=_serializing, signer=signer)
            except BaseException:
                self._discard_kept()  # part of a sync nobody will load: nothing of it stays
                raise
            kwargs = {"folder": str(self._kept.folder), "files": written.names}
            load = kwargs | proof_args(signer, written.tags)
            return StagedCalls(rpc, [(LOAD, load)], discard=self._discard_kept)
        folder, written = self.stage(buckets, signer=signer)
        fresh = {"folder": str(folder)} | proof_args(signer, written.tags)
        return StagedCalls(rpc, [(LOAD, fresh)], lambda: shutil.rmtree(folder, ignore_errors=True))

    def stage(
        self, buckets: Iterable[Bucket], *, aliases: bool = True, signer: Signer | None = None
    ) -> tuple[Path, Written]:
        """Write every bucket to a new folder under `root` (tagged by ``signer`` if given) and
        return it; the caller removes it. Nothing reaches the engine here, so a failure (the
        trainer's, a full tmpfs) leaves it untouched, and removes the folder. ``aliases``: see ``wire.format``."""
        self._updates += 1
        folder = self.root / f"update-{self._updates:06d}"
        try:
            written = write_folder(
                buckets, folder, aliases=aliases, around=_serializing, signer=signer
            )
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)  # part of a sync nobody will load
            raise
        return folder, written

    def _discard_kept(self) -> None:
        """Remove the kept files (the next sync writes them anew)."""
        if self._kept is not None:
            self._kept.close()
            shutil.rmtree(self._kept.folder, ignore_errors=True)

    def close(self) -> None:
        if self._kept is not None:
            self._kept.close()
            shutil.rmtree(self._kept.folder, ignore_errors=True)
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)
