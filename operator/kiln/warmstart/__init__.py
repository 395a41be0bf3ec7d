"""Warm start (ModelKeeper, NSDI '23): architecture graphs, DAG alignment, weight transfer.

Modules: `graph` (model -> architecture graph, JSON), `dag` (its array form), `match`
(parent/child alignment and similarity), `select` (parent choice and cold-start reasons),
`transform` (parent weights -> child shapes, Net2Net-style; it plans with `transferplan`, unit
maps, heads and identity layers from shapes, and writes with `net2net`, the tensor operators),
`plan` (the pipeline end to end: `plan` decides, `apply` seeds). Import the modules, not names:
`from kiln.warmstart import match`.
"""
