"""`kiln operator`: run the Kiln operator against any Kubernetes API server.

Parses the options (every field of `settings.Options`: flag = field name with dashes, or
environment variable KILN_OPERATOR_<FIELD NAME>; a flag wins), builds the operator and runs
kopf. Installs no CRD (apply crds/trainingjob.yaml first).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import difflib
import functools
import logging
import math
import os
import re
import string
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kopf
import prometheus_client
import yaml

from kiln import api, contract
from kiln.controller import (
    admission,
    cache,
    gates,
    handlers,
    jobs,
    kube,
    kueue,
    leadership,
    lifecycle,
    metrics,
    parents,
    placement_loop,
    settings,
    zoo_access,
)
from kiln.placement import types
from kiln.zoo import eviction, store

_log = logging.getLogger(__name__)
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
ZOO_POD_ACCESS = ("presigned", "credentials")
# kopf decodes each watched object (json.loads) and copies and compares it (copy.deepcopy,
# ==) before any handler of Kiln's sees it, all recursively: one object nested 1,000 levels
# deep would raise RecursionError there, fail the watch, and stop the operator for every
# namespace. The API server stores objects up to api.API_SERVER_MAX_DEPTH levels deep, and
# each level costs at most two frames (deepcopy), so with this limit kopf reads any stored
# object and Kiln's own bound refuses it as InvalidSpec (`api.parse_job`). Python 3.11, the
# operator image's, counts json's C recursion against it too; the main thread's 8 MiB of stack
# holds it.
RECURSION_LIMIT = 2 * api.API_SERVER_MAX_DEPTH + 5_000

# (field of settings.Options, help). Flags are the field names with dashes.
_HELP: tuple[tuple[str, str], ...] = (
    ("kubeconfig", "kubeconfig file (default: $KUBECONFIG, else the pod's service account)"),
    ("namespaces", "namespace to watch, repeatable (default: all namespaces)"),
    ("zoo_uri", "model zoo: s3://bucket[/prefix] or a directory"),
    ("zoo_endpoint", ("S3 endpoint host:port or http(s)://host:port for the operator and the "
                      "trainer pods (default: $KILN_ZOO_ENDPOINT)")),
    ("zoo_secret", ("Secret in each job namespace with that namespace's zoo credentials for "
                    "its pods (only with --zoo-pod-access credentials)")),
    ("zoo_secret_access_key", "key of the access key in --zoo-secret"),
    ("zoo_secret_secret_key", "key of the secret key in --zoo-secret"),
    ("zoo_secret_session_token", ("key of an optional session token in --zoo-secret "
                                  "(temporary credentials)")),
    ("zoo_share", ("who sees models of jobs without spec.zoo.share: private (their "
                   "namespace) or shared (every namespace)")),
    ("zoo_pod_access", ("how pods reach an s3:// zoo: presigned (URLs for the job's own "
                        "objects and visible parents, no credential) or credentials "
                        "(each namespace's own, from --zoo-secret)")),
    ("zoo_access_hours", ("lifetime of presigned zoo URLs in hours (0.001 to 168; keep it "
                          "above a pod's start time; shorter when the operator's own "
                          "credential is temporary)")),
    ("zoo_retry_limit", "failed attempts to reach the zoo before a job cold-starts"),
    ("zoo_retry_delay_seconds", "wait after the first failed zoo attempt (doubles each time)"),
    ("zoo_retry_max_delay_seconds", "longest wait between zoo attempts"),
    ("zoo_request_attempts", "S3 requests tried per zoo attempt"),
    ("zoo_refresh_seconds", "re-list the zoo's models at most this often"),
    ("zoo_query_timeout_seconds", "deadline of one warm-start parent search"),
    ("zoo_capacity", ("the zoo's size budget, e.g. 10GiB: past it, the models worth least per "
                      "byte (decayed parent hits) are deleted, never a live job's parent "
                      "(default: no limit)")),
    ("zoo_gc_interval_seconds", "how often the zoo is held to --zoo-capacity"),
    ("zoo_hit_half_life_seconds", "a parent hit's weight in zoo eviction halves this often"),
    ("warm_start_graph_timeout_seconds", "deadline of tracing one job's model for its search"),
    ("default_image", "trainer image for jobs without spec.template.image"),
    ("image_pull_policy", "imagePullPolicy of trainer pods"),
    ("trainer_metrics_port", "the trainer's Prometheus port inside its pod"),
    ("trainer_service_account", "service account of trainer pods"),
    ("termination_grace_seconds", "time a stopped trainer has to checkpoint"),
    ("pod_start_timeout_seconds", ("fail a job whose trainer pod is not running this long after "
                                   "its launch, deleting the pod (0: wait forever)")),
    ("liveness_port", "port of the liveness endpoint /healthz (0: none)"),
    ("liveness_host", "interface of the liveness endpoint"),
    ("metrics_port", "port of the operator's Prometheus /metrics (0: none)"),
    ("metrics_host", "interface of /metrics"),
    ("placement_interval_seconds", "re-plan at least this often"),
    ("placement_time_limit_seconds", "MILP time limit per plan"),
    ("placement_use_milp", "solve the MILP (else the heuristic alone)"),
    ("placement_freeze_window_seconds", "planned starts this close keep their slot"),
    ("placement_objective", ("auto (makespan for a sweep, weighted completion time for "
                             "arrivals), makespan or completion-time")),
    ("namespace_gpu_quota", ("namespace=GPUs: most GPUs a namespace's jobs hold at once "
                             "(repeatable)")),
    ("priority_weights", "priorityClassName=weight in placement (repeatable; others 1)"),
    ("max_gpus_per_job", "most GPUs one job gets"),
    ("resize", "move running jobs by checkpoint-restart when it pays (--no-resize: never)"),
    ("resize_min_gain", "a move must save this many times its restart cost (>= 1)"),
    ("resize_min_interval_seconds", "a job that moved moves again only this much later"),
    ("resize_restart_seconds", "restart cost assumed until a job's own is measured"),
    ("resize_grow_price", ("a move onto more GPUs pays this many seconds of the job's time "
                           "x the pool's GPUs per extra GPU-second (0: free)")),
    ("resize_grow_load_exponent", ("--resize-grow-price is scaled by the pool's busy share "
                                   "(GPUs held plus each queued job's fewest, over all GPUs) "
                                   "to this power (0: a fixed price)")),
    ("resize_short_job_weight", ("a shrink counts a shorter job's saved wait up to this many "
                                 "times the shrunk job's seconds (>= 1)")),
    ("cpu_slots_per_node", "jobs a GPU-less node runs at once"),
    ("gpu_type", ("place jobs only on GPU nodes whose --gpu-type-label equals this "
                  "(default: any GPU node)")),
    ("gpu_type_label", "node label naming a node's GPU type"),
    ("gpu_resources", ("extended resource that counts as GPUs, e.g. nvidia.com/gpu, "
                       "nvidia.com/mig-1g.10gb or amd.com/gpu (repeatable; a node's GPUs are "
                       "the first it has; default nvidia.com/gpu)")),
    ("housekeeping_interval_seconds", "how often deadlines, TTLs and progress are checked"),
    ("progress_address", "trainer metrics address, from {pod_ip} {port} {pod} {namespace}"),
    ("progress_timeout_seconds", "timeout of one trainer metrics read"),
    ("profile_entrypoint_models", ("measure user-code models in a short pod of their image "
                                   "before placement")),
    ("profile_unmeasured", ("profile built-in models on a GPU type with no measurement of "
                            "the same model and batch yet")),
    ("profile_timeout_seconds", "the longest a profiling pod may run"),
    ("finalizer", ("put a finalizer on TrainingJobs so a deleted job waits for the operator "
                   "to delete its pods (default: none; the garbage collector deletes them "
                   "through their ownerReferences)")),
    ("peering", ("kopf peering name for leader election between replicas (default: "
                 "standalone, one replica); needs the chart's KopfPeering objects")),
    ("pod_security_context", "trainer pods' securityContext, a JSON object"),
    ("container_security_context", ("trainer container's securityContext, a JSON object "
                                    "(spec.template.securityContext keys win)")),
    ("kueue", ("Kueue admits jobs labelled kueue.x-k8s.io/queue-name (a Workload each); Kiln "
               "places them within Kueue's admission")),
    ("kueue_api_version", ("Kueue's Workload API version: auto (v1beta2 when the API server "
                           "serves it, else v1beta1), v1beta2 or v1beta1")),
    ("verbose", "debug logging"),
)


# Numeric options that must be > 0 (the rest must be >= 0; ports at most 65535), and upper
# bounds where a larger value breaks arithmetic (2 ** attempts backoffs) or means nothing.
_POSITIVE = {"zoo_request_attempts", "zoo_retry_max_delay_seconds", "zoo_query_timeout_seconds",
             "warm_start_graph_timeout_seconds",
             "placement_interval_seconds", "placement_time_limit_seconds", "max_gpus_per_job",
             "cpu_slots_per_node", "housekeeping_interval_seconds", "progress_timeout_seconds",
             "termination_grace_seconds", "profile_timeout_seconds",
             "zoo_gc_interval_seconds", "zoo_hit_half_life_seconds", "zoo_access_hours",
             "trainer_metrics_port"}  # every trainer pod declares it: containerPort 0 is refused
_MAXIMUM = {"zoo_request_attempts": 100, "zoo_retry_limit": 1000, "max_gpus_per_job": 64,
            "cpu_slots_per_node": 256, "termination_grace_seconds": 86400,
            "zoo_access_hours": 168,  # SigV4 signs URLs for at most 7 days
            # A pipe's poll takes at most 2**31 ms (24.8 days): a longer graph deadline raised
            # OverflowError in every warm-start search. A day is far past any model's tracing,
            # and past any profiling run (its pod's activeDeadlineSeconds).
            "warm_start_graph_timeout_seconds": 86400, "profile_timeout_seconds": 86400}
# Kubernetes label values and (optionally prefixed) keys, for --gpu-type and its label.
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
# Extended resources: a domain prefix and a name, e.g. nvidia.com/mig-1g.10gb.
_RESOURCE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/"
                       r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a DNS-1123 label
_PROGRESS_FIELDS = {"pod_ip", "port", "pod", "namespace"}
# A key of a Secret's data, as the zoo credential keys are.
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")
# The options that name objects every trainer pod refers to: a bad name is accepted here but
# the API server refuses every trainer pod the operator creates.
_OBJECT_NAMES = {"zoo_secret": "a Secret", "trainer_service_account": "a ServiceAccount"}


def _text(name: str) -> Any:
    """An argparse type for string options, checking those that have a shape."""
    def parse(text: str) -> str:
        if name == "namespaces" and not _NAMESPACE.match(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a namespace name (lowercase letters, digits and '-', at most "
                "63, starting and ending with a letter or digit), e.g. team-a")
        if name == "zoo_uri":  # before connecting; S3's settings are checked at the operator's start
            parts = urlsplit(text)
            if parts.scheme.lower() == "presigned":
                raise argparse.ArgumentTypeError(
                    f"{text!r}: a presigned manifest is how pods reach the zoo, not the "
                    "operator; give the zoo itself, s3://bucket[/prefix] or a directory")
            try:
                if parts.scheme.lower() != "s3":
                    store.open_store(text)  # a directory: contacts nothing
                elif not parts.netloc:
                    raise ValueError(f"zoo URI {text!r}: name the bucket, as in "
                                     "s3://bucket[/prefix]")
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
        if name == "zoo_endpoint":
            try:
                store.parse_endpoint(text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
        if name == "gpu_type" and not _LABEL_VALUE.match(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a node label value (letters, digits, '-', '_', '.'; at most "
                "63), e.g. NVIDIA-A100-SXM4-80GB")
        if name == "gpu_resources" and not _RESOURCE.match(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not an extended resource name (domain/name), e.g. amd.com/gpu "
                "or nvidia.com/mig-1g.10gb")
        if name == "gpu_type_label" and not _LABEL_KEY.match(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a label key, e.g. nvidia.com/gpu.product")
        if name == "progress_address":
            fields = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
            if not fields <= _PROGRESS_FIELDS:
                raise argparse.ArgumentTypeError(
                    f"unknown fields {sorted(fields - _PROGRESS_FIELDS)}; use "
                    "{pod_ip}, {port}, {pod}, {namespace}")
        if name.endswith("security_context"):
            try:
                settings.security_context(text, name.replace("_", "-"))
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc).split(" ", 1)[-1]) from None
        if name == "peering" and not _NAME.match(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not an object name (lowercase letters, digits, '-', '.'), "
                "e.g. kiln")
        if name == "zoo_capacity":
            try:
                eviction.parse_capacity(text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
        if name == "default_image" and (not text.strip() or re.search(r"\s", text)):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not an image reference (no spaces; the kubelet could not pull "
                f"it for any job), e.g. {settings.DEFAULT_IMAGE}")
        if name in _OBJECT_NAMES and not _NAME.match(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not the name of {_OBJECT_NAMES[name]} (lowercase letters, "
                "digits, '-', '.'; the API server would refuse every trainer pod), e.g. zoo-creds")
        if name.startswith("zoo_secret_") and not _SECRET_KEY.match(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a Secret key (letters, digits, '-', '_', '.'), e.g. accessKey")
        return text
    return parse


def _number(kind: type[int | float], name: str) -> Any:
    """An argparse type: a finite `kind` in the option's range, else a message saying so."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'a whole number' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if name in _POSITIVE and value <= 0:
            raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
        if name == "zoo_access_hours" and value < 0.001:
            raise argparse.ArgumentTypeError(
                f"must be at least 0.001 (3.6 s: S3 signs URLs for at least a second), got {text}")
        if name == "resize_min_gain" and value < 1:
            raise argparse.ArgumentTypeError(
                f"must be at least 1 (a move must save at least its restart cost), got {text}")
        if name == "resize_short_job_weight" and value < 1:
            raise argparse.ArgumentTypeError(
                f"must be at least 1 (1 counts every job's seconds alike), got {text}")
        if name.endswith("_port") and value > 65535:
            raise argparse.ArgumentTypeError(f"a port is at most 65535, got {text}")
        if name in _MAXIMUM and value > _MAXIMUM[name]:
            raise argparse.ArgumentTypeError(f"must be at most {_MAXIMUM[name]}, got {text}")
        return value
    return parse


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where there is none or the help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or "(default" in text:
            return text
        return super()._get_help_string(action) or text


