"""Warm-start decisions for the operator: off the event loop, cached, against one zoo index.

No status writes of its own (``status.warmStart`` is the decision, by alias), no weights.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import logging
import multiprocessing
import multiprocessing.connection
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import networkx as nx

from kiln import api, contract
from kiln.controller import metrics
from kiln.warmstart import select
from kiln.zoo import records, store

# decision, graph and the index import torch: the functions that use them import them, so
# the operator starts without torch (the first decision that searches the zoo imports it).
if TYPE_CHECKING:
    from kiln.warmstart import index as zoo_index

CACHE_ENTRIES = 4096
IN_TRAINER_REASON = ("the warm-start decision for entrypoint models is made in the trainer pod, "
                     "before its first step (the operator never imports user code)")
DISABLED_REASON = "warm start disabled by spec.warmStart.enabled"
# Decisions run in this many threads, so cached and zoo-free ones never wait behind a slow one;
# graph extraction, the part whose cost a job's spec decides, runs in at most GRAPH_WORKERS
# processes (each holds torch, a few hundred MB) that a timeout kills.
DECISION_THREADS = 4
GRAPH_WORKERS = 2
GRAPH_CACHE_ENTRIES = 256
GRAPH_TIMEOUT_SECONDS = 60.0
# A new graph worker imports torch before it serves; that is not the job's time.
WORKER_START_SECONDS = 300.0
_log = logging.getLogger(__name__)


def open_zoo(uri: str, *, env: Mapping[str, str], retry: store.RetryPolicy) -> store.ObjectStore:
    """The zoo store a URI names (as `store.open_store`), S3 with `retry` as its policy.

    Raises:
        ValueError: the URI or the S3 settings in `env` are unusable (see `store.open_store`).
    """
    opened = store.open_store(uri, env=env)  # validates everything, contacts nothing
    if not isinstance(opened, store.S3Store):
        return opened
    parts = urlsplit(uri)
    return store.S3Store(
        env[contract.Env.ZOO_ENDPOINT].strip(), parts.netloc, access_key=None, secret_key=None,
        credentials=store.credentials_provider(env),
        region=env.get(contract.Env.ZOO_REGION) or None, prefix=unquote(parts.path), retry=retry)


def seconds_saved(known: Sequence[records.ZooRecord],
                  warm: api.WarmStartDecision | None) -> float:
    """Training seconds a succeeded job's warm start saved, estimated: its parent's own
    training seconds times the share of the job's weight tensors that came from it.

    A deliberately simple estimate (what the parent's training bought, in the share the child
    kept), needing no cold run to compare with; 0 for a cold start, or a parent that is gone or
    has no training time (imported weights).

    Args:
        known: the zoo's records (`ParentChooser.records`).
        warm: the job's ``status.warmStart``.
    """
    if warm is None or not warm.parent or warm.matched_tensors is None or not warm.total_tensors:
        return 0.0
    matched, total = warm.matched_tensors, warm.total_tensors
    record = next((r for r in known if r.id == warm.parent), None)
    if record is None or not record.train_seconds:
        return 0.0
    return record.train_seconds * min(1.0, matched / total)


class ParentChooser:
    """Warm-start decisions for the operator: `decision.decide` in worker threads, so the kopf
    event loop never blocks, against a `ZooIndex` kept loaded and refreshed at most every
    `refresh_seconds`. Decisions are cached by (model spec, warmStart spec, zoo contents): jobs
    of one architecture submitted together trace their graph and search the zoo once. A job
    with warm start disabled never touches the zoo; an empty zoo needs no search at all. An
    unreachable zoo raises `store.StoreUnavailable`.

    The child's graph is extracted in a worker process (`_GraphWorker`) that is killed after
    `graph_timeout_seconds`: one job's model cannot hold the decisions of the others; its job
    cold-starts saying so.

    Args:
        zoo: the zoo store.
        metrics: operator metrics (zoo query seconds).
        refresh_seconds: re-list the zoo at most this often (0: before every decision).
        query_timeout_seconds: deadline of one similarity search.
        graph_timeout_seconds: deadline of one graph extraction.
        index_start_method: multiprocessing start method of the zoo index's scoring pool
            (`zoo_index.IndexSettings.start_method`). The index lives long: it keeps the zoo's
            clusters, so a large zoo is searched fast.
        clock: monotonic seconds.
    """

    def __init__(self, zoo: store.ObjectStore, *, metrics: metrics.OperatorMetrics,
                 refresh_seconds: float, query_timeout_seconds: float,
                 graph_timeout_seconds: float = GRAPH_TIMEOUT_SECONDS,
                 index_start_method: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.zoo = zoo
        self._metrics = metrics
        self._refresh_seconds = refresh_seconds
        self._timeout_seconds = query_timeout_seconds
        self._graph_timeout_seconds = graph_timeout_seconds
        self._index_start_method = index_start_method
        self._clock = clock
        self._index: zoo_index.ZooIndex | None = None
        self._refreshed = -float("inf")
        self._lock = threading.Lock()  # the index, its refresh and search, and the caches
        self._cache: collections.OrderedDict[str, api.WarmStartDecision] = collections.OrderedDict()
        self._graphs: collections.OrderedDict[str, nx.DiGraph] = collections.OrderedDict()
        self._workers = [_GraphWorker() for _ in range(GRAPH_WORKERS)]
        # Last in, first out: a burst's first worker stays warm, the next starts only if needed.
        self._idle: queue.LifoQueue[_GraphWorker] = queue.LifoQueue()
        for worker in self._workers:
            self._idle.put(worker)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=DECISION_THREADS, thread_name_prefix="kiln-warmstart")
        # Its own thread: a decision may wait for it (`_child_graph`), so it never queues
        # behind decisions.
        self._warmer = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kiln-graph-warm-up")
        self._warming: concurrent.futures.Future[None] | None = None
        self._settled = False  # no warm-up is left to do

    def warm_up(self) -> concurrent.futures.Future[None]:
        """In a thread of its own, start the first graph worker if the zoo holds a model to
        search: it imports torch (seconds to tens of seconds), which the first decision that
        traces a model would otherwise wait for. With an empty or unreachable zoo no decision
        traces one, so none starts: with an empty zoo the next call looks again (an
        unreachable one is not asked again: the first decision that traces a model starts the
        worker then). Once settled, later calls return the same future. Call it from one
        thread."""
        if self._warming is None or (self._warming.done() and not self._settled):
            self._warming = self._warmer.submit(self._start_worker)
        return self._warming

    def _start_worker(self) -> None:
        from kiln.warmstart import graph

        try:
            with self._lock:
                if len(self._fresh_index()) == 0:
                    return
        except (store.StoreUnavailable, store.StoreMisconfigured):
            self._settled = True  # the job's own decision reports it
            return
        self._settled = True
        worker = self._idle.get()
        try:
            worker.start()
        except graph.GraphError as exc:  # the first decision that needs one tries again
            _log.warning("warm-start graph worker: %s", exc)
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        """Stop the worker threads and processes, and the index's pool."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._warmer.shutdown(wait=False, cancel_futures=True)
        for worker in self._workers:
            worker.kill()
        if self._index is not None:
            self._index.close()

    async def decide(self, job: api.TrainingJob) -> api.WarmStartDecision:
        """The warm-start decision for `job`, computed in a worker thread.

        Raises:
            store.StoreUnavailable: the zoo could not be read.
            api.InvalidSpec: the pinned parent is not in the zoo.
        """
        decided = _without_zoo(job) or self._cached(job)
        if decided is not None:
            return decided
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.decide_now, job)

    def _cached(self, job: api.TrainingJob) -> api.WarmStartDecision | None:
        """A cached decision when no zoo refresh is due (no thread hop for repeat jobs)."""
        index = self._index
        if index is None or self._clock() - self._refreshed >= self._refresh_seconds:
            return None
        return self._cache.get(self._key(job, index))

    @staticmethod
    def _key(job: api.TrainingJob, index: zoo_index.ZooIndex) -> str:
        # The namespace decides which records the job may see, the data which it prefers.
        return json.dumps([api.to_wire(job.spec.model), api.to_wire(job.spec.warm_start),
                           job.namespace, records.dataset_fingerprint(job.spec.dataset),
                           sorted(r.id for r in index.all_records())], sort_keys=True)

    def decide_now(self, job: api.TrainingJob) -> api.WarmStartDecision:
        """`decide`, in the calling thread (blocking)."""
        decided = _without_zoo(job)
        if decided is not None:
            return decided
        started = self._clock()
        try:
            with self._lock:
                index = self._fresh_index()
                cached = self._cache.get(self._key(job, index))
                if cached is not None:
                    self._cache.move_to_end(self._key(job, index))
                    return cached
                spec = job.spec.warm_start
                if spec.parent == "auto" and len(index) == 0:
                    return select.cold_start(
                        api.WarmStartOutcome.COLD_EMPTY,
                        f"cold start: the model zoo ({self.zoo.describe()}) is empty")
            # Outside the lock: other jobs' decisions go on while this model is traced.
            child = self._child_graph(job.spec.model)
            if isinstance(child, api.WarmStartDecision):
                return child
            from kiln.warmstart import decision

            with self._lock:
                index = self._fresh_index()
                chosen = decision.decide(job, self.zoo, zoo_index=index,
                                         timeout_seconds=self._timeout_seconds, child=child)
                _remember(self._cache, self._key(job, index), chosen, CACHE_ENTRIES)
                return chosen
        finally:
            self._metrics.zoo_query_seconds.observe(self._clock() - started)

    def records(self) -> list[records.ZooRecord]:
        """The zoo's records as last indexed ([] before the first decision)."""
        index = self._index
        return index.all_records() if index is not None else []

    def _fresh_index(self) -> zoo_index.ZooIndex:
        from kiln.warmstart import index as zoo_index

        now = self._clock()
        if self._index is None:
            self._index = zoo_index.ZooIndex(self.zoo, settings=zoo_index.IndexSettings(
                start_method=self._index_start_method, maintain_clusters=True))
            self._refreshed = now
        elif now - self._refreshed >= self._refresh_seconds:
            self._index.refresh()
            self._refreshed = now
        return self._index

    def _child_graph(self, spec: api.ModelSpec) -> nx.DiGraph | api.WarmStartDecision:
        """The job's model graph from a graph worker (cached per model spec), or the cold-start
        decision when it cannot be had: untraceable, over the deadline, or the worker died."""
        from kiln.warmstart import graph

        key = json.dumps(api.to_wire(spec), sort_keys=True)
        with self._lock:
            if key in self._graphs:
                self._graphs.move_to_end(key)
                return self._graphs[key]
        warming = self._warming
        if warming is not None:  # a worker starting: wait for it rather than start another
            concurrent.futures.wait([warming])
        worker = self._idle.get()
        try:
            child = worker.extract(spec, timeout_seconds=self._graph_timeout_seconds)
        except graph.GraphError as exc:
            return select.cold_start(api.WarmStartOutcome.COLD_UNTRACEABLE, f"cold start: {exc}")
        finally:
            self._idle.put(worker)
        with self._lock:
            _remember(self._graphs, key, child, GRAPH_CACHE_ENTRIES)
        return child


