"""Tests for kiln.placement.milp (in process): exactness against brute force, decoding,
warm start, reservations. Small instances, time limits of a few seconds."""

from __future__ import annotations

import pyomo.environ as pyo
import pytest
from unit.placement import cases

from kiln.placement import heuristic, milp, types

EXACT = types.Settings(slot_seconds=1.0, mip_rel_gap=0.0, time_limit_seconds=5.0)


def _run(snapshot: types.Snapshot, settings: types.Settings
         ) -> tuple[types.Plan | None, milp.SolveOutcome, types.Plan]:
    problem = heuristic.problem_of(snapshot)
    warm = heuristic.schedule(problem, settings)
    decoded, outcome = milp.run(problem, warm, settings)
    return decoded, outcome, warm


def test_two_identical_jobs_run_concurrently_at_four_gpus() -> None:
    configs = (types.Config("ddp", 8, 10.0), types.Config("ddp", 4, 16.0))
    snapshot = types.Snapshot(0.0, (types.Node("n0", 8),),
                              tuple(types.JobRequest(f"j{i}", configs) for i in range(2)))
    decoded, outcome, _ = _run(snapshot, EXACT)
    assert outcome.status == "optimal"
    assert decoded is not None and decoded.makespan == 16.0
    assert sorted(a.gpus for a in decoded.assignments) == [4, 4]


@pytest.mark.parametrize("seed", range(16))
def test_unit_slots_match_the_brute_force_optimum(seed: int) -> None:
    """With integer durations and one-second slots the time-indexed model is exact."""
    nodes = [(8,), (4, 4), (8,), (4, 8)][seed % 4]
    snapshot = cases.random_snapshot(seed, jobs=3 + seed % 3, nodes=nodes, integer=True,
                                     scale=30.0, running=seed % 2)
    decoded, outcome, warm = _run(snapshot, EXACT)
    assert outcome.status == "optimal", outcome
    assert decoded is not None
    cases.check_plan(snapshot, decoded)
    assert decoded.makespan == pytest.approx(cases.brute_force_makespan(snapshot))
    assert decoded.makespan <= warm.makespan + 1e-9


@pytest.mark.parametrize("seed", range(4))
def test_decoded_plan_is_valid_and_no_later_than_the_slot_plan(seed: int) -> None:
    snapshot = cases.random_snapshot(seed, jobs=8, nodes=(8, 8), running=2, arrivals=True)
    settings = types.Settings(time_limit_seconds=3.0, slots=24)
    problem = heuristic.problem_of(snapshot)
    sp = milp.build_problem(problem, heuristic.schedule(problem, settings), settings)
    m = milp.build_model(sp)
    outcome = milp.solve(m, sp, settings, time_limit_seconds=3.0)
    assert outcome.has_solution  # the warm start alone is a solution
    decoded = milp.decode(m, sp)
    cases.check_plan(snapshot, decoded)
    assert decoded.makespan <= snapshot.now + sp.slot_seconds * pyo.value(m.makespan) + 1e-6


def test_warm_start_satisfies_every_row_including_symmetry_breaking() -> None:
    configs = cases.amdahl_configs(100.0, 0.1)
    jobs = tuple(types.JobRequest(f"lr-{i}", configs) for i in range(6))  # identical copies
    snapshot = types.Snapshot(0.0, (types.Node("a", 8), types.Node("b", 8)), jobs)
    settings = types.Settings()
    problem = heuristic.problem_of(snapshot)
    sp = milp.build_problem(problem, heuristic.schedule(problem, settings), settings)
    assert len(sp.identical_jobs) == 5 and sp.identical_nodes == [("a", "b")]
    assert sp.warm is not None
    m = milp.build_model(sp)
    chosen = set(sp.warm.values())
    for c in m.CHOICES:
        m.x[c].set_value(1 if c in chosen else 0)
    m.makespan.set_value(max(sp.choices[c][3] + sp.duration_slots[c] for c in chosen))
    for row in m.component_data_objects(pyo.Constraint, active=True):
        body = pyo.value(row.body)
        assert row.lower is None or body >= pyo.value(row.lower) - 1e-9, row.name
        assert row.upper is None or body <= pyo.value(row.upper) + 1e-9, row.name


def test_running_jobs_reduce_slot_capacity() -> None:
    snapshot = types.Snapshot(0.0, (types.Node("n0", 8),),
                              (types.JobRequest("q", (types.Config("ddp", 8, 10.0),)),),
                              (types.Running("r", "n0", 4, "ddp", 25.0),))
    decoded, outcome, _ = _run(snapshot, EXACT)
    assert outcome.status == "optimal" and decoded is not None
    assert decoded.assignments[0].start == 25.0
    cases.check_plan(snapshot, decoded)
