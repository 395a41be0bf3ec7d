"""Keeping the zoo within a byte budget: hits (times a record was chosen as a parent), their
decayed value, and eviction of the records worth least per byte.

Never evicts a protected record (a live job's parent, a running job's provisional record, the
base of a LoRA adapter still in the zoo); the caller says which of the first two are
protected, since only the operator knows its live jobs. Also finds the unusable records of jobs
that no longer run (`abandoned`), which nothing else would ever delete.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import secrets
from collections.abc import Callable, Iterable, Mapping

from kiln.zoo import presigned, records, store

HITS_PREFIX = "hits/"
# hits/<record-id>/<YYYYMMDDTHHMMSSZ>-<8 hex>: one empty object per time a record was chosen as
# a parent. Every hit is an object of its own, so writers never read-modify-write a counter: two
# jobs choosing the same parent at once write two keys, and no hit is lost (object stores offer
# no compare-and-swap). Counting is one listing; the time is in the key, so no object is read.
_HIT_NAME = re.compile(r"(\d{8}T\d{6}Z)-[0-9a-f]{8}")
_HIT_TIME_FORMAT = "%Y%m%dT%H%M%SZ"

DEFAULT_HALF_LIFE_SECONDS = 7 * 24 * 3600.0
"""A hit's weight halves every week: a parent chosen often last month counts less than one
chosen twice yesterday."""

# A record's created_time is written by its trainer pod (user code): one later than the survey's
# time by more than clock skew is not believed, or it would count as a fresh registration forever.
CLOCK_SKEW = datetime.timedelta(hours=1)

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes from a size such as ``10GiB``, ``500MB`` or ``1048576``.

    Raises:
        ValueError: not a non-negative number with an optional unit (B, KB, MB, GB, TB, KiB,
            MiB, GiB, TiB).
    """
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = found.group(2).upper() if found else ""
    if not found or unit not in _SIZE_UNITS:
        raise ValueError(f"size {text!r}: expected a number of bytes with an optional unit "
                         "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 10GiB")
    return int(float(found.group(1)) * _SIZE_UNITS[unit])


def parse_capacity(text: str) -> int:
    """A zoo budget in bytes (`parse_size`), which must be positive.

    Raises:
        ValueError: not a size, or 0 (a budget that would evict every model).
    """
    size = parse_size(text)
    if size <= 0:
        raise ValueError(f"size {text!r}: a capacity of 0 bytes would evict every model; give "
                         "a positive size, e.g. 10GiB")
    return size


def record_hit(zoo: store.ObjectStore, record_id: str, *, now: datetime.datetime) -> None:
    """Count one more time `record_id` was chosen as a parent (at `now`, a UTC time).

    Raises:
        ValueError: an invalid id.
        StoreUnavailable: the store failed.
    """
    prefix = f"{HITS_PREFIX}{records.check_id(record_id)}/"
    if isinstance(zoo, presigned.PresignedStore):  # a pod writes the hit key the operator minted
        granted = zoo.granted(prefix, "put")
        if not granted:
            raise presigned.NotGranted(f"no hit of {record_id} is granted in {zoo.describe()}")
        zoo.put_bytes(granted[0], b"")
        return
    zoo.put_bytes(hit_key(record_id, now=now), b"")


def hit_key(record_id: str, *, now: datetime.datetime) -> str:
    """A fresh key for one hit of `record_id` at `now`.

    Raises:
        ValueError: an invalid id.
    """
    stamp = now.astimezone(datetime.UTC).strftime(_HIT_TIME_FORMAT)
    return f"{HITS_PREFIX}{records.check_id(record_id)}/{stamp}-{secrets.token_hex(4)}"


def hit_times(zoo: store.ObjectStore) -> dict[str, list[datetime.datetime]]:
    """Record id -> the times it was chosen as a parent (oldest first); one listing.

    Keys that are not hits (written by something else) are ignored.

    Raises:
        StoreUnavailable: the store failed.
    """
    times: dict[str, list[datetime.datetime]] = {}
    for key in zoo.list_keys(HITS_PREFIX):
        parts = key.split("/")
        found = _HIT_NAME.fullmatch(parts[-1]) if len(parts) == 3 else None
        if found:
            when = datetime.datetime.strptime(found.group(1), _HIT_TIME_FORMAT)
            times.setdefault(parts[1], []).append(when.replace(tzinfo=datetime.UTC))
    return {record_id: sorted(found) for record_id, found in times.items()}


