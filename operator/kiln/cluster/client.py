"""`kiln.Client`: submit, list, get, logs, wait and delete Kiln jobs on a cluster, or locally.

The cluster backend talks to the API server with the official `kubernetes` client on the
user's kubeconfig; `Client(local=True)` runs job files through `kiln run`'s machinery. Both
return the shapes of `kiln.cluster.views`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from kiln import api
from kiln.api import jobfile
from kiln.cluster import views
from kiln.cluster.errors import ClusterError, WaitFailed, WaitTimeout

KINDS = {api.KIND: api.PLURAL, api.sweep.SWEEP_KIND: api.sweep.SWEEP_PLURAL}
DEFAULT_KUBECONFIG = Path("~/.kube/config")
POLL_SECONDS = 1.0
RECENT_EVENTS = 20

JobFile = Path | str | Mapping[str, Any]
"""What `submit` takes: a YAML file's path, or one document as a dict."""


class Client:
    """Kiln jobs from Python: the calls behind `kiln submit/ls/get/logs/wait/delete`.

    Args:
        namespace: where jobs go and are looked up; default: the kubeconfig context's
            namespace, else "default".
        context: the kubeconfig context; default: its current context.
        kubeconfig: the kubeconfig file; default: $KUBECONFIG, else ~/.kube/config, else the
            pod's service account when running inside a cluster.
        local: run jobs here with `kiln run`'s trainer instead (no cluster needed).
        zoo: the local zoo (path or s3://) of `local=True`.
        work_dir: where `local=True` keeps job files and trainer logs (default .kiln/runs).

    Example:
        >>> client = Client(namespace="team-a")                      # doctest: +SKIP
        >>> client.submit("job.yaml")
        >>> client.wait("digits")["result"]["validationAccuracy"]
    """

    def __init__(self, *, namespace: str | None = None, context: str | None = None,
                 kubeconfig: Path | str | None = None, local: bool = False,
                 zoo: str = ".kiln/zoo", work_dir: Path | None = None) -> None:
        if local:
            from kiln.cluster import local as local_runs

            self._local: local_runs.LocalRuns | None = local_runs.LocalRuns(
                zoo_uri=zoo, work_dir=work_dir)
            self._kube: _Kube | None = None
            self.namespace = local_runs.NAMESPACE
        else:
            self._local = None
            self._kube = _Kube(kubeconfig=kubeconfig, context=context)
            self.namespace = namespace or self._kube.default_namespace
        # As kubectl: a file may name its namespace unless one was asked for explicitly.
        self._namespace_given = namespace is not None

    def submit(self, job: JobFile) -> list[dict[str, Any]]:
        """Validate a TrainingJob/TrainingSweep file (or document) as `kiln validate` does, then
        create each document, or update the spec of one that exists (as `kubectl apply`).
        Locally, train the jobs now (as `kiln run`).

        Returns:
            One {kind, name, namespace, action} per document; action is created or configured
            (locally: succeeded or failed).

        Raises:
            api.InvalidSpec: a document is invalid (nothing was submitted).
            ClusterError: the cluster refused or could not be reached.
        """
        docs = checked_documents(job)
        if self._local is not None:
            return self._local.run(docs)
        assert self._kube is not None
        for doc in docs:
            named = doc.metadata.namespace
            if self._namespace_given and named and named != self.namespace:
                raise ClusterError(
                    f"{doc.kind} {doc.name} names namespace {named}, not {self.namespace} as "
                    f"asked (-n); pass -n {named}, or drop metadata.namespace from the file")
        return [self._kube.apply(doc, self.namespace) for doc in docs]

    def list(self, *, all_namespaces: bool = False) -> list[dict[str, Any]]:
        """Every TrainingJob and TrainingSweep of the namespace (or all), as `views.summary`."""
        if self._local is not None:
            return [views.summary(obj) for obj in self._local.objects()]
        assert self._kube is not None
        namespace = None if all_namespaces else self.namespace
        found = [obj for kind in KINDS for obj in self._kube.list_kind(kind, namespace)]
        return [views.summary(obj) for obj in sorted(found, key=_created)]

    def get(self, name: str) -> dict[str, Any]:
        """One job (or sweep) as `views.detail`: progress, conditions, recent events, story."""
        if self._local is not None:
            return views.detail(self._local.object(name))
        assert self._kube is not None
        obj = self._kube.find(name, self.namespace)
        events = self._kube.events(obj)
        return views.detail(obj, events[-RECENT_EVENTS:])

    def logs(self, name: str, *, rank: int = 0, follow: bool = False) -> Iterator[str]:
        """The trainer's log lines (latest attempt, pod of `rank`); with `follow`, until the
        pod ends. An unknown job or rank raises here, not at the first line."""
        if self._local is not None:
            self._local.object(name)
            return self._local.log(name)
        assert self._kube is not None
        pod = self._kube.trainer_pod(name, self.namespace, rank)
        return self._kube.pod_log(pod, follow=follow)

    def wait(self, name: str, *, phase: str = api.Phase.SUCCEEDED.value,
             timeout: float | None = None) -> dict[str, Any]:
        """Wait until the job's phase is `phase`; returns its `views.detail` then.

        Raises:
            WaitFailed: it ended in another phase (Failed, or Succeeded when waiting for Failed)
                or was deleted; the message gives the Failed condition's reason.
            WaitTimeout: `timeout` seconds passed first.
            ClusterError: no such job, or the cluster could not be reached.
        """
        if phase not in {p.value for p in api.Phase} | {p.value for p in api.sweep.SweepPhase}:
            raise ClusterError(f"--for {phase}: not a phase; use one of "
                               f"{', '.join(p.value for p in api.Phase)}")
        deadline = None if timeout is None else time.monotonic() + timeout
        view = self.get(name)  # an unknown job is a ClusterError here
        while True:
            if view["phase"] == phase:
                return view
            if view["phase"] in views.TERMINAL_PHASES:
                raise WaitFailed(_ended(view, phase), view)
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"{name}: still {view['phase'] or 'without a phase'} after "
                                  f"{timeout:g} s (waiting for {phase})", view)
            time.sleep(POLL_SECONDS if deadline is None
                       else max(0.0, min(POLL_SECONDS, deadline - time.monotonic())))
            try:
                view = self.get(name)
            except _NotFound:  # not an unreachable cluster: that stays a ClusterError
                raise WaitFailed(f"{name} was deleted before reaching {phase}", {}) from None

    def delete(self, name: str) -> dict[str, Any]:
        """Delete the job or sweep (its pods go with it); returns {kind, name, namespace,
        action: deleted}."""
        if self._local is not None:
            return self._local.forget(name)
        assert self._kube is not None
        return self._kube.delete(name, self.namespace)


