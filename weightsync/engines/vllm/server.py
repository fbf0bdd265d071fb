"""A running ``vllm serve`` server as a weightsync engine, controlled over HTTP.

Start it with ``VLLM_SERVER_DEV_MODE=1`` (the ``/collective_rpc``, ``/pause``, ``/sleep``
routes), ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` if it serves LoRA, and ``--worker-extension-cls
weightsync.engines.vllm.worker.WeightsyncWorker``; a server without the extension is a
`StockServerEngine` (``stock.py``). Writing, recovery and adapters are `RemoteVLLMEngine`'s
(``remote.py``).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import sys
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from ...errors import AuthError, EngineUnavailableError
from ...wire.protocol import EngineFacts
from .control import TOKEN_MIDDLEWARE, WORKER_EXTENSION, HTTPControl, WeightsSpan
from .remote import RemoteVLLMEngine
from .server_auth import TOKEN_ENV
from .transports import Transport, WeightTransferTransport


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is this machine's loopback."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


class VLLMServerEngine(RemoteVLLMEngine):
    """A running ``vllm serve`` as a weightsync engine, controlled over HTTP.

    Who may change the server's weights: with a token (``token=``, or ``WEIGHTSYNC_TOKEN`` in
    this process's environment) every call carries it, and the server must be guarded by
    weightsync's middleware (``--middleware`` `TOKEN_MIDDLEWARE`, the same token in its
    environment): a server that answers a weight-changing route without it is refused. Without
    a token only a server on loopback is used: one reached over the network would take new
    weights from anyone who reaches it (docs/security.md), so it is refused unless
    ``allow_unauthenticated=True`` says the network itself keeps others out.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        token: weightsync's token (default: ``WEIGHTSYNC_TOKEN`` from the environment).
        allow_unauthenticated: use a server reached over the network without a token.
        transport: ``"tmpfs"`` (same host or shared filesystem) or ``"gloo"`` (any host), or a
            `Transport`. A weight-transfer transport whose client speaks to this server
            (vLLM's ``HTTPVLLMWeightSyncClient``, an `HTTPControl`) makes its calls through
            this engine's control instead, which holds the pause's lease (`_speak_through`).
        **kwargs: see `RemoteVLLMEngine`.

    Raises:
        AuthError: before anything is sent, as said above.
    """

    name = "vllm-server"
    control: HTTPControl

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        allow_unauthenticated: bool = False,
        transport: str | Transport = "tmpfs",
        **kwargs: Any,
    ) -> None:
        token = token or os.environ.get(TOKEN_ENV) or None
        host = urlparse(base_url).hostname or ""
        if token is None and not allow_unauthenticated and not is_loopback(host):
            raise AuthError(
                f"refusing {base_url} without a token: a server reached over the network, "
                f"not loopback, takes new weights from anyone who reaches it. Start it with "
                f"--middleware {TOKEN_MIDDLEWARE} and {TOKEN_ENV}=<secret> in its environment "
                f"and pass token=<secret> here (or set {TOKEN_ENV}); or pass "
                "allow_unauthenticated=True if your network keeps everyone else out"
            )
        control = HTTPControl(base_url, token=token)
        if token is not None and not control.guarded():
            raise AuthError(
                f"the server at {base_url} answers weight-changing calls without a token: it "
                f"does not run weightsync's guard, so anyone who reaches it can change its "
                f"weights and the token would protect nothing. Start it with --middleware "
                f"{TOKEN_MIDDLEWARE} and {TOKEN_ENV} in its environment"
            )
        _speak_through(transport, control)
        super().__init__(control, transport=transport, **kwargs)

    def _read_facts(self, transport: str | Transport) -> EngineFacts:
        """From the worker extension; a server without it is named as such (an error the
        server answered, a refused token among them, is raised as it is)."""
        try:
            return EngineFacts.from_json(self.rpc("weightsync_facts")[0].value)
        except RuntimeError as e:
            if isinstance(e, EngineUnavailableError) or "weightsync_facts" not in str(e):
                raise
            raise RuntimeError(
                f"the server's workers do not answer weightsync_facts ({e}): start it with "
                f"--worker-extension-cls {WORKER_EXTENSION} and VLLM_SERVER_DEV_MODE=1; a server "
                "that cannot be restarted with it: StockServerEngine(url) syncs it through "
                "vLLM's own reload_weights (tmpfs only; a full sync every time)"
            ) from e

    def describe(self) -> str:
        return f"{super().describe()} at {self.control.base_url} ({self.writes_through})"

    def weights_spans(
        self, output: Mapping[str, Any], index: int = 0, *, model: str | None = None
    ) -> list[WeightsSpan] | None:
        """The base and adapter versions that produced each token of a finished answer of
        vLLM's token-in-token-out route (``POST /inference/v1/generate``, served with
        ``--enable-scale-out``): its choice ``index``'s ``weight_versions`` (the base label,
        `RemoteVLLMEngine._written`) with the adapter version of the ``model`` the answer names.
        A stream carries the spans on its last chunk, which names no model: pass the name the
        request used as ``model``.

        None where the server cannot say: vLLM's OpenAI routes (``/v1/completions``,
        ``/v1/chat/completions``) return no spans, an unfinished chunk has none, and with
        ``adapter_versions=1`` every adapter version is served under ``lora_name``, so the
        name does not tell which one a request ran with.

        Raises:
            ValueError: the request ran with an adapter this engine did not load.
        """
        choice = next(c for c in output["choices"] if c["index"] == index)
        spans = choice.get("weight_versions")
        if spans is None:
            return None
        name = model or output.get("model")
        adapter = None
        if name != self.control.model:
            if self.adapter_versions == 1 and name == self.lora_name:
                return None
            found = re.fullmatch(re.escape(self.lora_name) + r"-v(\d+)", name or "")
            if found is None:
                raise ValueError(
                    f"the request ran with model {name!r}, an adapter this engine did not load "
                    f"(it serves {self.control.model!r} and {self.lora_name!r}-v<k>): its "
                    "version is not weightsync's to name"
                )
            adapter = int(found.group(1))
        return [WeightsSpan(s["version"], adapter, s["start"], s["end"]) for s in spans]

    #: How this engine's weights are written, for `describe`.
    writes_through = "worker extension"


def _speak_through(transport: str | Transport, control: HTTPControl) -> None:
    """Give a weight-transfer transport whose client speaks to this server (vLLM's
    ``HTTPVLLMWeightSyncClient``, or an `HTTPControl` of its own) the engine's own control as
    its client. The server runs a pause's calls only when they carry its lease
    (``server_lease.py``), which the engine's control holds: another client's calls inside the
    engine's pause would be refused as another caller's. vLLM's client sends neither the token
    nor the lease: a trainer slow inside its pause would have its late ``finish_weight_update``
    run unleased, after the lease had settled its update. Through the control the late call is
    refused and told what the lease did."""
    clients = sys.modules.get("vllm.distributed.weight_transfer.clients")
    client = getattr(transport, "client", None)
    kinds = (HTTPControl,) if clients is None else (HTTPControl, clients.HTTPVLLMWeightSyncClient)
    if (
        isinstance(transport, WeightTransferTransport)
        and isinstance(client, kinds)
        and client.base_url.rstrip("/") == control.base_url
    ):
        transport.client = control
