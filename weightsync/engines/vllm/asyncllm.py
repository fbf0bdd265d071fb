"""vLLM's ``AsyncLLM`` (``vllm.v1.engine.async_llm.AsyncLLM``) as a weightsync engine.

An ``AsyncLLM``'s engine core always runs in its own process, exactly like a multiprocess
``vllm.LLM``'s, so the engine is `RemoteVLLMEngine` (its writes, recovery, adapter versions,
attestation and transports; nothing of the write path is written twice) with one more control
plane, `AsyncLLMControl`, whose calls are the AsyncLLM's coroutines. An ``AsyncLLM`` belongs to
the event loop it was created on, so every control call is scheduled onto that loop and waited
for from the calling thread; on the loop's own thread that would deadlock, so it is refused
(there, ``await syncer.async_sync(model)`` and ``await AsyncLLMEngine.open(async_llm)``). Every
write keeps the generations in flight (``pause_generation(mode="keep")``, then a prefix-cache
reset with ``reset_running_requests=True`` so kept requests recompute their KV under the new
weights), and labels vLLM's ``weight_version`` with the base version the write left, before
generation resumes.

True labels. vLLM's label is engine-wide: every token of a step gets it, whichever adapter
the token's request runs with, and a request keeps the adapter it was admitted with to its end
(each adapter version has an id and path of its own). So the label names the base only (it
moves only when a base write completes; after one that failed part-way it is
`UNKNOWN_BASE`), and `weights_spans` adds each request's adapter version from its own
``LoRARequest``: base and adapter of every token, for requests admitted before, during and
after a write.

Why each of these, and how to use it from an async framework: docs/engines.md, "``AsyncLLM``
(async RL frameworks)".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from ...errors import EngineUnavailableError
from ..base import instance_of, register
from .control import (
    Control,
    LoraIds,
    greedy_params,
    greedy_result,
    held_lora,
    score_params,
    score_result,
)
from .remote import RemoteVLLMEngine
from .transports import Transport

T = TypeVar("T")


class AsyncLLMControl(Control):
    """The control calls on a vLLM ``AsyncLLM`` created with
    ``worker_extension_cls=WORKER_EXTENSION``, each run on the AsyncLLM's event loop and waited
    for from the calling thread (see the module docstring).

    Args:
        async_llm: the ``AsyncLLM``.
        loop: the event loop it runs on; default: the loop of its output handler (vLLM starts
            it on the loop the AsyncLLM was created in, or first generated on).
        timeout_s: how long one call may take.

    Raises:
        ValueError: no loop was given and the AsyncLLM has not run on one yet.
    """

    def __init__(
        self,
        async_llm: Any,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        if loop is None:
            handler = getattr(async_llm, "output_handler", None)
            if handler is None:
                raise ValueError(
                    "this AsyncLLM has not run on an event loop yet (it starts its output "
                    "handler on the loop it is created or first used in): pass loop=<its loop>"
                )
            loop = handler.get_loop()
        self.async_llm = async_llm
        self.loop: asyncio.AbstractEventLoop = loop
        self.timeout_s = timeout_s
        self._loras: dict[str, Any] = {}
        self._ids = LoraIds()

    def _run(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run ``call()`` on the AsyncLLM's loop and wait for its result.

        Raises:
            RuntimeError: called on the loop's own thread (waiting would deadlock it).
            EngineUnavailableError: the engine core died, the loop is closed, or no answer
                within ``timeout_s``.
        """
        if self.on_loop():
            raise RuntimeError(
                "a synchronous weightsync call on the AsyncLLM's own event loop would "
                "block the loop that must run it: from a coroutine on that loop use "
                "`await syncer.async_sync(model)`, `await AsyncLLMEngine.open(async_llm)`, "
                "or `await asyncio.to_thread(...)` for other calls"
            )
        if self.loop.is_closed() or not self.loop.is_running():
            raise EngineUnavailableError(
                "the event loop the AsyncLLM runs on is not running: nothing can reach it"
            )

        async def run() -> T:
            return await call()

        future = asyncio.run_coroutine_threadsafe(run(), self.loop)
        with self._answering():
            try:
                return future.result(self.timeout_s)
            except concurrent.futures.TimeoutError as err:  # builtin TimeoutError from 3.11
                future.cancel()
                raise EngineUnavailableError(
                    f"the AsyncLLM did not answer within {self.timeout_s:g} s (its event loop "
                    "blocked, or its engine core hung); nothing more was sent to it"
                ) from err

    def on_loop(self) -> bool:
        """Whether the caller runs on the AsyncLLM's own event loop, where `_run` cannot wait."""
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:  # no loop runs in this thread
            return False

    @contextlib.contextmanager
    def _answering(self) -> Iterator[None]:
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            yield
        except EngineDeadError as err:
            model = self.async_llm.model_config.model
            raise EngineUnavailableError(
                f"the AsyncLLM on {model} does not answer: its engine core died ({err}); "
                "create a new AsyncLLM (and a new engine adapter for it)"
            ) from err

    def rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        return self._run(lambda: self.async_llm.collective_rpc(method, kwargs=kwargs or {}))

    def pause(self) -> None:
        # Requests in flight are frozen, not aborted; the caches are reset after the write.
        self._run(lambda: self.async_llm.pause_generation(mode="keep", clear_cache=False))

    def resume(self) -> None:
        self._run(self.async_llm.resume_generation)

    def reset_prefix_cache(self) -> None:
        # Preempts the kept requests so their KV is recomputed under the new weights; without
        # it vLLM refuses (returns False) while any request holds KV blocks.
        if not self._run(lambda: self.async_llm.reset_prefix_cache(reset_running_requests=True)):
            raise RuntimeError("the AsyncLLM did not reset its prefix cache")

    def label(self, version: str) -> None:
        self._run(lambda: self.async_llm.update_weight_version(version))

    def lora_request(self, name: str | None) -> Any:
        """The ``LoRARequest`` of the adapter loaded under ``name`` (None: none)."""
        return held_lora(self._loras, name)

    def load_lora(self, name: str, path: str) -> None:
        request = self._ids.request(name, path, self._run(self.async_llm.list_loras))
        self._run(lambda: self.async_llm.add_lora(request))
        self._loras[name] = request

    def unload_lora(self, name: str) -> None:
        request = self._loras.pop(name, None)
        if request is not None:
            self._run(lambda: self.async_llm.remove_lora(request.lora_int_id))

    async def _finish(self, prompt: list[int], params: Any, lora_request: Any) -> Any:
        """Run one prompt (token ids) to completion; its last ``RequestOutput``."""
        import uuid

        from vllm.inputs import TokensPrompt

        last = None
        async for out in self.async_llm.generate(
            TokensPrompt(prompt_token_ids=list(prompt)),
            params,
            f"weightsync-{uuid.uuid4().hex[:12]}",
            lora_request=lora_request,
        ):
            last = out
        return last

    def generate(
        self, prompts: list[list[int]], max_tokens: int, lora: str | None
    ) -> list[tuple[list[int], list[float]]]:
        params, request = greedy_params(max_tokens), self.lora_request(lora)

        async def batch() -> list[Any]:
            return await asyncio.gather(*(self._finish(p, params, request) for p in prompts))

        return [greedy_result(out) for out in self._run(batch)]

    def score(
        self, prompts: list[list[int]], top_k: int, lora: str | None
    ) -> list[list[dict[int, float]]]:
        params, request = score_params(top_k), self.lora_request(lora)
        # One prompt at a time with LoRA enabled: vLLM 0.32's CPU LoRA logits path fails on a
        # batch of prompt_logprobs requests (see control.score_prompts).
        one_by_one = self.async_llm.vllm_config.lora_config is not None

        async def batch() -> list[Any]:
            if one_by_one:
                return [await self._finish(p, params, request) for p in prompts]
            return await asyncio.gather(*(self._finish(p, params, request) for p in prompts))

        return [score_result(out) for out in self._run(batch)]

    def is_sleeping(self) -> bool:
        return bool(self._run(self.async_llm.is_sleeping))

    def sleep(self, level: int) -> None:
        self._run(lambda: self.async_llm.sleep(level=level, mode="keep"))

    def wake_up(self, tags: list[str] | None) -> None:
        self._run(lambda: self.async_llm.wake_up(tags=tags))


