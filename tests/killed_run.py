"""Run only by ``test_suite_hygiene.py``, in a nested test run that it then SIGKILLs as a whole:
what such a run leaves behind, a server in a session of its own and a shared-memory segment
(the resource tracker that would unlink it dies with the run)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path


def test_hold_until_killed() -> None:
    segment = shared_memory.SharedMemory(create=True, size=4096)
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    server = subprocess.Popen(["sleep", "600"], start_new_session=True)
    out = Path(os.environ["KILLED_RUN_OUT"])
    out.with_suffix(".tmp").write_text(json.dumps({"shm": segment.name, "server": server.pid}))
    out.with_suffix(".tmp").rename(out)
    time.sleep(600)
