"""Job validation and load_job."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from unbroken.errors import ConfigError, JobLoadError
from unbroken.job import Job, load_job

DATA = TensorDataset(torch.zeros(10, 2), torch.zeros(10))


def make_job(**fields: object) -> Job:
    values: dict[str, object] = {
        "name": "unit",
        "model": lambda: nn.Linear(2, 1),
        "optimizer": lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
        "dataset": DATA,
        "loss": nn.functional.mse_loss,
        "batch_size": 4,
        "num_steps": 3,
    }
    values.update(fields)
    return Job(**values)  # type: ignore[arg-type]


JOB_SOURCE = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from unbroken import Job

def make():
    return Job(
        name="from-file",
        model=lambda: nn.Linear(2, 1),
        optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
        dataset=TensorDataset(torch.zeros(6, 2), torch.zeros(6)),
        loss=nn.functional.mse_loss,
        batch_size=3,
        num_steps=2,
    )

job = make()
number = 5
nothing = None

def needs_args(x, y):
    return make()


def with_args(argv):
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    return make_steps(parser.parse_args(argv).steps)


def make_steps(steps=7):
    job = make()
    import dataclasses
    return dataclasses.replace(job, num_steps=steps)

def broken():
    raise RuntimeError("dataset missing")
"""


@pytest.fixture
def job_file(tmp_path: Path) -> Path:
    path = tmp_path / "myjob.py"
    path.write_text(JOB_SOURCE)
    return path


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"batch_size": 0}, ["Job.batch_size", "= 0", "at least 1"]),
        ({"batch_size": -3}, ["Job.batch_size", "-3"]),
        ({"num_steps": 0}, ["Job.num_steps", "= 0", "at least 1"]),
        ({"dataset": TensorDataset(torch.zeros(0, 2))}, ["Job.dataset", "empty"]),
        ({"name": ""}, ["Job.name", "non-empty"]),
        ({"name": "x" * 129}, ["Job.name", "128"]),
    ],
)
def test_invalid_jobs_are_refused_naming_the_field(fields: dict[str, object], words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        make_job(**fields)
    for w in words:
        assert w in str(err.value)


def test_a_valid_job_reports_its_size() -> None:
    job = make_job()
    assert job.num_samples == 10
    assert job.batch_size == 4


def test_identity_is_stable_and_changes_with_what_must_match() -> None:
    base = make_job().identity()
    assert make_job().identity() == base
    assert make_job(model=lambda: nn.Linear(2, 1, bias=False)).identity() == base  # the model has its own check
    changed = [
        make_job(batch_size=5),
        make_job(num_steps=4),
        make_job(seed=1),
        make_job(name="other"),
        make_job(dataset=TensorDataset(torch.zeros(11, 2), torch.zeros(11))),
    ]
    ids = [j.identity() for j in changed]
    assert base not in ids
    assert len(set(ids)) == len(ids)
    assert len(base) == 16


def test_build_is_deterministic_given_the_seed() -> None:
    job = make_job(seed=3)
    (m1, _), (m2, _) = job.build(), job.build()
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values(), strict=True))
    m3, opt = make_job(seed=4).build()
    assert not torch.equal(m1.weight, m3.weight)
    assert opt.param_groups[0]["params"][0] is m3.weight


# ---------------------------------------------------------------- load_job


def test_load_a_job_from_a_file(job_file: Path) -> None:
    job = load_job(f"{job_file}:job")
    assert isinstance(job, Job) and job.name == "from-file"


def test_load_a_job_from_a_factory_in_a_file(job_file: Path) -> None:
    job = load_job(f"{job_file}:make")
    assert isinstance(job, Job) and job.batch_size == 3


def test_load_a_job_from_a_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"unit_job_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(JOB_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert load_job(f"{name}:job").name == "from-file"
        assert load_job(f"{name}:make").num_steps == 2
    finally:
        sys.modules.pop(name, None)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(JobLoadError, match=r"job file .*nope\.py does not exist"):
        load_job(f"{tmp_path}/nope.py:job")


def test_a_missing_attribute_is_named(job_file: Path) -> None:
    with pytest.raises(JobLoadError, match="has no attribute 'jobb'"):
        load_job(f"{job_file}:jobb")


def test_a_missing_module_is_named() -> None:
    with pytest.raises(JobLoadError, match=r"importing 'no_such_module_xyz' failed: ModuleNotFoundError"):
        load_job("no_such_module_xyz:job")


