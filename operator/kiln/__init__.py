"""Kiln: a Kubernetes operator that makes deep-learning training finish sooner.

Packages, bottom to top: `api` (job types) <- `contract` (the operator-trainer interface) <-
`models`, `zoo` <- `warmstart`, `placement` <- `controller`, `local` <- `cli`.
"""

import importlib.metadata

try:  # pyproject.toml holds the one version; everything else reads it from here
    __version__ = importlib.metadata.version("kiln-operator")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
