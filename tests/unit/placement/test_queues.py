"""Tests for kiln.placement.queues: per-node queues and the one start rule."""

from __future__ import annotations

from kiln.placement import queues, types

HEURISTIC = types.Settings(use_milp=False)


def _plan(*assignments: types.Assignment) -> types.Plan:
    return types.Plan(assignments, max(a.end for a in assignments), "heuristic")


def test_each_node_queues_its_jobs_by_planned_start() -> None:
    line = queues.NodeQueues(_plan(
        types.Assignment("a", "n1", 2, "ddp", 10.0, 5.0),
        types.Assignment("b", "n1", 2, "ddp", 0.0, 5.0),
        types.Assignment("c", "n2", 1, "single", 3.0, 5.0)))
    assert {n: [a.job for a in q] for n, q in line.per_node().items()} == {
        "n1": ["b", "a"], "n2": ["c"]}
    assert [a.job for a in line.waiting()] == ["b", "c", "a"]
    assert len(line) == 3 and "a" in line


def test_heads_start_while_their_devices_are_free_whatever_their_planned_start() -> None:
    line = queues.NodeQueues(_plan(
        types.Assignment("first", "n", 2, "ddp", 0.0, 10.0),
        types.Assignment("second", "n", 1, "single", 50.0, 10.0),
        types.Assignment("third", "n", 2, "ddp", 60.0, 10.0)))
    assert [a.job for a in line.start_heads({"n": 3})] == ["first", "second"]
    assert [a.job for a in line.waiting()] == ["third"]
    assert line.start_heads({"n": 1}) == []
    assert [a.job for a in line.start_heads({"n": 2})] == ["third"]
    assert len(line) == 0


def test_a_head_whose_devices_are_busy_blocks_the_jobs_behind_it() -> None:
    line = queues.NodeQueues(_plan(
        types.Assignment("wide", "n", 4, "ddp", 0.0, 10.0),
        types.Assignment("narrow", "n", 1, "single", 10.0, 10.0)))
    assert line.start_heads({"n": 2}) == []
    assert [a.job for a in line.waiting()] == ["wide", "narrow"]


def test_a_dropped_job_leaves_its_place_to_the_next() -> None:
    line = queues.NodeQueues(_plan(
        types.Assignment("gone", "n", 4, "ddp", 0.0, 10.0),
        types.Assignment("next", "n", 1, "single", 10.0, 10.0)))
    line.drop("gone")
    assert [a.job for a in line.start_heads({"n": 2})] == ["next"]


def test_replan_follows_the_new_plan_and_only_its_jobs_wait() -> None:
    line = queues.NodeQueues()
    assert line.plan is None and line.start_heads({"n": 4}) == []
    snapshot = types.Snapshot(0.0, (types.Node("n", 2),), (
        types.JobRequest("a", (types.Config("single", 1, 10.0),)),
        types.JobRequest("b", (types.Config("single", 1, 10.0),))),
        (types.Running("r", "n", 1, "single", 5.0),))
    plan = line.replan(snapshot, HEURISTIC)
    assert line.plan is plan and {a.job for a in line.waiting()} == {"a", "b"}
    started = line.start_heads({"n": 1})
    assert len(started) == 1
    later = types.Snapshot(5.0, snapshot.nodes, tuple(
        r for r in snapshot.queued if r.name != started[0].job))
    line.replan(later, HEURISTIC)
    assert [a.job for a in line.waiting()] == [r.name for r in later.queued]
