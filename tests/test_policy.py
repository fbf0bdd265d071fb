"""policy.choose: every row of the decision table, and every bad argument."""

import itertools

import pytest

from weightsync import AdapterSync, FullSync, ReloadWeights, policy

BOOLS = (False, True)
LEVELS = (0, 1, 2)


def choose(**kw):
    return policy.choose(**kw)


@pytest.mark.parametrize(
    "rollout_lora,base_sync_done,level", list(itertools.product(BOOLS, BOOLS, LEVELS))
)
def test_full_training_always_full_sync(rollout_lora, base_sync_done, level):
    s = choose(
        train_type="full",
        rollout_lora=rollout_lora,
        base_sync_done=base_sync_done,
        sleep_level=level,
    )
    assert type(s) is FullSync and s.lora is None
    assert "full training" in s.reason


@pytest.mark.parametrize("base_sync_done,level", list(itertools.product(BOOLS, LEVELS)))
def test_lora_not_served_is_merged(base_sync_done, level):
    s = choose(
        train_type="lora", rollout_lora=False, base_sync_done=base_sync_done, sleep_level=level
    )
    assert type(s) is FullSync and s.lora == "merge"
    assert "merged" in s.reason


@pytest.mark.parametrize("level", LEVELS)
def test_lora_served_base_never_pushed(level):
    s = choose(train_type="lora", rollout_lora=True, base_sync_done=False, sleep_level=level)
    assert type(s) is FullSync and s.lora == "separate"
    assert "not been pushed" in s.reason


def test_lora_served_level2_discarded_base():
    s = choose(train_type="lora", rollout_lora=True, base_sync_done=True, sleep_level=2)
    assert type(s) is FullSync and s.lora == "separate"
    assert "level 2" in s.reason


@pytest.mark.parametrize("level", (0, 1))
def test_lora_served_base_kept_adapter_only(level):
    s = choose(train_type="lora", rollout_lora=True, base_sync_done=True, sleep_level=level)
    assert type(s) is AdapterSync
    assert s.name == "AdapterSync" and f"sleep level {level}" in s.reason


@pytest.mark.parametrize("base_sync_done,level", [(False, 0), (False, 1), (False, 2), (True, 2)])
def test_prefer_reload_where_base_must_be_restored(base_sync_done, level):
    s = choose(
        train_type="lora",
        rollout_lora=True,
        base_sync_done=base_sync_done,
        sleep_level=level,
        prefer_reload=True,
    )
    assert type(s) is ReloadWeights and s.snapshot_dir is None
    assert "checkpoint" in s.reason


@pytest.mark.parametrize("level", (0, 1))
def test_prefer_reload_keeps_adapter_only_when_base_is_held(level):
    s = choose(
        train_type="lora",
        rollout_lora=True,
        base_sync_done=True,
        sleep_level=level,
        prefer_reload=True,
    )
    assert type(s) is AdapterSync


@pytest.mark.parametrize(
    "train_type,rollout_lora,match",
    [("full", True, "full training"), ("full", False, "full training"), ("lora", False, "merged")],
)
def test_prefer_reload_invalid_says_why(train_type, rollout_lora, match):
    with pytest.raises(ValueError, match=match) as err:
        choose(
            train_type=train_type,
            rollout_lora=rollout_lora,
            base_sync_done=True,
            sleep_level=2,
            prefer_reload=True,
        )
    assert "stale" in str(err.value)


@pytest.mark.parametrize(
    "kwargs,names",
    [
        (dict(train_type="qlora"), "train_type"),
        (dict(train_type="LoRA"), "train_type"),
        (dict(sleep_level=3), "sleep_level"),
        (dict(sleep_level=-1), "sleep_level"),
        (dict(sleep_level=True), "sleep_level"),
        (dict(sleep_level="2"), "sleep_level"),
        (dict(rollout_lora=1), "rollout_lora"),
        (dict(rollout_lora="True"), "rollout_lora"),
        (dict(base_sync_done=None), "base_sync_done"),
        (dict(prefer_reload=0), "prefer_reload"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, names):
    args = dict(train_type="lora", rollout_lora=True, base_sync_done=True, sleep_level=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=names):
        policy.choose(**args)


def test_import_does_not_pull_vllm():
    import subprocess
    import sys

    code = "import sys, weightsync, weightsync.engines; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
