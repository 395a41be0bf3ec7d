"""Processes that start often (the operator, `kiln validate` and `kiln run`, a digits trainer)
leave out libraries they need only sometimes, each about a second of CPU per process:
torchvision (its import imports torch's compiler), FSDP, DTensor and scikit-learn (it imports
SciPy); the operator leaves out torch itself until a job needs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.process


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_the_operator_and_the_cli_import_no_torchvision() -> None:
    loaded = _modules_after("import kiln.controller.main, kiln.cli, kiln.models")
    assert "torchvision" not in loaded


def test_the_operator_starts_without_torch() -> None:
    # its first job imports it: the registry's checks, placement estimates, warm start
    loaded = _modules_after("import kiln.controller.main")
    assert "torch" not in loaded


def test_the_trainer_imports_neither_torchvision_nor_fsdp_before_a_job_needs_them() -> None:
    loaded = _modules_after("import kiln_trainer.loop")
    # DTensor's modules import torch's compiler: 0.65 of the trainer's 2.8 s of imports
    assert not {"torchvision", "torch.distributed.fsdp", "torch.distributed.tensor"} & loaded


def test_a_torchvision_architecture_imports_torchvision_when_built() -> None:
    loaded = _modules_after(
        "import torch\nfrom kiln import models\n"
        "with torch.device('meta'): models.get_model('resnet18', input_shape=(3, 32, 32))")
    assert "torchvision" in loaded


def test_digits_load_without_scikit_learn() -> None:
    loaded = _modules_after(
        "from kiln import api\nfrom kiln_trainer import data\n"
        "data.load(api.DatasetSpec.model_validate({'name': 'digits'}), input_shape=[1, 8, 8],"
        " seed=0)")
    assert "sklearn" not in loaded
