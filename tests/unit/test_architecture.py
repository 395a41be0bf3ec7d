"""Layering and code hygiene: import-linter's contracts, the controller's import depth, ruff,
`mypy --strict`, and a fresh interpreter that imports the trainer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp
import networkx as nx
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


# The longest chain of imports between the controller's modules, counted in modules: each
# level is one more module to read before a change is understood.
CONTROLLER_MAX_CHAIN = 9


def test_the_controllers_longest_import_chain_is_short() -> None:
    graph = grimp.build_graph("kiln", cache_dir=None)
    imports = nx.DiGraph()
    for module in graph.find_descendants("kiln.controller"):
        imports.add_node(module)
        imports.add_edges_from((module, imported) for imported in
                               graph.find_modules_directly_imported_by(module)
                               if imported.startswith("kiln.controller."))
    chain = nx.dag_longest_path(imports)  # acyclic: import-linter's contract
    assert len(chain) <= CONTROLLER_MAX_CHAIN, " -> ".join(chain)


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
