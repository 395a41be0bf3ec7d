"""`kiln operator`: run the Kiln operator against any Kubernetes API server.

Parses the options (every field of `settings.Options`, flag = field name with dashes), builds
the services and runs kopf. Installs no CRD (apply crds/trainingjob.yaml first).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import math
import os
import re
import string
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import kopf
import prometheus_client
import yaml

from kiln import contract
from kiln.controller import (
    handlers,
    jobs,
    kube,
    lifecycle,
    metrics,
    parents,
    placement_loop,
    services,
    settings,
)
from kiln.placement import types
from kiln.warmstart import index as zoo_index
from kiln.zoo import store

_log = logging.getLogger(__name__)
PULL_POLICIES = ("Always", "IfNotPresent", "Never")

# (field of settings.Options, help). Flags are the field names with dashes.
_HELP: tuple[tuple[str, str], ...] = (
    ("kubeconfig", "kubeconfig file (default: $KUBECONFIG, else the pod's service account)"),
    ("namespaces", "namespace to watch, repeatable (default: all namespaces)"),
    ("zoo_uri", "model zoo: s3://bucket[/prefix] or a directory"),
    ("zoo_endpoint", ("S3 endpoint host:port or http(s)://host:port for the operator and the "
                      "trainer pods (default: $KILN_ZOO_ENDPOINT)")),
    ("zoo_secret", "Secret in each job namespace with the zoo credentials for trainer pods"),
    ("zoo_secret_access_key", "key of the access key in --zoo-secret"),
    ("zoo_secret_secret_key", "key of the secret key in --zoo-secret"),
    ("zoo_retry_limit", "failed attempts to reach the zoo before a job cold-starts"),
    ("zoo_retry_delay_seconds", "wait after the first failed zoo attempt (doubles each time)"),
    ("zoo_retry_max_delay_seconds", "longest wait between zoo attempts"),
    ("zoo_request_attempts", "S3 requests tried per zoo attempt"),
    ("zoo_refresh_seconds", "re-list the zoo's models at most this often"),
    ("zoo_query_timeout_seconds", "deadline of one warm-start parent search"),
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
    ("cpu_slots_per_node", "jobs a GPU-less node runs at once"),
    ("gpu_type", ("place jobs only on GPU nodes whose --gpu-type-label equals this "
                  "(default: any GPU node)")),
    ("gpu_type_label", "node label naming a node's GPU type"),
    ("housekeeping_interval_seconds", "how often deadlines, TTLs and progress are checked"),
    ("progress_address", "trainer metrics address, from {pod_ip} {port} {pod} {namespace}"),
    ("progress_timeout_seconds", "timeout of one trainer metrics read"),
    ("profile_entrypoint_models", ("measure user-code models in a short pod of their image "
                                   "before placement")),
    ("profile_unmeasured", ("profile built-in models on a GPU type with no measurement of "
                            "the same model and batch yet")),
    ("profile_timeout_seconds", "the longest a profiling pod may run"),
    ("verbose", "debug logging"),
)


# Numeric options that must be > 0 (the rest must be >= 0; ports at most 65535), and upper
# bounds where a larger value breaks arithmetic (2 ** attempts backoffs) or means nothing.
_POSITIVE = {"zoo_request_attempts", "zoo_retry_max_delay_seconds", "zoo_query_timeout_seconds",
             "warm_start_graph_timeout_seconds",
             "placement_interval_seconds", "placement_time_limit_seconds", "max_gpus_per_job",
             "cpu_slots_per_node", "housekeeping_interval_seconds", "progress_timeout_seconds",
             "termination_grace_seconds", "profile_timeout_seconds"}
_MAXIMUM = {"zoo_request_attempts": 100, "zoo_retry_limit": 1000, "max_gpus_per_job": 64,
            "cpu_slots_per_node": 256, "termination_grace_seconds": 86400}
# Kubernetes label values and (optionally prefixed) keys, for --gpu-type and its label.
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_PROGRESS_FIELDS = {"pod_ip", "port", "pod", "namespace"}


def _text(name: str) -> Any:
    """An argparse type for string options, checking those that have a shape."""
    def parse(text: str) -> str:
        if name == "gpu_type" and not _LABEL_VALUE.match(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a node label value (letters, digits, '-', '_', '.'; at most "
                "63), e.g. NVIDIA-A100-SXM4-80GB")
        if name == "gpu_type_label" and not _LABEL_KEY.match(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a label key, e.g. nvidia.com/gpu.product")
        if name == "progress_address":
            fields = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
            if not fields <= _PROGRESS_FIELDS:
                raise argparse.ArgumentTypeError(
                    f"unknown fields {sorted(fields - _PROGRESS_FIELDS)}; use "
                    "{pod_ip}, {port}, {pod}, {namespace}")
        if name == "default_image" and not text.strip():
            raise argparse.ArgumentTypeError("an image is needed, e.g. "
                                             f"{settings.DEFAULT_IMAGE}")
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
        if name == "resize_min_gain" and value < 1:
            raise argparse.ArgumentTypeError(
                f"must be at least 1 (a move must save at least its restart cost), got {text}")
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


def build_parser(prog: str = "kiln operator") -> argparse.ArgumentParser:
    """The argument parser of `kiln operator` (every `settings.Options` field)."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Run the Kiln operator (kopf) against a Kubernetes API server.",
        formatter_class=_HelpFormatter)
    defaults = settings.Options()
    fields = {f.name: f for f in dataclasses.fields(settings.Options)}
    for name, text in _HELP:
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        if name == "namespaces":
            parser.add_argument("--namespace", "-n", dest=name, action="append", default=[],
                                help=text)
        elif name in ("namespace_gpu_quota", "priority_weights"):
            flag = "--priority-weight" if name == "priority_weights" else flag
            parser.add_argument(flag, dest=name, action="append", default=[], help=text,
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
                       types.OBJECTIVES if name == "placement_objective" else None)
            parser.add_argument(flag, dest=name, type=kind, default=default, help=text,
                                choices=choices)
        assert name in fields, name
    return parser


