"""The suite's own hygiene: a test run SIGKILLed as a whole (no stop of its runs) leaves a
server and /dev/shm entries, and the next run on the machine stops and removes them at its start
(tests/conftest.py, "a run killed before its end"). It runs alone: the next run judges
/dev/shm only when no other test run is alive, and a module beside it may be running one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from benchmarks.processes import stretched

ROOT = Path(__file__).resolve().parents[1]


def _nested_run(path: str, out: Path, *args: str) -> subprocess.Popen:
    # a run of its own, not one nested in this one: without this run's markers
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_TESTS_")}
    env["KILLED_RUN_OUT"] = str(out)
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider", *args, path],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_the_next_run_stops_and_removes_what_a_killed_run_left(tmp_path):
    out = tmp_path / "held.json"
    killed = _nested_run("tests/killed_run.py", out)
    server = None
    try:
        deadline = time.monotonic() + stretched(120)
        while not out.exists():
            assert killed.poll() is None, killed.communicate()[0]
            assert time.monotonic() < deadline, "the nested run did not start its test"
            time.sleep(0.2)
        held = json.loads(out.read_text())
        server = psutil.Process(held["server"])
        os.killpg(killed.pid, signal.SIGKILL)  # the whole run, as a CI job's cancel does
        killed.wait(timeout=30)
        time.sleep(1)
        assert server.is_running(), "the server should outlive the run it was started by"
        assert (Path("/dev/shm") / held["shm"]).exists()

        nxt = _nested_run("tests/killed_run.py", tmp_path / "unused", "--collect-only")
        report = nxt.communicate(timeout=stretched(120))[0]
        assert nxt.returncode == 0, report
        assert f"a test run killed before its end (PID {killed.pid}) left behind" in report
        assert f"process {server.pid} (stopped now)" in report
        assert f"/dev/shm/{held['shm']} (removed now)" in report
        assert not server.is_running()
        assert not (Path("/dev/shm") / held["shm"]).exists()
    finally:
        if killed.poll() is None:
            os.killpg(killed.pid, signal.SIGKILL)
            killed.wait(timeout=30)
        if server is not None and server.is_running():
            server.kill()
        if out.exists():
            (Path("/dev/shm") / json.loads(out.read_text())["shm"]).unlink(missing_ok=True)
