"""The pause lease and the commit route of a ``vllm serve`` server: an ASGI middleware vLLM loads
into its API server.

Start the server with ``--middleware weightsync.engines.vllm.server_lease.PauseLease`` (beside
the token guard, ``server_auth.py``, if it has one). It does three things.

The commit in one call. ``POST /weightsync/commit`` (`COMMIT_PATH`) takes a whole commit from
the trainer (``control.Commit``: the worker calls that load what the trainer staged, the
adapter loads and unloads) and runs it here, on the server's own engine client
(``server_commit.py``): pause (requests kept), the calls, the version read and labelled, the
prefix-cache reset, resume -- or, when a call fails, the trainer's own recovery (the workers
restore unfinished layers, reset, label, resume; left paused if that fails) -- and answers what
happened (``control.Committed``: the calls' outcomes, the version attested while paused, the
pause measured here). The pause holds no round trip to the trainer, and the commit runs in a
task of its own that the client's disconnect does not cancel: a trainer SIGKILLed during the
call leaves a server that finishes the commit (or recovers from it) and resumes at once. It is
refused (409, nothing run) while another caller's pause or commit is in force, asks for the
token of ``WEIGHTSYNC_TOKEN`` itself (``server_auth.admitted``: this middleware may sit outside
the guard), and the workers' answers pass the fence as they come, before the engine resumes.

The lease, for a pause taken with ``/pause`` (a trainer's explicit pause, or a write only the
trainer can make inside it: a stream it sends, vLLM's weight-transfer API): a trainer killed
inside it -- OOM-killed, pre-empted, SIGKILLed -- never resumes, and without the lease the server
generates nothing until another trainer comes (measured: 60 s and more). With it, a pause nobody
completes ends by itself: once no weightsync call has reached the server for
``WEIGHTSYNC_PAUSE_LEASE_S`` seconds (default `DEFAULT_LEASE_S`) and none is in flight, the
middleware has every worker settle what the trainer left (``weightsync_settle``): a
weight-transfer update whose load ended on every worker without an error and covered every
weight the engine loads -- its trainer killed once the load call was sent -- is finished by
vLLM's own finish, run in the workers, so the new weights are served whole; anything else is
abandoned as the trainer's own recovery does (the layers a write left unfinished restored,
those it finished reported, which fences) and an update left open is closed. It then labels
what the workers hold (their attested version, or ``unknown`` while fenced), resets the prefix
cache and resumes.

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
server that resumed without it. Where the lease finished the trainer's update, the answer says
so and names the label of those weights (``X-Weightsync-Lease-Finished``): the trainer's write
is what the server serves, and the trainer, which alone knows what it wrote, counts its sync
done if the workers still attest that label, or raises if another write came since.

One caller at a time. While a pause is in force, or a commit runs, only the calls carrying
that pause's lease are run, besides reads (``GET`` routes, the worker calls of `READS`) and
generation. Any other call -- another trainer's sync, vLLM's own client starting or finishing
an update, a ``/resume`` or ``/pause`` of someone else's, a worker call that writes or abandons
-- is answered 409 with ``X-Weightsync-Busy`` and not run (the trainer's ``errors.EngineBusyError``): it
would otherwise finish, abandon or resume a write it does not own, or write into it. A read of
another caller neither renews the lease nor holds its expiry off: a client polling the server
does not keep a dead trainer's pause alive.

The fence. A weight write that fails part-way (a worker error while applying, a bucket refused
mid-stream, a gloo stream cut) leaves the layers vLLM's layerwise reload had finished with their
new weights and the rest with their old: a mix, which generates plausible but wrong tokens.
The workers report it: every weightsync reload's outcome, and ``weightsync_abandon``'s, carries
the layers it had finished (``wire.protocol.RELOAD_REPORT``). This middleware reads that report
in every ``/collective_rpc`` answer (the trainer's call, or the abandon of an expired lease) and
in every worker answer of a commit it runs, and, when a failed write had finished any layer,
*fences* the server: every route that answers from the weights (`GENERATING`: completions,
chat, embeddings, scores, ...) is answered 503 with a JSON error saying why (header
``X-Weightsync-Fenced``), for every client, and a request already admitted when the fence came
is refused too (its answer, or the rest of its stream, replaced by the error): its tokens may
come from the mix. Health and description routes stay open. A
weightsync write that completes and loaded every weight of the engine (a full restore:
``FullSync``, ``ReloadWeights``) lifts it. What is not a mix and does not fence: a write refused
before its first layer finished (a file whose tag does not match, a trainer that failed while
staging, a stream cut inside the first layer) -- the workers then hold their old weights,
whole. A load through vLLM's weight-transfer API (``in_engine/backend.py``) reports the same
way, through ``weightsync_weight_update``. Not seen: a write not made through weightsync
(vLLM's own ``reload_weights``): the fence reads weightsync's reports only.

Standard library only when vLLM imports it by name at start; the commit route imports
``server_commit.py`` (weightsync's control planes) when it first runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from .server_auth import (
    BUSY_HEADER,
    COMMIT_PATH,
    FENCED_HEADER,
    FINISHED_HEADER,
    LEASE_HEADER,
    OPEN,
    Receive,
    Scope,
    Send,
    admitted,
    answer_error,
)
from .server_auth import HEADER as TOKEN_HEADER

#: The header carrying the lease id (answered by ``/pause``, sent back by the trainer).
HEADER = LEASE_HEADER

#: The server's environment variable holding the lease, in seconds.
LEASE_ENV = "WEIGHTSYNC_PAUSE_LEASE_S"

#: The lease when the environment sets none: calls of one pause follow each other within
#: milliseconds, so seconds of silence mean nobody is left to resume.
DEFAULT_LEASE_S = 10.0


#: Routes of `OPEN` that describe the server or its tokenizer and read no weights: they stay
#: open while the server is fenced.
DESCRIBING = frozenset(
    {
        "/health",
        "/ping",
        "/ready",
        "/readyz",
        "/load",
        "/version",
        "/metrics",
        "/v1/models",
        "/tokenize",
        "/detokenize",
    }
)

#: Routes that answer from the weights, refused while fenced: those of `OPEN` that do not
#: describe, and (`generates`) every other ``/v1/`` route but the adapter loads weightsync makes.
GENERATING = OPEN - DESCRIBING

#: ``wire.protocol.RELOAD_REPORT`` (the workers' report of what a write did), spelt out here:
#: this module imports nothing of weightsync's trainer side.
REPORT = "weightsync_reload"


def generates(path: str) -> bool:
    """Whether ``path`` answers from the weights (refused while the server is fenced)."""
    if path in GENERATING:
        return True
    return path.startswith("/v1/") and path not in DESCRIBING and "lora_adapter" not in path


# Under vLLM's logger: this runs in the API server, whose root logger vLLM leaves at ERROR, so
# a logger of weightsync's own would drop every warning here (a dead trainer's expired pause,
# a fence), which are for the server's operator. vLLM's handler prints them in its format.
logger = logging.getLogger("vllm.weightsync.server_lease")


class PauseLease:
    """ASGI middleware: a ``/pause`` that no call follows within the lease is undone, and a
    server whose weights a failed write left a mix of old and new refuses to generate (the
    fence; see the module docstring).

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
        self._expired: dict[str, _Expired] = {}  # lease id -> what its expiry did
        self._inflight = 0  # weightsync calls being served now
        self._last = time.monotonic()  # when the last one ended
        self._watch: asyncio.Task[None] | None = None
        #: Why generation is refused (the server holds a mix); None: it serves.
        self.fence: str | None = None
        self._fences = 0  # fences raised so far: a request admitted before one is refused
        self._reason = ""  # the last fence's reason (it may be lifted before such a request ends)
        self._commit: asyncio.Task[tuple[int, bytes]] | None = None  # the commit running

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "")).rstrip("/") or "/"
        if generates(path):  # they neither hold nor renew a lease; a fence refuses them
            if self.fence is not None:
                await self._refuse_fenced(send, self.fence)
                return
            await self.app(scope, receive, self._fenced_midway(send))
            return
        if path in OPEN:  # they describe: they neither hold nor renew a lease
            await self.app(scope, receive, send)
            return
        given = _header(scope, HEADER)
        if path == COMMIT_PATH and scope["method"] == "POST":
            await self._committing(scope, receive, send, given)
            return
        if given is not None and given != self.held:
            await _refuse(send, given, self._expired.get(given), self.lease_s)
            return
        if given is None and self._busy() and admitted(scope):  # no token: the guard answers
            receive, reads = await _only_reads(scope, path, receive)
            if not reads:
                await _refuse_busy(send, f"{scope['method']} {path}", self._busy())
                return
            await self.app(scope, receive, send)  # another caller's read: it renews no lease
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

        body: list[bytes] = []

        async def answer(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message.get("status", 0)))
            if path == "/collective_rpc" and message["type"] == "http.response.body":
                body.append(bytes(message.get("body", b"")))
                if not message.get("more_body", False) and status and status[0] == 200:
                    self._read_reports(b"".join(body))
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

    def _busy(self) -> str:
        """What holds the server for one caller ("" when nothing does): a commit running, or a
        pause in force."""
        if self._commit is not None:
            return "another caller's commit runs on this server"
        if self.held is not None:
            return "another caller holds this server's pause (its weight write is under way)"
        return ""

    # --- the fence ---------------------------------------------------------------------------

    def _read_reports(self, body: bytes) -> None:
        """A ``/collective_rpc`` answer's JSON: its workers' write reports, if any."""
        try:
            results = json.loads(body).get("results")
        except (ValueError, AttributeError):
            return
        self.note(results)

    def note(self, results: Any) -> None:
        """Raise the fence when a worker reports a failed write that had finished layers (a
        mix); lift it when every worker reports a write that loaded every weight."""
        reports = [
            (str(r.get("error") or ""), r["value"][REPORT])
            for r in results or []
            if isinstance(r, dict)
            and isinstance(r.get("value"), dict)
            and isinstance(r["value"].get(REPORT), dict)
        ]
        if not reports:
            return
        written = sorted(
            {str(layer) for _, report in reports for layer in report.get("written", [])}
        )
        if written:
            errors = "; ".join(error for error, _ in reports if error) or (
                "abandoned unfinished: its pause's lease expired, or its trainer gave up"
            )
            shown = ", ".join(written[:4]) + (
                f" and {len(written) - 4} more" if len(written) > 4 else ""
            )
            self.fence = (
                f"weightsync: this server's weights are a mix of old and new layers: a weight "
                f"write failed part-way at {time.strftime('%H:%M:%S')} ({errors}) after "
                f"{len(written)} layer(s) took their new weights ({shown}) while the rest kept "
                "the old. It refuses to generate until a full weight sync (FullSync, or "
                "ReloadWeights) completes."
            )
            self._fences += 1
            self._reason = self.fence
            logger.error("%s", self.fence)
        elif self.fence is not None and all(
            not error and report.get("complete") for error, report in reports
        ):
            self.fence = None
            logger.warning("weightsync: a full weight sync completed; the fence is lifted")

    @staticmethod
    async def _refuse_fenced(send: Send, reason: str) -> None:
        await answer_error(send, 503, reason, ((FENCED_HEADER.encode(), b"1"),))

    def _fenced_midway(self, send: Send) -> Send:
        """``send`` of a request admitted while the server served whole weights: if a fence
        comes before its answer starts (lifted since or not: the request ran on the mix), the
        answer is the fence's 503; if it comes while the answer streams, the stream ends with
        the fence's error. The app's later messages are dropped (the client has its answer)."""
        admitted = self._fences
        state = {"started": False, "cut": False, "stream": False}

        async def answer(message: MutableMapping[str, Any]) -> None:
            if state["cut"]:
                return
            fenced = self._fences != admitted
            if message["type"] == "http.response.start":
                if fenced:
                    state["cut"] = True
                    await self._refuse_fenced(send, self._reason)
                    return
                state["started"] = True
                state["stream"] = any(
                    k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                    for k, v in message.get("headers", [])
                )
            elif message["type"] == "http.response.body" and fenced and state["started"]:
                state["cut"] = True
                error = json.dumps({"error": {"message": self._reason, "code": 503}})
                last = f"data: {error}\n\n" if state["stream"] else error
                await send(
                    {"type": "http.response.body", "body": last.encode(), "more_body": False}
                )
                return
            await send(message)

        return answer

    # --- the commit --------------------------------------------------------------------------

    async def _committing(self, scope: Scope, receive: Receive, send: Send, lease: str | None):
        """`COMMIT_PATH`: the whole commit run here (``server_commit.py``), in a task of its
        own that the caller's disconnect cannot cancel: a trainer killed during the call
        leaves a server that finishes the commit, or recovers from it, and resumes by itself.
        Refused (409, nothing run) while another caller's pause or commit is in force."""
        if not admitted(scope):  # the guard may sit inside this middleware
            await answer_error(send, 401, f"weightsync token required ({TOKEN_HEADER} header)")
            return
        if self._commit is not None or (self.held is not None and lease != self.held):
            await _refuse_busy(send, f"POST {COMMIT_PATH}", self._busy())
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.held = None  # the commit resumes the server: a pause the caller held ends with it
        self._inflight += 1
        loop = asyncio.get_running_loop()
        self._commit = loop.create_task(self._commit_task(scope["app"].state, loop, body))
        status, answer = await asyncio.shield(self._commit)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": answer})

    async def _commit_task(
        self, state: Any, loop: asyncio.AbstractEventLoop, body: bytes
    ) -> tuple[int, bytes]:
        """Run the commit in a worker thread (its control calls come back onto this loop);
        its answer. The worker answers go through the fence as they come (`note`)."""
        try:
            from .server_commit import serve_commit

            return 200, await asyncio.to_thread(serve_commit, state, loop, body, self.note)
        except Exception as error:  # answered: a malformed commit, a failed pause
            logger.exception("weightsync: the commit could not run")
            return 500, json.dumps({"error": f"weightsync commit: {error}"}).encode()
        finally:
            self._commit = None
            self._inflight -= 1
            self._last = time.monotonic()

    # --- the lease ---------------------------------------------------------------------------

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
        """End what the pause's trainer left (``weightsync_settle``: a weight-transfer update it
        loaded whole is finished by vLLM's own finish, anything else is abandoned -- unfinished
        layers restored, finished ones reported, which fences -- and the update closed), label
        what the workers hold (`_label`), reset the prefix cache, resume; a server whose
        workers cannot be restored is left paused (never resume a broken engine) and says so."""
        self.held = None
        expired = self._expired[lease] = _Expired(time.time())
        while len(self._expired) > 64:
            self._expired.pop(next(iter(self._expired)))
        try:
            await self._settle(engine, quiet, expired)
        finally:
            expired.settled.set()

    async def _settle(self, engine: Any, quiet: float, expired: _Expired) -> None:
        """`_expire`'s work; ``expired.finished`` set when the trainer's update was finished."""
        logger.warning(
            "weightsync: the pause taken %.1f s ago saw no call since; its lease (%s=%g) "
            "expired: restoring unfinished layers and resuming",
            quiet,
            LEASE_ENV,
            self.lease_s,
        )
        try:
            results = await engine.collective_rpc("weightsync_settle")
            self.note(results)  # a write the pause left unfinished with layers done: a mix
            failed = [
                r.get("error") for r in results or [] if isinstance(r, dict) and r.get("error")
            ]
            if failed:
                raise RuntimeError(f"weightsync_settle failed: {failed}")
            finished = bool(results) and all(
                isinstance(r, dict) and (r.get("value") or {}).get(REPORT, {}).get("complete")
                for r in results
            )
            label = await self._label(engine)
            await engine.reset_prefix_cache(reset_running_requests=True)
            await engine.resume_generation()
        except Exception:
            logger.exception(
                "weightsync: the expired pause could not be undone; the server is left paused "
                "(restart it, or sync it fully and resume)"
            )
            return
        if finished:
            expired.finished = label
            logger.warning(
                "weightsync: finished the weight update its trainer had loaded whole (every "
                "weight of the engine) and left unfinished; resumed on it, labelled %s",
                label,
            )
        else:
            logger.warning("weightsync: resumed on the weights the workers hold (%s)", label)

    async def _label(self, engine: Any) -> str:
        """Give vLLM the label of what the workers hold as the expired pause ends: their
        attested version (``control.version_label``, the base part), as the trainer's commit
        labels after a write, or `control.UNKNOWN_BASE` while fenced (a mix, as the trainer's
        recovery labels it). At every expiry, not only after a finish run here: a trainer
        killed after its write completed but before its label (its finish, or its version
        read, in flight) left the label of the weights before it on the new ones. The label
        it returns, before the engine resumes: no token of the new weights carries the old."""
        from ...wire.protocol import Outcome, raise_failures
        from .control import UNKNOWN_BASE, attestation, base_label, version_label

        label = UNKNOWN_BASE
        if self.fence is None:
            asleep = await engine.is_sleeping()
            answers = await engine.collective_rpc(
                "weightsync_attest", kwargs={"since": None, "asleep": asleep}
            )
            outcomes = [Outcome.from_json(a) for a in answers]
            raise_failures("weightsync_attest", outcomes)
            version = version_label(attestation([o.value for o in outcomes]).epoch)
            assert version is not None  # an attested epoch always has a label
            label = base_label(version)
        await engine.update_weight_version(label)
        return label


