"""The Helm chart through the real Helm library: lint it, and install it into the emulator.

Each call runs `helm_worker` in a subprocess with ``HELM_DRIVER=memory``; `install` returns what
Helm rendered and what the API server received. No upgrades, no hooks.
"""

# Helm is the Go library bundled by ``helm-sdkpy`` (no ``helm`` binary is installable here).
# `install` starts a fresh `emulator.Emulator` that also serves the Prometheus Operator's
# ServiceMonitor and PodMonitor kinds, then runs ``helm install`` against it over HTTP (CRDs from
# the chart's crds/, then every template).

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import kmock
import yaml

from kubesim import emulator

CHART = Path(__file__).resolve().parents[2] / "helm" / "kiln"
WORKER = Path(__file__).with_name("helm_worker.py")
TIMEOUT_SECONDS = 180.0
MONITORING_RESOURCES = {
    f"monitoring.coreos.com/v1/{plural}": kmock.ResourceInfo(
        kind=kind, singular=kind.lower(), namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"})
    for plural, kind in (("servicemonitors", "ServiceMonitor"), ("podmonitors", "PodMonitor"))
}
# kopf's peering kinds (the chart's crds/kopf-peering.yaml), for replicaCount above 1.
PEERING_RESOURCES = {
    f"kopf.dev/v1/{plural}": kmock.ResourceInfo(
        kind=kind, singular=kind.lower(), namespaced=namespaced,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"})
    for plural, kind, namespaced in (("kopfpeerings", "KopfPeering", True),
                                     ("clusterkopfpeerings", "ClusterKopfPeering", False))
}


# What every install must set (the chart refuses to install without a zoo endpoint).
REQUIRED_VALUES: dict[str, Any] = {
    "zoo": {"endpoint": "minio.example:9000", "existingSecret": "kiln-zoo"}}


class HelmFailed(Exception):
    """Helm refused: the message is Helm's own (e.g. a values.schema.json violation)."""


@dataclasses.dataclass(frozen=True)
class Release:
    """An installed release.

    Attributes:
        manifests: the rendered template documents, in Helm's order (CRDs not included).
        crds: the CRD documents Helm installed from the chart's crds/ folder.
        notes: the rendered NOTES.txt.
        created: (apiVersion/kind, namespace, name) of every object the API server received.
    """

    manifests: list[dict[str, Any]]
    crds: list[dict[str, Any]]
    notes: str
    created: set[tuple[str, str, str]]

    def grants(self) -> set[tuple[str, str, str]]:
        """(group, resource, verb) granted by all of the release's ClusterRoles and Roles."""
        roles = self.of_kind("ClusterRole") + self.of_kind("Role")
        return set().union(*(rule_grants(role["rules"]) for role in roles))

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        """The rendered documents of `kind`."""
        return [m for m in self.manifests if m.get("kind") == kind]

    def one(self, kind: str, name_suffix: str = "") -> dict[str, Any]:
        """The one rendered document of `kind` whose name ends with `name_suffix`."""
        found = [m for m in self.of_kind(kind) if m["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, f"{len(found)} {kind} named *{name_suffix}"
        return found[0]


def rule_grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(group, resource, verb) triples of RBAC rules.

    Raises:
        AssertionError: a rule uses a wildcard (never least privilege).
    """
    found = set()
    for rule in rules:
        for part in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[part], f"wildcard in {rule}"
        found |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"]
                  for v in rule["verbs"]}
    return found


def _run(args: list[str]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(WORKER), *args], capture_output=True, text=True,
        timeout=TIMEOUT_SECONDS, env={**os.environ, "HELM_DRIVER": "memory"}, check=False)
    try:
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise RuntimeError(f"helm worker exited {done.returncode}: {done.stderr[-2000:]}"
                           ) from None
    if done.returncode != 0:
        raise HelmFailed(result.get("error", ""))
    return result


def lint(chart: Path = CHART) -> dict[str, Any]:
    """``helm lint`` of `chart`: Helm's result ({"Messages": [...], "Errors": ...})."""
    return _run(["lint", str(chart)])


def install(values: dict[str, Any] | None = None, *, namespace: str = "kiln-system",
            release: str = "kiln", chart: Path = CHART, required: bool = True) -> Release:
    """``helm install`` of `chart` with `values` into a fresh emulator.

    `values` go over `REQUIRED_VALUES` (deep merge) unless `required` is False.

    Raises:
        HelmFailed: Helm refused the values or the rendered objects.
    """
    with emulator.Emulator(extra_resources=MONITORING_RESOURCES | PEERING_RESOURCES) as cluster:
        kubeconfig = cluster.write_kubeconfig(
            Path(os.environ.get("TMPDIR", "/tmp")) / f"kiln-helm-{os.getpid()}.kubeconfig")
        try:
            given = _merged(REQUIRED_VALUES, values or {}) if required else values or {}
            result = _run(["install", str(chart), release, namespace, str(kubeconfig),
                           json.dumps(given)])
        finally:
            kubeconfig.unlink(missing_ok=True)
        created = {(f"{r.body.get('apiVersion')}/{r.body.get('kind')}", r.namespace or "",
                    str((r.body.get("metadata") or {}).get("name")))
                   for r in cluster.requests
                   if r.method == "POST" and isinstance(r.body, dict)}
    manifests = [d for d in yaml.safe_load_all(result.get("manifest") or "") if d]
    crds = [d for d in yaml.safe_load_all(_chart_crds(chart)) if d]
    return Release(manifests=manifests, crds=crds,
                   notes=str((result.get("info") or {}).get("notes") or ""), created=created)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        merged[key] = (_merged(merged[key], value)
                       if isinstance(value, dict) and isinstance(merged.get(key), dict) else value)
    return merged


def _chart_crds(chart: Path) -> str:
    return "\n---\n".join(p.read_text(encoding="utf-8")
                          for p in sorted((chart / "crds").glob("*.yaml")))