def _without_zoo(job: api.TrainingJob) -> api.WarmStartDecision | None:
    """The decision of a job that needs no zoo search here (warm start disabled, pretrained
    weights, or decided by the trainer: for user code the operator never imports, and for a
    LoRA job on pretrained weights, whose base only its pod sees), else None."""
    if not job.spec.warm_start.enabled:
        return select.cold_start(api.WarmStartOutcome.DISABLED, DISABLED_REASON)
    if job.spec.model.pretrained is not None and job.spec.training.peft is not None:
        from kiln.warmstart import decision

        return select.cold_start(api.WarmStartOutcome.IN_TRAINER,
                                 decision.PRETRAINED_LORA_REASON)
    if job.spec.model.pretrained is not None:
        return select.cold_start(api.WarmStartOutcome.DISABLED, select.PRETRAINED_REASON)
    if job.spec.model.entrypoint is not None:
        return select.cold_start(api.WarmStartOutcome.IN_TRAINER, IN_TRAINER_REASON)
    return None


def _remember(cache: collections.OrderedDict[str, Any], key: str, value: Any,
              entries: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > entries:
        cache.popitem(last=False)


class _GraphWorker:
    """`decision.model_graph` in a spawned process, killed when it runs past its deadline and
    started again (lazily) for the next model. Used by one thread at a time."""

    def __init__(self) -> None:
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: multiprocessing.connection.Connection | None = None

    def extract(self, spec: api.ModelSpec, *, timeout_seconds: float) -> nx.DiGraph:
        """The graph of `spec`'s model (a registry architecture).

        Raises:
            graph.GraphError: the model cannot be traced, tracing it took longer than
                `timeout_seconds` (the process is killed), or the process died.
        """
        from kiln.warmstart import graph

        conn = self.start()
        conn.send(api.to_wire(spec))
        if not conn.poll(timeout_seconds):
            self.kill()
            raise graph.GraphError(
                f"{spec.label}: tracing its graph took longer than {timeout_seconds:g} s "
                "(the operator's --warm-start-graph-timeout-seconds)")
        try:
            kind, payload = conn.recv()
        except EOFError:
            code = self._process.exitcode if self._process is not None else None
            self.kill()
            raise graph.GraphError(f"{spec.label}: the process tracing its graph died "
                                   f"(exit code {code})") from None
        if kind == "error":
            raise graph.GraphError(payload)
        return graph.from_json(payload)

    def kill(self) -> None:
        """Stop the process now (a later `extract` starts a new one)."""
        if self._process is not None:
            self._process.kill()
            self._process.join()
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None

    def alive(self) -> bool:
        """Whether its process runs (started and not killed)."""
        return self._process is not None and self._process.is_alive()

    def start(self) -> multiprocessing.connection.Connection:
        """The connection to the running process, started first if there is none.

        Raises:
            graph.GraphError: it did not start within WORKER_START_SECONDS, or died starting.
        """
        from kiln.warmstart import graph

        if self._conn is not None and self._process is not None and self._process.is_alive():
            return self._conn
        self.kill()
        ours, theirs = multiprocessing.get_context("spawn").Pipe()
        process = multiprocessing.get_context("spawn").Process(
            target=_serve_graphs, args=(theirs,), name="kiln-graph-worker", daemon=True)
        process.start()
        theirs.close()
        self._process, self._conn = process, ours
        if not ours.poll(WORKER_START_SECONDS):
            self.kill()
            raise graph.GraphError(f"the graph worker did not start in {WORKER_START_SECONDS:g} s")
        try:
            ours.recv()  # "ready": torch is imported
        except EOFError:  # it died before "ready": a broken install, or killed for memory
            # Its exit code says why; a process that closed its pipe is ending, so a few
            # seconds suffice (a decision must not wait the start-up allowance for a message).
            process.join(5.0)
            code = process.exitcode
            self.kill()
            raise graph.GraphError(
                f"the graph worker died while starting (exit code {code})") from None
        return ours


def _serve_graphs(conn: multiprocessing.connection.Connection) -> None:
    """A graph worker's main: model specs in, ("graph", JSON) or ("error", message) out."""
    from kiln.warmstart import decision, graph

    # One tiny trace first: its lazy imports (torch's compiler, about a second of CPU) are paid
    # before "ready", not inside the first job's tracing deadline.
    decision.model_graph(api.ModelSpec(architecture="small_cnn", input_shape=[1, 8, 8]))
    conn.send(("ready", None))
    while True:
        try:
            wire = conn.recv()
        except EOFError:  # the operator closed its end
            return
        spec = api.ModelSpec.model_validate(wire)
        try:
            conn.send(("graph", graph.to_json(decision.model_graph(spec))))
        except graph.GraphError as exc:
            conn.send(("error", str(exc)))
