"""Kiln: a Kubernetes operator that makes deep-learning training finish sooner.

Packages, bottom to top: `api` (job types) <- `contract` (the operator-trainer interface) <-
`models`, `zoo` <- `warmstart`, `placement` <- `controller`, `local` <- `cli`.
"""

__version__ = "0.1.0"
