"""Leader election between replicas: who leads, read from kopf's peering object."""

from __future__ import annotations

import asyncio
import datetime

import kopf
from kubesim import emulator, helm

from kiln.controller import kube, leadership

NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)


def _peer(priority: int, *, seen_seconds_ago: float, lifetime: int = 60) -> dict[str, object]:
    seen = NOW - datetime.timedelta(seconds=seen_seconds_ago)
    return {"priority": priority, "lifetime": lifetime, "lastseen": seen.isoformat()}


def test_the_oldest_replica_has_the_highest_priority() -> None:
    first, second = leadership.start_priority(1000.0), leadership.start_priority(1000.5)
    assert first > second


def test_a_live_higher_peer_outranks_a_dead_or_lower_one_does_not() -> None:
    me = leadership.start_priority(2000.0)
    older = leadership.start_priority(1000.0)
    newer = leadership.start_priority(3000.0)
    live_older = {"status": {"a": _peer(older, seen_seconds_ago=10),
                             "me": _peer(me, seen_seconds_ago=1)}}
    dead_older = {"status": {"a": _peer(older, seen_seconds_ago=120)}}
    only_newer = {"status": {"b": _peer(newer, seen_seconds_ago=1)}}
    assert leadership.outranked(live_older, priority=me, now=NOW)
    assert not leadership.outranked(dead_older, priority=me, now=NOW)
    assert not leadership.outranked(only_newer, priority=me, now=NOW)
    assert not leadership.outranked(None, priority=me, now=NOW)  # no peering object yet
    assert not leadership.outranked({"status": {"x": {"priority": older, "lastseen": "?"}}},
                                    priority=me, now=NOW)


def test_the_peering_objects_follow_the_watched_namespaces() -> None:
    assert leadership.peering_paths("kiln", []) == [
        "/apis/kopf.dev/v1/clusterkopfpeerings/kiln"]
    assert leadership.peering_paths("kiln", ["a", "b"]) == [
        "/apis/kopf.dev/v1/namespaces/a/kopfpeerings/kiln",
        "/apis/kopf.dev/v1/namespaces/b/kopfpeerings/kiln"]


def test_a_replica_reads_whether_it_leads_from_the_api_server() -> None:
    now = datetime.datetime.now(datetime.UTC)
    me, older = leadership.start_priority(now.timestamp()), leadership.start_priority(1000.0)
    with emulator.Emulator(extra_resources=helm.PEERING_RESOURCES) as api_server:
        path = "/apis/kopf.dev/v1/clusterkopfpeerings"
        api_server.client.create(path, {
            "apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
            "metadata": {"name": "kiln"},
            "status": {"old-pod": {"priority": older, "lifetime": 60,
                                   "lastseen": now.isoformat()}}})

        async def leads(priority: int) -> bool:
            client = kube.Client(kopf.ConnectionInfo(server=api_server.url))
            try:
                return await leadership.leading(
                    client, leadership.peering_paths("kiln", []), priority=priority)
            finally:
                await client.close()

        assert not asyncio.run(leads(me))
        assert asyncio.run(leads(older))
