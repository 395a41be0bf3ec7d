"""Kiln: a Kubernetes operator that makes deep-learning training finish sooner.

Packages, bottom to top: `api` (job types) <- `contract` (the operator-trainer interface) <-
`models`, `zoo` <- `warmstart`, `placement` <- `controller`, `local` <- `cluster` <- `cli`.
`from kiln import Client` is `kiln.cluster.client.Client`, imported on first use.
"""

import importlib.metadata
from typing import Any

try:  # pyproject.toml holds the one version; everything else reads it from here
    __version__ = importlib.metadata.version("kiln-operator")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str) -> Any:
    # `import kiln` stays light (the CLI's --help); the Client brings the kubernetes client.
    if name == "Client":
        from kiln.cluster.client import Client

        return Client
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
