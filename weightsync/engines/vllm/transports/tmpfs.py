"""Buckets as sealed memory files the workers map, check while the engine serves, and load in
the commit (``wire.files``): the default transport where the trainer and the engine share a
host. Where the workers cannot open the trainer's files (another PID namespace), files in a RAM
folder instead, checked inside the commit."""

from __future__ import annotations

import logging
import secrets
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from .... import timing
from ....plan import Bucket
from ....wire.files import KeptFiles, Written, write_folder
from ....wire.protocol import raise_failures
from ....wire.scratch import private_dir, scratch_dir
from ....wire.tags import Signer
from .base import Rpc, Staged, StagedCalls, Transport, proof_args, signer_for

logger = logging.getLogger(__name__)


def _serializing() -> Any:
    return timing.span("serialize")


#: The workers' check and load of a sync's files in a folder, inside the commit.
LOAD = "weightsync_load_files"
#: The workers' stage of sealed files (checked while the engine serves) and its commit.
STAGE, COMMIT = "weightsync_stage_files", "weightsync_commit_staged"


class TmpfsTransport(Transport):
    """Buckets as files in memory the engine's workers map (``wire.files``).

    By default sealed memory files, which the workers check while the engine serves (the
    commit only loads them). `connect` asks the workers to open one first; a worker that
    cannot (another PID namespace) puts the transport on files in ``root`` for good, checked
    inside the commit, with a warning. Naming ``root`` asks for files there from the start.

    Args:
        root: a folder the engine's workers can read at the same path; defaults to a fresh
            scratch folder in ``/dev/shm``, removed by `close` (or when collected, or by the
            next weightsync process after a crash).
        keep: keep the files (and both sides' mappings of them) between syncs and rewrite them
            in place: RAM for one copy of the weights stays taken between syncs, and a sync
            costs about half (``docs/benchmarks.md``). False writes fresh files per sync and
            lets them go after.
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
        self.keep = keep
        #: sealed memory files (else files in `root`)
        self.sealed = root is None
        self._updates = 0
        self._kept = KeptFiles(None if self.sealed else self.root / "kept") if keep else None
        self._staged = False  # a stage of sealed files not yet committed, dropped or discarded

    def connect(self, rpc: Rpc, world_size: int) -> None:
        """Check that every worker can open this process's sealed files; if one cannot, use
        files in `root` from now on (warned). The probe is tagged: a worker in another PID
        namespace may find another process under this one's PID, and must not take its file
        for the probe."""
        if not self.sealed:
            return
        probe, signer = KeptFiles(), Signer()
        try:
            written = probe.write([[("probe", torch.zeros(1))]], signer=signer)
            rpc(
                "weightsync_open_sealed",
                {"files": written.names} | proof_args(signer, written.tags),
            )
        except Exception as e:  # noqa: BLE001 (the folder works wherever the workers see it)
            logger.warning(
                "weightsync: the engine's workers cannot open this process's sealed files "
                "(%s); bucket files go through %s instead, checked inside the commit",
                e,
                self.root,
            )
            self.sealed = False
            if self._kept is not None:
                self._kept = KeptFiles(self.root / "kept")
        finally:
            probe.close()

    def send(self, rpc: Rpc, buckets: Iterable[Bucket]) -> None:
        staged = self.prepare(rpc, buckets)
        try:
            staged.apply()
        finally:
            staged.drop()

    def prepare(self, rpc: Rpc, buckets: Iterable[Bucket]) -> Staged:
        """Sealed files: see `_prepare_sealed`. Files in a folder: write (and tag) every
        bucket's file now, while the engine serves; the apply is one call, the workers' check
        of every tag and their load of the files. A trainer that fails or dies while writing
        leaves the engine untouched and never paused (its files are swept with its scratch
        folder); a failure while writing kept files removes them (they hold part of a sync
        nobody will load), as does the stage's `Staged.discard`."""
        signer = signer_for(self.tagged)
        if self.sealed:
            return self._prepare_sealed(rpc, buckets, signer)
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

    def _prepare_sealed(self, rpc: Rpc, buckets: Iterable[Bucket], signer: Signer | None) -> Staged:
        """Write (and tag) every bucket's sealed file, then have every worker stage them
        (``weightsync_stage_files``: mapped, every tag and name checked) while the engine
        serves; the apply is the workers' commit of what they staged. Any failure here leaves
        the engine untouched and never paused. Files that were written but not committed are
        let go (a failed write's, a refused stage's, a discarded one's): the next sync writes
        fresh ones. The kept files are rewritten only once the previous stage was committed,
        dropped or discarded: the trainer's mapping is their one writer, and a stage must not
        change under its check."""
        if self._staged:
            raise RuntimeError(
                "TmpfsTransport: the previous stage was neither applied, dropped nor "
                "discarded; its files cannot be rewritten under it"
            )
        files = self._kept if self._kept is not None else KeptFiles()
        committed: list[bool] = []
        stage = {"stage": secrets.token_hex(8)}  # named by its commit and drop: `_other_stage`

        def release() -> None:
            files.close()
            if files is self._kept:
                self._kept = KeptFiles()

        def drop() -> None:  # always called, applied or not
            self._staged = False
            if not committed:
                try:
                    rpc("weightsync_drop_staged", stage)
                except Exception:
                    logger.warning("weightsync: weightsync_drop_staged failed", exc_info=True)
            if not committed or not self.keep:
                release()

        try:
            written = files.write(buckets, around=_serializing, signer=signer)
            self._staged = True
            kwargs = {"files": written.names, "keep": self.keep} | stage
            kwargs |= proof_args(signer, written.tags)
            # raised here whatever ``rpc`` does with failures (a Ray actor's hop returns them)
            raise_failures(STAGE, rpc(STAGE, kwargs))
        except BaseException:
            drop()
            raise
        return StagedCalls(rpc, [(COMMIT, stage)], drop, applied=lambda: committed.append(True))

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
        """Remove the kept files in `root` (the next sync writes them anew)."""
        if self._kept is not None and self._kept.folder is not None:
            self._kept.close()
            shutil.rmtree(self._kept.folder, ignore_errors=True)

    def close(self) -> None:
        if self._kept is not None:
            self._kept.close()
            if self._kept.folder is not None:
                shutil.rmtree(self._kept.folder, ignore_errors=True)
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)