def value(hits: Iterable[datetime.datetime], *, created: datetime.datetime | None,
          now: datetime.datetime, half_life_seconds: float) -> float:
    """A record's worth: its hits, each weighted 0.5 ** (age / half-life).

    Registration counts as one hit at `created` (None: none, for an abandoned provisional
    record), so a new model is not the first to go before any job could choose it.
    """
    moments = [*hits, *([created] if created is not None else [])]
    ages = (max(0.0, (now - moment).total_seconds()) for moment in moments)
    return float(sum(0.5 ** (age / half_life_seconds) for age in ages))


@dataclasses.dataclass(frozen=True)
class Entry:
    """One record as eviction sees it.

    Attributes:
        record: the record.
        size_bytes: all its objects together.
        hits: times it was chosen as a parent.
        value: decayed hits (`value`).
        protected: why it must stay (e.g. "parent of live job team-a/sweep-3"), or "".
    """

    record: records.ZooRecord
    size_bytes: int
    hits: int
    value: float
    protected: str = ""

    @property
    def value_per_gib(self) -> float:
        """Worth per GiB kept: what eviction ranks by (lowest goes first)."""
        return self.value / max(self.size_bytes, 1) * 2**30


@dataclasses.dataclass(frozen=True)
class Plan:
    """What eviction does: which records go, and the zoo's size before and after.

    Attributes:
        entries: every record, each with its size, hits and value.
        evict: the records to delete, lowest value per byte first.
        capacity_bytes: the budget.
        size_bytes: all records now.
        after_bytes: all records once `evict` are gone.
    """

    entries: tuple[Entry, ...]
    evict: tuple[Entry, ...]
    capacity_bytes: int
    size_bytes: int
    after_bytes: int

    @property
    def over_capacity(self) -> bool:
        """Whether protected records alone exceed the budget (nothing more may go)."""
        return self.after_bytes > self.capacity_bytes


def survey(
    zoo: store.ObjectStore,
    *,
    now: datetime.datetime,
    half_life_seconds: float = DEFAULT_HALF_LIFE_SECONDS,
    protect: Mapping[str, str] = {},
    live_jobs: Iterable[tuple[str, str]] = (),
) -> list[Entry]:
    """Every usable record with its size, hits and value.

    Args:
        zoo: the store.
        now: the current time (UTC).
        half_life_seconds: how fast a hit loses its weight.
        protect: record id -> why it must stay (the operator: its live jobs' parents).
        live_jobs: (namespace, name) of each job still training, as records hold them
            (``namespace``, ``job_name``): their provisional records stay. A provisional record
            of any other job was abandoned (the job failed or was deleted) and counts no
            registration hit; a job of the same name in another namespace keeps none alive.

    Raises:
        StoreUnavailable: the store failed.
    """
    hits = hit_times(zoo)
    running = set(live_jobs)
    entries = []
    listed = records.list_records(zoo)
    # An adapter is useless without its base: a base stays while any adapter on it does (a
    # later survey may evict it once they are gone). Only a base the adapter's namespace may
    # see: no job can keep another namespace's private records by naming them.
    by_id = {r.id: r for r in listed}
    bases = {r.base: f"base of LoRA adapter {r.id}" for r in listed
             if r.base is not None and r.base in by_id and by_id[r.base].visible_to(r.namespace)}
    for record in listed:
        prefix = records.record_prefix(record.id)
        try:
            size = sum(zoo.size_bytes(key) for key in zoo.list_keys(prefix))
        except store.ObjectNotFound:
            continue  # deleted while surveyed
        created = datetime.datetime.fromisoformat(record.created_time)
        created = created if created.tzinfo else created.replace(tzinfo=datetime.UTC)
        abandoned = record.provisional and (record.namespace, record.job_name) not in running
        # A pod's word: a time in the future counts no registration hit (it never decays).
        registered = None if abandoned or created > now + CLOCK_SKEW else created
        why = protect.get(record.id, "") or bases.get(record.id, "")
        if not why and record.provisional and not abandoned:
            why = f"provisional record of running job {record.namespace}/{record.job_name}"
        found = hits.get(record.id, [])
        entries.append(Entry(
            record=record, size_bytes=size, hits=len(found), protected=why,
            value=value(found, created=registered, now=now,
                        half_life_seconds=half_life_seconds)))
    return entries


