"""Placement (Saturn, VLDB'24): per-job configs, runtime estimates, the MILP and baselines.

Pure functions over a cluster snapshot, shared by the operator and the local runner
(DESIGN.md section 6; research digest shared/research/saturn.md). Modules:
`types` (configs, jobs, nodes, snapshots, plans, settings; `candidates`, `Unplaceable`),
`estimate` and `profile` (per-config runtime estimates: zoo, profiling run, FLOPs; the
profile cache in `profilecache`), `heuristic` (GPU count by min-area or knee, longest-first
list scheduling on `timeline`s, lower bound), `milp` (the time-indexed count-based model in
Pyomo/HiGHS: build, solve, decode; its data on the slot grid in `slotgrid`),
`worker` (the MILP in a watchdogged worker process), `plan` (`plan`, `replan`, `extend`:
the better of heuristic and MILP, online re-planning with hysteresis and a freeze window),
`baselines` (whole-node FIFO, fixed-k FIFO) and `simulate` (event-driven replay of a
workload under a policy). Import the modules, not names: `from kiln.placement import plan`.
The planner modules (all but `estimate` and `profile`, which measure models) never import
torch or kubernetes; pyomo is imported only by `milp`, which runs in the worker process.
"""
