"""Placement (Saturn, VLDB'24): per-job configs, runtime estimates, the MILP and baselines.

Pure functions over a cluster snapshot, shared by the operator and the local runner
(DESIGN.md section 6). Filled in by the placement issue.
"""