def unlisted(zoo: store.ObjectStore, entries: Iterable[Entry]) -> tuple[int, list[str]]:
    """The bytes and names of the record folders under models/ that `entries` lack: records
    `records.list_records` skipped as unreadable (or written since the survey). Eviction
    neither counts nor deletes them, so callers say so.

    Raises:
        StoreUnavailable: the store failed.
    """
    listed = {e.record.id for e in entries}
    size, names = 0, set()
    for key in zoo.list_keys(records.MODELS_PREFIX):
        name = key.removeprefix(records.MODELS_PREFIX).split("/", 1)[0]
        if name in listed:
            continue
        try:
            size += zoo.size_bytes(key)
        except store.ObjectNotFound:
            continue  # deleted meanwhile
        names.add(name)
    return size, sorted(names)


def abandoned(zoo: store.ObjectStore, entries: Iterable[Entry], *,
              live_jobs: Iterable[tuple[str, str]], watched: Callable[[str], bool]) -> list[str]:
    """The unusable record folders (`unlisted`) reserved for jobs (`records.claims`) none of
    which still runs, all in namespaces `watched` accepts: what a failed pod left half-written,
    or a record its pod wrote under another job's name. Nothing can read them, and eviction
    neither counts nor deletes them, so without this they would hold storage forever. A folder
    nobody reserved (an import still uploading) is never one of them.

    Raises:
        StoreUnavailable: the store failed.
    """
    live = set(live_jobs)
    reserved = records.claims(zoo)
    return [name for name in unlisted(zoo, entries)[1]
            if (owners := reserved.get(name)) and not owners & live
            and all(watched(namespace) for namespace, _ in owners)]


def plan(entries: Iterable[Entry], *, capacity_bytes: int) -> Plan:
    """Choose what to evict so the rest fits `capacity_bytes` and keeps the most value.

    A 0/1 knapsack (keep the most value within the budget), solved greedily by value density:
    evict the unprotected records worth least per byte until the rest fits, then take back,
    densest first, every evicted record that still fits (evicting one large record may have
    made room that a small one need not give up). Ties go oldest first.
    """
    entries = tuple(entries)
    total = sum(e.size_bytes for e in entries)
    candidates = sorted((e for e in entries if not e.protected),
                        key=lambda e: (e.value_per_gib, e.record.created_time, -e.size_bytes))
    evicted: list[Entry] = []
    size = total
    for entry in candidates:
        if size <= capacity_bytes:
            break
        evicted.append(entry)
        size -= entry.size_bytes
    for entry in sorted(evicted, key=lambda e: -e.value_per_gib):
        if size + entry.size_bytes <= capacity_bytes:
            evicted.remove(entry)
            size += entry.size_bytes
    return Plan(entries=entries, evict=tuple(evicted), capacity_bytes=capacity_bytes,
                size_bytes=total, after_bytes=size)


def carry_out(zoo: store.ObjectStore, chosen: Plan) -> None:
    """Delete the planned records (meta.json first, so each vanishes at once) and their hits,
    then the hits of records that no longer exist.

    Raises:
        StoreUnavailable: the store failed; records already deleted stay deleted.
    """
    for entry in chosen.evict:
        records.delete_record(zoo, entry.record.id)
    kept = {e.record.id for e in chosen.entries} - {e.record.id for e in chosen.evict}
    for key in zoo.list_keys(HITS_PREFIX):
        parts = key.split("/")
        if len(parts) == 3 and parts[1] not in kept and not _exists(zoo, parts[1]):
            zoo.delete(key)


def _exists(zoo: store.ObjectStore, record_id: str) -> bool:
    """Whether a record with this id exists (False for a name that is no id)."""
    try:
        return zoo.exists(records.record_prefix(record_id) + records.META_NAME)
    except ValueError:
        return False
