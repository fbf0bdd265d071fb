"""The epoch's arithmetic, without an engine: what a worker's ledger answers about the harm since
an epoch (the wrapping of vLLM's own methods is tested on real engines in test_attested_vllm.py,
test_server_vllm.py and test_multiproc_vllm.py)."""

from __future__ import annotations

import torch

from weightsync.engines.vllm.in_engine.ledger import (
    _SAMPLERS,
    LOG_SIZE,
    Ledger,
    attest,
    note_adapter,
    seal,
)


def test_harm_since_an_epoch_is_the_worst_logged_after_it():
    ledger = Ledger(asleep=False)
    assert ledger.report(None)["harm"] == 0
    ledger.record(2)  # a write
    mark = [ledger.boot, ledger.epoch]
    assert ledger.report(mark) == {
        "boot": ledger.boot,
        "epoch": 1,
        "asleep": [],
        "harm": 0,
        "adapters": 0,
    }
    ledger.record(1)  # a level-1 sleep and its wake
    ledger.record(1)
    assert ledger.report(mark)["harm"] == 1
    ledger.record(2)  # a level-2 sleep
    assert ledger.report(mark)["harm"] == 2
    assert ledger.report([ledger.boot, ledger.epoch])["harm"] == 0


def test_another_boot_or_a_log_too_short_counts_as_lost():
    ledger = Ledger(asleep=False)
    assert ledger.report(["another-process", 0])["harm"] == 2  # the engine restarted
    mark = [ledger.boot, ledger.epoch]
    for _ in range(LOG_SIZE + 1):
        ledger.record(1)
    assert ledger.report(mark)["harm"] == 2  # what happened first is no longer known


def test_asleep_when_installed_is_an_unknown_level():
    ledger = Ledger(asleep=True)
    report = ledger.report(None)
    assert report["harm"] == 2 and report["asleep"] == ["kv_cache", "weights"]


def test_adapter_writes_are_counted_and_leave_the_epoch():
    """Every ``add_lora`` (by anyone, an in-place re-add too) and weightsync's in-memory
    installs count as adapter writes; neither moves the epoch nor harms the base."""

    class Worker:  # the worker methods the ledger wraps
        def sleep(self, level: int = 1) -> None: ...

        def wake_up(self, tags: list[str] | None = None) -> None: ...

        def add_lora(self, request: object) -> bool:
            return True

    worker = Worker()
    first = attest(worker)
    assert first["adapters"] == 0
    assert worker.add_lora("an adapter") is True
    note_adapter(worker)
    now = attest(worker, since=[[first["boot"], first["epoch"]]])
    assert now["adapters"] == 2 and now["epoch"] == first["epoch"] and now["harm"] == 0


def test_the_seal_sees_writes_and_replacements_through_its_kept_views():
    """The seal keeps where it reads a model between reports: a write in place is read through
    its views, and a replaced parameter, parameter data or module, or an added parameter,
    makes it find the parameters again; a recorded event drops what it kept."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.Linear(300, 2))
    model.to(torch.bfloat16)
    first = seal(model)
    assert seal(model) == first and _SAMPLERS[model] is _SAMPLERS[model]
    kept = _SAMPLERS[model]

    saved = model[0].weight.data.view(-1)[0].item()
    model[0].weight.data.view(-1)[0] = saved + 1  # through .data: no version counter moves
    assert seal(model) != first and _SAMPLERS[model] is kept
    model[0].weight.data.view(-1)[0] = saved
    assert seal(model) == first

    changes = [
        lambda: setattr(model[1], "weight", torch.nn.Parameter(model[1].weight * 2)),
        lambda: setattr(model[1].weight, "data", model[1].weight.detach() * 2),
        lambda: model.__setitem__(1, torch.nn.Linear(300, 2).to(torch.bfloat16)),
        lambda: model[1].register_parameter("extra", torch.nn.Parameter(torch.ones(3))),
    ]
    for change in changes:
        before = seal(model)
        change()
        assert seal(model) != before and _SAMPLERS[model] is not kept
        kept = _SAMPLERS[model]

    Ledger(asleep=False).record(1)
    assert model not in _SAMPLERS
