"""Layering (DESIGN.md section 2) and import hygiene, checked by import-linter and a fresh
interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_importing_the_trainer_pulls_in_no_operator_libraries() -> None:
    code = (
        "import sys, kiln_trainer; "
        "bad = [m for m in ('kopf', 'kubernetes', 'pyomo', 'kiln.controller', 'kiln.cli') "
        "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
