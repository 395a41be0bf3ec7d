"""The operator's zoo eviction against the kmock API emulator: started by the startup handler
when --zoo-capacity is set, each round lists the TrainingJobs over HTTP, keeps what unfinished
jobs use (their parents, pinned or decided, and running jobs' provisional records) and evicts
the rest past capacity."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import kopf
import pytest
from kubesim import emulator
from zoofactory import add, hit

from kiln import api
from kiln.controller import handlers, main
from kiln.zoo import records, store

# Listing while a record is replaced or deleted skips it with a warning: expected here.
pytestmark = pytest.mark.filterwarnings("ignore::kiln.zoo.records.SkippedRecordWarning")
SUCCEEDED = {"conditions": [{"type": "Succeeded", "status": "True", "reason": "TargetReached",
                             "message": "done", "lastTransitionTime": "2025-01-01T00:00:00Z"}]}


def _job(name: str, *, parent: str = "auto", status: dict[str, Any] | None = None
         ) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                 "dataset": {"name": "digits"}, "training": {"epochs": 1},
                 "warmStart": {"parent": parent}}}
    if status is not None:
        doc["status"] = status
    return doc


def test_operator_eviction_keeps_live_parents_and_running_provisional_records(
        tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    for record_id in ("decided-00000001", "finished-00000003", "spare-00000004"):
        add(zoo, record_id, floats=3000, days_old=400)  # old and never chosen: worth least
    add(zoo, "pinned-00000002", floats=3000, days_old=400, namespace="team-b")  # its pinner's
    add(zoo, "provisional-00000005", floats=3000, days_old=400, provisional=True,
        job_name="running", namespace="team-a")
    # Job "running" of team-b is gone: a live job of that name in team-a keeps this one no more.
    add(zoo, "provisional-00000007", floats=3000, days_old=400, provisional=True,
        job_name="running", namespace="team-b")
    # Team-c's private model, pinned by a team-a job not yet admitted: naming it keeps nothing.
    add(zoo, "private-00000008", floats=3000, days_old=400, namespace="team-c",
        share=api.ZooShare.PRIVATE)
    add(zoo, "popular-00000006", floats=3000)
    hit(zoo, "popular-00000006", days_ago=0, times=5)
    with emulator.Emulator() as cluster:
        cluster.client.create_job("team-a", _job("running", status={
            "warmStart": {"parent": "decided-00000001"}}))
        cluster.client.create_job("team-b", _job("pinned", parent="pinned-00000002"))
        cluster.client.create_job("team-a", _job("pins-theirs", parent="private-00000008"))
        cluster.client.create_job("team-a", _job("done", status={
            **SUCCEEDED, "warmStart": {"parent": "finished-00000003"}}))
        options = main.options_from_args(main.build_parser().parse_args(
            ["--zoo-uri", str(zoo.root), "--zoo-capacity", "1KB"]))
        operator = main.build(options, kopf.ConnectionInfo(server=cluster.url))

        async def operator_until_evicted() -> None:
            memo = kopf.Memo()
            memo.operator = operator
            await handlers.startup(settings=kopf.OperatorSettings(), memo=memo)
            deadline = time.monotonic() + 60
            try:
                while len(await asyncio.to_thread(records.list_records, zoo)) > 3:
                    assert time.monotonic() < deadline, "no eviction round ran"
                    await asyncio.sleep(0.05)  # integration: the round runs in the background
            finally:
                await handlers.cleanup(memo=memo)

        asyncio.run(operator_until_evicted())
    # What live jobs use stays, even past the 1 KB budget.
    left = {r.id for r in records.list_records(zoo)}
    assert left == {"decided-00000001", "pinned-00000002", "provisional-00000005"}


def test_operator_deletes_unusable_records_of_jobs_that_no_longer_run(tmp_path: Path) -> None:
    """What a failed pod left half-written, and a record its pod wrote under another job's
    name, go once their job is over; a running job's half-written record, a folder nobody
    reserved (an import still uploading) and a usable record of a finished job stay."""
    zoo = store.DirStore(tmp_path / "zoo")

    def half_written(record_id: str) -> None:  # weights uploaded, meta.json never written
        zoo.put_bytes(f"{records.record_prefix(record_id)}{records.WEIGHTS_NAME}", b"x" * 100)

    half_written("failed-00000001")
    records.write_claim(zoo, "failed-00000001", "team-a", "failed")
    half_written("running-00000002")
    records.write_claim(zoo, "running-00000002", "team-a", "running")
    half_written("uploading-00000003")  # no claim: `kiln zoo import`, say
    # Job "forger" of team-a wrote its record as team-b's model, then ended.
    add(zoo, "forged-00000004", floats=10, namespace="team-b", job_name="victim")
    records.write_claim(zoo, "forged-00000004", "team-a", "forger")
    add(zoo, "done-00000005", floats=10, namespace="team-a", job_name="done")
    records.write_claim(zoo, "done-00000005", "team-a", "done")
    failed = {"conditions": [{"type": "Failed", "status": "True", "reason": "PodFailed",
                              "message": "x", "lastTransitionTime": "2025-01-01T00:00:00Z"}]}
    with emulator.Emulator() as cluster:
        cluster.client.create_job("team-a", _job("failed", status=failed))
        cluster.client.create_job("team-a", _job("running", status={}))
        cluster.client.create_job("team-a", _job("forger", status=SUCCEEDED))
        cluster.client.create_job("team-a", _job("done", status=SUCCEEDED))
        options = main.options_from_args(main.build_parser().parse_args(
            ["--zoo-uri", str(zoo.root), "--zoo-capacity", "1GB"]))
        operator = main.build(options, kopf.ConnectionInfo(server=cluster.url))

        def folders() -> set[str]:
            return {key.split("/")[1] for key in zoo.list_keys(records.MODELS_PREFIX)}

        async def operator_until_collected() -> None:
            memo = kopf.Memo()
            memo.operator = operator
            await handlers.startup(settings=kopf.OperatorSettings(), memo=memo)
            deadline = time.monotonic() + 60
            try:
                while {"failed-00000001", "forged-00000004"} & await asyncio.to_thread(folders):
                    assert time.monotonic() < deadline, "no round deleted the abandoned records"
                    await asyncio.sleep(0.05)  # integration: the round runs in the background
            finally:
                await handlers.cleanup(memo=memo)

        asyncio.run(operator_until_collected())
    assert folders() == {"running-00000002", "uploading-00000003", "done-00000005"}
    assert records.read_record(zoo, "done-00000005").job_name == "done"
