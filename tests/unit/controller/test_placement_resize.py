"""The placement loop moves running jobs: a job grows into freed GPUs, and not twice in a row."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from kubesim import selection
from unit.controller import resize_cases

from kiln import api
from kiln.controller import cluster, jobs, kube, main, metrics, placement_loop, pods
from kiln.controller import settings as operator_settings
from kiln.placement import introspect, types
from kiln.warmstart import select


def _pod(name: str, *, job: str | None, node: str, gpus: int, parallelism: str = "single",
         attempt: int = 0) -> dict[str, Any]:
    labels = {api.JOB_NAME_LABEL: job, api.ATTEMPT_LABEL: str(attempt)} if job else {}
    container: dict[str, Any] = {"name": "c", "resources": {
        "limits": {pods.GPU_RESOURCE: str(gpus)}}}
    return {"metadata": {"name": name, "namespace": "ns", "labels": labels, "annotations": {
        pods.NODE_ANNOTATION: node, pods.GPUS_ANNOTATION: str(gpus),
        pods.DEVICE_ANNOTATION: "gpu", pods.PARALLELISM_ANNOTATION: parallelism}},
        "spec": {"nodeName": node, "containers": [container]}, "status": {"phase": "Running"}}


class _Cluster:
    """A node with 2 GPUs, one held by another workload, and the callbacks' pods."""

    def __init__(self, *, gpus: int = 2, other_gpus: int = 1) -> None:
        self.nodes: list[dict[str, Any]] = [{"metadata": {"name": resize_cases.NODE}, "status": {
            "allocatable": {pods.GPU_RESOURCE: str(gpus)},
            "conditions": [{"type": "Ready", "status": "True"}]}}]
        self.pods = {"other": _pod("other", job=None, node=resize_cases.NODE, gpus=other_gpus)}
        self.moves: list[introspect.Move] = []

    async def list(self, path: str, *, label_selector: str | None = None,
                   field_selector: str | None = None) -> list[dict[str, Any]]:
        if path == kube.Paths.nodes():
            return self.nodes
        return [dict(p) for p in selection.select(self.pods.values(), labels=label_selector,
                                                  fields=field_selector)]

    async def launch(self, entry: placement_loop.Queued, assignment: types.Assignment,
                     device: str) -> bool:
        self.pods[entry.ref.name] = _pod(entry.ref.name, job=entry.ref.name,
                                         node=assignment.node, gpus=assignment.gpus)
        return True

    async def resize(self, ref: jobs.JobRef, move: introspect.Move, device: str) -> bool:
        self.moves.append(move)
        self.pods[ref.name] = _pod(ref.name, job=ref.name, node=move.node, gpus=move.gpus,
                                   parallelism=move.parallelism, attempt=1)
        return True


async def _nothing(*_: Any) -> None:
    return None


def _loop(state: _Cluster, clock: list[float], *, min_interval: float,
          eta: dict[str, float], max_gpus: int = 2,
          publish: placement_loop.Publish = _nothing) -> placement_loop.PlacementLoop:
    settings = main.loop_settings(operator_settings.Options(
        placement_interval_seconds=1.0, cpu_slots_per_node=1, max_gpus_per_job=max_gpus,
        placement_use_milp=False, resize_min_gain=2.0, resize_min_interval_seconds=min_interval,
        resize_restart_seconds=60.0, resize_grow_price=0.0))  # GPUs taken while idle: free
    return placement_loop.PlacementLoop(
        client=state,  # type: ignore[arg-type]  # lists nodes and pods, as the loop needs
        settings=settings, launch=state.launch, publish=publish, unplaceable=_nothing,
        zoo_records=list, metrics=metrics.OperatorMetrics(), clock=lambda: clock[0],
        eta_seconds=eta, resize=state.resize)


def _queue(loop: placement_loop.PlacementLoop, name: str, now: float) -> None:
    decision = select.cold_start(api.WarmStartOutcome.COLD_EMPTY, "no zoo models")
    loop.add(placement_loop.Queued(jobs.JobRef("ns", name), resize_cases.heavy_job(name), decision, since=now))


def test_a_running_job_grows_into_gpus_another_workload_freed() -> None:
    state, clock, eta = _Cluster(), [1000.0], dict[str, float]()
    loop = _loop(state, clock, min_interval=300.0, eta=eta)  # its first move: no wait

    async def scenario() -> None:
        _queue(loop, "a", clock[0])
        await loop.tick()  # starts on the one free GPU
        assert state.pods["a"]["metadata"]["annotations"][pods.GPUS_ANNOTATION] == "1"
        eta[cluster.job_key("ns", "a")] = 2000.0
        del state.pods["other"]  # the other workload ends: a second GPU is free
        clock[0] += 10.0
        await loop.tick()
        (move,) = state.moves
        assert (move.job, move.kind, move.from_gpus, move.gpus) == ("ns/a", "grow", 1, 2)
        assert move.gain_seconds > 2 * 60.0

    asyncio.run(scenario())


