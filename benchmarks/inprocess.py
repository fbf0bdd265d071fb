"""The in-process vLLM engines the rows name (``plain``, ``lora``, ``untied``: `benchmarks.rows`).

Each is started at the first row that needs it and kept to the end of the run: deleting an
in-process vLLM engine tears down vLLM's process-wide parallel state, which the others still use.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from weightsync.engines import VLLMEngine
from weightsync.testing import make_llm

from .models import ModelSpec
from .rows import RANKS


class InProcessEngines:
    """``engine(which)`` starts ``which`` on ``spec`` (``untied`` on its untied twin)."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        untied: ModelSpec | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.spec = spec
        self.untied = untied
        self.log = log
        self._engines: dict[str, VLLMEngine] = {}

    def started(self, which: str) -> bool:
        return which in self._engines

    def engine(self, which: str) -> VLLMEngine:
        if which not in self._engines:
            spec = self.untied if which == "untied" else self.spec
            assert spec is not None
            self.log(f"[bench] starting vLLM engine '{which}' on {spec.name}")
            t = time.perf_counter()
            llm = make_llm(
                spec.checkpoint,
                dtype=spec.dtype_name,
                enable_lora=which in ("lora", "lora16"),
                max_lora_rank=16 if which == "lora16" else max(RANKS),
            )
            self._engines[which] = VLLMEngine(llm)
            self.log(f"[bench] engine '{which}' ready in {time.perf_counter() - t:.1f} s")
        return self._engines[which]

    def close(self) -> None:
        """Drop every engine (at the end of the run)."""
        self._engines.clear()
