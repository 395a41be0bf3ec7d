"""kmock's Kubernetes emulator served over HTTP from a background thread, with a request log.

An in-memory API server in its own thread and event loop, so tests stay synchronous and the
operator under test (a separate process) talks to it over real HTTP. No TLS, no authentication.
"""

# A deleted pod stays Terminating, as on a real API server: a DELETE of a scheduled, unfinished
# pod sets deletionTimestamp and deletionGracePeriodSeconds (the DeleteOptions' grace, else the
# pod's terminationGracePeriodSeconds, at most the emulator's `max_pod_grace_seconds`), and the
# object goes only when deleted again with grace 0 (the test kubelet does that once the
# pod's process has exited; a uid precondition is honoured). Pod creation can be refused with
# 403 "exceeded quota" (`Emulator.refuse_pods`), as a ResourceQuota admission does. A body
# nested deeper than the API server decodes (10,000 levels) is refused with 400.
#
# What the emulator does not do (so these tests cannot check it): admission (webhooks, schema
# validation, defaulting, pruning of undeclared status fields), garbage collection through
# ownerReferences, resourceVersion bookkeeping and conflicts (it never changes resourceVersion,
# so optimistic concurrency is never exercised), label and field selectors on watches (LISTs
# apply them, `kubesim.selection`, so a selector that matches nothing fails a test), server-side
# apply, PUT, deletecollection, generateName, and a scheduler or kubelet
# (`kubesim.kubelet` stands in for the last two).

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self, TypeVar

import kmock
import yaml

from kiln import api
from kubesim import client, selection

T = TypeVar("T")

START_SECONDS = 30.0
TRAININGJOBS = f"{api.GROUP}/{api.VERSION}/{api.PLURAL}"
TRAININGSWEEPS = f"{api.GROUP}/{api.VERSION}/{api.sweep.SWEEP_PLURAL}"
DEFAULT_POD_GRACE_SECONDS = 30  # the API server's default terminationGracePeriodSeconds


@dataclasses.dataclass
class QuotaRefusal:
    """Refuse the creation of matching pods as a ResourceQuota would (403 "exceeded quota").

    Attributes:
        namespace: the namespace whose pod creations are refused.
        quota: the ResourceQuota's name, in the message.
        resource: what it limits, e.g. ``requests.nvidia.com/gpu`` (in the message).
        when: which pod bodies to refuse (default: every pod of the namespace).
        refused: names of the pods refused so far (filled by the emulator).
    """

    namespace: str
    quota: str = "compute-quota"
    resource: str = "pods"
    when: Callable[[dict[str, Any]], bool] = lambda _pod: True
    refused: list[str] = dataclasses.field(default_factory=list)

    def message(self, pod: str) -> str:
        """The API server's words for a refused pod."""
        return (f'pods "{pod}" is forbidden: exceeded quota: {self.quota}, requested: '
                f"{self.resource}=1, used: {self.resource}=1, limited: {self.resource}=1")


@dataclasses.dataclass
class CreateRefusal:
    """Refuse the creation of matching objects as one of the API server's validation rules
    would (422 Invalid): what the emulator does not check itself, e.g. a CRD's CEL rules.

    Attributes:
        plural: the resource, e.g. ``trainingjobs``.
        message: the server's words.
        when: which bodies to refuse (default: every one).
        refused: names of the objects refused so far (filled by the emulator).
    """

    plural: str
    message: str
    when: Callable[[dict[str, Any]], bool] = lambda _body: True
    refused: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class LoggedRequest:
    """One request the emulator received.

    Attributes:
        seconds: `time.monotonic()` when it arrived.
        method: HTTP method (GET, POST, PATCH, DELETE, PUT).
        action: kmock's Kubernetes action (LIST, WATCH, FETCH, CREATE, UPDATE, DELETE) or None
            for discovery and other non-resource URLs.
        group: API group of the resource ("" for the core group), or None.
        resource: plural resource name, or None.
        subresource: e.g. "status", or None.
        namespace: the namespace in the URL, or None (cluster-wide or cluster-scoped).
        name: the object name in the URL, or None.
        path: the URL path.
        user_agent: the User-Agent header.
        body: the decoded JSON body, or None.
        params: the query parameters (a LIST's labelSelector and fieldSelector).
    """

    seconds: float
    method: str
    action: str | None
    group: str | None
    resource: str | None
    subresource: str | None
    namespace: str | None
    name: str | None
    path: str
    user_agent: str
    body: Any
    params: dict[str, str] = dataclasses.field(default_factory=dict)


