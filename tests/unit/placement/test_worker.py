"""Tests for kiln.placement.worker: the MILP in a separate process, failures as reasons."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from unit.placement import cases

from kiln.placement import heuristic, types, worker

# A guard only: the tiny problems solve to the gap at once, but a loaded machine may take many
# seconds to start the worker, and a watchdog kill would change the outcome under test.
SETTINGS = types.Settings(time_limit_seconds=120.0)


@pytest.mark.process
def test_a_solve_in_the_worker_returns_a_valid_plan_and_its_outcome() -> None:
    snapshot = cases.random_snapshot(7, jobs=4, nodes=(8,))
    problem = heuristic.problem_of(snapshot)
    decoded, reason, outcome = worker.solve(problem, heuristic.schedule(problem, SETTINGS),
                                            SETTINGS)
    assert decoded is not None and decoded.solver == "milp"
    assert reason.startswith("milp: ") and outcome.has_solution
    cases.check_plan(snapshot, decoded)


@pytest.mark.process
def test_an_error_inside_the_worker_comes_back_as_a_reason() -> None:
    snapshot = cases.random_snapshot(7, jobs=3, nodes=(8,))
    problem = heuristic.problem_of(snapshot)
    warm = heuristic.schedule(problem, SETTINGS)
    broken = dataclasses.replace(warm, assignments=tuple(
        dataclasses.replace(a, parallelism="pipeline") for a in warm.assignments))
    decoded, reason, outcome = worker.solve(problem, broken, SETTINGS)
    assert decoded is None and outcome is None
    assert reason.startswith("milp: solver failed: ValueError: warm plan: job")


@pytest.mark.process
def test_the_watchdog_kills_a_worker_past_its_budget() -> None:
    snapshot = cases.random_snapshot(8, jobs=10, nodes=(8, 8))
    problem = heuristic.problem_of(snapshot)
    settings = types.Settings(watchdog_margin_seconds=0.0)
    decoded, reason, outcome = worker.solve(problem, heuristic.schedule(problem, settings),
                                            settings, budget_seconds=0.05)
    assert decoded is None and outcome is None
    assert reason.startswith("milp: watchdog killed the solver after")


def test_a_budget_shorter_than_the_model_build_gives_no_plan_and_says_why() -> None:
    from kiln.placement import milp

    snapshot = cases.random_snapshot(9, jobs=30, nodes=(8, 8))
    problem = heuristic.problem_of(snapshot)
    decoded, outcome = milp.run(problem, heuristic.schedule(problem, SETTINGS), SETTINGS,
                                time_limit_seconds=0.001)
    assert decoded is None and outcome.status == "no-solution"
    assert outcome.message.startswith("model build took")


@pytest.mark.process
def test_a_module_in_the_working_directory_cannot_shadow_the_standard_library(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "operator.py").write_text("raise ImportError('shadowed stdlib')\n")
    monkeypatch.chdir(tmp_path)
    snapshot = cases.random_snapshot(7, jobs=4, nodes=(8,))
    problem = heuristic.problem_of(snapshot)
    decoded, reason, _ = worker.solve(problem, heuristic.schedule(problem, SETTINGS), SETTINGS)
    assert decoded is not None, reason


def test_the_worker_pipe_carries_placement_types_as_json_and_nothing_else() -> None:
    problem = heuristic.problem_of(cases.random_snapshot(7, jobs=4, nodes=(8,)))
    warm = heuristic.schedule(problem, SETTINGS)
    sent = (problem, warm, SETTINGS, 12.5)
    assert worker.decode(worker.encode(sent)) == sent
    assert json.loads(worker.encode(warm))["__class__"] == "Plan"  # plain JSON on the pipe
    with pytest.raises(ValueError, match="not a placement type: 'Popen'"):
        worker.decode(b'{"__class__": "Popen", "args": ["rm", "-rf", "/"]}')
