"""Housekeeping without kopf timers: a loop over a kopf index of the jobs that need it.

kopf's timers always put a finalizer on their objects; with ``--no-finalizer`` this loop runs
`housekeeping.tick` instead, every interval, for each job of the index (an index needs no
finalizer). Only the leading replica sweeps.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import kopf

from kiln.controller import kube, metrics

INDEX_ID = "housekeeping_jobs"
_log = logging.getLogger(__name__)


def index_job(namespace: str | None, name: str, body: kopf.Body, **_: Any
              ) -> dict[tuple[str | None, str], kube.Object]:
    """The index entry of a job that needs housekeeping: its latest body by its key."""
    return {(namespace, name): dict(body)}


async def run(index: Mapping[Any, Iterable[Mapping[str, Any]]], *,
              tick: Callable[[Mapping[str, Any]], Awaitable[None]],
              leads: Callable[[], Awaitable[bool]], counts: metrics.OperatorMetrics,
              interval_seconds: float) -> None:
    """`tick` every indexed job every `interval_seconds` while this replica `leads`, until
    cancelled.

    An error in one job's tick is logged and counted in `counts`; the others still tick.
    """
    while True:
        await asyncio.sleep(interval_seconds)
        try:
            if not await leads():
                continue
        except kube.ApiError as exc:
            _log.warning("housekeeping: leadership not readable (%s); skipping a round", exc)
            continue
        for key in list(index):
            for body in list(index.get(key, ())):
                try:
                    await tick(body)
                except kube.ApiError as exc:
                    counts.reconcile_errors.labels(handler="housekeeping").inc()
                    _log.warning("housekeeping of %s/%s: %s", key[0], key[1], exc)
                except Exception:  # noqa: BLE001  # a bug: keep sweeping the other jobs, loudly
                    counts.reconcile_errors.labels(handler="housekeeping").inc()
                    _log.exception("housekeeping of %s/%s: unexpected error", key[0], key[1])
