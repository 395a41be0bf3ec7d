"""Layering and code hygiene: import-linter's contracts, ruff, `mypy --strict`, and a fresh
interpreter that imports the trainer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # `make check` runs the tools themselves

ROOT = Path(__file__).resolve().parents[2]


def _run_tool(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run a tool installed beside this interpreter, from the repository root."""
    tool = Path(sys.executable).with_name(name)
    return subprocess.run([str(tool), *args], cwd=ROOT, capture_output=True, text=True,
                          check=False)


def test_import_contracts_hold() -> None:
    done = _run_tool("lint-imports", "--no-cache")  # its cache can miss a fresh edit
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_finds_nothing() -> None:
    done = _run_tool("ruff", "check", "operator", "trainer_image", "tests", "bench")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_strict_passes_on_both_packages() -> None:
    done = _run_tool("mypy", "operator/kiln", "trainer_image/kiln_trainer")
    assert done.returncode == 0, done.stdout + done.stderr


def test_importing_the_trainer_pulls_in_no_operator_libraries() -> None:
    code = (
        "import sys, kiln_trainer; "
        "bad = [m for m in ('kopf', 'kubernetes', 'pyomo', 'kiln.controller', 'kiln.cli') "
        "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
