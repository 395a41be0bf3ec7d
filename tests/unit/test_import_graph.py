"""No import cycle anywhere in `kiln` or `kiln_trainer`, function-level imports included.

import-linter's contracts check chosen layers; this checks every module against every other.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import grimp
import networkx as nx
import pytest


def _cycles(*packages: str, shown: int = 10) -> list[list[str]]:
    """Up to `shown` import cycles among the modules of `packages` (each in import order)."""
    graph = grimp.build_graph(*packages, cache_dir=None)  # every import statement, nested too
    imports = nx.DiGraph()
    for module in graph.modules:
        imports.add_edges_from((module, imported)
                               for imported in graph.find_modules_directly_imported_by(module))
    return list(itertools.islice(nx.simple_cycles(imports), shown))


def test_no_module_imports_itself_through_others() -> None:
    cycles = _cycles("kiln", "kiln_trainer")
    assert not cycles, "import cycles (break each, e.g. by moving the shared part down): " + (
        "; ".join(" -> ".join([*cycle, cycle[0]]) for cycle in cycles))


def test_an_import_inside_a_function_closes_a_cycle_too(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "circle"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def opener():\n    from circle import high\n"
                                    "    return high\n")
    (package / "high.py").write_text("from circle import low\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [sorted(cycle) for cycle in _cycles("circle")] == [["circle.high", "circle.low"]]