def _checked_pair(flag: str, kind: type[int | float]) -> Callable[[str], str]:
    """An argparse type: a "name=value" entry checked at parse time (so a typo fails before
    the operator connects), kept as given."""
    def check(entry: str) -> str:
        try:
            settings.pair(entry, flag, kind)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).split(" ", 1)[-1]) from None
        return entry
    return check


ENV_PREFIX = "KILN_OPERATOR_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# Kubernetes gives pods a <SERVICE>_PORT=tcp://ip:port variable per Service in the namespace:
# the chart's Service kiln-operator-metrics yields --metrics-port's variable, not a setting.
_SERVICE_LINK = re.compile(r"^(tcp|udp|sctp)://")
# The other variables of such a Service: <SERVICE>_SERVICE_HOST, _PORT_9100_TCP_ADDR, ...
_SERVICE_VARIABLE = re.compile(r"_SERVICE_(HOST|PORT)(_[A-Z0-9_]+)?$|_PORT_\d+_(TCP|UDP|SCTP)")


def env_var(name: str) -> str:
    """The environment variable of `settings.Options` field `name`: ENV_PREFIX + `name` in
    capitals (zoo_uri: KILN_OPERATOR_ + ZOO_URI)."""
    return ENV_PREFIX + name.upper()


class _AppendOverEnv(argparse.Action):
    """action="append", except that the first flag replaces a list the environment gave (a
    flag wins over its variable, as for single-valued options)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        items = getattr(namespace, self.dest)
        setattr(namespace, self.dest, [*([] if items is self.default else items), values])


_LIST_EXAMPLES = {"namespaces": "team-a,team-b", "gpu_resources": "amd.com/gpu,nvidia.com/gpu",
                  "namespace_gpu_quota": "team-a=8,team-b=4",
                  "priority_weights": "high=4,low=0.5"}


def _apply_env(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Make each option's environment variable its default, read as its flag's value would
    be: lists comma-separated (namespaces: "team-a,team-b"), booleans true/false.

    Raises:
        ValueError: a value the flag would refuse; the message names the variable.
    """
    for action in parser._actions:  # argparse lists its options nowhere public
        variable = env_var(action.dest)
        if variable not in environ or not action.option_strings or action.dest == "help":
            continue
        text = environ[variable]
        if _SERVICE_LINK.match(text):
            continue
        try:
            if isinstance(action, argparse.BooleanOptionalAction):
                if text.strip().lower() not in _TRUE + _FALSE:
                    raise argparse.ArgumentTypeError(
                        f"expected one of {', '.join(_TRUE + _FALSE)}")
                action.default = text.strip().lower() in _TRUE
                continue
            convert = action.type if callable(action.type) else str
            if isinstance(action, _AppendOverEnv):
                action.default = [convert(item.strip()) for item in text.split(",")
                                  if item.strip()]
                if not action.default:  # "" or ",,": a typo, not a request for the default
                    raise argparse.ArgumentTypeError(
                        "an empty list; give comma-separated entries, e.g. "
                        f"{_LIST_EXAMPLES.get(action.dest, 'a,b')}")
                continue
            value = convert(text)
            if action.choices is not None and value not in action.choices:
                raise argparse.ArgumentTypeError(
                    f"invalid choice {text!r} (choose from {', '.join(map(str, action.choices))})")
            action.default = value
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise ValueError(f"environment variable {variable}={text!r}: {exc}; fix or unset it "
                             f"(or pass {action.option_strings[0]}, which wins)") from None


