"""Zoo eviction on a DirStore: hits, their decay, the value-per-byte plan, and what never goes.

The same against a real S3 server is in tests/integration/test_zoo_eviction_s3.py.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
from zoofactory import NOW, add, hit

from kiln import cli
from kiln.zoo import eviction, records, store

DAY_SECONDS = 86400.0


@pytest.fixture
def zoo(tmp_path: Path) -> store.DirStore:
    return store.DirStore(tmp_path / "zoo")


def sizes(zoo: store.ObjectStore) -> dict[str, int]:
    return {e.record.id: e.size_bytes for e in eviction.survey(zoo, now=NOW)}


def test_hits_are_separate_objects_so_concurrent_choices_all_count(zoo: store.DirStore) -> None:
    add(zoo, "popular-00000001", floats=10)
    hit(zoo, "popular-00000001", days_ago=0, times=5)  # same second: still five keys
    assert len(eviction.hit_times(zoo)["popular-00000001"]) == 5


def test_value_halves_with_each_half_life() -> None:
    fresh = eviction.value([NOW], created=None, now=NOW, half_life_seconds=DAY_SECONDS)
    old = eviction.value([NOW - datetime.timedelta(days=2)], created=None, now=NOW,
                         half_life_seconds=DAY_SECONDS)
    assert fresh == pytest.approx(1.0)
    assert old == pytest.approx(0.25)


def test_evicts_lowest_value_per_byte_until_under_capacity(zoo: store.DirStore) -> None:
    add(zoo, "big-unused-00000001", floats=4000)
    add(zoo, "big-used-00000002", floats=4000)
    add(zoo, "small-unused-00000003", floats=100)
    hit(zoo, "big-used-00000002", days_ago=1, times=3)
    size = sizes(zoo)
    capacity = sum(size.values()) - size["big-unused-00000001"] // 2
    chosen = eviction.plan(eviction.survey(zoo, now=NOW), capacity_bytes=capacity)
    # The large, never-chosen record is worth least per byte; evicting it alone suffices, so
    # the small one, evicted first by density, is taken back.
    assert [e.record.id for e in chosen.evict] == ["big-unused-00000001"]
    assert chosen.after_bytes <= capacity


def test_never_evicts_a_live_parent_even_over_capacity(zoo: store.DirStore) -> None:
    add(zoo, "parent-00000001", floats=5000, days_old=300)
    add(zoo, "other-00000002", floats=50)
    hit(zoo, "other-00000002", days_ago=0, times=10)
    entries = eviction.survey(zoo, now=NOW, protect={"parent-00000001": "parent of live job x"})
    chosen = eviction.plan(entries, capacity_bytes=100)
    assert "parent-00000001" not in [e.record.id for e in chosen.evict]
    assert chosen.over_capacity
    eviction.carry_out(zoo, chosen)
    assert records.read_record(zoo, "parent-00000001").id == "parent-00000001"


def test_never_evicts_the_base_of_a_kept_lora_adapter(zoo: store.DirStore) -> None:
    lora = {"method": "lora", "rank": 2, "alpha": 4.0, "targetModules": ["head.2"],
            "dropout": 0.0}
    add(zoo, "base-00000001", floats=5000, days_old=300)  # large, old, never chosen
    add(zoo, "adapter-00000002", floats=50, base="base-00000001", adapter=lora)
    hit(zoo, "adapter-00000002", days_ago=0, times=10)
    # another namespace's private record: naming it as a base keeps nothing
    add(zoo, "private-00000003", floats=5000, days_old=300, namespace="team-b")
    add(zoo, "adapter-00000004", floats=50, base="private-00000003", adapter=lora,
        namespace="team-a")
    hit(zoo, "adapter-00000004", days_ago=0, times=10)
    entries = eviction.survey(zoo, now=NOW)
    protected: dict[str, str] = {e.record.id: e.protected for e in entries}
    assert protected["base-00000001"] == "base of LoRA adapter adapter-00000002"
    assert protected["private-00000003"] == ""
    size = sizes(zoo)
    chosen = eviction.plan(entries, capacity_bytes=sum(
        size[i] for i in ("base-00000001", "adapter-00000002", "adapter-00000004")))
    assert [e.record.id for e in chosen.evict] == ["private-00000003"]
    eviction.carry_out(zoo, chosen)
    assert records.read_record(zoo, "base-00000001").id == "base-00000001"
    # once its adapter is gone, the base is evicted as any other record
    records.delete_record(zoo, "adapter-00000002")
    chosen = eviction.plan(eviction.survey(zoo, now=NOW), capacity_bytes=size["base-00000001"])
    assert "base-00000001" in [e.record.id for e in chosen.evict]


def test_keeps_a_running_jobs_provisional_record_and_evicts_an_abandoned_one_first(
        zoo: store.DirStore) -> None:
    add(zoo, "running-00000001", floats=1000, provisional=True, days_old=0, namespace="team-a")
    add(zoo, "abandoned-00000002", floats=1000, provisional=True, days_old=0, namespace="team-a")
    add(zoo, "final-00000003", floats=1000, days_old=0)
    total = sum(sizes(zoo).values())
    entries = eviction.survey(zoo, now=NOW, live_jobs={("team-a", "job-running-00000001")})
    chosen = eviction.plan(entries, capacity_bytes=total - 1)
    assert [e.record.id for e in chosen.evict] == ["abandoned-00000002"]
    protected = {e.record.id: e.protected for e in entries}
    assert "running job team-a/job-running-00000001" in protected["running-00000001"]


def test_a_job_of_the_same_name_in_another_namespace_keeps_no_provisional_record_alive(
        zoo: store.DirStore) -> None:
    add(zoo, "abandoned-00000001", floats=1000, provisional=True, days_old=0, namespace="team-a")
    add(zoo, "final-00000002", floats=1000, days_old=0)
    total = sum(sizes(zoo).values())
    entries = eviction.survey(zoo, now=NOW, live_jobs={("team-b", "job-abandoned-00000001")})
    assert [e.protected for e in entries if e.record.id == "abandoned-00000001"] == [""]
    chosen = eviction.plan(entries, capacity_bytes=total - 1)
    assert [e.record.id for e in chosen.evict] == ["abandoned-00000001"]


def test_a_created_time_in_the_future_counts_no_registration_and_never_outlasts_others(
        zoo: store.DirStore) -> None:
    # A trainer pod writes its record's created_time: one far in the future would weigh as a
    # registration of this moment forever, so another team's newer model went first.
    add(zoo, "forged-00000001", floats=1000, days_old=-365 * 100, namespace="team-a")
    add(zoo, "honest-00000002", floats=1000, days_old=1, namespace="team-b")
    add(zoo, "skewed-00000003", floats=1000, days_old=-0.01, namespace="team-c")  # 15 min
    entries = eviction.survey(zoo, now=NOW, half_life_seconds=7 * DAY_SECONDS)
    worth = {e.record.id: e.value for e in entries}
    assert worth["forged-00000001"] == 0.0
    assert worth["skewed-00000003"] == pytest.approx(1.0)  # clock skew is believed
    total = sum(sizes(zoo).values())
    chosen = eviction.plan(entries, capacity_bytes=total - 1)
    assert [e.record.id for e in chosen.evict] == ["forged-00000001"]


def test_carry_out_deletes_records_and_their_hits(zoo: store.DirStore) -> None:
    add(zoo, "gone-00000001", floats=2000)
    add(zoo, "kept-00000002", floats=10)
    hit(zoo, "gone-00000001", days_ago=30)
    hit(zoo, "kept-00000002", days_ago=1)
    chosen = eviction.plan(eviction.survey(zoo, now=NOW), capacity_bytes=2000)
    eviction.carry_out(zoo, chosen)
    assert [r.id for r in records.list_records(zoo)] == ["kept-00000002"]
    assert set(eviction.hit_times(zoo)) == {"kept-00000002"}


@pytest.mark.parametrize("text,expected", [
    pytest.param("10GiB", 10 * 2**30, id="gib"), pytest.param("500MB", 500 * 10**6, id="mb"),
    pytest.param("1048576", 2**20, id="bytes"), pytest.param("1.5 KiB", 1536, id="fraction"),
])
def test_parse_size_reads_units(text: str, expected: int) -> None:
    assert eviction.parse_size(text) == expected


def test_zoo_gc_dry_run_lists_but_deletes_nothing(zoo: store.DirStore,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    add(zoo, "a-00000001", floats=3000)
    add(zoo, "b-00000002", floats=3000)
    argv = ["zoo", "gc", "--zoo", str(zoo.root), "--capacity", "20KB", "-o", "json"]
    assert cli.main([*argv, "--dry-run"]) == cli.EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["dry_run"] and len(report["evicted"]) == 1
    assert len(records.list_records(zoo)) == 2
    assert cli.main([*argv[:-2], "--dry-run"]) == cli.EXIT_OK  # the table: no provisional
    table = capsys.readouterr().out
    assert report["evicted"][0]["id"] in table and "provisional" not in table
    assert "False" not in table, table
    assert cli.main(argv) == cli.EXIT_OK
    capsys.readouterr()
    left = {r.id for r in records.list_records(zoo)}
    assert left == {"a-00000001", "b-00000002"} - {report["evicted"][0]["id"]}


def test_zoo_gc_rejects_a_bad_capacity(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["zoo", "gc", "--capacity", "ten gigs"])
    assert "10GiB" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--capacity", "0"], ["--capacity", "0GiB"],
                                  ["--capacity", "1GiB", "--half-life-days", "abc"]])
def test_zoo_gc_refuses_a_zero_capacity_or_a_bad_half_life_readably(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["zoo", "gc", *argv])
    err = capsys.readouterr().err
    assert ("would evict every model" in err if argv[1].startswith("0")
            else "expected a number, got 'abc'" in err), err
    assert "_positive" not in err


def test_zoo_gc_reports_unreadable_records_it_neither_counts_nor_deletes(
        zoo: store.DirStore, capsys: pytest.CaptureFixture[str]) -> None:
    add(zoo, "a-00000001", floats=3000)
    add(zoo, "broken-00000002", floats=3000)
    (zoo.root / records.record_prefix("broken-00000002") / records.META_NAME).write_text("{")
    assert cli.main(["zoo", "gc", "--zoo", str(zoo.root), "--capacity", "1GiB",
                     "-o", "json"]) == cli.EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["unreadable_records"] == ["broken-00000002"]
    assert report["unreadable_bytes"] > 3000 * 4
    assert cli.main(["zoo", "gc", "--zoo", str(zoo.root), "--capacity", "1GiB"]) == 0
    assert "not counted: " in capsys.readouterr().out
    assert (zoo.root / records.record_prefix("broken-00000002")).is_dir()


@pytest.mark.filterwarnings("ignore::kiln.zoo.records.SkippedRecordWarning")
def test_abandoned_is_only_unusable_records_reserved_for_jobs_that_ended_in_watched_namespaces(
        zoo: store.DirStore) -> None:
    for record_id, owner in (("ended-00000001", ("team-a", "ended")),
                             ("live-00000002", ("team-a", "live")),
                             ("elsewhere-00000003", ("team-z", "ended")),
                             ("unclaimed-00000004", None)):
        zoo.put_bytes(records.record_prefix(record_id) + records.WEIGHTS_NAME, b"partial")
        if owner is not None:
            records.write_claim(zoo, record_id, *owner)
    add(zoo, "usable-00000005", floats=4, namespace="team-a", job_name="ended2")
    records.write_claim(zoo, "usable-00000005", "team-a", "ended2")
    entries = eviction.survey(zoo, now=NOW)
    found = eviction.abandoned(zoo, entries, live_jobs=[("team-a", "live")],
                               watched=lambda namespace: namespace != "team-z")
    assert found == ["ended-00000001"]
    assert records.unusable(zoo, "ended-00000001")
    assert not records.unusable(zoo, "usable-00000005")
    assert not records.unusable(zoo, "gone-00000006")  # no folder: nothing to delete