#: Worker calls (``/collective_rpc`` methods) that read and change nothing, run for any caller
#: while another's pause or commit is in force: the facts, the attested version, a check of
#: files, the delta copies' state, the staged bytes, the adapters loaded.
READS = frozenset(
    {
        "weightsync_facts",
        "weightsync_attest",
        "weightsync_check_files",
        "weightsync_check_update",
        "weightsync_delta_state",
        "weightsync_delta_digests",
        "weightsync_staged_bytes",
        "list_loras",
    }
)


async def _only_reads(scope: Scope, path: str, receive: Receive) -> tuple[Receive, bool]:
    """Whether a request only reads (a ``GET``, or a ``/collective_rpc`` of a method in
    `READS`), and the ``receive`` to hand on: a ``/collective_rpc`` body read here is replayed
    to the route."""
    if scope["method"] in ("GET", "HEAD"):
        return receive, True
    if path != "/collective_rpc":
        return receive, False
    messages: list[MutableMapping[str, Any]] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    body = b"".join(bytes(m.get("body", b"")) for m in messages)
    try:
        method = json.loads(body).get("method")
    except (ValueError, AttributeError):
        method = None

    async def replay() -> MutableMapping[str, Any]:
        return messages.pop(0) if messages else await receive()

    return replay, method in READS


