"""A worker's stage: a sync's checked tensors, held while the engine serves until the commit
that claims them loads them, or until they expire.

Both staging transports end here: a gloo stream received in a thread (``gloo.Staging``) and
sealed bucket files mapped and checked at once (``files.SealedFiles``). A stage that completed
but that no commit claims -- its trainer died between its stage and its commit -- is dropped
after ``WEIGHTSYNC_STAGE_EXPIRY_S`` (`stage_expiry_s`), so a dead trainer's bytes do not stay in
every worker until the next trainer comes.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable

import torch

from ..errors import StageExpiredError, WeightSyncError

#: The engine's environment variable (a server's: its workers inherit it) holding how long a
#: completed stage waits for its commit, in seconds (`Held`).
STAGE_EXPIRY_ENV = "WEIGHTSYNC_STAGE_EXPIRY_S"

#: The expiry when the environment sets none. A lone trainer commits within one pause call of
#: its stage's end (milliseconds), but a fleet (`Replicas`) commits once every replica staged,
#: so the replica that staged first waits for the slowest one's stream: ten minutes, as long as
#: one Ray actor call may take, bounds how long a dead trainer's bytes stay in every worker
#: without expiring a slow fleet's stage. The same variable bounds a Ray actor's stage.
DEFAULT_STAGE_EXPIRY_S = 600.0

logger = logging.getLogger(__name__)


def stage_expiry_s() -> float:
    """The stage expiry this process's environment sets (`STAGE_EXPIRY_ENV`), or the default.

    Raises:
        ValueError: it is not a positive, finite number of seconds.
    """
    raw = os.environ.get(STAGE_EXPIRY_ENV, str(DEFAULT_STAGE_EXPIRY_S))
    try:
        expiry = float(raw)
    except ValueError:
        expiry = -1.0
    if not 0 < expiry < math.inf:
        raise ValueError(f"{STAGE_EXPIRY_ENV} must be a positive number of seconds, got {raw!r}")
    return expiry


Pairs = list[tuple[str, torch.Tensor]]


class Held:
    """Checked ``(name, tensor)`` pairs held for the commit that `claim` s them.

    Once `hold` has them, the stage waits ``expire_s`` for its claim; then it is dropped (its
    tensors let go, ``on_expire`` called, `StageExpiredError` kept). A lock orders the claim,
    the drop and the expiry: a claim before the expiry gets every tensor and the stage no
    longer expires; a claim after it is refused. A worker of several (TP ranks) decides alone;
    ``in_engine/model_ops.claim_staged`` makes the decision one for every worker of an engine.

    Args:
        expire_s: how long held pairs wait for their claim (None: `stage_expiry_s`).
        on_expire: called once the expiry let the pairs go (what else a dead trainer's stage
            keeps: a worker's mappings of its files).

    Raises:
        ValueError: ``expire_s`` is None and the environment's expiry is not a valid one.
    """

    def __init__(
        self, expire_s: float | None = None, on_expire: Callable[[], None] = lambda: None
    ) -> None:
        self._expire_s = stage_expiry_s() if expire_s is None else float(expire_s)
        self._on_expire = on_expire
        self._pairs: Pairs = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._claimed = self._dropped = False
        self._timer: threading.Timer | None = None
        self.buckets = 0

    @property
    def held(self) -> int:
        """Bytes of tensors this stage holds now (0 once claimed and let go, dropped, expired
        or failed)."""
        with self._lock:
            return sum(t.nbytes for _, t in self._pairs)

    def hold(self, pairs: Pairs, buckets: int) -> None:
        """Hold ``pairs`` (``buckets`` checked buckets) from now until claimed, dropped or
        expired; a stage dropped while they came lets them go at once."""
        with self._lock:
            self.buckets = buckets
            if self._dropped:
                self._pairs = []
                return
            self._pairs = pairs
            ended = time.time()
            self._timer = threading.Timer(self._expire_s, self._expire, (ended,))
            self._timer.daemon = True
            self._timer.start()

    def fail(self, error: BaseException) -> None:
        """Keep ``error`` instead of any tensors: what `claim` raises."""
        with self._lock:
            self._error, self._pairs = error, []

    def _expire(self, ended: float) -> None:
        with self._lock:
            if self._claimed or self._dropped:
                return
            self._dropped = True
            self._pairs = []
            self._error = StageExpiredError(
                f"the staged sync ended at {time.strftime('%H:%M:%S', time.localtime(ended))} "
                f"and no commit claimed it within {self._expire_s:g} s ({STAGE_EXPIRY_ENV}): "
                "this worker dropped it; nothing of it was loaded"
            )
        logger.warning("weightsync: %s", self._error)
        self._on_expire()

    def _ready(self) -> None:
        """Raise if the stage cannot be claimed yet (a stream still coming)."""

    def claim(self) -> Pairs:
        """The staged pairs, for the commit that loads them: from here on the stage does not
        expire (the caller lets it go with `drop` once loaded).

        Raises:
            StageExpiredError: it expired first (nothing of it is held any more).
            WeightSyncError: it is not whole yet, or was dropped.
            Exception: what failed the stage (``BytesRejectedError`` for a refused bucket).
        """
        with self._lock:
            self._ready()
            if self._error is not None:
                raise self._error
            if self._dropped:
                raise WeightSyncError("the stage was dropped before its commit")
            self._claimed = True
            if self._timer is not None:
                self._timer.cancel()
            return self._pairs

    def drop(self) -> None:
        """Let go of the staged tensors."""
        with self._lock:
            self._dropped = True
            self._pairs = []
            if self._timer is not None:
                self._timer.cancel()
