"""The token guard of a ``vllm serve`` server: an ASGI middleware vLLM loads into its API server.

Start the server with ``--middleware weightsync.engines.vllm.server_auth.RequireToken`` and
the token in its environment (``WEIGHTSYNC_TOKEN``); the trainer passes the same token
(``VLLMServerEngine(url, token=...)`` or ``WEIGHTSYNC_TOKEN``), sent as the
``X-Weightsync-Token`` header.

Why weightsync's own guard: vLLM's ``--api-key`` checks only paths under ``/v1``, ``/v2``,
``/inference`` and ``/cohere`` (``vllm/entrypoints/serve/middleware/authenticate.py``), while
the routes that change a server's weights -- ``/collective_rpc``, ``/sleep``, ``/wake_up``,
``/pause``, the weight-transfer routes -- are elsewhere, open to anyone who reaches the port.

Deny by default: every request needs the token except those on `OPEN` (inference and health
routes, which read the served weights and change none). A route vLLM adds in a later release is
therefore guarded until someone decides otherwise. Rollout clients keep using the inference
routes without weightsync's token (guard those with ``--api-key`` if needed; the two headers do
not collide).

Standard library only: it runs inside vLLM's API server process, which imports it by name.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

#: The server's environment variable holding the token (and the trainer's default).
TOKEN_ENV = "WEIGHTSYNC_TOKEN"

#: The request header carrying it.
HEADER = "x-weightsync-token"

#: The names weightsync's trainer and its pause lease (``server_lease.py``) share, here so that
#: the trainer's side imports no middleware: the header carrying a pause's lease id (answered by
#: ``/pause``, sent back by the trainer), the header of a fenced server's 503 answers (the
#: trainer tells them from other 503s by it), the header of a late call's 409 naming the label
#: of the weights the expired pause's lease finished that trainer's update into, the header of
#: a 409 refusing a call because another caller's pause or commit is in force (nothing run),
#: and the route that runs a whole commit on the server's side in one call (``POST``, a
#: ``control.Commit`` as JSON; answers a ``control.Committed``).
LEASE_HEADER = "x-weightsync-lease"
FENCED_HEADER = "x-weightsync-fenced"
FINISHED_HEADER = "x-weightsync-lease-finished"
BUSY_HEADER = "x-weightsync-busy"
COMMIT_PATH = "/weightsync/commit"

#: Shortest token accepted: a guessable token guards nothing.
MIN_TOKEN_CHARS = 16

#: Paths served without the token: they generate from, or describe, the weights served now.
OPEN = frozenset(
    {
        "/health",
        "/ping",
        "/ready",
        "/readyz",
        "/load",
        "/version",
        "/metrics",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/tokenize",
        "/detokenize",
        "/classify",
        "/pooling",
        "/score",
        "/rerank",
        "/v1/score",
        "/v1/rerank",
        "/inference/v1/generate",
    }
)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class RequireToken:
    """ASGI middleware: a request to anything not in `OPEN` needs ``X-Weightsync-Token``.

    Raises:
        RuntimeError: at server start, when ``WEIGHTSYNC_TOKEN`` is unset or shorter than
            `MIN_TOKEN_CHARS` (a guard without a token would guard nothing: refuse to start).
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        token = os.environ.get(TOKEN_ENV, "")
        if len(token) < MIN_TOKEN_CHARS:
            raise RuntimeError(
                f"weightsync's token guard needs {TOKEN_ENV} in the server's environment, at "
                f"least {MIN_TOKEN_CHARS} characters (e.g. python -c 'import secrets; "
                f"print(secrets.token_urlsafe(32))'); it is "
                f"{'unset' if not token else 'too short'}"
            )
        self.app = app
        self._token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan: nothing to guard
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "")).rstrip("/") or "/"
        if path in OPEN or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await answer_error(send, 401, f"weightsync token required for {path} ({HEADER} header)")

    def _allowed(self, scope: Scope) -> bool:
        return _carries(scope, self._token)


def admitted(scope: Scope) -> bool:
    """Whether a request may run a route another middleware answers itself (the pause
    lease's commit): it carries the token of this server's environment, or the environment
    holds none (a server without the guard). That middleware may sit outside the guard
    (``--middleware`` order), so it asks here, not the guard."""
    token = os.environ.get(TOKEN_ENV, "")
    return not token or _carries(scope, token.encode())


def _carries(scope: Scope, token: bytes) -> bool:
    given = [v for k, v in scope.get("headers", []) if k.lower() == HEADER.encode()]
    return len(given) == 1 and hmac.compare_digest(given[0], token)


async def answer_error(
    send: Send, status: int, message: str, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    """Answer an HTTP request with ``status`` and ``{"error": message}`` (JSON)."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *headers],
        }
    )
    await send({"type": "http.response.body", "body": json.dumps({"error": message}).encode()})
