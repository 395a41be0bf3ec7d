"""Models from user code through `kiln run`: the own-model example trains from its own package
(on the PYTHONPATH `kiln run` builds), a deeper and wider variant warm-starts from it, freezing
engages, and every broken entrypoint ends as a permanent failure naming the user's file and line.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import clirun
import pytest
import yaml

from kiln import contract
from kiln.zoo import records, store

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own-model"


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
    env.pop("KILN_ZOO", None)
    env.pop("PYTHONPATH", None) if "PYTHONPATH" not in extra else None
    return env


def _kiln(*args: str, cwd: Path, env: dict[str, str] | None = None) -> clirun.Done:
    return clirun.kiln(*args, cwd=cwd, env=env or _env())


def _variant(source: Path, target: Path, name: str, **spec: object) -> Path:
    doc = yaml.safe_load(source.read_text(encoding="utf-8"))
    doc["metadata"]["name"] = name
    doc["spec"].update(spec)
    target.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return target


def test_example_trains_then_bigger_variant_warm_starts_and_a_longer_run_freezes(
        tmp_path: Path) -> None:
    # The example's folder as a user has it, its two jobs cut to one epoch: a parent and a
    # child is what is checked here (the longer run below trains for its freezing).
    example = tmp_path / "own-model"
    shutil.copytree(EXAMPLE, example, ignore=shutil.ignore_patterns("__pycache__"))
    first, bigger = example / "mixer.yaml", example / "mixer-bigger.yaml"
    for job in (first, bigger):
        doc = yaml.safe_load(job.read_text(encoding="utf-8"))
        training = {**doc["spec"]["training"], "epochs": 1}
        _variant(job, job, doc["metadata"]["name"], training=training)
    done = _kiln("run", str(first), str(bigger), "--zoo", "zoo", "--slots", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    zoo = store.DirStore(tmp_path / "zoo")
    found = {r.job_name: r for r in records.list_records(zoo)}
    assert set(found) == {"digits-mixer", "digits-mixer-bigger"}
    parent, child = found["digits-mixer"], found["digits-mixer-bigger"]
    assert parent.entrypoint == "mynets.mixer:mixer" and parent.architecture is None
    assert child.parent == parent.id and child.similarity is not None and child.similarity > 0.3
    out = " ".join(done.stdout.split())  # rich wraps long lines
    assert f"Warm start from {parent.id} (similarity {child.similarity:.2f}): guard: step-0 probe loss" in out, out
    assert "tensors transferred" in out, out

    # A longer run of the bigger variant, from a job file elsewhere: PYTHONPATH given by the
    # user is honoured, and freezing is told to decide early.
    longer = _variant(bigger, tmp_path / "longer.yaml", "digits-mixer-longer",
                      training={"epochs": 3, "batchSize": 32, "seed": 1,
                                "optimizer": {"name": "adamw", "lr": 0.005}},
                      freezing={"checkEverySteps": 4, "window": 3, "patience": 1,
                                "peakFraction": 1.0})
    done = _kiln("run", str(longer), "--zoo", "zoo", cwd=tmp_path,
                 env=_env(PYTHONPATH=str(EXAMPLE)))
    assert done.returncode == 0, done.stdout + done.stderr
    rec = next(r for r in records.list_records(zoo) if r.job_name == "digits-mixer-longer")
    assert rec.parent is not None  # warm-started from one of the two above
    out = " ".join(done.stdout.split())
    # the results table's "frozen" column: the most modules frozen at once (else off/none)
    assert re.search(r"\b[1-9]\d* modules \(", out), out


BROKEN = '''
import torch
{body}
'''

# Every case is also a unit test of `models.build` (tests/unit/models); these go the whole way.
CASES = [
    pytest.param("nosuchpkg.models:build", "", "cannot import 'nosuchpkg.models'",
                 id="module-not-importable"),
    pytest.param("broken_import:build", "import not_installed_dependency\n",
                 "broken_import.py, line 3", id="import-error-inside-user-module"),
    pytest.param("userbad:build", "def build():\n    raise ValueError('width must be even')\n",
                 "userbad.py, line 4, in build", id="raises"),
]


@pytest.mark.parametrize(("entrypoint", "body", "expected"), CASES)
def test_broken_entrypoint_fails_permanently_naming_the_field_and_the_users_line(
        tmp_path: Path, entrypoint: str, body: str, expected: str) -> None:
    module = entrypoint.partition(":")[0]
    if body:
        (tmp_path / f"{module}.py").write_text(BROKEN.format(body=body), encoding="utf-8")
    job = _variant(EXAMPLE / "mixer.yaml", tmp_path / "bad.yaml", "bad-entrypoint",
                   model={"entrypoint": entrypoint, "inputShape": [1, 8, 8]},
                   training={"epochs": 1})
    assert _kiln("validate", str(job), cwd=tmp_path).returncode == 0  # the format is fine
    done = _kiln("run", str(job), "--zoo", "zoo", cwd=tmp_path)
    out = " ".join((done.stdout + done.stderr).split())  # rich wraps long lines
    assert done.returncode != 0, out
    assert "spec.model.entrypoint" in out and expected in out, out
    assert f"exited with code {contract.EXIT_INVALID}" in out, out
    assert records.list_records(store.DirStore(tmp_path / "zoo")) == []


NAN_FORWARD = '''
import torch


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x.flatten(1))
        return out * float("nan") if self.training else out  # checked in eval mode: finite


def build() -> Net:
    return Net()
'''

NO_PARAMETERS = '''
import torch


class Net(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)[:, :10]


def build() -> Net:
    return Net()
'''


@pytest.mark.parametrize(("body", "expected"), [
    pytest.param(NAN_FORWARD, "training diverged: the loss became nan at step 1;",
                 id="nan-loss"),
    pytest.param(NAN_FORWARD.replace("if self.training", "if not self.training"),
                 "training diverged: the validation loss became nan at step 23;",
                 id="nan-validation-loss"),
    pytest.param(NO_PARAMETERS, "spec.model.entrypoint: the model usermodel:build has no "
                 "trainable parameters", id="no-parameters"),
])
def test_a_model_that_cannot_train_fails_permanently_with_the_fix_and_saves_nothing(
        tmp_path: Path, body: str, expected: str) -> None:
    (tmp_path / "usermodel.py").write_text(body, encoding="utf-8")
    job = _variant(EXAMPLE / "mixer.yaml", tmp_path / "bad.yaml", "cannot-train",
                   model={"entrypoint": "usermodel:build", "inputShape": [1, 8, 8]},
                   training={"epochs": 1, "batchSize": 64})
    done = _kiln("run", str(job), "--zoo", "zoo", cwd=tmp_path)
    out = " ".join((done.stdout + done.stderr).split())  # rich wraps long lines
    assert expected in out, out
    assert f"exited with code {contract.EXIT_INVALID}" in out, out
    assert "Traceback" not in out, out
    zoo = tmp_path / "zoo"
    assert not zoo.exists() or records.list_records(store.DirStore(zoo)) == []
    assert not list(tmp_path.rglob("checkpoint.pt"))  # no diverged weights to resume from