def options_from_args(args: argparse.Namespace) -> settings.Options:
    """`settings.Options` from parsed arguments."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(settings.Options)
              if hasattr(args, f.name)}
    for name in ("namespaces", "namespace_gpu_quota", "priority_weights"):
        values[name] = tuple(values.get(name) or ())
    return settings.Options(**values)


def build_services(options: settings.Options, connection: kopf.ConnectionInfo, *,
                   clock: Callable[[], float] = time.time) -> services.Services:
    """The operator's services, wired to the lifecycle steps; nothing is contacted yet.

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
        index_settings=zoo_index.IndexSettings(start_method="forkserver",
                                             maintain_clusters=True))
    svc = services.Services(
        options=options, connection=connection, metrics=registry, client=client,
        jobs=jobs.Jobs(client, metrics=registry, clock=clock), parents=chooser,
        pod_settings=settings.pod_settings(options), clock=clock, eta_seconds={})
    svc.placement = placement_loop.PlacementLoop(
        client=client,
        settings=placement_loop.LoopSettings(
            interval_seconds=options.placement_interval_seconds,
            cpu_slots=options.cpu_slots_per_node, max_gpus=options.max_gpus_per_job,
            planner=settings.placement_settings(options),
            gpu_type=settings.gpu_type(options), gpu_type_label=options.gpu_type_label,
            resize=settings.resize_policy(options), priority_weights=settings.priority_weights(options)),
        launch=functools.partial(lifecycle.launch, svc),
        resize=functools.partial(lifecycle.resize, svc),
        publish=functools.partial(lifecycle.publish_plan, svc),
        unplaceable=functools.partial(lifecycle.mark_unplaceable, svc),
        zoo_records=chooser.records, metrics=registry, clock=clock,
        eta_seconds=svc.eta_seconds)
    return svc


class ApiUnreachable(RuntimeError):
    """The API server does not accept connections (exit 1: a Deployment restarts us)."""


def run(options: settings.Options) -> None:
    """Run the operator until SIGINT/SIGTERM.

    Resolves the credentials (``--kubeconfig``, $KUBECONFIG, else the pod's service account),
    builds the services, registers the handlers, serves /metrics, and runs kopf (standalone,
    cluster-wide or on the given namespaces, liveness on /healthz).

    Raises:
        kopf.LoginError: no credentials (no kubeconfig and not in a pod).
        ApiUnreachable: no connection to the API server opens (after a few seconds of tries).
        ValueError: unusable zoo settings.
    """
    logging.basicConfig(level=logging.DEBUG if options.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not options.verbose:
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
        logging.getLogger("kopf.objects").addFilter(_quiet_timers)
    connection = kube.connection_info(kubeconfig=options.kubeconfig)
    problem = asyncio.run(kube.unreachable(connection))
    if problem:
        raise ApiUnreachable(f"{problem}; check --kubeconfig (or KUBECONFIG) and the cluster")
    svc = build_services(options, connection)
    registry = kopf.OperatorRegistry()
    handlers.register(registry, options)
    if options.metrics_port:
        prometheus_client.start_http_server(options.metrics_port, addr=options.metrics_host,
                                            registry=svc.metrics.registry)
    liveness = (f"http://{options.liveness_host}:{options.liveness_port}/healthz"
                if options.liveness_port else None)
    _log.info("Kiln operator: API server %s, %s, zoo %s", connection.server,
              f"namespaces {', '.join(options.namespaces)}" if options.namespaces
              else "all namespaces", options.zoo_uri)
    kopf.run(registry=registry, standalone=True, clusterwide=not options.namespaces,
             namespaces=options.namespaces, liveness_endpoint=liveness,
             memo=kopf.Memo(services=svc))


def _quiet_timers(record: logging.LogRecord) -> bool:
    """Drop kopf's "Timer 'housekeeping' succeeded." line (one per job per interval)."""
    message = record.getMessage()
    return not (message.startswith("Timer ") and message.endswith(" succeeded."))


def main(argv: Sequence[str] | None = None, *, prog: str = "kiln operator") -> int:
    """Parse `argv` and run the operator; returns the process exit code."""
    args = build_parser(prog).parse_args(argv)
    if args.kubeconfig is not None:
        problem = _unreadable_kubeconfig(Path(args.kubeconfig))
        if problem:
            print(f"{prog}: error: --kubeconfig {args.kubeconfig}: {problem}")
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
