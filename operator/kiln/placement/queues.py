"""The online placement queue: per-node queues from the plan in force, and when a job starts.

Each node gets an ordered queue; a job starts when it reaches the head of its node's queue and
its devices are free, never by the wall clock. One rule for `kiln run --slots`, the operator's
placement loop and the simulator.
"""

from __future__ import annotations

from collections.abc import Mapping

from kiln.placement import planner, types


class NodeQueues:
    """The plan in force over one pool of nodes, and which of its jobs still wait to start.

    One owner at a time calls it (the local run's loop, the operator's placement task, the
    simulator); it is not locked.

    Args:
        current: the plan to follow from the start (None: none yet; `replan` or `follow`).
    """

    def __init__(self, current: types.Plan | None = None) -> None:
        self._plan: types.Plan | None = None
        self._waiting: set[str] = set()
        if current is not None:
            self.follow(current)

    @property
    def plan(self) -> types.Plan | None:
        """The plan in force (None before the first one)."""
        return self._plan

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, job: object) -> bool:
        return job in self._waiting

    def follow(self, new: types.Plan) -> None:
        """Put `new` in force: the jobs it places are the ones waiting to start."""
        self._plan = new
        self._waiting = {a.job for a in new.assignments}

    def replan(self, snapshot: types.Snapshot, settings: types.Settings) -> types.Plan:
        """Re-plan `snapshot` against the plan in force and follow the result.

        `planner.replan`: running jobs are pinned for their remaining time, planned starts
        inside the freeze window keep their slot, and the plan in force is kept unless a fresh
        one is shorter by `settings.replan_threshold`. On an error nothing changes.

        Raises:
            types.Unplaceable: a queued job has no config that fits any node.
            ValueError: as for `planner.plan`.
        """
        new = planner.replan(self._plan, snapshot, settings)
        self.follow(new)
        return new

    def waiting(self) -> list[types.Assignment]:
        """The assignments of the jobs still waiting, by planned start (then job name)."""
        if self._plan is None:
            return []
        return sorted((a for a in self._plan.assignments if a.job in self._waiting),
                      key=lambda a: (a.start, a.job))

    def per_node(self) -> dict[str, list[types.Assignment]]:
        """Per node, its waiting assignments in queue order (planned start, then job name); a
        multi-node assignment waits in the queue of each of its nodes."""
        out: dict[str, list[types.Assignment]] = {}
        for a in self.waiting():
            for node in a.all_nodes:
                out.setdefault(node, []).append(a)
        return out

    def start_heads(self, free_devices: Mapping[str, int]) -> list[types.Assignment]:
        """Take the jobs that start now: per node, queue heads while their devices are free.

        The head whose devices are not free blocks the rest of its node's queue: a smaller
        job behind it would take devices the head waits for, delaying the plan. A multi-node
        job starts when it heads the queues of all its nodes and each has its devices free
        (its pods start together). Taken jobs no longer wait; the caller starts them.

        Args:
            free_devices: node -> devices free right now (GPUs, or CPU worker slots).

        Returns:
            The assignments to start, node by node, each node's in queue order.
        """
        taken: list[types.Assignment] = []
        lines = self.per_node()
        free = {node: free_devices.get(node, 0) for node in lines}
        changed = True
        while changed:  # a gang taken frees no devices, but may bring another to every head
            changed = False
            for line in lines.values():
                while line:
                    a = line[0]
                    if (not all(lines[n] and lines[n][0] is a for n in a.all_nodes)
                            or any(a.gpus > free[n] for n in a.all_nodes)):
                        break
                    for n in a.all_nodes:
                        free[n] -= a.gpus
                        lines[n].pop(0)
                    self._waiting.discard(a.job)
                    taken.append(a)
                    changed = True
        return taken

    def drop(self, job: str) -> None:
        """Stop waiting for `job` (it left the queue); no-op when it is not waiting."""
        self._waiting.discard(job)
