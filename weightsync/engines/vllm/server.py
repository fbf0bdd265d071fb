"""A running ``vllm serve`` server as a weightsync engine, controlled over HTTP.

Start it with ``VLLM_SERVER_DEV_MODE=1`` (the ``/collective_rpc``, ``/pause``, ``/sleep``
routes), ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` if it serves LoRA, and ``--worker-extension-cls
weightsync.engines.vllm.worker.WeightsyncWorker``; without the extension it is a stock server
(``stock.py``). Writing, recovery and adapters are `RemoteVLLMEngine`'s (``remote.py``).
"""

from __future__ import annotations

from typing import Any

from ...errors import EngineUnavailableError
from ...wire.protocol import EngineFacts
from . import stock
from .control import WORKER_EXTENSION, HTTPControl
from .remote import RemoteVLLMEngine
from .transports import TmpfsTransport, Transport


class VLLMServerEngine(RemoteVLLMEngine):
    """A running ``vllm serve`` as a weightsync engine, controlled over HTTP.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        transport: ``"tmpfs"`` (same host or shared filesystem) or ``"gloo"`` (any host).
        **kwargs: see `RemoteVLLMEngine`.
    """

    name = "vllm-server"
    control: HTTPControl

    def __init__(
        self, base_url: str, *, transport: str | Transport = "tmpfs", **kwargs: Any
    ) -> None:
        super().__init__(HTTPControl(base_url), transport=transport, **kwargs)

    def _read_facts(self, transport: str | Transport) -> EngineFacts:
        """From the worker extension if the server loaded it, else from the server's config
        and the model folder it serves (a stock server: tmpfs only)."""
        try:
            return EngineFacts.from_json(self.rpc("weightsync_facts")[0].value)
        except EngineUnavailableError:
            raise
        except RuntimeError as e:
            if "weightsync_facts" not in str(e):
                raise  # not a missing extension (no dev mode, server down): say so as it is
        if not (transport == "tmpfs" or isinstance(transport, TmpfsTransport)):
            raise ValueError(
                f"transport={transport!r} needs weightsync's worker extension in the server, "
                f"which this one did not load: start it with --worker-extension-cls "
                f"{WORKER_EXTENSION}, or use transport='tmpfs' (same host or shared filesystem)"
            )
        return stock.facts(self.control)

    def describe(self) -> str:
        how = "stock server, vLLM's reload_weights" if self.stock else "worker extension"
        return f"{super().describe()} at {self.control.base_url} ({how})"