async def _refuse_busy(send: Send, call: str, why: str) -> None:
    """Answer a call made while another caller's pause or commit is in force (409, nothing
    run, `BUSY_HEADER`)."""
    await answer_error(
        send,
        409,
        f"weightsync: {why}: {call} was not run. A call inside a pause carries its lease "
        f"({HEADER} header); reads and generation are served meanwhile.",
        ((BUSY_HEADER.encode(), b"1"),),
    )


def _header(scope: Scope, name: str) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name.encode():
            return str(value.decode("latin-1"))
    return None


@dataclass
class _Expired:
    """What a pause's lease did when it expired, told to its trainer's late calls."""

    at: float  # when (``time.time()``)
    #: Set once the workers were settled and the server resumed: a late call waits for it, so
    #: its answer says how the settle ended.
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    #: The label of the weights the lease finished the trainer's update into (a load it had
    #: made whole); None: nothing was finished (what the pause left was abandoned).
    finished: str | None = None


#: How long a late call waits for its expired pause's settle to end before it is answered.
SETTLE_WAIT_S = 60.0


async def _refuse(send: Send, lease: str, expired: _Expired | None, lease_s: float) -> None:
    """Answer a call of a pause that is over (409), nothing run. The trainer whose update the
    lease finished learns it (`FINISHED_HEADER`: the label of those weights): its write is
    served, and only it can tell whether the engine changed since."""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    if expired is None:
        when = "the server holds no such pause (it was resumed, or the server restarted)"
    else:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(expired.settled.wait(), SETTLE_WAIT_S)
        at = time.strftime("%H:%M:%S", time.localtime(expired.at))
        when = f"it expired at {at} after {lease_s:g} s without a call, and the server "
        if expired.finished is None:
            when += "resumed on the weights its workers held"
        else:
            when += (
                "finished the weight update its trainer had loaded whole and resumed on it, "
                f"labelled {expired.finished}"
            )
            headers = ((FINISHED_HEADER.encode(), expired.finished.encode()),)
    await answer_error(
        send, 409, f"weightsync pause lease {lease} is over: {when}. Nothing was run.", headers
    )
