"""weightsync as verl's checkpoint-engine backend, through verl's own classes (issue 34).

verl 0.9.1's ``CheckpointEngineManager.update_weights`` drives its ``ActorRolloutRefWorker``
(two ranks: rank 0 sends, rank 1 walks the weights and stays out of the group) and its
``CheckpointEngineWorker`` (two one-rank rollout replicas) on a one-node Ray cluster on loopback,
the backend loaded by name from ``weightsync.integrations.verl`` in every process, as a verl user
configures it. What stands in for what verl cannot run on a CPU (its FSDP engine, its vLLM
``ServerAdapter``): ``benchmarks/verl.py``. The model is tiny Qwen2 in bf16, tied embeddings.

verl 0.9.1 installs beside the project's environment (``.ci/verl-env``: verl and its pure-Python
packages ``--no-deps`` into ``.venv/verl-site``, about 30 MB, once); run under ``.ci/env`` alone,
this module builds that folder first and puts it on the path, here and for Ray's workers. It is
skipped, saying why, only when verl cannot be installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

# Before Ray is imported (verl imports it; see benchmarks.processes.ray_cluster): loopback only.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / ".venv" / "verl-site"


def _install_verl() -> str:
    """Make verl importable here and in the Ray workers this module starts (they inherit
    PYTHONPATH); "" when it is, else why not."""
    try:
        import verl.checkpoint_engine  # noqa: F401

        return ""
    except ImportError:
        pass
    built = subprocess.run(
        ["bash", str(ROOT / ".ci" / "verl-env"), "true"], capture_output=True, text=True
    )
    if built.returncode != 0:
        return f"verl 0.9.1 cannot be installed here (.ci/verl-env): {built.stderr[-800:]}"
    sys.path.append(str(SITE))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH"), str(SITE)) if p
    )
    return ""


if why := _install_verl():
    pytest.skip(why, allow_module_level=True)

from benchmarks import verl as B  # noqa: E402
from benchmarks.processes import ray_cluster  # noqa: E402
from weightsync import testing as T  # noqa: E402

SHM = Path("/dev/shm")
METRIC = "checkpoint_engine/weightsync_"

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """verl's manager over the two actor and two rollout ranks, on one Ray node; every process
    stopped by PID after, nothing left in /dev/shm by them."""
    before = set(os.listdir(SHM))
    path = T.save_checkpoint(T.tiny_model(dtype=torch.bfloat16), tmp_path_factory.mktemp("m"))
    # 1 MB buckets: the tiny model (1.1 MB in bf16) travels in two.
    with ray_cluster(1, cpus_per_node=8):
        run = B.Run(path, B.BACKEND, {"delta": True, "model_path": path}, bucket_mb=1)
        try:
            yield run
        finally:
            run.close()
    new = set(os.listdir(SHM)) - before
    left = [
        n
        for n in new
        if re.match(r"weightsync-(\d+)-", n) and not psutil.pid_exists(int(n.split("-")[1]))
    ]
    assert not left, f"left in /dev/shm: {left}"


def check_exact(run) -> dict:
    """Both rollout ranks hold the trainer's bits; the trainer's weights."""
    want = run.trainer()
    assert "lm_head.weight" in want and want["lm_head.weight"].dtype == torch.bfloat16
    for rank, (weights, _, _) in enumerate(run.received()):
        bad = B.mismatches(want, weights)
        assert not bad, f"rollout rank {rank} differs from the trainer in {bad[:5]}"
    return want


def changed_words(before: dict, after: dict) -> int:
    """16-bit words that differ, counted under every name (a tied weight under each)."""
    return sum(
        int((before[n].view(-1).view(torch.int16) != after[n].view(-1).view(torch.int16)).sum())
        for n in after
    )


def check_refused(run, before: list, match: str, **sync) -> None:
    """verl's update_weights fails naming ``match``; neither rollout rank was handed a tensor
    and both hold what they held before."""
    with pytest.raises(Exception, match=match):
        run.sync(**sync)
    for (weights, last, updates), (old, _, old_updates) in zip(run.received(), before, strict=True):
        assert updates == old_updates + 1 and last == {}, "a refused sync handed tensors on"
        assert not B.mismatches(old, weights), "a refused sync changed the rollout's weights"


def test_syncs_through_verl(run):
    """Six syncs through verl's manager: the first full, the next a delta carrying only the
    words the step changed, a tampered one and a diverged one (a NaN) refused with nothing
    handed to either rollout rank, then full again, then a delta again; every accepted one
    bit-exact on both ranks, its metrics back at the trainer."""
    # 1. The first sync: every bucket whole.
    metrics, _ = run.sync(global_steps=1)
    held = check_exact(run)
    buckets = metrics[METRIC + "buckets"]
    assert buckets >= 2 and metrics[METRIC + "delta_buckets"] == 0
    assert metrics[METRIC + "delta_fraction"] == 1.0
    full = metrics[METRIC + "full_bytes"]
    assert metrics[METRIC + "bytes"] == full > 0 and metrics[METRIC + "seconds"] > 0

    # 2. A step moving 1% of the elements: a delta, its changed words and nothing more. Each
    # changed 16-bit word travels as its gap and its value (4 bytes), once per bucket it is in
    # (the tied embedding: once, or twice when lm_head falls in another bucket); each bucket
    # adds its small JSON header.
    once = run.actors.step(2, 0.01)[0]
    metrics, _ = run.sync(global_steps=2)
    now = check_exact(run)
    assert metrics[METRIC + "delta_buckets"] == metrics[METRIC + "buckets"] == buckets
    assert metrics[METRIC + "full_bytes"] == full
    wire = metrics[METRIC + "bytes"]
    assert 4 * once <= wire <= 4 * changed_words(held, now) + 256 * buckets
    assert metrics[METRIC + "delta_fraction"] < 0.05

    # 3. One byte of the second bucket altered after it was tagged: refused, nothing handed on.
    run.actors.step(3, 0.01)
    run.actors.tamper_in_transit(1)
    check_refused(run, run.received(), "not the ones the trainer sent", global_steps=3)

    # 4. A diverged step (one NaN): refused by the rollout ranks, nothing handed on.
    name = "model.layers.1.mlp.up_proj.weight"
    old = run.actors.set_element(name, 7, float("nan"))[0]
    check_refused(run, run.received(), f"{name}: holds NaN", global_steps=4)
    run.actors.set_element(name, 7, old)

    # 5. After a refusal the next sync is full again, and exact.
    metrics, _ = run.sync(global_steps=5)
    check_exact(run)
    assert metrics[METRIC + "delta_buckets"] == 0 and metrics[METRIC + "bytes"] == full

    # 6. And a delta again.
    run.actors.step(6, 0.01)
    metrics, _ = run.sync(global_steps=6)
    check_exact(run)
    assert metrics[METRIC + "delta_buckets"] == buckets
