"""Placement (Saturn, VLDB'24): which parallelism, how many devices, which node, and when.

Pure functions over a cluster snapshot, shared by the operator and `kiln run`. Only `milp`
imports pyomo (in the worker process); only `estimate` and `profile` import torch; nothing here
imports kubernetes.
"""