def test_a_moved_job_is_not_moved_again_within_the_interval() -> None:
    state, clock, eta = _Cluster(), [1000.0], dict[str, float]()
    loop = _loop(state, clock, min_interval=300.0, eta=eta, max_gpus=4)

    async def scenario() -> None:
        _queue(loop, "a", clock[0])
        await loop.tick()
        del state.pods["other"]
        eta["ns/a"] = 2000.0
        await loop.tick()
        assert [m.gpus for m in state.moves] == [2]
        # Two more GPUs appear right after the move: growing again would pay, but the job
        # moved 100 s ago, so it waits out the interval.
        state.nodes[0]["status"]["allocatable"][pods.GPU_RESOURCE] = "4"
        eta["ns/a"] = 5000.0
        clock[0] += 100.0
        await loop.tick()
        assert [m.gpus for m in state.moves] == [2]
        clock[0] += 200.0
        await loop.tick()
        assert [m.gpus for m in state.moves] == [2, 4]

    asyncio.run(scenario())


def test_a_measured_fast_restart_lets_a_smaller_gain_move_the_job() -> None:
    state, clock, eta = _Cluster(gpus=4, other_gpus=3), [1000.0], dict[str, float]()
    loop = _loop(state, clock, min_interval=0.0, eta=eta, max_gpus=4)

    async def scenario() -> None:
        _queue(loop, "a", clock[0])
        await loop.tick()  # 1 GPU
        state.pods["other"] = _pod("other", job=None, node=resize_cases.NODE, gpus=2)
        eta["ns/a"] = 2000.0
        await loop.tick()  # 1 -> 2 GPUs, assuming the 60 s default restart
        assert [m.gpus for m in state.moves] == [2]
        del state.pods["other"]
        eta["ns/a"] = 400.0  # 4 GPUs would save ~56 s: not 2 x 60 s
        await loop.tick()
        assert len(state.moves) == 1
        clock[0] += 12.0  # the resumed trainer steps 12 s after the stop
        loop.observe_progress("ns/a", samples_per_second=900.0, step=10, now=clock[0])
        await loop.tick()  # ~56 s is more than 2 x 12 s
        assert [(m.gpus, m.restart_seconds) for m in state.moves] == [(2, 60.0), (4, 12.0)]

    asyncio.run(scenario())


@pytest.mark.parametrize(("reported_eta", "speed"), [(1.7e308, 900.0), (None, 5e-324)])
def test_a_trainer_reporting_an_endless_eta_or_no_speed_leaves_the_gains_finite(
        reported_eta: float | None, speed: float) -> None:
    # Before its reports were bounded, an ETA of 1.7e308 s made the grow's gain NaN (inf -
    # inf), and a speed of 5e-324 samples/s made every config infinite.
    state, clock, eta = _Cluster(), [1000.0], dict[str, float]()
    loop = _loop(state, clock, min_interval=300.0, eta=eta)

    async def scenario() -> None:
        _queue(loop, "a", clock[0])
        await loop.tick()
        if reported_eta is not None:
            eta["ns/a"] = reported_eta
        del state.pods["other"]
        clock[0] += 10.0
        loop.observe_progress("ns/a", samples_per_second=speed, step=10, now=clock[0])
        await loop.tick()

    asyncio.run(scenario())
    assert state.moves and all(math.isfinite(m.gain_seconds) and math.isfinite(
        m.remaining_seconds) for m in state.moves)


def test_a_trainer_reporting_it_is_about_to_end_does_not_make_the_planner_wait_on_it() -> None:
    # "b" waits for the GPU "a" holds. "a" reports an ETA of 0 s at step 0 of 2,000 epochs:
    # at ten times its estimated speed (~300k samples/s) those 80M samples take minutes, and
    # b's planned start says so (it was 5 s away at every re-plan).
    state, clock, eta = _Cluster(gpus=1, other_gpus=0), [1000.0], dict[str, float]()
    published: list[types.Assignment] = []

    async def publish(_: placement_loop.Queued, assignment: types.Assignment, __: str) -> None:
        published.append(assignment)

    loop = _loop(state, clock, min_interval=300.0, eta=eta, publish=publish)
    long_job = resize_cases.heavy_job("a")
    long_job = long_job.model_copy(update={"spec": long_job.spec.model_copy(update={
        "training": long_job.spec.training.model_copy(update={"epochs": 2000})})})
    decision = select.cold_start(api.WarmStartOutcome.COLD_EMPTY, "no zoo models")

    async def scenario() -> None:
        loop.add(placement_loop.Queued(jobs.JobRef("ns", "a"), long_job, decision,
                                       since=clock[0]))
        await loop.tick()
        eta["ns/a"] = 0.0
        loop.observe_progress("ns/a", samples_per_second=900.0, step=0, now=clock[0])
        _queue(loop, "b", clock[0])
        await loop.tick()

    asyncio.run(scenario())
    (waiting,) = [a for a in published if a.job == "ns/b"]
    assert waiting.start - clock[0] > 100.0
