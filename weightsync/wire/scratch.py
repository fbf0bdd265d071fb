"""Scratch folders in RAM (``/dev/shm``) for adapters and weight buckets, never left behind,
and readable by their owner only.

Engines that read from a folder (vLLM's adapter loader, a server's ``reload_weights``) get one
here. Each folder is named after the process that made it (``weightsync-<pid>-<kind>-...``) and
removed when its owner object goes away or the interpreter exits. A process killed before
either leaves its folder behind, so making a folder also removes those of processes that are
no longer running: RAM is not given back by anything else.

Whoever can write a bucket file changes the weights its engine loads, and ``/dev/shm`` is
shared by every user of the host: folders weightsync makes are ``0700`` and its files ``0600``
(`owner_only`), and a folder a caller names is used only if it is already so (`private_dir`):
one that others can enter is refused, not tightened, since someone may already hold a file
open in it. The engine's server must then run as the same user as the trainer.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
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


def owner_only(path: str, flags: int) -> int:
    """An ``open(..., opener=owner_only)`` that creates files readable by their owner only."""
    return os.open(path, flags, 0o600)


def private_dir(path: str | Path) -> Path:
    """``path`` as a folder only its owner (this process's user) can enter: made with mode
    ``0700`` if missing (its parents as ``os.makedirs`` makes them).

    Raises:
        PermissionError: it exists and is not a folder, is a symlink, belongs to another user,
            or lets others in (its mode says which).
    """
    path = Path(path)
    if not path.exists():
        path.mkdir(mode=0o700, parents=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{path} is not a folder (a symlink or a file): refused for weights")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.getuid() or mode & 0o077:
        raise PermissionError(
            f"{path} (mode {mode:04o}, owner uid {st.st_uid}) lets others than its owner "
            f"(uid {os.getuid()}) in: whoever can write a file there changes the engine's "
            f"weights. Use a folder of your own with mode 0700 (or none: weightsync makes one)"
        )
    return path
