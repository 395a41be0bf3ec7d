"""Warm-start decisions for the operator: off the event loop, cached, against one zoo index.

Also the decision's round trip through ``status.warmStart``, from admission to the trainer
pods (a restarted operator launches from status). No status writes of its own, no weights.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

from kiln import api, contract
from kiln.controller import metrics
from kiln.warmstart import decision, select
from kiln.warmstart import index as zoo_index
from kiln.zoo import records, store

CACHE_ENTRIES = 4096
IN_TRAINER_REASON = ("the warm-start decision for entrypoint models is made in the trainer pod, "
                     "before its first step (the operator never imports user code)")
DEFAULT_INDEX_SETTINGS = zoo_index.IndexSettings()


def open_zoo(uri: str, *, env: Mapping[str, str], retry: store.RetryPolicy) -> store.ObjectStore:
    """The zoo store a URI names (as `store.open_store`), S3 with `retry` as its policy.

    Raises:
        ValueError: the URI or the S3 settings in `env` are unusable (see `store.open_store`).
    """
    opened = store.open_store(uri, env=env)  # validates everything, contacts nothing
    if not isinstance(opened, store.S3Store):
        return opened
    parts = urlsplit(uri)
    access_key, secret_key = store.credentials_from_env(env)
    return store.S3Store(
        env[contract.Env.ZOO_ENDPOINT].strip(), parts.netloc, access_key=access_key,
        secret_key=secret_key, region=env.get(contract.Env.ZOO_REGION) or None,
        prefix=unquote(parts.path), retry=retry)


# Wire names of `select.Decision` fields in ``status.warmStart`` (api.WarmStartStatus).
_STATUS_FIELDS = {"parent_id": "parent", "similarity": "similarity",
                  "parent_metric": "parentMetric", "matched_tensors": "matchedTensors",
                  "total_tensors": "totalTensors", "reason": "reason", "outcome": "outcome"}


def to_status(chosen: select.Decision) -> dict[str, Any]:
    """``status.warmStart`` for a decision (None fields left out)."""
    doc = chosen.to_json()
    return {wire: doc[name] for name, wire in _STATUS_FIELDS.items() if doc[name] is not None}


def from_status(warm: Mapping[str, Any] | None) -> select.Decision:
    """The decision recorded in ``status.warmStart`` by `to_status`, to launch the trainer with.

    A status without an outcome (written by an older operator) reads as a warm start when it
    names a parent, else as a cold start.
    """
    warm = warm or {}
    doc: dict[str, Any] = {name: warm.get(wire) for name, wire in _STATUS_FIELDS.items()}
    if doc["outcome"] not in {o.value for o in select.Outcome}:
        doc["outcome"] = select.Outcome.WARM if doc["parent_id"] else select.Outcome.COLD_EMPTY
    doc["reason"] = str(doc["reason"] or "")
    return select.Decision.from_json({**doc, "candidates_considered": 0})


def from_trainer(report: Mapping[str, Any]) -> select.Decision | None:
    """The decision a trainer made and applied itself (`contract.Result.warm_start_decision`),
    or None when the report is not one (missing, or an unknown outcome)."""
    outcome = report.get("outcome")
    if outcome not in {o.value for o in select.Outcome} or outcome == select.Outcome.IN_TRAINER:
        return None
    doc = {"parent_id": report.get("parent"), "similarity": report.get("similarity"),
           "parent_metric": report.get("parent_metric"),
           "matched_tensors": report.get("matched_tensors"),
           "total_tensors": report.get("total_tensors"), "reason": str(report.get("reason") or ""),
           "outcome": outcome, "candidates_considered": 0}
    return select.Decision.from_json(doc)


class ParentChooser:
    """Warm-start decisions for the operator: `decision.decide` in a worker thread, so the kopf
    event loop never blocks, against a `ZooIndex` kept loaded and refreshed at most every
    `refresh_seconds`. Decisions are cached by (model spec, warmStart spec, zoo contents): jobs
    of one architecture submitted together trace their graph and search the zoo once. An empty
    zoo needs no search at all. An unreachable zoo raises `store.StoreUnavailable`.

    Args:
        zoo: the zoo store.
        metrics: operator metrics (zoo query seconds).
        refresh_seconds: re-list the zoo at most this often (0: before every decision).
        query_timeout_seconds: deadline of one similarity search.
        index_settings: settings of the zoo index.
        clock: monotonic seconds.
    """

    def __init__(self, zoo: store.ObjectStore, *, metrics: metrics.OperatorMetrics,
                 refresh_seconds: float, query_timeout_seconds: float,
                 index_settings: zoo_index.IndexSettings = DEFAULT_INDEX_SETTINGS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.zoo = zoo
        self._metrics = metrics
        self._refresh_seconds = refresh_seconds
        self._timeout_seconds = query_timeout_seconds
        self._index_settings = index_settings
        self._clock = clock
        self._index: zoo_index.ZooIndex | None = None
        self._refreshed = -float("inf")
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, select.Decision] = collections.OrderedDict()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kiln-warmstart")

    def close(self) -> None:
        """Stop the worker thread and the index's pool."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._index is not None:
            self._index.close()

    async def decide(self, job: api.TrainingJob) -> select.Decision:
        """The warm-start decision for `job`, computed in the worker thread.

        Raises:
            store.StoreUnavailable: the zoo could not be read.
            api.InvalidSpec: the pinned parent is not in the zoo.
        """
        if job.spec.model.entrypoint is not None and job.spec.warm_start.enabled:
            # User code: the operator never imports it, so it cannot trace the graph.
            return select.cold_start(select.Outcome.IN_TRAINER, IN_TRAINER_REASON)
        cached = self._cached(job)
        if cached is not None:
            return cached
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.decide_now, job)

    def _cached(self, job: api.TrainingJob) -> select.Decision | None:
        """A cached decision when no zoo refresh is due (no thread hop for repeat jobs)."""
        index = self._index
        if index is None or self._clock() - self._refreshed >= self._refresh_seconds:
            return None
        return self._cache.get(self._key(job, index))

    @staticmethod
    def _key(job: api.TrainingJob, index: zoo_index.ZooIndex) -> str:
        return json.dumps([api.to_wire(job.spec.model), api.to_wire(job.spec.warm_start),
                           sorted(r.id for r in index.all_records())], sort_keys=True)

    def decide_now(self, job: api.TrainingJob) -> select.Decision:
        """`decide`, in the calling thread (blocking)."""
        started = self._clock()
        try:
            with self._lock:
                index = self._fresh_index()
                key = self._key(job, index)
                cached = self._cache.get(key)
                if cached is not None:
                    self._cache.move_to_end(key)
                    return cached
                chosen = self._search(job, index)
                self._cache[key] = chosen
                while len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
                return chosen
        finally:
            self._metrics.zoo_query_seconds.observe(self._clock() - started)

    def records(self) -> list[records.ZooRecord]:
        """The zoo's records as last indexed ([] before the first decision)."""
        index = self._index
        return index.all_records() if index is not None else []

    def _fresh_index(self) -> zoo_index.ZooIndex:
        now = self._clock()
        if self._index is None:
            self._index = zoo_index.ZooIndex(self.zoo, settings=self._index_settings)
            self._refreshed = now
        elif now - self._refreshed >= self._refresh_seconds:
            self._index.refresh()
            self._refreshed = now
        return self._index

    def _search(self, job: api.TrainingJob, index: zoo_index.ZooIndex) -> select.Decision:
        spec = job.spec.warm_start
        if spec.enabled and spec.parent == "auto" and len(index) == 0:
            return select.cold_start(
                select.Outcome.COLD_EMPTY,
                f"cold start: the model zoo ({self.zoo.describe()}) is empty")
        return decision.decide(job, self.zoo, zoo_index=index,
                               timeout_seconds=self._timeout_seconds)
