"""The placement MILP's data on the slot grid (Model A), built in Python: `build_problem`.

`kiln.placement.milp`'s docstring is the formulation; this module computes its sets and
parameters from a normalised snapshot and the heuristic plan: the slot length (1.2 H / T) and
horizon, the sparse CHOICES (job, config, node, start slot) that fit and finish by the horizon,
`gpus`, `duration_slots`, per-slot `capacity_gpus` after reservations, `reserved_area`, the
makespan lower bound in slots, the identical-job and identical-node pairs for symmetry
breaking, and the heuristic plan on the grid as the warm start (relabelled to satisfy the
symmetry rows). The grid widens until the warm start fits, so it is always feasible.

Callers: `milp` (which re-exports `SlotProblem` and `build_problem`) and tests. Non-goals: no
Pyomo model, no solving, no decoding (`milp`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping

from kiln.placement import heuristic, types

HORIZON_FACTOR = 1.2  # H' = 1.2 H: room for slot rounding (digest 7.2: 1.1-1.3)
Choice = tuple[str, int, str, int]  # (job, index into options[job], node, start slot)


@dataclasses.dataclass
class SlotProblem:
    """Model A's data, built in Python (sparse, only meaningful choices)."""

    problem: heuristic.Problem
    slot_seconds: float
    slots: int
    choices: list[Choice]
    gpus: list[int]
    duration_slots: list[int]
    choices_of: dict[str, list[int]]
    holding: dict[tuple[str, int], list[int]]
    capacity_gpus: dict[tuple[str, int], int]
    reserved_area: dict[str, int]
    lower_bound_slots: int
    identical_jobs: list[tuple[str, str]]
    identical_nodes: list[tuple[str, str]]
    warm: dict[str, int] | None  # job -> choice index of the warm start


def _slot_capacity(problem: heuristic.Problem, slot_seconds: float, slots: int
                   ) -> dict[tuple[str, int], int]:
    """Per (node, slot): GPUs minus reservations overlapping the slot (conservative)."""
    cap = {(n.name, t): n.gpus for n in problem.nodes for t in range(slots)}
    for r in problem.reservations:
        first = max(0, math.floor((r.start - problem.now) / slot_seconds))
        last = min(slots, math.ceil((r.end - problem.now) / slot_seconds - 1e-9))
        for t in range(first, last):
            cap[r.node, t] -= r.gpus
    return cap


def _warm_slots(problem: heuristic.Problem, warm: types.Plan, slot_seconds: float,
                slots: int, cap: Mapping[tuple[str, int], int]
                ) -> tuple[dict[str, tuple[int, str, int]], int]:
    """The warm plan on the slot grid: per job (option index, node, slot), and its end slot.

    Jobs keep the warm plan's node and config and its start order, each at its earliest
    slot that fits; the end may exceed `slots` (the caller then widens the slots).
    """
    used = {key: 0 for key in cap}
    out: dict[str, tuple[int, str, int]] = {}
    end = 0
    planned = {a.job: a for a in warm.assignments}
    for job in sorted(problem.jobs, key=lambda j: (planned[j.name].start, j.name)):
        a = planned[job.name]
        idx = next((i for i, c in enumerate(problem.options[job.name])
                    if c.gpus == a.gpus and c.parallelism == a.parallelism), None)
        if idx is None:
            raise ValueError(f"warm plan: job {job.name} uses a config not among its options")
        p = math.ceil(a.seconds / slot_seconds - 1e-9)
        t = math.ceil((problem.release[job.name] - problem.now) / slot_seconds - 1e-9)
        while any(used.get((a.node, s), 0) + a.gpus > cap.get((a.node, s), a.gpus)
                  for s in range(t, t + p)):
            t += 1
        for s in range(t, t + p):
            if (a.node, s) in used:
                used[a.node, s] += a.gpus
        out[job.name] = (idx, a.node, t)
        end = max(end, t + p)
    return out, end


