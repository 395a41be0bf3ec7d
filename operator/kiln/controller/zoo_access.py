"""Each job's zoo access under ``--zoo-pod-access presigned``: the ``<job>-zoo-access`` Secret.

The operator signs presigned URLs for the job's own objects and the parents it may read
(`kiln.zoo.access`), puts the manifest in a Secret owned by the job, mounted read-only into its
trainer and profiling pods, and re-signs it before half its lifetime has passed.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import logging
from collections.abc import Callable, Mapping
from typing import Any, cast

import kopf

from kiln import api, contract
from kiln.controller import kube, pods, status
from kiln.zoo import access, eviction, presigned, records, store

MINTED_ANNOTATION = "kiln.dev/zoo-access-minted"
EXPIRES_ANNOTATION = "kiln.dev/zoo-access-expires"
# A namespace's visible records a searching pod gets URLs for: a Secret holds at most 1 MiB,
# and each record costs about 2 kB of signed URLs (over 10 kB with a long session token); the
# newest are kept, halved until the manifest fits `MAX_MANIFEST_BYTES`.
MAX_VISIBLE_RECORDS = 256
MAX_MANIFEST_BYTES = 900_000
_log = logging.getLogger(__name__)


def newest_visible(found: list[records.ZooRecord], namespace: str, *,
                   now: datetime.datetime) -> list[str]:
    """The ids of the newest `MAX_VISIBLE_RECORDS` records `namespace` may see, by their
    created_time; one dated more than clock skew ahead of `now` comes last (a pod writes that
    time: dated ahead, one namespace's records would crowd every other's out)."""
    ahead = (now + eviction.CLOCK_SKEW).strftime("%Y-%m-%dT%H:%M:%SZ")
    seen = sorted((r for r in found if r.visible_to(namespace)),
                  key=lambda r: (r.created_time <= ahead, r.created_time), reverse=True)
    return [r.id for r in seen[:MAX_VISIBLE_RECORDS]]


class ZooAccess:
    """Signs jobs' zoo access and keeps when each job's was signed (`due`).

    Args:
        zoo: the zoo, with the operator's credential.
        client: the API client (writes the Secrets).
        settings: the pod settings (`pods.PodSettings.presigned_zoo`).
        lifetime_hours: how long presigned URLs work (--zoo-access-hours).
        clock: epoch seconds.
        max_gpus: the most GPUs the planner gives one job (--max-gpus-per-job).
    """

    def __init__(self, zoo: store.ObjectStore, client: kube.Client, *,
                 settings: pods.PodSettings, lifetime_hours: float,
                 clock: Callable[[], float], max_gpus: int = 8) -> None:
        self.zoo = zoo
        self.max_gpus = max_gpus
        self.client = client
        self.settings = settings
        self.lifetime_hours = lifetime_hours
        self.clock = clock
        # Job uid -> when its zoo access was signed and when it expires.
        self.expiry: dict[str, tuple[float, float]] = {}

    @property
    def enabled(self) -> bool:
        """Whether pods get presigned URLs instead of the zoo credential."""
        return self.settings.presigned_zoo

    async def ensure(self, owner: Mapping[str, Any], job: api.TrainingJob, *,
                     decided: api.WarmStartDecision | None) -> None:
        """Sign the job's zoo access and write its Secret (created, or replaced in place).

        Args:
            owner: the TrainingJob as the API returned it.
            job: the parsed job.
            decided: the trainer's warm-start decision; None for the profiling pod.

        Raises:
            store.StoreUnavailable: the zoo could not be read or asked for its region.
            store.StoreMisconfigured: the operator's credential was refused.
            records.IdTaken: the job's record id is claimed for another job (nothing is
                signed: its pods wait, and the log says to create the job again).
        """
        zoo = self.zoo
        if not isinstance(zoo, store.S3Store):
            return
        meta = owner.get("metadata") or {}
        now = datetime.datetime.fromtimestamp(self.clock(), datetime.UTC).replace(microsecond=0)
        named = [] if decided is None else [
            p for p in (decided.parent, *decided.alternatives) if p]
        # The status a re-signing reads them from is writable by more than the operator: only
        # records the job's namespace may see get URLs.
        readable = await asyncio.to_thread(records.visible_ids, zoo, named, job.namespace)
        visible: list[str] = []
        if _searches(decided):
            found = await asyncio.to_thread(records.list_records, zoo)
            visible = newest_visible(found, job.namespace, now=now)
        record = records.job_record_id(job.spec.model.label, str(meta.get("uid") or ""))
        imports = job.spec.model.pretrained is not None and job.spec.training.peft is not None
        # Before its pod may write there: a record under these ids naming another namespace
        # or job is then refused wherever records are read.
        for reserved in (record, *([records.base_record_id(record)] if imports else [])):
            await asyncio.to_thread(records.write_claim, zoo, reserved, job.namespace, job.name)
        manifest = await asyncio.to_thread(
            sign_within_budget, zoo, lambda seen: access.job_grants(
                job.namespace, job.name, uid=str(meta.get("uid") or ""), record=record,
                base=records.base_record_id(record) if imports else None, parents=readable, visible=seen,
                visible_hits=decided is not None,
                shard_ranks=shard_ranks(job, max_gpus=self.max_gpus), now=now),
            visible, lifetime=datetime.timedelta(hours=self.lifetime_hours), now=now)
        secret = build_secret(owner, job, manifest, minted=now)
        path = f"/api/v1/namespaces/{job.namespace}/secrets"
        if await self.client.create(path, secret) is None:  # re-signed: replace it in place
            await self.client.merge_patch(f"{path}/{pods.zoo_access_secret(job.name)}",
                                          {"metadata": {"annotations": secret["metadata"][
                                              "annotations"]}, "data": secret["data"]})
        self.expiry[str(meta.get("uid") or "")] = (now.timestamp(),
                                                   manifest.expires.timestamp())

    async def prepare(self, owner: Mapping[str, Any], job: api.TrainingJob, *,
                      decided: api.WarmStartDecision | None) -> None:
        """`ensure` before a pod is created, when `enabled`; a failure only warns: the pod then
        waits for its Secret (ContainerCreating), which `refresh` writes once the zoo answers
        (--pod-start-timeout-seconds, or a profiling pod's deadline, bounds the wait)."""
        if not self.enabled:
            return
        try:
            await self.ensure(owner, job, decided=decided)
        except Exception as exc:  # noqa: BLE001  # the zoo or the API server: never another job's
            _log.warning("%s/%s: could not sign its zoo access (its pods wait for Secret %s): %s",
                         job.namespace, job.name, pods.zoo_access_secret(job.name), exc)

    def due(self, uid: str, *, now: float) -> bool:
        """Whether the job's URLs have less than half their lifetime left (or were never signed
        by this operator process, which then signs them again once)."""
        minted, expires = self.expiry.get(uid, (0.0, 0.0))
        return now >= minted + (expires - minted) / 2

    async def refresh(self, body: Mapping[str, Any]) -> None:
        """Re-sign an active job's access when `due`; a zoo failure only warns (the old URLs
        still work for half their lifetime)."""
        meta = body.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        if not self.enabled or not uid or not self.due(uid, now=self.clock()):
            return
        st = body.get("status") or {}
        try:
            job = api.parse_running(body)
        except api.InvalidSpec:
            return
        # what its pods were launched with
        decided = status.part(st, "warmStart", api.WarmStartDecision)
        await self.prepare(body, job, decided=decided)

    def forget(self, uid: str) -> None:
        """Drop what is kept about a finished job's access."""
        self.expiry.pop(uid, None)


def shard_ranks(job: api.TrainingJob, *, max_gpus: int) -> int:
    """The most trainer processes a job may run with sharded (FSDP) checkpoints, 0 if none.

    FSDP runs when asked for, or when the planner picks it for parallelism auto, with one
    process per GPU: gpus when fixed, else at most the planner's cap (--max-gpus-per-job, or
    gpusPerNode), which a resize may grow the job to; one process never shards.
    """
    res = job.spec.resources
    if res.parallelism not in (api.Parallelism.FSDP, api.Parallelism.AUTO):
        return 0
    most = res.gpus if res.gpus is not None else min(max_gpus, res.gpus_per_node or max_gpus)
    return most if most > 1 else 0


def _searches(decided: api.WarmStartDecision | None) -> bool:
    """Whether the pod searches the zoo itself: a profiling pod (None) or a trainer whose
    decision was left to it."""
    return decided is None or decided.outcome is api.WarmStartOutcome.IN_TRAINER


def sign_within_budget(zoo: store.S3Store, grants: Callable[[list[str]], presigned.Grants],
                       visible: list[str], *, lifetime: datetime.timedelta,
                       now: datetime.datetime) -> presigned.Manifest:
    """The manifest of `grants(visible)`, keeping the newest half of `visible` until it fits
    `MAX_MANIFEST_BYTES` (a Secret holds at most 1 MiB; long session tokens lengthen URLs).

    Args:
        zoo: the zoo, with the operator's credential.
        grants: the grants for a list of visible record ids.
        visible: visible record ids, newest first.
        lifetime: the URLs' lifetime.
        now: the signing time.
    """
    while True:
        manifest = presigned.mint(zoo, grants(visible), lifetime=lifetime, now=now)
        if len(manifest.to_json()) <= MAX_MANIFEST_BYTES or not visible:
            return manifest
        visible = visible[: len(visible) // 2]


def build_secret(owner: Mapping[str, Any], job: api.TrainingJob, manifest: presigned.Manifest,
                 *, minted: datetime.datetime) -> dict[str, Any]:
    """The Secret holding `manifest`, owned by the job (deleted with it)."""
    secret: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {
            "name": pods.zoo_access_secret(job.name),
            "annotations": {MINTED_ANNOTATION: status.rfc3339(minted.timestamp()),
                            EXPIRES_ANNOTATION: status.rfc3339(manifest.expires.timestamp())},
        },
        "data": {contract.ZOO_ACCESS_FILE: base64.b64encode(
            manifest.to_json().encode()).decode()},
    }
    kopf.adopt(secret, owner=cast(kopf.Body, dict(owner)))  # ownerReference and namespace
    # not the job's labels, which adopt copies
    secret["metadata"]["labels"] = {"app.kubernetes.io/managed-by": "kiln-operator",
                                    api.JOB_NAME_LABEL: job.name}
    return secret
