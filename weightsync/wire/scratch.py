"""Scratch folders in RAM (``/dev/shm``) for adapters and weight buckets, never left behind.

Engines that read from a folder (vLLM's adapter loader, a server's ``reload_weights``) get one
here. Each folder is named after the process that made it (``weightsync-<pid>-<kind>-...``) and
removed when its owner object goes away or the interpreter exits. A process killed before
either leaves its folder behind, so making a folder also removes those of processes that are
no longer running: RAM is not given back by anything else.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import weakref
from pathlib import Path

_NAME = re.compile(r"^weightsync-(\d+)-")


def _tmpfs() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def sweep(root: str | None = None) -> list[str]:
    """Remove the scratch folders of processes that are no longer running; return their paths."""
    root = root or _tmpfs() or tempfile.gettempdir()
    removed = []
    for entry in Path(root).glob("weightsync-*"):
        match = _NAME.match(entry.name)
        if match and entry.is_dir() and not _alive(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
    return removed


def scratch_dir(owner: object, kind: str) -> Path:
    """A new folder in RAM (or the temp dir where there is no ``/dev/shm``), removed with
    ``owner`` or at exit, whichever comes first."""
    root = _tmpfs()
    sweep(root)
    folder = Path(tempfile.mkdtemp(prefix=f"weightsync-{os.getpid()}-{kind}-", dir=root))
    weakref.finalize(owner, shutil.rmtree, str(folder), True)
    return folder
