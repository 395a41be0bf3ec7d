"""The operator's settings: one frozen dataclass, filled from the command line by `main`.

Every knob of `kiln operator` lives in `Options`, with its unit in its name and its default;
`pod_settings` and `placement_settings` derive the typed slices the pod builder and the
planner take (and `main.loop_settings` the placement loop's), which declare no defaults.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import kiln
from kiln.api import names, podschema
from kiln.controller import cluster, pods
from kiln.placement import introspect, types

# The trainer image of the same release (Chart.yaml and values.yaml name it too).
DEFAULT_IMAGE = f"ghcr.io/kiln-dev/kiln-trainer:{kiln.__version__}"
DEFAULT_ZOO_URI = "s3://kiln-zoo"
DEFAULT_POD_SECURITY_CONTEXT = json.dumps(pods.POD_SECURITY_CONTEXT)
DEFAULT_CONTAINER_SECURITY_CONTEXT = json.dumps(pods.CONTAINER_SECURITY_CONTEXT)
# The planner's settings in the operator: the planner's own defaults, but a MILP time limit of
# half the default --placement-interval-seconds, so a plan is ready before the next is due.
PLANNER = types.Settings(time_limit_seconds=5.0)


@dataclasses.dataclass(frozen=True)
class Options:
    """Everything `kiln operator` can be told.

    Attributes:
        kubeconfig: kubeconfig file to use (else $KUBECONFIG, else the pod's service account).
        namespaces: namespaces to watch; empty: all namespaces (cluster-wide).
        zoo_uri: the model zoo, e.g. s3://kiln-zoo or s3://bucket/prefix (or a directory).
        zoo_endpoint: S3 endpoint (host:port or http(s)://host:port) for the operator and the
            trainer pods; None: the operator's $KILN_ZOO_ENDPOINT.
        zoo_secret: Secret (in each job's namespace) with the zoo credentials for trainer pods;
            None: pods get no credentials. The operator's own credentials come from its
            environment (KILN_ZOO_ACCESS_KEY, KILN_ZOO_SECRET_KEY).
        zoo_secret_access_key: key of the access key in `zoo_secret`.
        zoo_secret_secret_key: key of the secret key in `zoo_secret`.
        zoo_secret_session_token: key of an optional session token in `zoo_secret`.
        zoo_share: who sees a registered model whose job leaves spec.zoo.share unset:
            ``private`` (the job's namespace) or ``shared`` (every namespace).
        zoo_pod_access: how trainer and profiling pods reach an s3:// zoo: ``presigned``
            (URLs signed for the job's own objects and the parents its namespace may read, in
            a ``<job>-zoo-access`` Secret; no credential in the pod) or ``credentials`` (the
            `zoo_secret` credential, zoo-wide).
        zoo_access_hours: how long presigned URLs work (at most 168, SigV4's limit); they
            are signed again when less than half of it is left.
        zoo_retry_limit: failed attempts to reach the zoo before a job cold-starts.
        zoo_retry_delay_seconds: wait after the first failed attempt; doubles each time, at
            most `zoo_retry_max_delay_seconds`.
        zoo_retry_max_delay_seconds: longest wait between attempts.
        zoo_request_attempts: S3 requests tried per attempt (short: the handler backs off).
        zoo_refresh_seconds: re-list the zoo's models at most this often.
        zoo_query_timeout_seconds: deadline of one parent search.
        zoo_capacity: the zoo's byte budget, e.g. ``10GiB``; past it, the records worth least
            per byte (decayed parent hits, `kiln.zoo.eviction`) are deleted, never a live
            job's parent or a running job's provisional record. None: the zoo grows freely.
        zoo_gc_interval_seconds: how often the zoo is held to `zoo_capacity`.
        zoo_hit_half_life_seconds: a parent hit's weight halves over this many seconds.
        warm_start_graph_timeout_seconds: deadline of tracing one job's model graph for its
            warm-start search (in a worker process, killed past it; the job cold-starts).
        default_image: trainer image when a job sets no spec.template.image.
        image_pull_policy: imagePullPolicy of trainer pods unless the job's template sets it.
        trainer_metrics_port: port of the trainer's /metrics inside its pod.
        trainer_service_account: service account of trainer pods (None: namespace default).
        termination_grace_seconds: time a stopped trainer has to write its checkpoint.
        pod_start_timeout_seconds: a trainer pod not running this long after its launch (an
            image that cannot be pulled, a missing Secret, no node fits) is deleted and its
            job fails, releasing its devices; 0: wait forever.
        liveness_port: port of the liveness endpoint /healthz (0: none).
        liveness_host: interface it listens on.
        metrics_port: port of the operator's Prometheus /metrics (0: none).
        metrics_host: interface it listens on.
        placement_interval_seconds: re-plan at least this often (and on every arrival or
            completion).
        placement_time_limit_seconds: MILP time limit (keep it at most half the interval).
        placement_use_milp: False plans with the heuristic alone.
        placement_freeze_window_seconds: planned starts this close keep their slot.
        placement_objective: "auto" (makespan for a sweep, weighted completion time for
            arrivals), "makespan" or "completion-time".
        namespace_gpu_quota: "namespace=GPUs" entries: at most that many GPUs run at once for
            the namespace's jobs.
        priority_weights: "priorityClassName=weight" entries: a job's weight in the
            completion-time objective (others: 1).
        max_gpus_per_job: the most GPUs the planner gives one job.
        resize: move running jobs (grow, shrink, another node) by checkpoint-restart when
            the predicted gain is worth the restart (`kiln.placement.introspect`).
        resize_min_gain: a move must save at least this many times its restart cost.
        resize_min_interval_seconds: a job that moved moves again only this many seconds later.
        resize_restart_seconds: restart cost assumed for a job until one of its moves is
            measured (stop to first step after the restart).
        resize_grow_price: what a move onto more GPUs pays per extra GPU-second, in seconds
            of the job's own time times the pool's GPUs (`introspect.Policy.grow_price`).
        resize_grow_load_exponent: that price is scaled by the pool's busy share to this
            power (`introspect.Policy.grow_load_exponent`).
        resize_short_job_weight: how much more a second of wait that a shrink saves a
            shorter job may count than a second of the shrunk job's
            (`introspect.Policy.short_job_weight`).
        cpu_slots_per_node: jobs a GPU-less node runs at once (CPU-only clusters).
        gpu_type: place jobs only on GPU nodes whose `gpu_type_label` equals this (e.g.
            NVIDIA-A100-SXM4-80GB); None: any GPU node.
        gpu_type_label: node label naming a node's GPU type.
        gpu_resources: the extended resources that count as GPUs, e.g. nvidia.com/gpu,
            nvidia.com/mig-1g.10gb (MIG "mixed" strategy), amd.com/gpu; a node's GPUs are the
            first of these it has allocatable, and a trainer pod asks for that one.
        housekeeping_interval_seconds: how often each job's deadline, TTL and progress are
            checked.
        profile_entrypoint_models: before placement, measure a model from user code
            (spec.model.entrypoint) in a short pod of its own image and decide its warm start
            there; False: place it on a nominal estimate and let its trainer decide.
        profile_unmeasured: profile a built-in model too, on one GPU of a type no job of the
            same model and batch was profiled on yet (cached per type for later jobs).
        profile_timeout_seconds: the longest a profiling pod may run (its
            activeDeadlineSeconds); past it the job is placed on a nominal estimate.
        progress_address: where a trainer's metrics are read, formatted with {pod_ip}, {port}
            (the pod's prometheus.io/port annotation), {pod}, {namespace}.
        progress_timeout_seconds: timeout of one metrics read.
        finalizer: put finalizer ``kiln.dev/finalizer`` on TrainingJobs, so a deleted job
            waits for the operator to delete its pods; False (the default, as Kubeflow's
            training operator does): none, the garbage collector deletes a deleted job's pods
            through their ownerReferences and `kubectl delete` never waits for the operator.
        peering: kopf peering object name for leader election between replicas (a
            KopfPeering in the watched namespace, or a ClusterKopfPeering when cluster-wide);
            None: standalone, one replica only.
        pod_security_context: the trainer pods' securityContext as JSON, unless the job's
            spec.template sets one.
        container_security_context: the trainer container's securityContext as JSON, unless
            the job's spec.template sets one.
        kueue: Kueue admits jobs labelled kueue.x-k8s.io/queue-name: each gets a Workload,
            and Kiln places it only once Kueue admitted it, within the admission
            (`kiln.controller.kueue`); False: the label is passed to trainer pods, nothing more.
        kueue_api_version: the Workload API version Kiln speaks to Kueue: "auto" (v1beta2 if
            the API server serves it, else v1beta1), "v1beta2" or "v1beta1".
        verbose: debug logging.
    """

    kubeconfig: Path | None = None
    namespaces: tuple[str, ...] = ()
    zoo_uri: str = DEFAULT_ZOO_URI
    zoo_endpoint: str | None = None
    zoo_secret: str | None = None
    zoo_secret_access_key: str = "accessKey"
    zoo_secret_secret_key: str = "secretKey"
    zoo_secret_session_token: str = "sessionToken"
    zoo_share: str = names.ZooShare.PRIVATE.value
    zoo_pod_access: str = "presigned"
    zoo_access_hours: float = 24.0
    zoo_retry_limit: int = 5
    zoo_retry_delay_seconds: float = 30.0
    zoo_retry_max_delay_seconds: float = 600.0
    zoo_request_attempts: int = 2
    zoo_refresh_seconds: float = 30.0
    zoo_query_timeout_seconds: float = 60.0
    zoo_capacity: str | None = None
    zoo_gc_interval_seconds: float = 600.0
    zoo_hit_half_life_seconds: float = 7 * 24 * 3600.0
    warm_start_graph_timeout_seconds: float = 60.0
    default_image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    trainer_metrics_port: int = 9090
    trainer_service_account: str | None = None
    termination_grace_seconds: int = 60
    pod_start_timeout_seconds: float = 600.0
    liveness_port: int = 8080
    liveness_host: str = "0.0.0.0"
    metrics_port: int = 9100
    metrics_host: str = "0.0.0.0"
    placement_interval_seconds: float = 10.0
    placement_time_limit_seconds: float = PLANNER.time_limit_seconds
    placement_use_milp: bool = PLANNER.use_milp
    placement_freeze_window_seconds: float = PLANNER.freeze_window_seconds
    placement_objective: str = PLANNER.objective
    namespace_gpu_quota: tuple[str, ...] = ()
    priority_weights: tuple[str, ...] = ()
    max_gpus_per_job: int = 8
    resize: bool = True
    resize_min_gain: float = 2.0
    resize_min_interval_seconds: float = 300.0
    resize_restart_seconds: float = 60.0
    resize_grow_price: float = introspect.Policy.grow_price
    resize_grow_load_exponent: float = introspect.Policy.grow_load_exponent
    resize_short_job_weight: float = introspect.Policy.short_job_weight
    cpu_slots_per_node: int = 1
    gpu_type: str | None = None
    gpu_type_label: str = "nvidia.com/gpu.product"
    gpu_resources: tuple[str, ...] = (pods.GPU_RESOURCE,)
    housekeeping_interval_seconds: float = 10.0
    progress_address: str = "{pod_ip}:{port}"
    progress_timeout_seconds: float = 5.0
    profile_entrypoint_models: bool = True
    profile_unmeasured: bool = True
    profile_timeout_seconds: float = 600.0
    finalizer: bool = False
    peering: str | None = None
    pod_security_context: str = DEFAULT_POD_SECURITY_CONTEXT
    container_security_context: str = DEFAULT_CONTAINER_SECURITY_CONTEXT
    kueue: bool = False
    kueue_api_version: str = "auto"
    verbose: bool = False

    def zoo_retry_delay(self, attempt: int) -> float:
        """Seconds to wait after failed zoo attempt number `attempt` (0-based)."""
        return min(self.zoo_retry_delay_seconds * 2.0 ** attempt,
                   self.zoo_retry_max_delay_seconds)


def pod_settings(options: Options) -> pods.PodSettings:
    """What the pod builder needs from the options."""
    return pods.PodSettings(
        default_image=options.default_image,
        image_pull_policy=options.image_pull_policy,
        zoo_uri=options.zoo_uri,
        zoo_endpoint=options.zoo_endpoint,
        zoo_secret=options.zoo_secret,
        zoo_pod_access=options.zoo_pod_access,
        zoo_secret_access_key=options.zoo_secret_access_key,
        zoo_secret_secret_key=options.zoo_secret_secret_key,
        zoo_secret_session_token=options.zoo_secret_session_token,
        zoo_share=options.zoo_share,
        metrics_port=options.trainer_metrics_port,
        termination_grace_seconds=options.termination_grace_seconds,
        service_account=options.trainer_service_account,
        kueue_labels=not options.kueue,
        pod_security_context=security_context(options.pod_security_context,
                                              "pod-security-context"),
        container_security_context=security_context(options.container_security_context,
                                                    "container-security-context"),
    )


def security_context(text: str, flag: str) -> dict[str, Any]:
    """A securityContext given as a JSON object to `--flag` (the flag without its dashes).

    Raises:
        ValueError: not JSON, or not an object; the message shows a working value.
    """
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--{flag}: not JSON ({exc}); give an object, e.g. "
                         '{"runAsNonRoot": true}') from None
    if not isinstance(value, dict):  # a bad flag value, reported like the others
        raise ValueError(  # noqa: TRY004
            f"--{flag}: must be a JSON object (got {text!r}), e.g. " '{"runAsNonRoot": true}')
    # What the API server would refuse in every trainer pod: refused at start instead.
    kind = "V1PodSecurityContext" if flag.startswith("pod") else "V1SecurityContext"
    problems = podschema.pod_schema_problems(value, kind, "")
    if problems:
        raise ValueError(f"--{flag}: " + "; ".join(p.lstrip(".") for p in problems))
    return value


def gpu_type(options: Options) -> cluster.GpuType | None:
    """The GPU type jobs are placed on, or None for any."""
    if not options.gpu_type:
        return None
    return cluster.GpuType(options.gpu_type, options.gpu_type_label)


def placement_settings(options: Options) -> types.Settings:
    """What the planner needs from the options (`PLANNER`, with the options' values)."""
    return dataclasses.replace(
        PLANNER,
        time_limit_seconds=options.placement_time_limit_seconds,
        freeze_window_seconds=options.placement_freeze_window_seconds,
        use_milp=options.placement_use_milp,
        objective=options.placement_objective,
        namespace_gpu_quota=tuple((ns, int(gpus)) for ns, gpus in
                                  _pairs(options.namespace_gpu_quota, "namespace-gpu-quota",
                                         int).items()),
    )


def priority_weights(options: Options) -> dict[str, float]:
    """priorityClassName -> placement weight, from --priority-weight."""
    return {name: float(w) for name, w in
            _pairs(options.priority_weights, "priority-weight", float).items()}


def _pairs(entries: tuple[str, ...], flag: str, kind: type[int | float]
           ) -> dict[str, int | float]:
    """"name=value" entries as a mapping.

    Raises:
        ValueError: an entry without "=", a value that is not a positive `kind`, or a name
            given twice.
    """
    out: dict[str, int | float] = {}
    for entry in entries:
        name, value = pair(entry, flag, kind)
        if name in out:
            raise ValueError(f"--{flag}: {name!r} is given twice; give each name once")
        out[name] = value
    return out


def pair(entry: str, flag: str, kind: type[int | float]) -> tuple[str, int | float]:
    """One "name=value" entry of `--flag` (the flag without its dashes), its value a positive
    `kind`.

    Raises:
        ValueError: the entry names the fix.
    """
    name, sep, text = entry.partition("=")
    try:
        value = kind(text)
    except ValueError:
        value = 0
    if not sep or not name or not value > 0 or not math.isfinite(value):
        example = "high-priority=4" if flag == "priority-weight" else "team-a=8"
        raise ValueError(f"--{flag} {entry!r}: expected name=value with a positive "
                         f"{kind.__name__} value, e.g. {example}")
    if flag == "namespace-gpu-quota" and not re.fullmatch(names.NAME_PATTERN, name):
        raise ValueError(f"--{flag} {entry!r}: {name!r} is not a namespace name (lowercase "
                         "letters, digits and '-'), e.g. team-a=8")
    return name, value


def resize_policy(options: Options) -> introspect.Policy | None:
    """When running jobs move (None: --no-resize, never)."""
    if not options.resize:
        return None
    return introspect.Policy(min_gain=options.resize_min_gain,
                             min_interval_seconds=options.resize_min_interval_seconds,
                             default_restart_seconds=options.resize_restart_seconds,
                             grow_price=options.resize_grow_price,
                             grow_load_exponent=options.resize_grow_load_exponent,
                             short_job_weight=options.resize_short_job_weight)
