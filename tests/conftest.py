"""After every test, each engine it used is made usable again, so one failing test stays one
failure instead of hanging the tests after it.

Two states outlive a failed test on a shared (module-scoped) in-process ``vllm.LLM``:

- a sleep: vLLM pauses its scheduler on ``sleep`` (also on CPU, where the memory part is a
  no-op) and resumes it only once every tag is awake. Recording the wake (``mark_awake``) is not
  enough: the next ``generate`` would wait forever.
- a request left in the scheduler by a ``generate`` that raised (or was interrupted by the
  per-test timeout): in-process, the next ``generate`` spins on it forever
  (docs/failure-modes.md, row 5). Aborting it is the recovery.

``tests/test_reliability.py::test_a_failure_while_asleep_stays_one_failure`` runs failing tests
in a nested pytest session against a real engine to prove this.
"""

from __future__ import annotations

import pytest

from weightsync.engines import Engine

pytest_plugins = ["pytester"]


def recover(engine: Engine) -> list[str]:
    """Wake ``engine`` for real and abort requests a failed ``generate`` left behind; return
    what was done (empty if the engine was fine)."""
    done = []
    llm = getattr(getattr(engine, "llm", None), "llm_engine", None)
    if engine.asleep or (llm is not None and llm.is_sleeping()):
        engine.wake_up()
        done.append("woke the engine")
    if llm is not None:
        left = list(llm.output_processor.request_states)
        if left:
            llm.abort_request(left, internal=True)
            done.append(f"aborted {len(left)} request(s) left in vLLM's scheduler")
    return done


@pytest.fixture(autouse=True)
def _recover_engines(request):
    yield
    for value in list(request.node.funcargs.values()):
        if isinstance(value, Engine):
            recover(value)