def test_an_attribute_that_is_not_a_job_is_named(job_file: Path) -> None:
    with pytest.raises(JobLoadError, match=r"is a int, not an unbroken\.Job"):
        load_job(f"{job_file}:number")


def test_a_file_that_fails_to_import_says_why(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nraise ImportError('needs a GPU')\n")
    with pytest.raises(JobLoadError, match=r"importing .*bad\.py' failed: ImportError: needs a GPU"):
        load_job(f"{bad}:job")


def test_a_file_with_a_syntax_error_says_so(tmp_path: Path) -> None:
    bad = tmp_path / "syntax.py"
    bad.write_text("def (:\n")
    with pytest.raises(JobLoadError, match="SyntaxError"):
        load_job(f"{bad}:job")


@pytest.mark.parametrize("ref", ["job.py", "job.py:", ":job", "module", ""])
def test_a_malformed_reference_shows_the_expected_form(ref: str) -> None:
    with pytest.raises(JobLoadError, match=r"FILE\.py:ATTR or MODULE:ATTR"):
        load_job(ref)


def test_a_factory_that_fails_raises_a_job_load_error_naming_it(job_file: Path) -> None:
    with pytest.raises(JobLoadError, match="dataset missing"):
        load_job(f"{job_file}:broken")


def test_a_factory_that_needs_arguments_raises_a_job_load_error(job_file: Path) -> None:
    with pytest.raises(JobLoadError, match="needs_args"):
        load_job(f"{job_file}:needs_args")


def test_an_attribute_set_to_none_is_reported_as_not_a_job(job_file: Path) -> None:
    with pytest.raises(JobLoadError, match=r"NoneType, not an unbroken\.Job"):
        load_job(f"{job_file}:nothing")


def test_job_arguments_reach_a_factory_that_takes_them_and_set_the_identity(job_file: Path) -> None:
    job = load_job(f"{job_file}:with_args", ["--steps", "11"])
    assert job.num_steps == 11 and job.args == ("--steps", "11")
    other = load_job(f"{job_file}:with_args", ["--steps", "11", "--steps", "11"])
    assert job.identity() != other.identity(), "nodes given other arguments are another job"
    assert load_job(f"{job_file}:make_steps").num_steps == 7, "a factory with defaults is called bare"


@pytest.mark.parametrize(
    ("attr", "args", "match"),
    [
        ("job", ["--lr", "1"], r"is a Job: make it a function def job\(argv: list\[str\]\)"),
        ("make", ["--lr", "1"], r"takes none: write def make\(argv: list\[str\]\) -> Job"),
        ("with_args", ["--nope"], r"refused its arguments \['--nope'\]"),
    ],
)
def test_job_arguments_that_cannot_be_taken_are_refused_with_the_fix(
    job_file: Path, attr: str, args: list[str], match: str
) -> None:
    with pytest.raises(JobLoadError, match=match):
        load_job(f"{job_file}:{attr}", args)


def test_an_optimizer_factory_given_parameters_names_the_new_form() -> None:
    job = make_job(optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    with pytest.raises(ConfigError, match=r"receives the model, not its parameters: write optimizer=lambda model"):
        job.build()


def test_the_optimizer_factory_gets_the_model_for_parameter_groups() -> None:
    def groups(model: nn.Module) -> torch.optim.Optimizer:
        named = dict(model.named_parameters())
        return torch.optim.AdamW([{"params": [named["weight"]]}, {"params": [named["bias"]], "weight_decay": 0}])

    _, optimizer = make_job(optimizer=groups).build()
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (
            {"scheduler": lambda opt: 3},
            r"Job.scheduler: the scheduler is a int without state_dict, load_state_dict, step\(\)",
        ),
        ({"state": lambda model: {"ema": [1.0]}}, r"Job.state: state 'ema' is a list without state_dict"),
        ({"state": lambda model: [model]}, r"Job.state must return a dict"),
    ],
)
def test_state_that_cannot_be_replicated_is_refused(fields: dict[str, object], match: str) -> None:
    job = make_job(**fields)
    model, optimizer = job.build()
    with pytest.raises(ConfigError, match=match):
        job.build_scheduler(optimizer)
        job.build_state(model)


