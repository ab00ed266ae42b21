"""`unbroken.join` and `Swarm`: mistakes are refused with the fix, before any connection."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import unbroken
from unbroken.errors import ConfigError


def test_join_without_a_coordinator_names_the_three_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UNBROKEN_COORDINATOR", raising=False)
    with pytest.raises(ConfigError, match=r"UNBROKEN_COORDINATOR.*unbroken run"):
        unbroken.join(job="j", batch_size=4, steps=2)


def test_join_takes_the_environment_and_node_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNBROKEN_COORDINATOR", "10.0.0.1:29400,10.0.0.2:29400")
    swarm = unbroken.join(job="j", batch_size=4, steps=2, name="gpu-box", max_microbatch=8)
    assert swarm.config.coordinators == (("10.0.0.1", 29400), ("10.0.0.2", 29400))
    assert swarm.config.name == "gpu-box" and swarm.config.max_microbatch == 8
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['batch'\]"):
        unbroken.join("h:1", job="j", batch_size=4, steps=2, batch=3)


def test_replicate_and_batches_are_checked_before_joining() -> None:
    swarm = unbroken.join("127.0.0.1:9", job="j", batch_size=4, steps=2)
    data = TensorDataset(torch.zeros(8, 1))
    with pytest.raises(ConfigError, match="replicate"):
        next(iter(swarm.batches(data)))
    with pytest.raises(ConfigError, match=r"torch\.nn\.Module"):
        swarm.replicate(lambda x: x, None)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert swarm.replicate(model, opt) == (model, opt)
    with pytest.raises(ConfigError, match="batch_size is 3 but the job's global batch is 4"):
        next(iter(swarm.batches(DataLoader(data, batch_size=3))))
    with pytest.raises(ConfigError, match=r"swarm\.step"):
        swarm.step()
    with pytest.raises(ConfigError, match="backward"):
        swarm.backward(torch.zeros(()))


def test_unbroken_run_names_a_missing_script(capsys: pytest.CaptureFixture[str]) -> None:
    from unbroken.cli.main import main

    assert main(["run", "no/such/script.py", "--coordinator", "127.0.0.1:9"]) == 2
    assert "no/such/script.py is not a file" in capsys.readouterr().err


def test_a_scheduler_left_out_of_replicate_is_refused_before_joining() -> None:
    swarm = unbroken.join("127.0.0.1:9", job="j", batch_size=4, steps=2)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    swarm.replicate(model, opt)
    data = TensorDataset(torch.zeros(8, 1))
    with pytest.raises(ConfigError, match=r"initial_lr.*swarm\.replicate\(model, opt, sched\)"):
        next(iter(swarm.batches(data)))
    assert sched.last_epoch == 0


def test_a_scheduler_resumed_from_a_checkpoint_of_ones_own_is_refused_naming_the_ways() -> None:
    swarm = unbroken.join("127.0.0.1:9", job="j", batch_size=4, steps=2)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    sched.load_state_dict({**sched.state_dict(), "last_epoch": 120})
    swarm.replicate(model, opt, sched)
    with pytest.raises(ConfigError, match=r"at step 120 before the job's first step.*--checkpoint-dir"):
        next(iter(swarm.batches(TensorDataset(torch.zeros(8, 1)))))
