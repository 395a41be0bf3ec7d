"""Kiln: a Kubernetes operator that makes deep-learning training finish sooner.

Packages, bottom to top (DESIGN.md section 2): `api`, `models` (job types and the architecture
registry) <- `zoo`, `warmstart`, `placement` <- `controller`, `local`, `cli`.
"""

__version__ = "0.1.0"
