"""Which zoo objects one job's pods may touch, and with which verbs (`presigned.Grants`).

The operator mints presigned URLs for these and nothing else, so a pod running user code can
read only the records its namespace may see, and write only its own job's objects.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable

from kiln.zoo import eviction, presigned, records

_OWN = ("get", "put", "delete", "head")
_READ = ("get", "head")
_FILES = (records.META_NAME, records.GRAPH_NAME, records.WEIGHTS_NAME)
_OWN_FILES = (*_FILES, records.HISTORY_NAME)  # the history: only `kiln plot` reads it


def job_grants(namespace: str, job_name: str, *, uid: str | None, record: str,
               base: str | None = None, parents: Iterable[str] = (),
               visible: Iterable[str] = (), visible_hits: bool = False,
               shard_ranks: int = 0, now: datetime.datetime) -> presigned.Grants:
    """The grants of one job's pods.

    Args:
        namespace: the job's namespace.
        job_name: the job's name.
        uid: the job's uid, part of its checkpoint's key (`records.checkpoint_key`).
        record: the id reserved for the job's model (provisional and final records, which the
            trainer writes, reads back and replaces).
        base: the id a LoRA job on pretrained weights imports them under
            (`records.base_record_id`), written once like `record`, with one hit key; None
            for other jobs.
        parents: records the job may start from (the decided parent and the guard's
            alternatives): every file readable, and one hit key each to count the start.
        visible: records its namespace may see, for a pod that searches the zoo itself (the
            profiling pod, or a trainer deciding its own warm start): every file readable, as
            the search reads candidates' graphs and dry-runs the best ones' weights.
        visible_hits: also one hit key per visible record (a trainer that decides and then
            applies its own warm start).
        shard_ranks: the most processes the job's trainer may have when its checkpoints are
            sharded (FSDP): both slots' shards of ranks below it and their metadata
            (`records.checkpoint_shard_keys`); 0 for a job that never shards.
        now: the time the hit keys carry.

    Raises:
        ValueError: an invalid record id, namespace or job name.
    """
    prefix = records.record_prefix(record)
    checkpoint = records.checkpoint_key(namespace, job_name, uid)
    entries: list[tuple[str, Iterable[str]]] = [
        (checkpoint, _OWN),
        *((key, _OWN) for key in records.checkpoint_shard_keys(checkpoint, shard_ranks)),
        (records.profile_key(namespace, job_name), ("put",)),
        *((prefix + name, _OWN) for name in _OWN_FILES),
    ]
    if base is not None:  # and one hit: a new adapter starts from it
        entries += [(records.record_prefix(base) + name, _OWN) for name in _FILES]
        entries.append((eviction.hit_key(base, now=now), ("put",)))
    for parent in parents:
        entries += [(records.record_prefix(parent) + name, _READ) for name in _FILES]
        entries.append((eviction.hit_key(parent, now=now), ("put",)))
    for seen in visible:
        entries += [(records.record_prefix(seen) + name, _READ) for name in _FILES]
        if visible_hits:
            entries.append((eviction.hit_key(seen, now=now), ("put",)))
    return presigned.Grants.of(entries, record=record)