def build_problem(problem: heuristic.Problem, warm: types.Plan, settings: types.Settings
                  ) -> SlotProblem:
    """Slot length, horizon, choices, capacities, symmetry pairs and warm start.

    The slot length starts at 1.2 H / T (H: the warm plan's remaining makespan) or
    `settings.slot_seconds`; if the warm plan rounded to slots does not fit the horizon, the
    slots grow (fixed length) or the length grows, so the warm start is always feasible.
    """
    horizon = max(warm.makespan - problem.now, 1e-9)
    slots = settings.slots
    slot_seconds = settings.slot_seconds or HORIZON_FACTOR * horizon / slots
    if settings.slot_seconds:
        slots = max(1, math.ceil(HORIZON_FACTOR * horizon / slot_seconds))
    for _ in range(8):
        cap = _slot_capacity(problem, slot_seconds, slots)
        placed, end = _warm_slots(problem, warm, slot_seconds, slots, cap)
        if end <= slots:
            break
        if settings.slot_seconds:
            slots = end
        else:
            slot_seconds *= end / slots * 1.01
    else:
        raise RuntimeError("warm start does not fit the slot horizon")  # cannot happen
    choices: list[Choice] = []
    choices_of: dict[str, list[int]] = {j.name: [] for j in problem.jobs}
    holding: dict[tuple[str, int], list[int]] = {}
    gpus, duration = [], []
    warm_index: dict[str, int] = {}
    for job in problem.jobs:
        release = math.ceil((problem.release[job.name] - problem.now) / slot_seconds - 1e-9)
        for idx, config in enumerate(problem.options[job.name]):
            p = max(1, math.ceil(config.seconds / slot_seconds - 1e-9))
            for node in problem.nodes:
                if config.gpus > node.gpus:
                    continue
                for t in range(release, slots - p + 1):
                    if any(cap[node.name, s] < config.gpus for s in range(t, t + p)):
                        continue
                    if placed[job.name] == (idx, node.name, t):
                        warm_index[job.name] = len(choices)
                    choices_of[job.name].append(len(choices))
                    for s in range(t, t + p):
                        holding.setdefault((node.name, s), []).append(len(choices))
                    choices.append((job.name, idx, node.name, t))
                    gpus.append(config.gpus)
                    duration.append(p)
    full = {n.name: n.gpus for n in problem.nodes}
    reserved = {n.name: sum(full[n.name] - cap[n.name, t] for t in range(slots))
                for n in problem.nodes}
    bound = max(0, math.ceil((heuristic.lower_bound(problem) - problem.now) / slot_seconds
                             - 1e-6))
    sp = SlotProblem(problem, slot_seconds, slots, choices, gpus, duration, choices_of,
                     holding, cap, reserved, bound, _identical_jobs(problem),
                     _identical_nodes(problem, cap, slots), None)
    sp.warm = _symmetric_warm(sp, warm_index)
    return sp


def _identical_jobs(problem: heuristic.Problem) -> list[tuple[str, str]]:
    """Consecutive pairs of jobs with the same options and release (e.g. lr copies)."""
    groups: dict[tuple[object, ...], list[str]] = {}
    for job in problem.jobs:
        key = (problem.options[job.name], problem.release[job.name])
        groups.setdefault(key, []).append(job.name)
    return [(a, b) for names in groups.values() for a, b in itertools.pairwise(names)]


def _identical_nodes(problem: heuristic.Problem, cap: Mapping[tuple[str, int], int],
                     slots: int) -> list[tuple[str, str]]:
    """Consecutive pairs of nodes with equal GPUs and nothing reserved."""
    groups: dict[int, list[str]] = {}
    for n in problem.nodes:
        if all(cap[n.name, t] == n.gpus for t in range(slots)):
            groups.setdefault(n.gpus, []).append(n.name)
    return [(a, b) for names in groups.values() for a, b in itertools.pairwise(names)]


def _symmetric_warm(sp: SlotProblem, warm: dict[str, int]) -> dict[str, int] | None:
    """The warm start relabelled to satisfy the symmetry-breaking rows (or None)."""
    if set(warm) != set(sp.choices_of):
        return None
    assigned = {job: sp.choices[c] for job, c in warm.items()}
    for group in _chains(sp.identical_nodes):  # heaviest node first
        load = {n: 0 for n in group}
        for job, (j, idx, node, t) in assigned.items():
            if node in load:
                load[node] += sp.problem.options[j][idx].gpus * sp.duration_slots[warm[job]]
        relabel = dict(zip(sorted(group, key=lambda n: -load[n]), group, strict=True))
        assigned = {job: (j, i, relabel.get(n, n), t) for job, (j, i, n, t) in assigned.items()}
    for group in _chains(sp.identical_jobs):  # earliest start to the earliest-listed job
        tuples = sorted((assigned[j] for j in group), key=lambda c: c[3])
        for job, (_, idx, node, t) in zip(group, tuples, strict=True):
            assigned[job] = (job, idx, node, t)
    index = {c: i for i, c in enumerate(sp.choices)}
    out = {job: index.get(choice) for job, choice in assigned.items()}
    return None if None in out.values() else {j: i for j, i in out.items() if i is not None}


def _chains(pairs: list[tuple[str, str]]) -> list[list[str]]:
    """Consecutive pairs back to ordered groups."""
    groups: list[list[str]] = []
    for a, b in pairs:
        if groups and groups[-1][-1] == a:
            groups[-1].append(b)
        else:
            groups.append([a, b])
    return groups
