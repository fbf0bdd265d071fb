"""The server's side of a commit in one call: what the pause lease's commit route
(``server_lease.py``, `server_lease.COMMIT_PATH`) runs inside a ``vllm serve`` process.

The route hands the trainer's `Commit` to `serve_commit`, in a worker thread; `run_commit`,
the same composition the trainer runs against an engine without the route, drives the API
server's own engine client (``app.state.engine_client``, the ``AsyncLLM`` the ``/pause``,
``/resume`` and ``/collective_rpc`` routes use) through `ServerControl`, each call scheduled
back onto the server's event loop. Adapters are loaded and unloaded through the server's model
registry (``app.state.openai_serving_models``), as its ``/v1/load_lora_adapter`` route does,
so requests find them by name. Every worker answer passes the fence (`PauseLease.note`) as it
comes, before the engine resumes, as a ``/collective_rpc`` answer does.

Imported by the route when it first runs, not by vLLM at start: it needs weightsync's control
planes, which need torch (the server has it).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from .asyncllm import AsyncLLMControl
from .control import Commit, run_commit


class ServerControl(AsyncLLMControl):
    """The control calls on a ``vllm serve`` process's own engine client, from a thread of
    that process (see the module docstring).

    Args:
        state: the API server's ``app.state``.
        loop: the server's event loop.
        note: called with every ``collective_rpc`` answer (the fence's reading).
    """

    def __init__(
        self, state: Any, loop: asyncio.AbstractEventLoop, note: Callable[[Any], None]
    ) -> None:
        super().__init__(state.engine_client, loop=loop)
        self.models = state.openai_serving_models
        self.note = note

    def rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        answers = super().rpc(method, kwargs)
        self.note(answers)
        return answers

    def load_lora(self, name: str, path: str) -> None:
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        self.unload_lora(name)  # an earlier client's adapter under this name: replaced
        request = LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
        _answered("load", name, self._run(lambda: self.models.load_lora_adapter(request)))

    def unload_lora(self, name: str) -> None:
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        if name in self.models.lora_requests:
            request = UnloadLoRAAdapterRequest(lora_name=name)
            _answered("unload", name, self._run(lambda: self.models.unload_lora_adapter(request)))


def _answered(what: str, name: str, answer: Any) -> None:
    """The model registry answers a string, or an ``ErrorResponse``: raise that."""
    if not isinstance(answer, str):
        raise RuntimeError(f"the server could not {what} adapter {name!r}: {answer}")


def serve_commit(
    state: Any, loop: asyncio.AbstractEventLoop, body: bytes, note: Callable[[Any], None]
) -> bytes:
    """Run the `Commit` of ``body`` (JSON) on this server; the `Committed` answer as JSON.

    Raises:
        ValueError: ``body`` is not a commit (nothing was run).
    """
    commit = Commit.from_json(json.loads(body))
    done = run_commit(ServerControl(state, loop, note), commit)
    return json.dumps(done.to_json(), default=str).encode()