def build_parser(prog: str = "kiln operator", *,
                 environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The argument parser of `kiln operator` (every `settings.Options` field).

    A field's environment variable (`env_var`) in `environ` (default `os.environ`) replaces
    its default, so precedence is flag > variable > built-in default (`_apply_env`).

    Raises:
        ValueError: a variable's value is not one its flag takes (the message names it).
    """
    parser = argparse.ArgumentParser(
        prog=prog, description="Run the Kiln operator (kopf) against a Kubernetes API server. "
        f"Every flag can also be set by an environment variable, {ENV_PREFIX} and the flag's "
        f"name in capitals with underscores ({env_var('zoo_uri')}); the flag wins.",
        formatter_class=_HelpFormatter)
    defaults = settings.Options()
    fields = {f.name: f for f in dataclasses.fields(settings.Options)}
    for name, text in _HELP:
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        if name == "namespaces":
            parser.add_argument("--namespace", "-n", dest=name, action=_AppendOverEnv,
                                default=[], type=_text(name), help=text)
        elif name == "gpu_resources":
            parser.add_argument("--gpu-resource", dest=name, action=_AppendOverEnv, default=[],
                                type=_text(name), help=text)
        elif name in ("namespace_gpu_quota", "priority_weights"):
            flag = "--priority-weight" if name == "priority_weights" else flag
            parser.add_argument(flag, dest=name, action=_AppendOverEnv, default=[], help=text,
                                type=_checked_pair(flag.removeprefix("--"),
                                                   float if name == "priority_weights" else int))
        elif isinstance(default, bool):
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                default=default, help=text)
        elif name == "kubeconfig":
            parser.add_argument(flag, dest=name, type=Path, default=None, help=text)
        else:
            kind: Any = type(default) if default is not None else str
            kind = _number(kind, name) if kind in (int, float) else _text(name)
            choices = (PULL_POLICIES if name == "image_pull_policy" else
                       types.OBJECTIVES if name == "placement_objective" else
                       [str(v) for v in api.ZooShare] if name == "zoo_share" else
                       ZOO_POD_ACCESS if name == "zoo_pod_access" else
                       (kueue.AUTO, *kueue.VERSIONS) if name == "kueue_api_version" else None)
            parser.add_argument(flag, dest=name, type=kind, default=default, help=text,
                                choices=choices)
        assert name in fields, name
    _apply_env(parser, os.environ if environ is None else environ)
    return parser


def options_from_args(args: argparse.Namespace) -> settings.Options:
    """`settings.Options` from parsed arguments.

    Raises:
        ValueError: options that cannot work together (the message names the flags).
    """
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(settings.Options)
              if hasattr(args, f.name)}
    for name in ("namespaces", "namespace_gpu_quota", "priority_weights"):
        values[name] = tuple(values.get(name) or ())
    if "gpu_resources" in values:  # repeated flags, without duplicates; none: the default
        values["gpu_resources"] = (tuple(dict.fromkeys(values["gpu_resources"]))
                                   or settings.Options.gpu_resources)
    options = settings.Options(**values)
    # Both servers bind at start, /metrics first: kopf's liveness endpoint then failed to bind
    # inside kopf, after the operator had connected.
    if options.metrics_port and options.metrics_port == options.liveness_port:
        raise ValueError(f"--metrics-port and --liveness-port are both {options.metrics_port}; "
                         "give the two endpoints different ports (0 turns one off)")
    return options


def build(options: settings.Options, connection: kopf.ConnectionInfo, *,
          clock: Callable[[], float] = time.time,
          peering_priority: int = 0) -> handlers.Operator:
    """The operator's parts, wired together; nothing is contacted yet.

    The admission gate is Kueue's under ``options.kueue``, else `gates.Open`. With
    ``options.peering``, the placement loop plans only while this replica, of kopf peering
    priority `peering_priority`, leads (`leadership.leading`).

    Raises:
        ValueError: the zoo URI or the zoo settings in the environment are unusable.
    """
    registry = metrics.OperatorMetrics()
    client = kube.Client(connection, relogin=lambda: kube.connection_info(
        kubeconfig=options.kubeconfig))
    env = dict(os.environ)
    if options.zoo_endpoint:
        env[contract.Env.ZOO_ENDPOINT] = options.zoo_endpoint
    elif env.get(contract.Env.ZOO_ENDPOINT):  # trainer pods must reach the zoo the operator uses
        options = dataclasses.replace(options, zoo_endpoint=env[contract.Env.ZOO_ENDPOINT])
    zoo = parents.open_zoo(options.zoo_uri, env=env, retry=store.RetryPolicy(
        attempts=options.zoo_request_attempts, first_backoff_seconds=0.5))
    chooser = parents.ParentChooser(
        zoo, metrics=registry, refresh_seconds=options.zoo_refresh_seconds,
        query_timeout_seconds=options.zoo_query_timeout_seconds,
        graph_timeout_seconds=options.warm_start_graph_timeout_seconds,
        index_start_method="forkserver")
    pod_settings = settings.pod_settings(options)
    caches = cache.Caches()
    job_store = jobs.Jobs(client, metrics=registry, clock=clock)

    def step(call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        # The loop's callbacks are job steps: they take `deps`, which holds the loop.
        return lambda *args: call(deps, *args)

    placement = placement_loop.PlacementLoop(
        client=client, settings=loop_settings(options),
        launch=step(lifecycle.launch), resize=step(lifecycle.resize),
        publish=step(lifecycle.publish_plan), unplaceable=step(lifecycle.mark_unplaceable),
        zoo_records=chooser.records, metrics=registry, clock=clock,
        eta_seconds=caches.eta_seconds,
        leading=functools.partial(
            leadership.leading, client,
            leadership.peering_paths(options.peering, options.namespaces),
            priority=peering_priority) if options.peering else None,
        hold=lambda entry: gate.holds(entry))
    gate: gates.Gate = gates.Open()
    if options.kueue:
        gate = kueue.Kueue(client=client, jobs=job_store, placement=placement, options=options,
                           clock=clock, profile=lambda ref, grant: admission.profile_admitted(
                               deps, ref, grant))
    deps = lifecycle.Deps(
        options=options, pod_settings=pod_settings, client=client, jobs=job_store,
        placement=placement, caches=caches, parents=chooser,
        zoo_access=zoo_access.ZooAccess(zoo, client, settings=pod_settings,
                                        lifetime_hours=options.zoo_access_hours, clock=clock,
                                        max_gpus=options.max_gpus_per_job),
        metrics=registry, clock=clock)
    return handlers.Operator(deps=deps, gate=gate)


def loop_settings(options: settings.Options) -> placement_loop.LoopSettings:
    """What the placement loop needs from the options."""
    return placement_loop.LoopSettings(
        interval_seconds=options.placement_interval_seconds,
        cpu_slots=options.cpu_slots_per_node, max_gpus=options.max_gpus_per_job,
        planner=settings.placement_settings(options), gpu_type=settings.gpu_type(options),
        gpu_type_label=options.gpu_type_label, gpu_resources=options.gpu_resources,
        resize=settings.resize_policy(options),
        priority_weights=settings.priority_weights(options))


class ApiUnreachable(RuntimeError):
    """The API server does not accept connections (exit 1: a Deployment restarts us)."""


def run(options: settings.Options) -> None:
    """Run the operator until SIGINT/SIGTERM.

    Resolves the credentials (``--kubeconfig``, $KUBECONFIG, else the pod's service account),
    builds the operator (`build`), registers the handlers, serves /metrics, and runs kopf (standalone,
    or peering under ``--peering``; cluster-wide or on the given namespaces; liveness on
    /healthz).

    Raises:
        kopf.LoginError: no credentials (no kubeconfig and not in a pod).
        ApiUnreachable: no connection to the API server opens (after a few seconds of tries).
        ValueError: unusable zoo settings, or /metrics cannot be served at --metrics-host and
            --metrics-port.
    """
    logging.basicConfig(level=logging.DEBUG if options.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not options.verbose:
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
        logging.getLogger("kopf.objects").addFilter(_quiet_timers)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), RECURSION_LIMIT))
    connection = kube.connection_info(kubeconfig=options.kubeconfig)
    problem = asyncio.run(kube.unreachable(connection))
    if problem:
        raise ApiUnreachable(f"{problem}; check --kubeconfig (or KUBECONFIG) and the cluster")
    if options.kueue:  # the Workload API version, before the handlers watch it
        version, warning = kueue.choose_version(asyncio.run(kueue.served_versions(connection)),
                                                options.kueue_api_version)
        if warning:
            _log.warning("Kueue: %s", warning)
        options = dataclasses.replace(options, kueue_api_version=version)
    # Peering (--peering): the oldest replica leads; the others wait, paused by kopf.
    priority = leadership.start_priority(time.time())
    operator = build(options, connection, peering_priority=priority)
    registry = kopf.OperatorRegistry()
    handlers.register(registry, options, operator.gate)
    if options.metrics_port:
        try:
            prometheus_client.start_http_server(options.metrics_port, addr=options.metrics_host,
                                                registry=operator.deps.metrics.registry)
        except OSError as exc:  # no such interface (socket.gaierror), or the port is taken
            raise ValueError(f"--metrics-host {options.metrics_host} --metrics-port "
                             f"{options.metrics_port}: cannot serve /metrics there ({exc}); "
                             "give an interface of this host (0.0.0.0 for all) and a free "
                             "port") from None
    liveness = (f"http://{options.liveness_host}:{options.liveness_port}/healthz"
                if options.liveness_port else None)
    _log.info("Kiln operator: API server %s, %s, zoo %s", connection.server,
              f"namespaces {', '.join(options.namespaces)}" if options.namespaces
              else "all namespaces", options.zoo_uri)
    kopf.run(registry=registry, standalone=options.peering is None,
             peering_name=options.peering, priority=priority if options.peering else None,
             clusterwide=not options.namespaces,
             namespaces=options.namespaces, liveness_endpoint=liveness,
             memo=kopf.Memo(operator=operator))


def _quiet_timers(record: logging.LogRecord) -> bool:
    """Drop kopf's "Timer 'housekeeping' succeeded." line (one per job per interval), and the
    no-finalizer deletion watcher's (one per job event; it acts on deletions only)."""
    message = record.getMessage()
    return not ((message.startswith("Timer ") and message.endswith(" succeeded."))
                or message == "Handler 'cleanup-job' succeeded.")


def main(argv: Sequence[str] | None = None, *, prog: str = "kiln operator") -> int:
    """Parse `argv` and run the operator; returns the process exit code."""
    try:
        parser = build_parser(prog)
    except ValueError as exc:  # a bad KILN_OPERATOR_* variable
        print(f"{prog}: error: {exc}")
        return 2
    for warning in unknown_variables(parser, os.environ):
        print(f"{prog}: warning: {warning}", file=sys.stderr)
    args = parser.parse_args(argv)
    if args.kubeconfig is not None:
        problem = _unreadable_kubeconfig(Path(args.kubeconfig))
        if problem:
            source = (env_var("kubeconfig") if args.kubeconfig == parser.get_default("kubeconfig")
                      else "--kubeconfig")
            print(f"{prog}: error: {source} {args.kubeconfig}: {problem}")
            return 2
    try:
        run(options_from_args(args))
    except (kopf.LoginError, ValueError) as exc:
        print(f"{prog}: error: {exc}")
        return 2
    except ApiUnreachable as exc:
        print(f"{prog}: error: {exc}")
        return 1
    return 0


def unknown_variables(parser: argparse.ArgumentParser,
                      environ: Mapping[str, str]) -> list[str]:
    """A warning for each KILN_OPERATOR_* variable that sets nothing (a typo, e.g. the singular
    of ..._NAMESPACES, would otherwise be ignored silently), naming the nearest setting."""
    known = {env_var(action.dest) for action in parser._actions if action.option_strings}
    warnings = []
    for variable in sorted(environ):
        if (not variable.startswith(ENV_PREFIX) or variable in known
                or _SERVICE_LINK.match(environ[variable]) or _SERVICE_VARIABLE.search(variable)):
            continue
        nearest = difflib.get_close_matches(variable, known, n=1)
        warnings.append(f"environment variable {variable} is not a setting and is ignored"
                        + (f"; did you mean {nearest[0]}?" if nearest else ""))
    return warnings


def _unreadable_kubeconfig(path: Path) -> str | None:
    """Why `path` cannot be a kubeconfig (missing, unreadable, not a YAML mapping), or None."""
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        return f"cannot read it ({exc.strerror}); pass an existing kubeconfig file"
    except yaml.YAMLError as exc:
        return f"not valid YAML ({exc.__class__.__name__}); pass a kubeconfig file"
    if not isinstance(document, dict):
        return "not a kubeconfig (expected a YAML mapping with clusters, users, contexts)"
    return None