class _RecordingEmulator(kmock.KubernetesEmulator):
    """The emulator, noting each request before serving it (and forgetting it once served)."""

    def _log_list(self) -> list[LoggedRequest]:
        log: list[LoggedRequest] | None = getattr(self, "_kubesim_log", None)
        if log is None:
            log = []
            self._kubesim_log = log
        return log

    async def _handle(self, request: kmock.Request) -> Any:
        # kmock matches each request against its reactions by scanning its whole request
        # history (quadratic: a 1,000-job run slows to seconds per request). Keep in that
        # history only the requests still being served; ours is in `_log_list`.
        inflight: list[kmock.Request] = getattr(self, "_kubesim_inflight", None) or []
        self._kubesim_inflight = inflight
        inflight.append(request)
        self._requests[:] = [r for r in self._requests if any(r is i for i in inflight)]
        try:
            return await self._record_and_serve(request)
        finally:
            inflight[:] = [i for i in inflight if i is not request]
            for payload in self._payloads:  # each reaction keeps the requests it served, too
                served = getattr(payload, "_requests", None)
                if isinstance(served, list):
                    served[:] = [r for r in served if any(r is i for i in inflight)]

    async def _record_and_serve(self, request: kmock.Request) -> Any:
        self._refuse_too_deep(request)
        self._bookkeep(request)
        resource = request.resource
        self._log_list().append(LoggedRequest(
            seconds=time.monotonic(),
            method=str(request.method.value if request.method else ""),
            action=request.action.value if request.action is not None else None,
            group=resource.group if resource is not None else None,
            resource=resource.plural if resource is not None else None,
            subresource=request.subresource,
            namespace=request.namespace,
            name=request.name,
            path=request.url.path,
            user_agent=request.headers.get("User-Agent", ""),
            body=request.data if request.method and request.method.value != "GET" else None,
            params=dict(request.params or {}),
        ))
        self._refuse_over_quota(request)
        self._refuse_invalid(request)
        if _is_pod(request) and request.subresource == "log":
            return await self._serve_log(request)
        if await self._serve_terminating(request):
            # kmock would delete an object with a deletionTimestamp and no finalizers at once:
            # the change is made above; only the answer is left to serve.
            return await kmock.RawHandler._handle(self, request)
        return await super()._handle(request)

    async def _serve_log(self, request: kmock.Request) -> Any:
        """A pod's container log, as the kubelet behind `serve_pod_logs` wrote it; with
        ?follow=true, streamed until the pod has ended (or is gone)."""
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            raise kmock.KubernetesError(status=404, reason="NotFound",
                                        message=f'pods "{request.name}" not found')
        reader: Callable[[str, str], Path | None] | None = getattr(self, "_kubesim_logs", None)
        path = reader(str(request.namespace), str(request.name)) if reader else None

        def read(offset: int) -> bytes:
            if path is None or not path.exists():
                return b""
            with path.open("rb") as log:
                log.seek(offset)
                return log.read()

        # As the API server parses booleans (Go's ParseBool): the Python client sends "True".
        if str((request.params or {}).get("follow", "")).lower() not in ("1", "t", "true"):
            return await kmock.Response(payload=read(0))(request)

        def ended() -> bool:
            if key not in self._objects or self._objects[key].deleted:
                return True
            return (self._objects[key].get("status") or {}).get("phase") in (
                "Succeeded", "Failed")

        async def stream() -> Any:
            offset = 0
            while True:
                done = ended()  # before reading: what the pod wrote before it ended is sent
                chunk = read(offset)
                if chunk:
                    offset += len(chunk)
                    yield chunk
                elif done:
                    return
                else:
                    await asyncio.sleep(0.1)

        return await kmock.Response(payload=stream())(request)

    def _refuse_too_deep(self, request: kmock.Request) -> None:
        """Refuse a body nested deeper than the API server decodes (`api.API_SERVER_MAX_DEPTH`),
        so nothing deeper is ever stored, as on a real cluster."""
        if api.nesting_depth(request.data) > api.API_SERVER_MAX_DEPTH:
            raise kmock.KubernetesError(status=400, reason="BadRequest", message=(
                f"json: exceeded max depth of {api.API_SERVER_MAX_DEPTH}"))

    def configure(self, *, max_pod_grace_seconds: int | None,
                  quota: list[QuotaRefusal], creates: list[CreateRefusal]) -> None:
        """Set what `Emulator` was given: the pods' longest grace period and the refusals."""
        self._kubesim_max_grace = max_pod_grace_seconds
        self._kubesim_quota = quota
        self._kubesim_creates = creates

    def _refuse_over_quota(self, request: kmock.Request) -> None:
        """Answer 403 to a pod creation that a `QuotaRefusal` matches (before any change)."""
        refusals: list[QuotaRefusal] = getattr(self, "_kubesim_quota", [])
        if (request.action != "CREATE" or not _is_pod(request)
                or not isinstance(request.data, dict)):
            return
        meta = request.data.get("metadata") or {}
        namespace = request.namespace or meta.get("namespace")
        for refusal in refusals:
            if refusal.namespace == namespace and refusal.when(request.data):
                name = str(meta.get("name") or "")
                refusal.refused.append(name)
                raise kmock.KubernetesError(status=403, reason="Forbidden",
                                            message=refusal.message(name))

    def _refuse_invalid(self, request: kmock.Request) -> None:
        """Answer 422 to a creation that a `CreateRefusal` matches (before any change)."""
        resource = request.resource
        if (request.action != "CREATE" or resource is None
                or not isinstance(request.data, dict)):
            return
        for refusal in getattr(self, "_kubesim_creates", []):
            if refusal.plural == resource.plural and refusal.when(request.data):
                refusal.refused.append(str((request.data.get("metadata") or {}).get("name")))
                raise kmock.KubernetesError(status=422, reason="Invalid",
                                            message=refusal.message)

    async def _serve_terminating(self, request: kmock.Request) -> bool:
        """Keep a deleted pod Terminating for its grace period; True when this request was
        handled here (a graceful DELETE, or a PATCH of a Terminating pod), False to leave it
        to kmock (any other request, and a DELETE that removes the pod now)."""
        resource, name = request.resource, request.name
        if resource is None or name is None or not _is_pod(request) or request.action not in (
                "DELETE", "UPDATE"):
            return False
        key = (resource, request.namespace, name)
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                return False  # kmock answers 404
            stored = self._objects[key]
            meta = stored.get("metadata") or {}
            if request.action == "UPDATE":
                if not meta.get("deletionTimestamp") or meta.get("finalizers"):
                    return False
                stored.patch(request.data)
            else:
                options = request.data if isinstance(request.data, dict) else {}
                wanted = (options.get("preconditions") or {}).get("uid")
                if wanted and wanted != meta.get("uid"):
                    raise kmock.KubernetesError(status=409, reason="Conflict", message=(
                        f"Precondition failed: UID in precondition: {wanted}, UID in object "
                        f"meta: {meta.get('uid')}"))
                grace = self._grace_seconds(stored, options, request.params or {})
                current = meta.get("deletionGracePeriodSeconds")
                if grace == 0 or stored.get("metadata", {}).get("finalizers"):
                    return False  # gone now (or kept by its finalizers: kmock's way)
                if isinstance(current, int) and current <= grace:
                    return True  # a second DELETE never lengthens the grace period
                ends = time.gmtime(time.time() + grace)
                stored.patch({"metadata": {
                    "deletionTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", ends),
                    "deletionGracePeriodSeconds": grace}})
            await self._buses[resource].put({"type": "MODIFIED", "object": stored.raw})
        return True

    def _grace_seconds(self, pod: Any, options: dict[str, Any], params: Any) -> int:
        """The API server's grace period for deleting `pod`: 0 for a pod never scheduled or
        already finished; else the DeleteOptions' (body or query), else the pod's own, at
        most `max_pod_grace_seconds`."""
        spec, phase = pod.get("spec") or {}, (pod.get("status") or {}).get("phase")
        if not spec.get("nodeName") or phase in ("Succeeded", "Failed"):
            return 0
        asked = options.get("gracePeriodSeconds", params.get("gracePeriodSeconds"))
        if asked is None:
            asked = spec.get("terminationGracePeriodSeconds", DEFAULT_POD_GRACE_SECONDS)
        grace = max(0, int(asked))
        cap: int | None = getattr(self, "_kubesim_max_grace", None)
        return grace if cap is None else min(grace, cap)


    async def _serve_list(self, request: kmock.Request) -> Any:
        # kmock lists every object; the API server applies ?labelSelector and ?fieldSelector.
        answer = await super()._serve_list(request)
        params = request.params or {}
        if isinstance(answer, dict):
            try:
                answer["items"] = selection.select(answer.get("items") or [],
                                                   labels=params.get("labelSelector"),
                                                   fields=params.get("fieldSelector"))
            except ValueError as exc:
                raise kmock.KubernetesError(status=400, reason="BadRequest",  # as the API server
                                            message=str(exc)) from exc
        return answer

    async def _serve_watch(self, request: kmock.Request) -> Any:
        # kmock marks its event bus only after it has sent the objects that exist, so a change
        # made in between is lost; here both happen under the lock every change is made under.
        # With ?sendInitialEvents=true, the API server's BOOKMARK annotated
        # k8s.io/initial-events-end follows those objects: the client's view is then complete.
        yield b""  # the headers now, as kmock does
        resource = request.resource
        assert resource is not None  # kmock routes only resource requests here
        bus = self._buses[resource]

        def watched(obj: Any) -> bool:
            meta = obj.get("metadata") or {}
            return ((request.namespace is None or meta.get("namespace") == request.namespace)
                    and (request.name is None or meta.get("name") == request.name))

        async with self._lock:
            mark = await bus.mark()
            events = [{"type": "ADDED", "object": obj.raw}
                      for (kind, _ns, _name), obj in self._objects.items()
                      if kind == resource and not obj.deleted and watched(obj.raw)]
        try:
            for event in events:
                yield event
            if str((request.params or {}).get("sendInitialEvents", "")).lower() == "true":
                yield {"type": "BOOKMARK", "object": {"metadata": {
                    "resourceVersion": str(getattr(self, "_kubesim_version", 0)),
                    "annotations": {"k8s.io/initial-events-end": "true"}}}}
            async for event in bus.stream(since=mark):
                if watched(event.get("object") or {}):
                    yield event
        finally:
            await bus.unmark(mark)

    async def _serve_version(self, request: kmock.Request) -> Any:
        # kmock names the core group's version "/v1" in /api/v1 discovery; client-go (Helm)
        # cannot parse that and then finds no ConfigMap, Service... The API server says "v1".
        document = await super()._serve_version(request)
        if isinstance(document, dict) and str(document.get("groupVersion", "")).startswith("/"):
            document["groupVersion"] = document["groupVersion"][1:]
        return document

    def _bookkeep(self, request: kmock.Request) -> None:
        """What the API server sets on writes: resourceVersion (a counter bumped on every
        create and patch), uid and creationTimestamp on create, metadata.generation (bumped
        when a patch outside the status subresource touches spec).

        kmock keeps none of these; kopf relies on resourceVersion to tell its own patches'
        echoes from stale events (without it a handler may run twice on one change).
        """
        if request.resource is None or request.action not in ("CREATE", "UPDATE"):
            return
        self._kubesim_version = getattr(self, "_kubesim_version", 0) + 1
        version = str(self._kubesim_version)
        data = request.data
        if request.action == "CREATE" and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            meta["resourceVersion"] = version
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp",
                            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            meta.setdefault("generation", 1)
        elif isinstance(data, dict):
            meta = data.setdefault("metadata", {}) if isinstance(
                data.get("metadata", {}), dict) else {}
            meta["resourceVersion"] = version
            if request.subresource is None and "spec" in data:
                meta["generation"] = self._generation(request) + 1
        elif isinstance(data, list):  # a JSON patch: its test ops see the old version first
            data.append({"op": "replace", "path": "/metadata/resourceVersion", "value": version})

    def _generation(self, request: kmock.Request) -> int:
        key = (request.resource, request.namespace, request.name)
        try:
            stored = self.objects[key]
        except (KeyError, LookupError):
            return 0
        value = (stored.get("metadata") or {}).get("generation") if not stored.deleted else 0
        return int(value) if isinstance(value, int) else 0


