"""Warm start (ModelKeeper, NSDI '23): seed a new job with the weights of a similar zoo model.

`decision` decides the parent once and applies it; beneath it `graph` (architecture graphs),
`match` (alignment), `index` with `scoring` and `clusters` (parent search), `select` (the
policy) and `transform` (weights into the child's shapes). Import modules, not names.
"""
