"""Which strategy brings the engine in step with the trainer, and why.

Call `choose` right after the engine wakes, before generating. The rule is the one RL
frameworks converged on (ms-swift's ``move_full_model``), made explicit:

===========  ============  ==============  ===========  =====================================
train_type   rollout_lora  base_sync_done  sleep_level  choice
===========  ============  ==============  ===========  =====================================
full         any           any             0, 1, 2      FullSync
lora         False         any             0, 1, 2      FullSync (LoRA merged into weights)
lora         True          False           0, 1, 2      FullSync (base + adapter)
lora         True          True            2            FullSync (base + adapter)
lora         True          True            0, 1         AdapterSync
===========  ============  ==============  ===========  =====================================

``base_sync_done`` is the caller's word; the AdapterSync it leads to still proves, before it
writes, that the engine holds the base the adapter was trained against
(`weightsync.strategies.proof`: not after a merged sync, nor onto another base) and refuses
otherwise; `weightsync.Syncer` then restores the base with the adapter instead.

A FullSync chosen for ``sleep_level`` 1 or 2 skips nothing (``skip_unchanged=False``): the caller
says the engine slept, so no record of what it held counts.

``prefer_reload=True`` replaces "FullSync (base + adapter)" with ReloadWeights of the engine's
own checkpoint followed by the adapter: valid only when the engine serves the adapter, because
only then is the base the trainer holds the untouched checkpoint. Asking for it with full
training or merged LoRA is an error, since the checkpoint no longer matches the trainer.
"""

from __future__ import annotations

from typing import Literal

from .strategies import AdapterSync, FullSync, ReloadWeights, Strategy

TrainType = Literal["full", "lora"]
TRAIN_TYPES = ("full", "lora")
SLEEP_LEVELS = (0, 1, 2)


def _require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def choose(
    *,
    train_type: TrainType,
    rollout_lora: bool,
    base_sync_done: bool,
    sleep_level: int,
    prefer_reload: bool = False,
) -> Strategy:
    """Pick the strategy for this sync and say why.

    Args:
        train_type: ``"full"`` (every weight trains) or ``"lora"`` (a PEFT LoRA adapter trains
            on a frozen base).
        rollout_lora: the engine serves the adapter itself (vLLM ``enable_lora=True``). False
            means LoRA is merged into the weights before sending.
        base_sync_done: the engine already holds the trainer's base weights from an earlier
            completed sync.
        sleep_level: the deepest vLLM sleep level since the last sync: 0 (not slept),
            1 (weights offloaded to host, kept) or 2 (weights discarded).
        prefer_reload: where the base must be restored and the base is the engine's own
            checkpoint, reload it from disk instead of pushing it from trainer memory.

    Returns:
        A strategy instance; its ``name`` and ``reason`` say what was chosen and why.

    Raises:
        ValueError: an argument outside what is listed above, or ``prefer_reload`` where
            reloading the checkpoint would not reproduce the trainer.
    """
    if train_type not in TRAIN_TYPES:
        raise ValueError(f"train_type must be one of {TRAIN_TYPES}, got {train_type!r}")
    _require_bool("rollout_lora", rollout_lora)
    _require_bool("base_sync_done", base_sync_done)
    _require_bool("prefer_reload", prefer_reload)
    if isinstance(sleep_level, bool) or sleep_level not in SLEEP_LEVELS:
        raise ValueError(
            f"sleep_level must be one of {SLEEP_LEVELS} (vLLM has no other), got {sleep_level!r}"
        )

    if prefer_reload and (train_type == "full" or not rollout_lora):
        what = "full training" if train_type == "full" else "LoRA merged into the weights"
        raise ValueError(
            f"prefer_reload is not valid with {what}: the engine's checkpoint on disk no longer "
            "matches the trainer's weights, so reloading it would serve stale weights "
            "(the trl#5312 failure). Reloading is valid only with train_type='lora' and "
            "rollout_lora=True; use ReloadWeights(snapshot_dir=...) to reload a fresh snapshot."
        )

    # A sleep the caller reports is a fact about the engine this choice is made for: the
    # FullSync it returns skips nothing, whatever the engine's record says.
    skip = sleep_level == 0
    slept = "" if skip else f"; sleep level {sleep_level}: nothing is skipped"
    if train_type == "full":
        return FullSync(
            reason=f"full training: every weight may have changed{slept}", skip_unchanged=skip
        )
    if not rollout_lora:
        return FullSync(
            lora="merge",
            reason="the engine does not serve LoRA, so the adapter is merged into the weights"
            + slept,
            skip_unchanged=skip,
        )
    if not base_sync_done:
        why = "the base has not been pushed to the engine yet"
    elif sleep_level == 2:
        why = "sleep level 2 discarded the engine's base weights"
    else:
        return AdapterSync(
            reason=f"the engine holds the base (sleep level {sleep_level} kept it); "
            "only the adapter changed"
        )
    if prefer_reload:
        return ReloadWeights(reason=f"{why}; reloading the untouched base from its checkpoint")
    return FullSync(lora="separate", reason=f"{why}; pushing base + adapter", skip_unchanged=skip)
