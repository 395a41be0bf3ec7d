"""Warm start (ModelKeeper, NSDI '23): architecture graphs, DAG alignment, weight transfer.

Modules: `graph` (model -> architecture graph, JSON), `match` (parent/child alignment and
similarity). Import the modules, not names: `from kiln.warmstart import match`.
"""
