"""spec.template against the Kubernetes pod schema (`api.pod_schema_problems`, read from the
kubernetes client's OpenAPI models): misspelt keys at any depth are named with their path and
the key meant, and every template problem shows at once."""

from __future__ import annotations

from typing import Any

import pytest

from kiln import api

TERM = ("spec.template.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0]")


def _problems(**template: Any) -> list[str]:
    doc = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "x"},
           "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                    "template": template}}
    with pytest.raises(api.InvalidSpec) as caught:
        api.parse_job(doc)
    return caught.value.problems


@pytest.mark.parametrize(("template", "problem"), [
    pytest.param({"affinity": {"nodeAfinity": {}}},
                 "spec.template.affinity.nodeAfinity: unknown field of a Kubernetes Affinity; "
                 "did you mean 'nodeAffinity'?", id="affinity"),
    pytest.param({"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpresions": [{"key": "gpu", "operator": "Exists"}]}]}}}},
        f"{TERM}.matchExpresions: unknown field of a Kubernetes NodeSelectorTerm; did you "
        "mean 'matchExpressions'?", id="affinity-deep"),
    pytest.param({"tolerations": [{"key": "gpu", "operator": "Exists", "efect": "NoSchedule"}]},
                 "spec.template.tolerations[0].efect: unknown field of a Kubernetes Toleration; "
                 "did you mean 'effect'?", id="toleration"),
    pytest.param({"tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoExecute",
                                   "tolerationSeconds": "60"}]},
                 "spec.template.tolerations[0].tolerationSeconds: must be an integer (got '60')",
                 id="toleration-seconds-quoted"),
    pytest.param({"resources": {"limts": {"memory": "8Gi"}}},
                 "spec.template.resources.limts: unknown; use limits or requests",
                 id="resources"),
    pytest.param({"initContainers": [{"name": "fetch", "image": "busybox:1.36",
                                      "resources": {"request": {"cpu": "1"}}}]},
                 "spec.template.initContainers[0].resources.request: unknown field of a "
                 "Kubernetes ResourceRequirements; did you mean 'requests'?",
                 id="init-container-resources"),
    pytest.param({"volumes": [{"name": "data", "persistentVolumeClaim": {"claimname": "d"}}],
                  "volumeMounts": [{"name": "data", "mountPath": "/data"}]},
                 "spec.template.volumes[0].persistentVolumeClaim.claimname: unknown field of a "
                 "Kubernetes PersistentVolumeClaimVolumeSource; did you mean 'claimName'?",
                 id="volume-source"),
    pytest.param({"securityContext": {"runAsNonroot": True}},
                 "spec.template.securityContext.runAsNonroot: unknown field of a Kubernetes "
                 "SecurityContext; did you mean 'runAsNonRoot'?", id="container-security"),
    pytest.param({"podSecurityContext": {"fsgroup": 1000}},
                 "spec.template.podSecurityContext.fsgroup: unknown field of a Kubernetes "
                 "PodSecurityContext; did you mean 'fsGroup'?", id="pod-security"),
    pytest.param({"env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s",
                                                                           "ky": "t"}}}]},
                 "spec.template.env[0].valueFrom.secretKeyRef.ky: unknown field of a Kubernetes "
                 "SecretKeySelector; did you mean 'key'?", id="env-secret-ref"),
    pytest.param({"affinity": {"podAffinity": []}},
                 "spec.template.affinity.podAffinity: must be a mapping of PodAffinity fields "
                 "(got a list)", id="shape"),
])
def test_a_template_is_checked_against_the_kubernetes_pod_schema(
        template: dict[str, Any], problem: str) -> None:
    problems = _problems(**template)
    assert problem in problems
    field = problem.split(":", 1)[0]
    assert [p for p in problems if p.startswith(f"{field}:")] == [problem]  # said once


def test_a_template_kubernetes_accepts_passes() -> None:
    template = {
        "image": "trainer:1", "imagePullPolicy": "IfNotPresent",
        "resources": {"requests": {"cpu": 2, "memory": "8Gi"}},
        "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": 1}}],
        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule",
                         "tolerationSeconds": None}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 10, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                               "labelSelector": {"matchLabels": {"a": "b"}}}}]}},
        "initContainers": [{"name": "fetch", "image": "busybox:1.36",
                            "ports": [{"containerPort": 80}],
                            "livenessProbe": {"httpGet": {"port": "http", "path": "/"}}}],
    }
    assert api.pod_schema_problems(template["initContainers"], "list[V1Container]", "x") == []
    doc = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "x"},
           "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                    "template": template}}
    assert api.parse_job(doc).spec.template == template