def test_a_job_needs_exactly_one_of_loss_and_step() -> None:
    with pytest.raises(ConfigError, match=r"give loss= .* or step= .*one of them"):
        make_job(loss=None)
    with pytest.raises(ConfigError, match="one of them"):
        make_job(step=lambda model, batch: model(batch[0]).sum())


def test_step_takes_any_batch_and_loss_names_it_when_the_batch_is_not_inputs_and_targets() -> None:
    dict_batch = {"x": torch.ones(3, 2), "y": torch.zeros(3, 1)}
    job = make_job(loss=None, step=lambda model, batch: nn.functional.mse_loss(model(batch["x"]), batch["y"]))
    model, _ = job.build()
    assert job.microbatch_loss(model, dict_batch).item() >= 0
    with pytest.raises(ConfigError, match=r"Job.loss needs batches of \(inputs, targets\); collate made a dict"):
        make_job().microbatch_loss(model, dict_batch)


def test_several_optimizers_step_together_and_replicate_together() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 1), nn.Linear(2, 1)

    job = make_job(
        model=Two,
        optimizer=lambda m: {"a": torch.optim.SGD(m.a.parameters(), lr=1.0), "b": torch.optim.Adam(m.b.parameters())},
        loss=None,
        step=lambda m, batch: m.a(batch[0]).sum() + m.b(batch[0]).sum(),
    )
    model, opt = job.build()
    before = [p.detach().clone() for p in model.parameters()]
    job.microbatch_loss(model, (torch.ones(3, 2), None)).backward()
    opt.step()
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    _, other = job.build()
    other.load_state_dict(opt.state_dict())
    assert other.state_dict()["b"]["state"][0]["step"] == 1 and set(other.state_dict()) == {"a", "b"}


def test_optimizers_that_share_a_parameter_are_refused() -> None:
    job = make_job(optimizer=lambda m: [torch.optim.SGD(m.parameters(), lr=1), torch.optim.SGD([m.bias], lr=1)])
    with pytest.raises(ConfigError, match=r"optimizers '0' and '1' share a parameter"):
        job.build()


def test_a_factory_with_an_optional_argv_gets_the_arguments_even_when_there_are_none(tmp_path: Path) -> None:
    path = tmp_path / "argv_job.py"
    path.write_text(JOB_SOURCE + "\n\ndef optional(argv=None):\n    assert argv == [], argv\n    return make()\n")
    assert load_job(f"{path}:optional").name == "from-file"


def test_state_that_cannot_be_sent_and_a_scheduler_that_needs_a_metric_are_refused() -> None:
    class Odd:
        def state_dict(self) -> dict[str, object]:
            return {"x": object()}

        def load_state_dict(self, state: dict[str, object]) -> None:
            pass

    job = make_job(state=lambda model: {"odd": Odd()})
    model, optimizer = job.build()
    with pytest.raises(ConfigError, match=r"Job.state: state 'odd''s state_dict\(\) cannot be sent to other nodes"):
        job.build_state(model)
    plateau = make_job(scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    with pytest.raises(ConfigError, match=r"step\(\) needs arguments .*step it in after_step instead"):
        plateau.build_scheduler(optimizer)


def test_the_optimizers_hyperparameters_are_part_of_the_job_identity_and_named_when_they_differ() -> None:
    from unbroken.control.membership import job_differences

    def build(lr: float, fused: bool | None = None) -> torch.optim.Optimizer:
        return torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=lr, fused=fused)

    job = Job(
        name="j",
        model=lambda: torch.nn.Linear(2, 2),
        optimizer=lambda m: build(1e-3),
        dataset=torch.utils.data.TensorDataset(torch.zeros(4, 2)),
        loss=torch.nn.functional.mse_loss,
        batch_size=2,
        num_steps=3,
    )
    assert job.identity(build(1e-3)) == job.identity(build(1e-3)) != job.identity(build(2e-3))
    assert job.identity(build(1e-3)) == job.identity(build(1e-3, fused=False)), "a kernel choice is not the math"
    assert job.identity() != job.identity(build(1e-3)), "checkpoints keep the identity without the optimizer"
    ours, theirs = (json.dumps(job.identity_spec(build(lr))) for lr in (1e-3, 2e-3))
    assert job_differences(ours, theirs) == ["optimizer[0].lr: 0.001 vs 0.002"]
    assert job_differences(ours, "not json") == []
