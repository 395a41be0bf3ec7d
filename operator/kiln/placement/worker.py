"""The MILP in a worker process, under a wall-clock watchdog.

Every way the MILP can fail (timeout, crash, no solution, infeasible, solver error) comes back
as a reason string, and the planner falls back to the heuristic plan. No modelling (`milp`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.placement import heuristic, types

log = logging.getLogger(__name__)
KILN_ROOT = str(Path(__file__).resolve().parents[2])  # the directory that holds `kiln/`


def solve(problem: heuristic.Problem, warm: types.Plan, settings: types.Settings, *,
          budget_seconds: float | None = None) -> tuple[types.Plan | None, str, Any]:
    """Run `milp.run` in a worker process with a watchdog.

    HiGHS honours its time limit only between branch-and-bound steps and Pyomo's model build
    is not interruptible, so the planner never solves in its own process. The worker is
    `python -m kiln.placement.worker`: a fresh interpreter is safe under threads and inside
    daemon or pool processes, and never re-imports the caller's main module (multiprocessing's
    spawn does). The problem, the heuristic plan and the settings go over stdin as JSON
    (`encode`: each dataclass tagged with its name; `decode` rebuilds only the placement types
    it knows, so nothing but data crosses the pipe); past the deadline the worker is killed.

    Args:
        problem: the normalised snapshot.
        warm: the heuristic plan (horizon and warm start).
        settings: time limit, watchdog margin and solver settings.
        budget_seconds: wall seconds from now for everything, the worker's start included
            (default `settings.time_limit_seconds`); the watchdog fires at this, and the
            solver's own deadline is `settings.watchdog_margin_seconds` earlier (at most half
            the budget), so the worker can hand its plan back before it.

    Returns:
        (decoded MILP plan or None, reason, `milp.SolveOutcome` or None). The reason says
        what happened, with numbers: status and gap, or why there is no plan (watchdog kill
        after N s, worker exit code and its last error line, solver error).
    """
    budget = settings.time_limit_seconds if budget_seconds is None else budget_seconds
    deadline = budget  # the call never outlives its budget, whatever the solver does
    reserve = min(max(settings.watchdog_margin_seconds, 0.0), budget / 2)
    wall_deadline = time.time() + budget - reserve  # the worker's clock: same machine
    # Only the directory holding `kiln` is added (after any PYTHONPATH of the caller's), and
    # -P keeps the working directory off sys.path: a caller's script folder must not shadow
    # the standard library in the worker (a bench/operator.py once hid `operator`).
    path = [KILN_ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    began = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-P", "-m", "kiln.placement.worker"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env)
    try:
        out, err = process.communicate(encode((problem, warm, settings, wall_deadline)),
                                       timeout=deadline)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        elapsed = time.perf_counter() - began
        return None, (f"milp: watchdog killed the solver after {elapsed:.1f} s (budget "
                      f"{budget:.1f} s)"), None
    except BaseException:  # interrupted while waiting: never leave the worker running
        process.kill()
        process.wait()
        raise
    if process.returncode != 0 or not out:
        last = (err.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        log.warning("MILP worker failed (exit %s): %s", process.returncode,
                    err.decode(errors="replace")[-2000:])
        return None, f"milp: solver worker exited with code {process.returncode}: {last}", None
    message = decode(out)
    if message[0] == "error":
        log.warning("MILP worker failed: %s", message[1])
        return None, f"milp: solver failed: {message[1].splitlines()[0]}", None
    _, decoded, outcome = message
    if decoded is None:
        detail = f": {outcome.message}" if outcome.message else ""
        return None, (f"milp: no plan ({outcome.status}, {outcome.termination}) after "
                      f"{outcome.build_seconds + outcome.solve_seconds:.1f} s{detail}"), outcome
    return decoded, decoded.reason, outcome


def encode(value: Any) -> bytes:
    """`value` (placement dataclasses, tuples, str-keyed mappings, numbers, text) as JSON."""
    return json.dumps(_tagged(value)).encode()


def decode(data: bytes) -> Any:
    """The value `encode` wrote; sequences come back as tuples, as the dataclasses hold them.

    Raises:
        ValueError: not JSON, or a tagged class that is not a placement type.
    """
    return _untagged(json.loads(data))


def _tagged(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"__class__": type(value).__name__,
                **{f.name: _tagged(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, list | tuple):
        return [_tagged(item) for item in value]
    if isinstance(value, frozenset):  # Config.nodes: back as a tuple, which Config re-sets
        return sorted(value)
    if isinstance(value, Mapping):
        return {str(key): _tagged(item) for key, item in value.items()}
    return value


def _untagged(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_untagged(item) for item in value)
    if not isinstance(value, dict):
        return value
    fields = {key: _untagged(item) for key, item in value.items() if key != "__class__"}
    if "__class__" not in value:
        return fields
    known = _placement_types()
    if value["__class__"] not in known:
        raise ValueError(f"not a placement type: {value['__class__']!r}")
    return known[value["__class__"]](**fields)


def _placement_types() -> dict[str, type]:
    from kiln.placement import milp  # SolveOutcome; imports pyomo, as the worker does anyway

    return {cls.__name__: cls for cls in (
        types.Config, types.JobRequest, types.Node, types.Assignment, types.Plan, types.Settings,
        heuristic.Reservation, heuristic.Problem, milp.SolveOutcome)}


def _main() -> int:
    """Worker entry point: (problem, warm, settings, wall deadline) as JSON on stdin -> result.

    The result is ("ok", plan | None, outcome) or ("error", text). Solver chatter is sent to
    stderr (fd 1 is re-pointed there) so that stdout carries only the result.
    """
    result_fd = os.dup(1)
    os.dup2(2, 1)
    problem, warm, settings, wall_deadline = decode(sys.stdin.buffer.read())
    try:
        from kiln.placement import milp  # pyomo is imported in the worker only

        decoded, outcome = milp.run(problem, warm, settings,
                                    time_limit_seconds=wall_deadline - time.time())
        message: tuple[Any, ...] = ("ok", decoded, outcome)
    except Exception as err:  # noqa: BLE001 - the worker boundary: reported, not swallowed
        message = ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}")
    with os.fdopen(result_fd, "wb") as result:
        result.write(encode(message))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