def test_every_template_problem_shows_at_once() -> None:
    problems = _problems(nodeAfinity={}, image=7,
                         tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedle",
                                       "efect": "NoSchedule"}],
                         resources={"limits": {"cpu": "lots"}})
    fields = [p.split(":", 1)[0] for p in problems]
    assert sorted(fields) == sorted([
        "spec.template.nodeAfinity", "spec.template.image",
        "spec.template.tolerations[0].effect", "spec.template.tolerations[0].efect",
        "spec.template.resources.limits.cpu"]), problems
    assert "did you mean 'affinity'?" in problems[fields.index("spec.template.nodeAfinity")]


def test_template_keys_have_their_types_in_a_pod() -> None:
    types = api.template_pod_types()
    assert set(types) == set(api.TEMPLATE_KEYS)
    assert (types["tolerations"], types["affinity"], types["podSecurityContext"]) == (
        "list[V1Toleration]", "V1Affinity", "V1PodSecurityContext")


@pytest.mark.parametrize(("template", "field"), [
    pytest.param({"labels": {"version": 2}}, "spec.template.labels.version", id="label"),
    pytest.param({"annotations": {"prometheus.io/port": 8080}},
                 "spec.template.annotations.prometheus.io/port", id="annotation"),
    pytest.param({"volumes": [{"name": "c", "configMap": {"name": 7}}],
                  "volumeMounts": [{"name": "c", "mountPath": "/c"}]},
                 "spec.template.volumes[0].configMap.name", id="configmap-name"),
    pytest.param({"env": [{"name": "P", "valueFrom": {"fieldRef": {"fieldPath": 1}}}]},
                 "spec.template.env[0].valueFrom.fieldRef.fieldPath", id="field-path"),
])
def test_a_number_where_kubernetes_wants_a_string_is_refused(template: dict[str, Any],
                                                             field: str) -> None:
    problems = _problems(**template)
    assert [p for p in problems if p.startswith(f"{field}:")] == [
        f"{field}: must be a string (got {next(_numbers(template))!r}); quote it"], problems


def _numbers(value: Any) -> Any:
    if isinstance(value, dict | list):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _numbers(item)
    elif isinstance(value, int) and not isinstance(value, bool):
        yield value


def test_a_realistic_template_kubernetes_accepts_passes() -> None:
    """Quantities as numbers and strings, anti-affinity, capabilities, a sidecar, and volumes
    of several kinds: nothing Kubernetes takes is refused."""
    template = {
        "resources": {"requests": {"cpu": "4", "memory": "16Gi"},
                      "limits": {"cpu": 8, "memory": 34359738368, "ephemeral-storage": 1.5e10}},
        "env": [{"name": "MEM", "valueFrom": {"resourceFieldRef": {
            "resource": "limits.memory", "divisor": 1}}}],
        "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "podSecurityContext": {"fsGroup": 1000, "supplementalGroups": [2000],
                               "sysctls": [{"name": "net.core.somaxconn", "value": "1024"}]},
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchExpressions": [
                {"key": "app", "operator": "In", "values": ["train"]}]},
             "topologyKey": "kubernetes.io/hostname", "matchLabelKeys": ["run"]}]}},
        "volumes": [
            {"name": "mem", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
            {"name": "cfg", "configMap": {"name": "cfg", "defaultMode": 0o644,
                                          "items": [{"key": "a", "path": "a.yaml"}]}},
            {"name": "proj", "projected": {"sources": [
                {"serviceAccountToken": {"audience": "vault", "expirationSeconds": 3600,
                                         "path": "token"}},
                {"downwardAPI": {"items": [{"path": "labels",
                                            "fieldRef": {"fieldPath": "metadata.labels"}}]}},
                {"secret": {"name": "s"}}]}},
            {"name": "csi", "csi": {"driver": "secrets-store.csi.k8s.io", "readOnly": True,
                                    "volumeAttributes": {"secretProviderClass": "x"}}},
            {"name": "scratch", "ephemeral": {"volumeClaimTemplate": {
                "metadata": {"labels": {"type": "scratch"}},
                "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "fast",
                         "resources": {"requests": {"storage": 100}}}}}},
        ],
        "volumeMounts": [{"name": v, "mountPath": f"/{v}"}
                         for v in ("mem", "cfg", "proj", "csi", "scratch")],
        "initContainers": [{"name": "proxy", "image": "envoy:1", "restartPolicy": "Always",
                            "startupProbe": {"tcpSocket": {"port": 9901}},
                            "lifecycle": {"preStop": {"sleep": {"seconds": 5}}}}],
    }
    doc = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "x"},
           "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                    "template": template}}
    assert api.parse_job(doc).spec.template == template