def checked_documents(job: JobFile) -> list[api.TrainingJob | api.sweep.TrainingSweep]:
    """The documents of `job`, each checked against the model registry as `kiln validate`
    checks it (a sweep at every trial value).

    Raises:
        api.InvalidSpec: every problem of the first invalid document, naming its fields.
    """
    from kiln import models

    if isinstance(job, Mapping):
        found = jobfile.parse_documents(json.dumps(job), source="<document>")
    else:
        found = jobfile.load_documents(Path(job))
    for doc in found:
        more = (models.check_sweep(doc) if isinstance(doc, api.sweep.TrainingSweep)
                else models.check_job(doc))
        if more:
            raise api.InvalidSpec(more, source=str(job) if not isinstance(job, Mapping)
                                  else "<document>", kind=doc.kind)
    return found


def _ended(view: Mapping[str, Any], wanted: str) -> str:
    failed = next((c for c in view.get("conditions", []) if c.get("type") == "Failed"
                   and c.get("status") == "True"), None)
    why = (f": {failed.get('reason')}: {failed.get('message')}" if failed
           else f" (not {wanted})")
    return f"{view.get('name')} ended {view.get('phase')}{why}"


def _created(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("creationTimestamp") or ""),
            str(meta.get("name") or ""))


class _Kube:
    """The API calls of the cluster backend, each error turned into a `ClusterError`."""

    def __init__(self, *, kubeconfig: Path | str | None, context: str | None) -> None:
        from kubernetes import client, config

        configuration = client.Configuration()
        configuration.retries = 1  # an unreachable cluster is reported at once
        given = str(kubeconfig) if kubeconfig else os.environ.get("KUBECONFIG")
        path = given or str(DEFAULT_KUBECONFIG.expanduser())
        self.default_namespace = "default"
        if given and not any(Path(p).expanduser().exists() for p in given.split(os.pathsep)
                             if p):
            raise ClusterError(
                f"kubeconfig {given} does not exist; pass --kubeconfig FILE or set KUBECONFIG "
                "to kubectl's file")
        if not given and not Path(path).exists():
            if not os.environ.get("KUBERNETES_SERVICE_HOST"):
                raise ClusterError(
                    f"no kubeconfig: KUBECONFIG is not set and {DEFAULT_KUBECONFIG} does not "
                    "exist; set KUBECONFIG or pass --kubeconfig FILE (kubectl's file)")
            config.load_incluster_config(client_configuration=configuration)
            self.where = "the in-cluster API server"
        else:
            try:
                config.load_kube_config(config_file=path, context=context,
                                        client_configuration=configuration)
                contexts, current = config.list_kube_config_contexts(config_file=path)
            except (config.ConfigException, OSError, yaml.YAMLError, TypeError) as exc:
                raise ClusterError(f"kubeconfig {path}: {exc}; check the file"
                                   + (" and --context" if context else "")) from None
            chosen = next((c for c in contexts if c.get("name") == context), current)
            self.default_namespace = (chosen.get("context") or {}).get("namespace") or "default"
            self.where = f"{configuration.host} (context {chosen.get('name')}, kubeconfig {path})"
        self._api = client.ApiClient(configuration)
        self._objects = client.CustomObjectsApi(self._api)
        self._core = client.CoreV1Api(self._api)

    def apply(self, doc: api.TrainingJob | api.sweep.TrainingSweep,
              namespace: str) -> dict[str, Any]:
        body = api.to_wire(doc)
        body.pop("status", None)
        meta = body.setdefault("metadata", {})
        namespace = meta.get("namespace") or namespace
        meta["namespace"] = namespace
        plural, name = KINDS[doc.kind], doc.name
        done = {"kind": doc.kind, "name": name, "namespace": namespace}
        try:
            self._call(f"create {doc.kind} {name}", lambda: self._objects
                       .create_namespaced_custom_object(api.GROUP, api.VERSION, namespace,
                                                        plural, body))
            return done | {"action": "created"}
        except _NotFound as exc:
            self.list_kind(doc.kind, namespace)  # a cluster without Kiln says so here
            raise ClusterError(f"create {doc.kind} {name}: {exc}; create the namespace "
                               f"(kubectl create namespace {namespace}) or pick another "
                               "with -n") from None
        except _Conflict:
            patch = {"metadata": {k: meta[k] for k in ("labels", "annotations") if k in meta},
                     "spec": body["spec"]}
            self._call(f"update {doc.kind} {name}", lambda: self._objects
                       .patch_namespaced_custom_object(api.GROUP, api.VERSION, namespace,
                                                       plural, name, patch))
            return done | {"action": "configured"}

    def list_kind(self, kind: str, namespace: str | None) -> list[dict[str, Any]]:
        try:
            if namespace is None:
                found = self._call(f"list {kind}s", lambda: self._objects
                                   .list_cluster_custom_object(api.GROUP, api.VERSION,
                                                               KINDS[kind]))
            else:
                found = self._call(f"list {kind}s", lambda: self._objects
                                   .list_namespaced_custom_object(api.GROUP, api.VERSION,
                                                                  namespace, KINDS[kind]))
        except _NotFound as exc:  # a list is never 404 for want of objects, or of a namespace
            raise ClusterError(
                f"list {kind}s: {self.where} does not serve {KINDS[kind]}.{api.GROUP} "
                f"({exc}); install Kiln there (its Helm chart brings the CRDs), or pick the "
                "cluster that runs it with --context") from None
        items: list[dict[str, Any]] = found.get("items") or []
        for item in items:  # a list's items carry no kind
            item.setdefault("kind", kind)
        return items

    def find(self, name: str, namespace: str) -> dict[str, Any]:
        """The TrainingJob of that name, else the TrainingSweep."""
        for kind, plural in KINDS.items():
            try:
                found: dict[str, Any] = self._call(f"get {kind} {name}", lambda p=plural: (
                    self._objects.get_namespaced_custom_object(api.GROUP, api.VERSION,
                                                               namespace, p, name)))
                return found
            except _NotFound:
                continue
        self.list_kind(api.KIND, namespace)  # a cluster without Kiln says so here
        raise _NotFound(f"no TrainingJob or TrainingSweep {name} in namespace {namespace}; "
                        f"list them with `kiln ls -n {namespace}`")

    def events(self, obj: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The object's events, oldest first."""
        meta = obj.get("metadata") or {}
        found = self._raw(f"list events of {meta.get('name')}", lambda: (
            self._core.list_namespaced_event(str(meta.get("namespace")),
                                             _preload_content=False)))
        mine = [e for e in found.get("items") or []
                if (e.get("involvedObject") or {}).get("name") == meta.get("name")
                and (e.get("involvedObject") or {}).get("kind") in (obj.get("kind"), None)]
        return sorted(mine, key=lambda e: str(views.event_row(e)["time"] or ""))

    def trainer_pod(self, name: str, namespace: str, rank: int) -> dict[str, Any]:
        """The pod of `rank` of the job's latest attempt."""
        job = self.find(name, namespace)
        if job.get("kind") == api.sweep.SWEEP_KIND:
            raise ClusterError(f"{name} is a TrainingSweep: its trial jobs have the pods; list "
                               f"them with `kiln ls -n {namespace}`, then `kiln logs -n "
                               f"{namespace} TRIAL`")
        found = self._raw(f"list the pods of {name}", lambda: self._core.list_namespaced_pod(
            namespace, label_selector=f"{api.JOB_NAME_LABEL}={name}", _preload_content=False))
        pods = [p for p in found.get("items") or []
                if int((p["metadata"].get("labels") or {}).get(api.RANK_LABEL, 0)) == rank]
        if not pods:
            phase = (job.get("status") or {}).get("phase") or "no phase yet"
            ranks = sorted({int((p["metadata"].get("labels") or {}).get(api.RANK_LABEL, 0))
                            for p in found.get("items") or []})
            raise ClusterError(
                f"{name} has no trainer pod of rank {rank} (phase {phase}); " + (
                    f"its pods have rank {', '.join(map(str, ranks))}: check --rank" if ranks
                    else f"a queued job has none yet: `kiln wait -n {namespace} {name} --for "
                         "Running`"))

        def attempt(pod: Mapping[str, Any]) -> tuple[int, str]:
            meta = pod["metadata"]
            return int((meta.get("labels") or {}).get(api.ATTEMPT_LABEL, 0)), str(
                meta.get("creationTimestamp") or "")

        return max(pods, key=attempt)

    def pod_log(self, pod: Mapping[str, Any], *, follow: bool) -> Iterator[str]:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        names = [c.get("name") for c in spec.get("containers") or []]
        container = api.CONTAINER_NAME if api.CONTAINER_NAME in names else None
        response = self._call(f"read the log of pod {meta['name']}", lambda: (
            self._core.read_namespaced_pod_log(meta["name"], meta["namespace"],
                                               container=container, follow=follow,
                                               _preload_content=False)))
        try:
            for line in response:
                yield line.decode("utf-8", errors="replace").rstrip("\r\n")
        finally:
            response.release_conn()

    def delete(self, name: str, namespace: str) -> dict[str, Any]:
        obj = self.find(name, namespace)
        kind = str(obj.get("kind"))
        self._call(f"delete {kind} {name}", lambda: self._objects.delete_namespaced_custom_object(
            api.GROUP, api.VERSION, namespace, KINDS[kind], name,
            propagation_policy="Background"))
        return {"kind": kind, "name": name, "namespace": namespace, "action": "deleted"}

    def _raw(self, what: str, call: Any) -> dict[str, Any]:
        """A core call's JSON as sent (the typed models reject an object missing a field)."""
        response = self._call(what, call)
        decoded: dict[str, Any] = json.loads(response.data)
        return decoded

    def _call(self, what: str, call: Any) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return call()
        except ApiException as exc:
            message = _api_message(exc)
            if exc.status == 404:
                raise _NotFound(message) from None
            if exc.status == 409:
                raise _Conflict(message) from None
            hint = {401: "; your credentials were refused: refresh them (kubectl get pods "
                         "tells the same)",
                    403: "; you lack that permission on trainingjobs.kiln.dev in this "
                         "namespace: ask the cluster's admin for it"}.get(exc.status or 0, "")
            raise ClusterError(f"{what}: the API server answered {exc.status}: {message}"
                               f"{hint}") from None
        except HTTPError as exc:
            raise ClusterError(f"{what}: cannot reach {self.where}: {exc}; check that the "
                               "cluster is up and --context/KUBECONFIG point at it") from None


class _NotFound(ClusterError):
    pass


class _Conflict(ClusterError):
    pass


def _api_message(exc: Any) -> str:
    """The Status message of an API error, else its reason."""
    try:
        return str(json.loads(exc.body).get("message") or exc.reason)
    except (TypeError, ValueError, AttributeError):
        return str(exc.reason)