class Emulator:
    """The emulator and its HTTP server, running in a daemon thread until `stop`.

    Args:
        extra_resources: more resources to serve ("group/version/plural" -> kmock's
            ResourceInfo), e.g. the Prometheus Operator's kinds for the Helm chart's tests.
        max_pod_grace_seconds: the longest a deleted pod stays Terminating (the pod's or the
            DELETE's grace period, if shorter); None: as long as they say.

    Example:
        >>> with Emulator() as cluster:                       # doctest: +SKIP
        ...     cluster.client.create_job("ns1", job_doc)
    """

    def __init__(self, *, extra_resources: dict[str, kmock.ResourceInfo] | None = None,
                 max_pod_grace_seconds: int | None = None) -> None:
        self._extra_resources = dict(extra_resources or {})
        self._max_pod_grace_seconds = max_pod_grace_seconds
        self._quota: list[QuotaRefusal] = []
        self._creates: list[CreateRefusal] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._handler: _RecordingEmulator | None = None
        self._thread = threading.Thread(target=self._main, name="kmock-emulator", daemon=True)
        self.url = ""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the thread and wait until the server listens.

        Raises:
            RuntimeError: the server did not come up within START_SECONDS.
        """
        # kmock and the test client decode and encode objects recursively; the API server
        # stores them up to api.API_SERVER_MAX_DEPTH levels deep, so this process must read them.
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 2 * api.API_SERVER_MAX_DEPTH + 5_000))
        self._thread.start()
        if not self._ready.wait(START_SECONDS) or self._failure is not None:
            raise RuntimeError(f"kmock emulator did not start: {self._failure!r}")
        self.client = client.Client(self.url)

    def stop(self) -> None:
        """Stop the server and join the thread (idempotent)."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=30)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001  # reported to start() / the test
            self._failure = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        handler = _RecordingEmulator()
        handler.configure(max_pod_grace_seconds=self._max_pod_grace_seconds, quota=self._quota,
                          creates=self._creates)
        handler.resources.load_bundled()  # kopf waits for v1/namespaces in discovery otherwise
        handler.resources[TRAININGJOBS] = kmock.ResourceInfo(
            kind=api.KIND, singular=api.SINGULAR, namespaced=True,
            verbs={"list", "watch", "get", "patch", "create", "delete", "update"},
            shortnames=set(api.SHORT_NAMES), categories=set(api.CATEGORIES),
            subresources={"status"},
        )
        handler.resources[TRAININGSWEEPS] = kmock.ResourceInfo(
            kind=api.sweep.SWEEP_KIND, singular=api.sweep.SWEEP_SINGULAR, namespaced=True,
            verbs={"list", "watch", "get", "patch", "create", "delete", "update"},
            shortnames=set(api.sweep.SWEEP_SHORT_NAMES), subresources={"status"},
        )
        for plural, kind, singular, namespaced in (
                (api.runtime.RUNTIME_PLURAL, api.runtime.RUNTIME_KIND,
                 api.runtime.RUNTIME_SINGULAR, True),
                (api.runtime.CLUSTER_RUNTIME_PLURAL, api.runtime.CLUSTER_RUNTIME_KIND,
                 api.runtime.CLUSTER_RUNTIME_SINGULAR, False)):
            handler.resources[f"{api.GROUP}/{api.VERSION}/{plural}"] = kmock.ResourceInfo(
                kind=kind, singular=singular, namespaced=namespaced,
                verbs={"list", "watch", "get", "patch", "create", "delete", "update"})
        for path, info in self._extra_resources.items():
            handler.resources[path] = info
        self._handler = handler
        async with handler, kmock.Server(handler) as server:
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def call(self, function: Callable[[], T], *, timeout_seconds: float = 30.0) -> T:
        """Run `function` on the emulator's event loop thread and return its result."""
        assert self._loop is not None

        async def run() -> T:
            return function()

        future = asyncio.run_coroutine_threadsafe(run(), self._loop)
        return future.result(timeout_seconds)

    def serve_pod_logs(self, reader: Callable[[str, str], Path | None]) -> None:
        """Answer GET pods/NAME/log with the file `reader(namespace, pod)` names (a kubelet's
        `pod_log_path`); without a reader, logs are empty."""
        assert self._handler is not None
        handler = self._handler
        self.call(lambda: setattr(handler, "_kubesim_logs", reader))

    def refuse_pods(self, refusal: QuotaRefusal) -> QuotaRefusal:
        """Refuse matching pod creations with 403 "exceeded quota" until `allow_pods`;
        returns `refusal` (its `refused` fills in)."""
        self.call(lambda: self._quota.append(refusal))
        return refusal

    def allow_pods(self, refusal: QuotaRefusal) -> None:
        """Stop refusing what `refusal` refused (the quota was raised)."""
        self.call(lambda: self._quota.remove(refusal))

    def refuse_creates(self, refusal: CreateRefusal) -> CreateRefusal:
        """Refuse matching creations with 422 Invalid from now on; returns `refusal` (its
        `refused` fills in)."""
        self.call(lambda: self._creates.append(refusal))
        return refusal

    @property
    def requests(self) -> list[LoggedRequest]:
        """A copy of the request log, oldest first."""
        assert self._handler is not None
        handler = self._handler
        return self.call(lambda: list(handler._log_list()))

    def objects(self, resource: str) -> list[dict[str, Any]]:
        """Current objects of a resource ("group/version/plural", "v1/pods"), read in the
        emulator's thread without a request (cheap enough to poll thousands of objects)."""
        assert self._handler is not None
        handler = self._handler

        def read() -> list[dict[str, Any]]:
            found = []
            for (res, _ns, _name), obj in handler.objects.items():
                if _resource_path(res) == resource and not obj.deleted:
                    found.append(json.loads(json.dumps(obj.raw)))
            return found

        return self.call(read)

    def write_kubeconfig(self, path: Path) -> Path:
        """Write a kubeconfig whose current context is this emulator; returns `path`."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "kubesim"}}],
            "contexts": [{"name": "kmock",
                          "context": {"cluster": "kmock", "user": "kmock"}}],
            "current-context": "kmock",
        }
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        return path


def _is_pod(request: kmock.Request) -> bool:
    resource = request.resource
    return resource is not None and not resource.group and resource.plural == "pods"


def _resource_path(resource: Any) -> str:
    group = resource.group or ""
    return f"{group}/{resource.version}/{resource.plural}" if group else (
        f"{resource.version}/{resource.plural}")
