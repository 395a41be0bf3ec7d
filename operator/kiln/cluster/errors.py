"""What `kiln.Client` raises besides `api.InvalidSpec`: user-facing problems and waits that end
badly. The CLI prints each as one message (exit 2, 1 and 124)."""

from __future__ import annotations

from typing import Any


class ClusterError(Exception):
    """A user-facing problem: no kubeconfig, an unreachable cluster, an unknown job, a refusal
    by the API server. The message names what is wrong and how to fix it."""


class WaitFailed(Exception):
    """`wait` saw the job end, or vanish, without reaching the wanted phase.

    Attributes:
        view: the job's last `views.detail` (empty when it was deleted).
    """

    def __init__(self, message: str, view: dict[str, Any]) -> None:
        super().__init__(message)
        self.view = view


class WaitTimeout(TimeoutError):
    """`wait` ran out of time; `view` is the job's last `views.detail`."""

    def __init__(self, message: str, view: dict[str, Any]) -> None:
        super().__init__(message)
        self.view = view
