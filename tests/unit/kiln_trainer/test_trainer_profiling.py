"""kiln_trainer.profiling and ``python -m kiln_trainer --profile``: a job's model is measured
(parameters, FLOPs, graph, step time) and its warm start decided without training; a model no
tracer follows, or one whose step fails, still gets the other measurements."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln import api, contract, models
from kiln.warmstart import select
from kiln.zoo import records, store
from kiln_trainer import cli, profiling

REPO = Path(__file__).resolve().parents[3]
OWN_MODEL = REPO / "examples" / "own-model"
MIXER_JOB = OWN_MODEL / "mixer.yaml"
# Where a job that leaves spec.training.device at auto is timed.
_DEVICE = f"cuda:{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "cpu"

USER_MODULE = '''
import torch
from torch import nn


class Moody(nn.Module):
    """Branches on a tensor value: no tracer can follow that."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 10)
        self.down = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        if x.sum() > 0:
            return self.up(x)
        return self.down(x)


class Scalar(nn.Module):
    """Returns one number per sample, not logits Tensor[B, K]: no loss can be taken."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1)).sum(-1)


def moody() -> Moody:
    return Moody()


def scalar() -> Scalar:
    return Scalar()
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "profiled_nets.py").write_text(USER_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "profiled_nets"
    sys.modules.pop("profiled_nets", None)


@pytest.fixture
def own_model_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.syspath_prepend(str(OWN_MODEL))
    yield
    for name in [m for m in sys.modules if m == "mynets" or m.startswith("mynets.")]:
        sys.modules.pop(name)


def _job(model: dict[str, Any], *, batch_size: int = 32, name: str = "prof",
         warm_start: dict[str, Any] | None = None) -> api.TrainingJob:
    spec: dict[str, Any] = {"model": model, "dataset": {"name": "digits"},
                            "training": {"epochs": 1, "batchSize": batch_size}}
    if warm_start is not None:
        spec["warmStart"] = warm_start
    return api.parse_job({"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
                          "metadata": {"name": name, "namespace": "team"}, "spec": spec})


def _parameters(job: api.TrainingJob) -> int:
    return sum(p.numel() for p in models.build(job.spec.model).parameters())


def _stored(zoo: Path, key: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(store.DirStore(zoo).get_bytes(key))
    return doc


@pytest.mark.parametrize("model", [
    pytest.param({"architecture": "small_cnn", "args": {"depth": 1, "width": 4},
                  "inputShape": [1, 8, 8]}, id="registry-small-cnn"),
    pytest.param({"entrypoint": "mynets.mixer:mixer", "args": {"dim": 16, "depth": 1},
                  "task": "classification", "inputShape": [1, 8, 8]}, id="entrypoint-mixer"),
])
def test_a_model_is_measured_timed_and_stored_in_the_zoo_with_its_graph(
        model: dict[str, Any], own_model_path: None, tmp_path: Path) -> None:
    job = _job(model)
    zoo = tmp_path / "zoo"
    measured = profiling.profile(job, zoo_uri=str(zoo))
    assert measured.parameters == _parameters(job)
    assert measured.flops_per_sample is not None and measured.flops_per_sample > 0
    assert measured.graph_nodes is not None and measured.graph_nodes > 0
    assert measured.untraceable is None
    assert (measured.step_status, measured.step_detail) == ("ok", "")
    assert measured.step_seconds is not None and measured.step_seconds > 0
    assert (measured.device, measured.batch_size) == (_DEVICE, 32)
    assert measured.warm_start_decision is not None
    assert measured.warm_start_decision.outcome == api.WarmStartOutcome.COLD_EMPTY
    assert measured.zoo_key == "profiles/team/prof.json"
    doc = _stored(zoo, measured.zoo_key)
    assert len(doc["graph"]["nodes"]) == measured.graph_nodes
    assert doc["parameters"] == measured.parameters and doc["zoo_key"] == measured.zoo_key
    assert api.WarmStartDecision.model_validate(doc["decision"]) == measured.warm_start_decision
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a profile is no half-written model record
        assert records.list_records(store.DirStore(zoo)) == []


def test_an_untraceable_model_is_reported_so_and_still_counted_and_timed(
        user_module: str) -> None:
    job = _job({"entrypoint": f"{user_module}:moody", "inputShape": [1, 8, 8]})
    measured = profiling.profile(job, zoo_uri=None)
    assert measured.graph_nodes is None
    assert measured.untraceable is not None and "moody" in measured.untraceable
    # The meta device cannot branch on a value, so the FLOPs were counted on the CPU.
    assert measured.flops_per_sample == pytest.approx(2 * 64 * 10)
    assert measured.step_status == "ok" and measured.step_seconds is not None
    assert measured.parameters == _parameters(job)
    assert measured.zoo_key is None
    assert measured.warm_start_decision is not None
    assert measured.warm_start_decision.outcome == api.WarmStartOutcome.COLD_EMPTY


def test_a_step_that_raises_is_the_models_problem_named_with_the_users_line(
        user_module: str, tmp_path: Path) -> None:
    job = _job({"entrypoint": f"{user_module}:scalar", "inputShape": [1, 8, 8]})
    with pytest.raises(models.EntrypointError) as caught:
        profiling.profile(job, zoo_uri=str(tmp_path / "zoo"))
    message = str(caught.value)
    assert message.startswith("spec.model.entrypoint: one training step of ")
    assert "raised IndexError" in message and "fix the model or spec.model.inputShape" in message
    assert not (tmp_path / "zoo" / "profiles").exists()  # nothing half-measured is kept


def test_warm_start_disabled_gives_the_trainers_disabled_decision(tmp_path: Path) -> None:
    job = _job({"architecture": "small_cnn", "args": {"depth": 1, "width": 4},
                "inputShape": [1, 8, 8]}, warm_start={"enabled": False})
    measured = profiling.profile(job, zoo_uri=str(tmp_path / "zoo"))
    assert measured.warm_start_decision is not None
    assert measured.warm_start_decision.outcome == api.WarmStartOutcome.DISABLED


def test_a_decision_made_upstream_is_reported_unchanged(tmp_path: Path) -> None:
    upstream = select.cold_start(api.WarmStartOutcome.COLD_BELOW_MIN_SIMILARITY,
                                 "cold start: decided above")
    job = _job({"architecture": "small_cnn", "args": {"depth": 1, "width": 4},
                "inputShape": [1, 8, 8]})
    measured = profiling.profile(job, zoo_uri=str(tmp_path / "zoo"),
                                 warm_decision_text=upstream.model_dump_json())
    assert measured.warm_start_decision == upstream
    stored = _stored(tmp_path / "zoo", "profiles/team/prof.json")["decision"]
    assert api.WarmStartDecision.model_validate(stored) == upstream


def test_a_zoo_that_cannot_take_the_profile_leaves_no_key_and_warns(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    (zoo / "profiles").write_text("a file where the profiles folder would go", encoding="utf-8")
    job = _job({"architecture": "small_cnn", "args": {"depth": 1, "width": 4},
                "inputShape": [1, 8, 8]})
    with caplog.at_level(logging.WARNING, logger="kiln_trainer.profiling"):
        measured = profiling.profile(job, zoo_uri=str(zoo))
    assert measured.zoo_key is None and measured.step_status == "ok"
    assert "could not write the profile" in caplog.text


def test_profiling_under_torchrun_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code = cli.main(["--profile", "--job", str(MIXER_JOB)])
    assert code == contract.EXIT_INVALID
    assert "--profile: profiling runs in one process, but WORLD_SIZE is 2" in (
        capsys.readouterr().err)


def _run_cli(job: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    log = tmp_path / "termination-log"
    log.touch()  # the kubelet creates it; the trainer only writes an existing one
    env = {**os.environ, contract.Env.TERMINATION_LOG: str(log),
           "PYTHONPATH": os.pathsep.join([str(OWN_MODEL), os.environ.get("PYTHONPATH", "")])}
    env.pop(contract.Env.JOB, None)
    env.pop(contract.Env.ZOO, None)
    done = subprocess.run([sys.executable, "-m", "kiln_trainer", "--profile", "--job", str(job),
                           "--zoo", str(tmp_path / "zoo")], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    return done, log


@pytest.mark.process
def test_the_cli_prints_the_profile_and_leaves_it_in_the_termination_log(
        tmp_path: Path) -> None:
    done, log = _run_cli(MIXER_JOB, tmp_path)
    assert done.returncode == contract.EXIT_OK, done.stderr
    (line,) = done.stdout.strip().splitlines()
    printed = contract.from_line(line)
    assert isinstance(printed, contract.Profile)
    assert printed.step_status == "ok" and printed.graph_nodes and printed.parameters > 0
    assert (printed.batch_size, printed.device) == (64, _DEVICE)  # mixer.yaml's batch
    assert printed.zoo_key == "profiles/default/digits-mixer.json"
    assert contract.read_termination_message(log.read_text()) == printed
    assert (tmp_path / "zoo" / "profiles" / "default" / "digits-mixer.json").is_file()


@pytest.mark.process
def test_the_cli_refuses_a_missing_entrypoint_module_with_exit_2(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(MIXER_JOB.read_text(encoding="utf-8").replace(
        "mynets.mixer:mixer", "no_such_nets.mixer:mixer"), encoding="utf-8")
    done, log = _run_cli(job, tmp_path)
    assert done.returncode == contract.EXIT_INVALID
    assert done.stdout.strip() == ""
    failure = contract.read_termination_message(log.read_text())
    assert isinstance(failure, contract.Failure)
    assert "spec.model.entrypoint" in failure.message and "no_such_nets" in failure.message
    assert "Traceback" not in done.stderr


def test_the_synthetic_batch_of_a_language_model_has_next_token_targets() -> None:
    spec = api.ModelSpec.model_validate({"architecture": "char_transformer",
                                         "args": {"width": 16, "depth": 1, "heads": 2},
                                         "inputShape": [12]})
    model = models.build(spec)
    inputs, targets = profiling.synthetic_batch(spec, model, batch_size=3,
                                                device=torch.device("cpu"), seed=0)
    assert inputs.shape == targets.shape == (3, 12) and inputs.dtype == torch.long
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert int(inputs.max()) < 256
