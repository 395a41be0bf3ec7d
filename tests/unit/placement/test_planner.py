"""Tests for kiln.placement.planner: best of heuristic and MILP, fallbacks, online re-planning."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from unit.placement import cases

from kiln.placement import heuristic, planner, types, worker

FAST = types.Settings(time_limit_seconds=2.0, objective="makespan", use_milp=True)


def _issue_case() -> types.Snapshot:
    configs = (types.Config("ddp", 8, 10.0), types.Config("ddp", 4, 16.0))
    return types.Snapshot(0.0, (types.Node("n0", 8),),
                          tuple(types.JobRequest(f"j{i}", configs) for i in range(2)))


def test_two_identical_jobs_get_four_gpus_each_and_makespan_16() -> None:
    result = planner.plan(_issue_case(), FAST)
    assert result.makespan == 16.0
    assert [(a.gpus, a.start) for a in result.assignments] == [(4, 0.0), (4, 0.0)]
    assert "meets the lower bound" in result.reason


@pytest.mark.parametrize("seed", [8, 9, 13])  # seeds where the heuristic is not optimal
@pytest.mark.process
def test_plan_is_near_the_brute_force_optimum_and_never_worse_than_the_heuristic(
        seed: int) -> None:
    nodes = [(8,), (4, 4), (8,), (4, 8)][seed % 4]
    snapshot = cases.random_snapshot(seed, jobs=3 + seed % 3, nodes=nodes, integer=True,
                                     scale=30.0, running=seed % 2)
    # the time limit is a guard only: a watchdog kill on a loaded machine would leave the
    # heuristic's plan, which these seeds keep from the optimum
    result = planner.plan(snapshot, types.Settings(time_limit_seconds=120.0, slots=24,
                                                   objective="makespan", use_milp=True))
    heuristic_plan = heuristic.schedule(heuristic.problem_of(snapshot), FAST)
    cases.check_plan(snapshot, result)
    assert result.makespan <= heuristic_plan.makespan
    assert result.makespan <= 1.05 * cases.brute_force_makespan(snapshot)
    assert result.solver in ("milp", "heuristic")


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.process
def test_plans_with_the_milp_are_valid_on_random_instances(seed: int) -> None:
    snapshot = cases.random_snapshot(100 + seed, jobs=8, nodes=(8, 8), running=2,
                                     arrivals=seed == 1)
    result = planner.plan(snapshot, FAST)
    cases.check_plan(snapshot, result)
    assert result.makespan <= heuristic.schedule(heuristic.problem_of(snapshot),
                                                 FAST).makespan + 1e-9


def test_a_tiny_time_limit_on_a_big_instance_returns_the_heuristic_with_a_reason() -> None:
    snapshot = cases.random_snapshot(1, jobs=60, nodes=(8, 8, 8, 8))
    result = planner.plan(snapshot, types.Settings(time_limit_seconds=0.05, milp_max_jobs=120,
                                                   objective="makespan", use_milp=True))
    assert result.solver == "heuristic"
    assert "MILP skipped: 0.00 s of the 0.05 s budget left after the heuristic" in result.reason
    cases.check_plan(snapshot, result)


@pytest.mark.process
def test_a_failed_milp_falls_back_to_the_heuristic_and_logs_why(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    snapshot = cases.random_snapshot(2, jobs=20, nodes=(8, 8))
    # The worker process really starts and crashes: an interpreter that dies with an error.
    # A generous budget keeps the outcome independent of how loaded the machine is.
    crashing = tmp_path / "python"
    crashing.write_text("#!/bin/sh\necho 'RuntimeError: solver crashed' >&2\nexit 3\n")
    crashing.chmod(0o755)
    monkeypatch.setattr(worker.sys, "executable", str(crashing))
    result = planner.plan(snapshot, types.Settings(time_limit_seconds=60.0, use_milp=True))
    assert result.solver == "heuristic" and result.milp == "failed"
    assert ("fallback: milp: solver worker exited with code 3: RuntimeError: solver crashed"
            in result.reason)
    assert "falls back to the heuristic plan" in caplog.text
    cases.check_plan(snapshot, result)


@pytest.mark.parametrize(("settings", "why"), [
    pytest.param(types.Settings(use_milp=False), "MILP off", id="off"),
    pytest.param(types.Settings(), "MILP off", id="opt-in: off by default"),
    pytest.param(types.Settings(milp_max_jobs=5, use_milp=True), "MILP skipped: 6 jobs",
                 id="too-many"),
])
def test_milp_skips_say_why(settings: types.Settings, why: str) -> None:
    snapshot = cases.random_snapshot(4, jobs=6, nodes=(8,))
    result = planner.plan(snapshot, settings)
    assert result.solver == "heuristic" and why in result.reason


def test_a_job_that_fits_no_node_is_unplaceable_by_name() -> None:
    snapshot = types.Snapshot(0.0, (types.Node("n0", 4),), (
        types.JobRequest("fits", (types.Config("ddp", 4, 5.0),)),
        types.JobRequest("too-wide", (types.Config("ddp", 8, 5.0),))))
    with pytest.raises(types.Unplaceable, match="job too-wide") as caught:
        planner.plan(snapshot, FAST)
    assert caught.value.jobs == ("too-wide",)
    with pytest.raises(types.Unplaceable):
        planner.replan(planner.plan(dataclasses.replace(snapshot, queued=snapshot.queued[:1])),
                    snapshot, FAST)


# Online ------------------------------------------------------------------------------------

NO_MILP = types.Settings(use_milp=False, objective="makespan")


def _sequential_current(now: float) -> types.Plan:
    """A poor current plan for the issue case: whole node each, one after the other."""
    return types.Plan((types.Assignment("j0", "n0", 8, "ddp", now + 100.0, 10.0),
                       types.Assignment("j1", "n0", 8, "ddp", now + 110.0, 10.0)),
                      now + 120.0, "whole-node-fifo")


def test_replan_without_a_current_plan_plans_from_scratch() -> None:
    assert planner.replan(None, _issue_case(), NO_MILP).makespan == 16.0


def test_replan_keeps_a_plan_that_is_not_beaten_by_the_threshold() -> None:
    snapshot = cases.random_snapshot(5, jobs=8, nodes=(8, 8))
    first = planner.plan(snapshot, NO_MILP)
    again = planner.replan(first, snapshot, NO_MILP)
    assert again.kept_current and "kept current plan" in again.reason
    assert set(again.assignments) == set(first.assignments)
    assert again.solver == first.solver


def test_replan_replaces_a_plan_beaten_by_more_than_the_threshold() -> None:
    snapshot = _issue_case()  # now 0: the current plan starts at 100, outside the window
    result = planner.replan(_sequential_current(0.0), snapshot, NO_MILP)
    assert not result.kept_current and result.makespan == 16.0
    assert result.reason.startswith("replaced: remaining makespan 16.0 s < 20.0 s")


def test_replan_threshold_prevents_a_swap_for_a_small_gain() -> None:
    settings = dataclasses.replace(NO_MILP, replan_threshold=0.25)  # 16 vs 20 is 20%
    result = planner.replan(_sequential_current(0.0), _issue_case(), settings)
    assert result.kept_current and result.makespan == 20.0  # re-timed: starts at now


def test_assignments_inside_the_freeze_window_keep_their_slot() -> None:
    current = _sequential_current(0.0)
    current = dataclasses.replace(current, assignments=(
        dataclasses.replace(current.assignments[0], start=30.0),  # inside 60 s
        current.assignments[1]))
    result = planner.replan(current, _issue_case(), NO_MILP)
    frozen = result.for_job("j0")
    assert frozen == current.assignments[0]
    cases.check_plan(_issue_case(), result)


def test_replan_drops_started_jobs_and_adds_new_ones() -> None:
    snapshot = cases.random_snapshot(6, jobs=6, nodes=(8, 8))
    first = planner.plan(snapshot, NO_MILP)
    started = first.assignments[0]
    later = types.Snapshot(
        now=5.0, nodes=snapshot.nodes,
        queued=(*[j for j in snapshot.queued if j.name != started.job],
                types.JobRequest("new", cases.amdahl_configs(40.0, 0.1), arrival=5.0)),
        running=(types.Running(started.job, started.node, started.gpus, started.parallelism,
                               started.seconds - 5.0),))
    for result in (planner.replan(first, later, NO_MILP), planner.extend(first, later, NO_MILP)):
        cases.check_plan(later, result)
        assert result.for_job(started.job) is None and result.for_job("new") is not None


def test_frozen_job_waits_when_a_running_job_overruns() -> None:
    current = types.Plan((types.Assignment("j0", "n0", 8, "ddp", 10.0, 10.0),), 20.0, "milp")
    snapshot = types.Snapshot(
        5.0, (types.Node("n0", 8),),
        (types.JobRequest("j0", (types.Config("ddp", 8, 10.0),)),),
        (types.Running("old", "n0", 2, "ddp", 20.0),))  # planned to end at 10, now 25
    result = planner.replan(current, snapshot, NO_MILP)
    a = result.for_job("j0")
    assert a is not None and (a.node, a.gpus, a.start) == ("n0", 8, 25.0)
    cases.check_plan(snapshot, result)


def test_a_queued_job_planned_narrow_starts_wide_once_gpus_are_free() -> None:
    # Completion time: j0 waited for 1 GPU, planned to start at 20 (inside the freeze
    # window); the job holding the GPUs ended early and all 8 are free at 10. Nothing is
    # frozen, so it takes the wider config that ends it sooner.
    configs = (types.Config("single", 1, 1000.0), types.Config("ddp", 4, 260.0),
               types.Config("ddp", 8, 140.0))
    current = types.Plan((types.Assignment("j0", "n0", 1, "single", 20.0, 1000.0),), 1020.0,
                         "heuristic", objective="completion-time")
    snapshot = types.Snapshot(10.0, (types.Node("n0", 8),),
                              (types.JobRequest("j0", configs),))
    result = planner.replan(current, snapshot,
                            dataclasses.replace(NO_MILP, objective="completion-time"))
    a = result.for_job("j0")
    assert a is not None and a.gpus > 1 and a.start == 10.0


@pytest.mark.parametrize(("group", "gpus"), [("sweep", 1), ("", 4)])
def test_a_sweep_arriving_in_parts_gets_minimum_area_configs_on_re_plan(
        group: str, gpus: int) -> None:
    # Each new job: 1 GPU for 100 s or 4 GPUs for 30 s (83% efficient). A grown sweep keeps
    # its GPU-seconds for the parts still to come; jobs of no sweep get the shortest makespan.
    configs = (types.Config("ddp", 1, 100.0), types.Config("ddp", 4, 30.0))
    node = (types.Node("n0", 8),)
    first = planner.plan(types.Snapshot(0.0, node, (
        types.JobRequest("a", configs, group=group),)), NO_MILP)
    later = types.Snapshot(10.0, node, tuple(
        types.JobRequest(name, configs, arrival=10.0, group=group) for name in ("b", "c")),
        (types.Running("a", "n0", first.assignments[0].gpus, "ddp", 20.0),))
    result = planner.replan(first, later, NO_MILP)
    cases.check_plan(later, result)
    assert [a.gpus for a in result.assignments if a.job in ("b", "c")] == [gpus, gpus]


def test_a_new_batch_gets_the_iterated_search_and_re_plans_of_it_do_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, bool]] = []
    real = heuristic.schedule

    def spy(problem: heuristic.Problem, settings: types.Settings, *,
            kicks: bool = True) -> types.Plan:
        calls.append((problem.objective, kicks))
        return real(problem, settings, kicks=kicks)

    monkeypatch.setattr(heuristic, "schedule", spy)
    snapshot = cases.random_snapshot(3, jobs=6, nodes=(8,))
    makespan = types.Settings(use_milp=False, objective="makespan")
    first = planner.plan(snapshot, makespan)
    planner.replan(first, snapshot, makespan)  # the batch in force, re-planned
    arrivals = planner.plan(snapshot, dataclasses.replace(makespan,
                                                          objective="completion-time"))
    planner.replan(arrivals, snapshot, makespan)  # a batch after a stream of arrivals
    assert calls == [("makespan", True), ("makespan", False), ("completion-time", True),
                     ("makespan", True)]
    assert "kick(s) kept" in first.reason
