"""A sharded (FSDP2) trainer syncing into a real vLLM engine on rank 0, two processes, gloo.

The ranks run tests/fsdp_worker.py under torchrun; the cases and what each asserts are there.
This test launches it on a free local port, with a timeout, and stops exactly the process
group it started if anything goes wrong.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.processes import free_port
from weightsync import testing

WORKER = Path(__file__).with_name("fsdp_worker.py")
CASES = [
    "full",
    "refused-shapes",
    "abort-mid-stream",
    "lora-merged",
    "lora-served",
    "reload",
    "refused-adapter-rank",
    "refused-on-rank-1",
    "engine-on-rank-1",
]
TIMEOUT = 240


@pytest.mark.timeout(TIMEOUT + 30)
def test_fsdp2_two_ranks_sync_into_vllm_on_rank_0(tmp_path):
    checkpoint = testing.save_checkpoint(testing.tiny_model("qwen2", seed=0), tmp_path / "ckpt")
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [
        str(torchrun),
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(WORKER),
        checkpoint,
    ]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    # A session of its own: on failure the whole group (torchrun and its two ranks) is stopped.
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the ranks did not finish within {TIMEOUT}s:\n{output[-6000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-6000:]
    print("\n".join(line for line in output.splitlines() if "CASE " in line))  # shown with -s
    for case in CASES:
        for rank in (0, 1):
            seen = f"CASE {case} OK rank {rank}" in output
            assert seen, f"{case} on rank {rank}:\n{output[-6000:]}"
