"""Leader election between operator replicas on top of kopf peering.

kopf pauses a replica's watches while a live peer has a higher priority; the placement loop is
not a watch, so it asks `leading` before each round. Pure apart from one GET per round.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any

from kiln.controller import kube

PEERING_GROUP_VERSION = "kopf.dev/v1"


def start_priority(started_epoch_seconds: float) -> int:
    """A replica's kopf peering priority: the earlier it started, the higher.

    So the replica that leads keeps leading while newer ones (a rolling update, a rescheduled
    pod) wait paused, and a newcomer never takes over from a healthy leader. Milliseconds make
    ties between replicas practically impossible (kopf pauses every replica of a tie).
    """
    return -int(started_epoch_seconds * 1000)


def peering_paths(name: str, namespaces: Iterable[str]) -> list[str]:
    """The peering objects kopf keeps: one ClusterKopfPeering when cluster-wide (no
    namespaces), else a KopfPeering in each watched namespace."""
    base = f"/apis/{PEERING_GROUP_VERSION}"
    listed = list(namespaces)
    if not listed:
        return [f"{base}/clusterkopfpeerings/{name}"]
    return [f"{base}/namespaces/{ns}/kopfpeerings/{name}" for ns in listed]


def outranked(peering: Mapping[str, Any] | None, *, priority: int,
              now: datetime.datetime) -> bool:
    """Whether a live peer in `peering` (a KopfPeering object) has a higher priority.

    A peer is live until its ``lastseen`` plus its ``lifetime`` seconds, as kopf judges it.
    """
    for peer in ((peering or {}).get("status") or {}).values():
        if not isinstance(peer, dict) or int(peer.get("priority", 0)) <= priority:
            continue
        try:
            seen = datetime.datetime.fromisoformat(str(peer.get("lastseen")))
        except ValueError:
            continue  # not a peer record kopf writes
        if seen.tzinfo is None:
            seen = seen.replace(tzinfo=datetime.UTC)
        if seen + datetime.timedelta(seconds=int(peer.get("lifetime", 60))) > now:
            return True
    return False


async def leading(client: kube.Client, paths: Iterable[str], *, priority: int) -> bool:
    """Whether this replica leads: no live peer outranks it in any of its peering objects.

    Raises:
        kube.ApiError: the API server did not answer (the caller retries next round).
    """
    now = datetime.datetime.now(datetime.UTC)
    for path in paths:
        if outranked(await client.get(path), priority=priority, now=now):
            return False
    return True
