"""Zoo eviction on a real S3 server (moto's, as a subprocess; the `minio` SDK over HTTP):
sizes come from HEAD requests, hits are objects, and a live parent survives `kiln zoo gc`."""

from __future__ import annotations

import datetime
import json
from typing import Any

import pytest
from zoofactory import NOW, add, hit

from kiln import cli, contract
from kiln.zoo import eviction, records, store


@pytest.fixture
def zoo(s3_server: Any, s3_bucket: str) -> store.S3Store:
    return store.S3Store(s3_server.endpoint, s3_bucket, access_key=s3_server.access_key,
                         secret_key=s3_server.secret_key, prefix="team-a/zoo",
                         retry=store.RetryPolicy(attempts=3, first_backoff_seconds=0.2))


def test_eviction_on_s3_never_removes_a_live_parent(zoo: store.S3Store) -> None:
    add(zoo, "parent-00000001", floats=4000, days_old=200)
    add(zoo, "unused-00000002", floats=4000, days_old=200)
    add(zoo, "used-00000003", floats=100)
    hit(zoo, "used-00000003", days_ago=1, times=2)
    entries = eviction.survey(zoo, now=NOW, protect={"parent-00000001": "parent of live job"})
    by_id = {e.record.id: e for e in entries}
    assert by_id["used-00000003"].hits == 2
    assert by_id["parent-00000001"].size_bytes > 16000  # HEAD sizes of all its objects
    chosen = eviction.plan(entries, capacity_bytes=by_id["parent-00000001"].size_bytes + 2000)
    eviction.carry_out(zoo, chosen)
    assert [r.id for r in records.list_records(zoo)] == ["parent-00000001", "used-00000003"]


def test_zoo_gc_through_the_cli_on_s3(zoo: store.S3Store, s3_server: Any, s3_bucket: str,
                                      monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    add(zoo, "old-00000001", floats=3000, days_old=60)
    add(zoo, "new-00000002", floats=3000, days_old=0)
    eviction.record_hit(zoo, "new-00000002", now=datetime.datetime.now(datetime.UTC))
    monkeypatch.setenv(contract.Env.ZOO_ACCESS_KEY, s3_server.access_key)
    monkeypatch.setenv(contract.Env.ZOO_SECRET_KEY, s3_server.secret_key)
    assert cli.main(["zoo", "gc", "--zoo", f"s3://{s3_bucket}/team-a/zoo", "--zoo-endpoint",
                     s3_server.endpoint, "--capacity", "20KB", "-o", "json"]) == cli.EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert [e["id"] for e in report["evicted"]] == ["old-00000001"]
    assert [r.id for r in records.list_records(zoo)] == ["new-00000002"]
