"""What a user's pod reports, checked against what the operator granted its job.

Results, profiles and warm-start decisions come from code the user controls. A zoo model id
counts only when it is the record reserved for the job; a parent only when the job's namespace
may see it and, once the operator decided the job's warm start, when the job was granted it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from kiln import api
from kiln.controller import status
from kiln.zoo import records, store


async def model_problem(zoo: store.ObjectStore, owner: Mapping[str, Any], job: api.TrainingJob,
                        model: str) -> str | None:
    """Why `model`, named in a trainer's result, is not the job's own zoo record (None when
    it is): the id reserved for the job (`records.job_record_id` of its uid), holding a record
    of the job's namespace and name.

    Raises:
        store.ObjectNotFound: `model` is the reserved id, and no record is there.
        store.StoreUnavailable: `model` is the reserved id, and the zoo could not be read.
        store.StoreMisconfigured: the zoo refused the operator's credential.
    """
    uid = str((owner.get("metadata") or {}).get("uid") or "")
    try:
        reserved = records.job_record_id(job.spec.model.label, uid)
    except ValueError as exc:
        return str(exc)
    if model != reserved:
        return f"the job's model can only be {reserved}"
    try:
        record = await asyncio.to_thread(records.read_record, zoo, model)
    except store.StoreMisconfigured:
        raise
    except ValueError as exc:  # a damaged record (CorruptRecord)
        return f"its record cannot be read ({exc})"
    if (record.namespace, record.job_name) != (job.namespace, job.name):
        return f"the record there is not this job's but {record.namespace}/{record.job_name}'s"
    return None


def decision_ids(decision: api.WarmStartDecision) -> tuple[str, ...]:
    """The zoo ids a warm-start decision names: its parent, then its alternatives."""
    return tuple(dict.fromkeys(i for i in (decision.parent, *decision.alternatives) if i))


def granted_ids(warm: Mapping[str, Any]) -> tuple[str, ...]:
    """The parents ``status.warmStart`` grants the job: its parent and alternatives."""
    named = [warm.get("parent"), *(warm.get("alternatives") or [])]
    return tuple(dict.fromkeys(i for i in named if isinstance(i, str) and i))


async def parents_problem(zoo: store.ObjectStore, namespace: str, ids: Iterable[str], *,
                          granted: Collection[str] | None) -> str | None:
    """Why a pod's warm-start report may not name `ids` as parents (None when it may).

    Args:
        zoo: the zoo.
        namespace: the job's namespace.
        ids: the zoo ids the report names (`decision_ids`).
        granted: the parents the operator gave the job (`granted_ids`); None when the job's
            decision was left to its pod: then each must be a record `namespace` may see.
    """
    if granted is not None:
        extra = [i for i in ids if i not in granted]
        return (f"{', '.join(extra)} {'is' if len(extra) == 1 else 'are'} not among the "
                f"parents granted to the job ({', '.join(granted) or 'none'})") if extra else None
    for record_id in ids:
        try:
            record = await asyncio.to_thread(records.read_record, zoo, record_id)
        except (store.StoreUnavailable, store.StoreMisconfigured) as exc:
            return f"{record_id} could not be checked in the zoo ({exc})"
        except (KeyError, ValueError):  # missing, damaged, or not an id at all
            record = None
        if record is None or not record.visible_to(namespace):
            return f"{record_id} is not a zoo model that namespace {namespace} may see"
    return None


def refused_event(pod: str, what: str, problem: str, outcome: str) -> status.Event:
    """The Warning event (ReportRefused) of a report naming what the job was not granted."""
    return status.Event.warning(api.Reason.REPORT_REFUSED, (
        f"Pod {pod} reported {what}, which the job was not granted: {problem}; {outcome}. "
        "The operator acts only on what it granted a job."))
