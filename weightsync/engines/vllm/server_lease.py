"""The pause lease of a ``vllm serve`` server: an ASGI middleware vLLM loads into its API server.

Start the server with ``--middleware weightsync.engines.vllm.server_lease.PauseLease`` (beside
the token guard, ``server_auth.py``, if it has one). A trainer writes into a server inside a
pause (``RemoteVLLMEngine._paused_write``: ``/pause``, the write, the prefix-cache reset,
``/resume``); a trainer killed inside it -- OOM-killed, pre-empted, SIGKILLed -- never resumes,
and without this the server generates nothing until another trainer comes (measured: 60 s and
more). With it, a pause nobody completes ends by itself: once no weightsync call has reached
the server for ``WEIGHTSYNC_PAUSE_LEASE_S`` seconds (default `DEFAULT_LEASE_S`) and none is in
flight, the middleware has every worker restore the layers a write left unfinished
(``weightsync_abandon``, as the trainer's own recovery does), resets the prefix cache and
resumes. The server then serves what its workers hold: the old weights if the write never
reached them, the new ones if it completed (the bytes of a sync reach the workers in one call
after the pause on tmpfs, so a kill inside the pause cannot leave part of them).

Why here: the pause lives in vLLM's engine core, which weightsync's code cannot reach on its
own (its worker extension runs below the core, in the workers, and the core runs one call at a
time), while the API server holds the engine client that paused it (``app.state.engine_client``,
the same object ``/pause`` and ``/resume`` use) and runs an event loop of its own. Why
"no call for a while" and not "a while after the pause": a write may take long (a large model,
a loaded machine); a call in flight is the trainer still writing, and the lease only starts
counting when it ends. The bound is therefore the lease after the last call ends; a call that
hangs inside the workers (a gloo receive from a dead trainer) holds the engine core until that
receive times out, lease or not.

The trainer learns of an expiry: ``/pause`` answers with a lease id (``X-Weightsync-Lease``),
the trainer sends it with every call of that pause, and a call carrying an expired lease is
answered 409 with the reason, never run -- a trainer that was only slow does not write into a
server that resumed without it.

Standard library only: it runs inside vLLM's API server process, which imports it by name.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .server_auth import OPEN, Receive, Scope, Send, answer_error

#: The server's environment variable holding the lease, in seconds.
LEASE_ENV = "WEIGHTSYNC_PAUSE_LEASE_S"

#: The lease when the environment sets none: calls of one pause follow each other within
#: milliseconds, so seconds of silence mean nobody is left to resume.
DEFAULT_LEASE_S = 10.0

#: The header carrying the lease id (answered by ``/pause``, sent back by the trainer).
HEADER = "x-weightsync-lease"


logger = logging.getLogger("weightsync.server_lease")


class PauseLease:
    """ASGI middleware: a ``/pause`` that no call follows within the lease is undone.

    Raises:
        ValueError: at server start, when ``WEIGHTSYNC_PAUSE_LEASE_S`` is not a positive number.
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        raw = os.environ.get(LEASE_ENV, str(DEFAULT_LEASE_S))
        try:
            lease = float(raw)
        except ValueError:
            lease = -1.0
        if not lease > 0:
            raise ValueError(f"{LEASE_ENV} must be a positive number of seconds, got {raw!r}")
        self.app = app
        self.lease_s = lease
        self.held: str | None = None  # the lease id of the pause in force
        self._expired: dict[str, float] = {}  # lease id -> when it expired
        self._inflight = 0  # weightsync calls being served now
        self._last = time.monotonic()  # when the last one ended
        self._watch: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "")).rstrip("/") or "/"
        if path in OPEN:  # they generate or describe: they neither hold nor renew a lease
            await self.app(scope, receive, send)
            return
        given = _header(scope, HEADER)
        if given is not None and given != self.held:
            await _refuse(send, given, self._expired.get(given), self.lease_s)
            return
        status: list[int] = []
        answer = self._answering(path, scope, send, status)
        self._inflight += 1
        try:
            await self.app(scope, receive, answer)
        finally:
            self._inflight -= 1
            if status and status[0] != 401:  # a caller the token guard turned away renews nothing
                self._last = time.monotonic()

    def _answering(self, path: str, scope: Scope, send: Send, status: list[int]) -> Send:
        """``send``, noting the answer's status in ``status``, taking the lease when ``/pause``
        succeeds and ending it when ``/resume`` does."""

        async def answer(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message.get("status", 0)))
            if message["type"] == "http.response.start" and message.get("status") == 200:
                if path == "/pause":
                    self.held = secrets.token_hex(8)
                    message["headers"] = [
                        *message.get("headers", []),
                        (HEADER.encode(), self.held.encode()),
                    ]
                    self._start(scope)
                elif path == "/resume":
                    self.held = None
            await send(message)

        return answer

    def _start(self, scope: Scope) -> None:
        if self._watch is None or self._watch.done():
            engine = scope["app"].state.engine_client
            self._watch = asyncio.get_running_loop().create_task(self._watching(engine))

    async def _watching(self, engine: Any) -> None:
        tick = min(1.0, self.lease_s / 4)
        while self.held is not None:
            await asyncio.sleep(tick)
            quiet = time.monotonic() - self._last
            if self.held is not None and self._inflight == 0 and quiet > self.lease_s:
                await self._expire(engine, self.held, quiet)

    async def _expire(self, engine: Any, lease: str, quiet: float) -> None:
        """Restore unfinished layers, reset the prefix cache, resume; a server whose workers
        cannot be restored is left paused (never resume a broken engine) and says so."""
        self.held = None
        self._expired[lease] = time.time()
        while len(self._expired) > 64:
            self._expired.pop(next(iter(self._expired)))
        logger.warning(
            "weightsync: the pause taken %.1f s ago saw no call since; its lease (%s=%g) "
            "expired: restoring unfinished layers and resuming",
            quiet,
            LEASE_ENV,
            self.lease_s,
        )
        try:
            results = await engine.collective_rpc("weightsync_abandon")
            failed = [
                r.get("error") for r in results or [] if isinstance(r, dict) and r.get("error")
            ]
            if failed:
                raise RuntimeError(f"weightsync_abandon failed: {failed}")
            await engine.reset_prefix_cache(reset_running_requests=True)
            await engine.resume_generation()
        except Exception:
            logger.exception(
                "weightsync: the expired pause could not be undone; the server is left paused "
                "(restart it, or sync it fully and resume)"
            )
            return
        logger.warning("weightsync: resumed on the weights the workers hold")


def _header(scope: Scope, name: str) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name.encode():
            return str(value.decode("latin-1"))
    return None


async def _refuse(send: Send, lease: str, expired_at: float | None, lease_s: float) -> None:
    when = (
        f"it expired at {time.strftime('%H:%M:%S', time.localtime(expired_at))} after {lease_s:g} s "
        "without a call, and the server resumed on the weights its workers held"
        if expired_at is not None
        else "the server holds no such pause (it was resumed, or the server restarted)"
    )
    await answer_error(
        send, 409, f"weightsync pause lease {lease} is over: {when}. Nothing was run."
    )
