"""Multi-node configs: k nodes x g GPUs, planned by the heuristic, started as one gang."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kiln import api
from kiln.placement import estimate, heuristic, planner, queues, types

# time limit: a guard only (the worker starts in seconds on a loaded machine; these solve at once)
SETTINGS = types.Settings(use_milp=True, time_limit_seconds=120.0, objective="makespan")


def _gang(gpus: int, node_count: int, seconds: float) -> types.Config:
    return types.Config("ddp", gpus, seconds, node_count=node_count)


def _snapshot(nodes: dict[str, int], *jobs: types.JobRequest,
              running: tuple[types.Running, ...] = ()) -> types.Snapshot:
    return types.Snapshot(now=0.0, nodes=tuple(types.Node(n, g) for n, g in nodes.items()),
                          queued=jobs, running=running)


def test_a_job_larger_than_any_node_spans_two_and_holds_gpus_on_both() -> None:
    job = types.JobRequest("big", (_gang(2, 2, 100.0),), asked_gpus=4)
    plan = planner.plan(_snapshot({"a": 2, "b": 2}, job), SETTINGS)
    (a,) = plan.assignments
    assert (a.all_nodes, a.gpus, a.devices, a.start) == (("a", "b"), 2, 4, 0.0)
    assert "multi-node configs are planned by the heuristic" in plan.reason
    assert plan.cost == pytest.approx(100.0)


def test_a_gang_starts_when_its_last_node_frees_up() -> None:
    busy = types.Running("other", "b", 2, "ddp", remaining_seconds=50.0)
    job = types.JobRequest("big", (_gang(2, 2, 100.0),))
    plan = planner.plan(_snapshot({"a": 2, "b": 2, "c": 1}, job, running=(busy,)), SETTINGS)
    (a,) = plan.assignments
    assert a.all_nodes == ("a", "b") and a.start == 50.0


def test_one_node_wins_when_one_has_room_as_spanning_nodes_is_slower() -> None:
    job = types.JobRequest("j", (types.Config("ddp", 4, 100.0), _gang(2, 2, 125.0)))
    (a,) = planner.plan(_snapshot({"a": 4, "b": 2, "c": 2}, job), SETTINGS).assignments
    assert (a.all_nodes, a.gpus) == (("a",), 4)
    # with the big node busy for long, two small ones start it sooner
    busy = types.Running("other", "a", 4, "ddp", remaining_seconds=500.0)
    (a,) = planner.plan(_snapshot({"a": 4, "b": 2, "c": 2}, job, running=(busy,)),
                        SETTINGS).assignments
    assert (a.all_nodes, a.start) == (("b", "c"), 0.0)


def test_a_gang_with_too_few_big_enough_nodes_is_unplaceable_with_numbers() -> None:
    job = types.JobRequest("big", (_gang(2, 3, 100.0),), asked_gpus=6)
    reasons = types.unplaceable_reasons(_snapshot({"a": 2, "b": 2, "c": 1}, job))
    assert "needs 3 nodes with 2 free devices each, but only 2 node(s)" in reasons["big"]
    with pytest.raises(types.Unplaceable):
        planner.plan(_snapshot({"a": 2, "b": 2, "c": 1}, job), SETTINGS)


def test_candidates_keep_node_counts_apart() -> None:
    job = types.JobRequest("j", (types.Config("ddp", 4, 100.0), _gang(2, 2, 125.0),
                                 _gang(2, 2, 130.0), _gang(1, 4, 140.0)))
    kept = types.candidates(job)
    assert [(c.gpus, c.node_count, c.seconds) for c in kept] == [
        (1, 4, 140.0), (2, 2, 125.0), (4, 1, 100.0)]
    with pytest.raises(ValueError, match="node_count"):
        types.Config("single", 1, 10.0, node_count=2)


def test_queue_starts_a_gang_only_at_the_head_of_all_its_nodes_with_devices_free() -> None:
    gang = types.Assignment("gang", "a", 2, "ddp", 10.0, 100.0, peer_nodes=("b",))
    first = types.Assignment("first", "b", 1, "single", 0.0, 10.0)
    plan = types.Plan((first, gang), makespan=110.0, solver="heuristic")
    line = queues.NodeQueues(plan)
    assert line.start_heads({"a": 2, "b": 1}) == [first]  # b's head first; gang not all free
    assert line.start_heads({"a": 2, "b": 1}) == []
    assert line.start_heads({"a": 2, "b": 2}) == [gang]
    assert len(line) == 0


def test_random_plans_with_gangs_never_exceed_any_nodes_gpus() -> None:
    rng = random.Random(7)
    for _ in range(30):
        nodes = {f"n{i}": rng.choice((1, 2, 4)) for i in range(rng.randint(2, 4))}
        jobs = []
        for j in range(rng.randint(1, 6)):
            k = rng.choice((1, 2))
            configs: list[types.Config] = [types.Config("single", 1, rng.uniform(50, 200))]
            if k > 1:
                configs.append(_gang(1, k, rng.uniform(30, 150)))
            jobs.append(types.JobRequest(f"j{j}", tuple(configs)))
        snapshot = _snapshot(nodes, *jobs)
        plan = planner.plan(snapshot, types.Settings(use_milp=False))
        events = sorted({a.start for a in plan.assignments})
        for t in events:
            for node, capacity in nodes.items():
                held = sum(a.gpus for a in plan.assignments
                           if node in a.all_nodes and a.start <= t < a.end)
                assert held <= capacity, (t, node, plan.assignments)
        assert all(len(set(a.all_nodes)) == len(a.all_nodes) for a in plan.assignments)
        assert heuristic.cost(heuristic.problem_of(snapshot), list(plan.assignments)) >= 0


def _job(resources: dict[str, Any]) -> api.TrainingJob:
    return api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "j"},
        "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                 "resources": resources}})


@pytest.mark.parametrize(("resources", "expected"), [
    pytest.param({"gpus": 4, "gpusPerNode": 2}, [(1, 4), (2, 2)], id="above-gpus-per-node"),
    pytest.param({"gpus": 4, "nodes": 4}, [(1, 4)], id="nodes-given"),
    pytest.param({"gpus": 4}, [(4, 1)], id="fits-one-node"),
])
def test_estimates_span_nodes_when_asked_or_above_the_per_node_cap(
        resources: dict[str, Any], expected: list[tuple[int, int]]) -> None:
    found = estimate.configs(_job(resources), zoo=None, profile_cache=None, max_gpus=8,
                             device_type="cuda")
    assert sorted({(c.gpus, c.node_count) for c in found}) == expected
    assert all(c.parallelism == "ddp" for c in found)


def test_spanning_nodes_is_estimated_slower_by_the_cross_node_factor() -> None:
    one = estimate.configs(_job({"gpus": 4}), zoo=None, profile_cache=None, max_gpus=8,
                           device_type="cuda")
    two = estimate.configs(_job({"gpus": 4, "nodes": 2}), zoo=None, profile_cache=None,
                           max_gpus=8, device_type="cuda")
    (single_node,), (spanning,) = one, two
    assert single_node.seconds < spanning.seconds
    work = estimate.workload(_job({"gpus": 4}))
    device = estimate.device_model("cuda")
    assert estimate.step_of(work, spanning.seconds, device) == pytest.approx(
        estimate.step_of(work, single_node.seconds, device) * estimate.CROSS_NODE_SLOWDOWN)