@register
class AsyncLLMEngine(RemoteVLLMEngine):
    """A vLLM ``AsyncLLM`` created with ``worker_extension_cls=WORKER_EXTENSION``; its control
    calls run on its event loop (`AsyncLLMControl`), its bytes go through ``transport``.

    Usable from any thread but its loop's (a synchronous ``Syncer.sync``); from a coroutine on
    that loop, ``await Syncer.async_sync(model)`` and ``await AsyncLLMEngine.open(async_llm)``.

    Args:
        async_llm: the ``AsyncLLM``.
        loop: the event loop it runs on (default: see `AsyncLLMControl`).
        transport: ``"tmpfs"`` (default), ``"gloo"``, or a `Transport`.
        **kwargs: see `RemoteVLLMEngine`.
    """

    name = "vllm-asyncllm"
    control: AsyncLLMControl

    @classmethod
    def accepts(cls, obj: Any) -> bool:
        return instance_of(obj, "vllm.v1.engine.async_llm", "AsyncLLM")

    def __init__(
        self,
        async_llm: Any,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        transport: str | Transport = "tmpfs",
        **kwargs: Any,
    ) -> None:
        super().__init__(AsyncLLMControl(async_llm, loop=loop), transport=transport, **kwargs)
        self.async_llm = async_llm

    @classmethod
    async def open(cls, async_llm: Any, **kwargs: Any) -> AsyncLLMEngine:
        """Create the adapter from a coroutine on the AsyncLLM's own loop (the construction
        asks the workers for their facts, in a worker thread)."""
        loop = asyncio.get_running_loop()
        return await asyncio.to_thread(lambda: cls(async_llm, loop=loop, **kwargs))

    @property
    def lora_request(self) -> Any:
        """The ``LoRARequest`` to generate with the synced adapter (None: no adapter served)."""
        return self.control.lora_request(self.served_adapter)

    def _adapters_stand(self) -> bool:
        """A rollout coroutine on the AsyncLLM's own loop reads `lora_request` while admitting
        requests, where the workers cannot be asked and waited for: there, the adapters stand
        unless a level-2 sleep was made or reported through this adapter."""
        if self.control.on_loop():
            return self._known_harm < 2
        return super()._adapters_stand()

    @property
    def adapter_requests(self) -> dict[int, Any]:
        """The ``LoRARequest`` of each adapter version kept loaded (see ``adapter_versions``),
        by version, oldest first: a rollout admitted under version k generates with the
        request of k to its end."""
        return {k: self.control.lora_request(name) for k, name in self.resident_adapters.items()}
