"""Bad chart values fail `helm install` with Helm's message naming the value (values.schema.json).

Each case is a mistake a platform engineer makes; the message must point at the value's path
so it can be fixed without reading templates.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubesim import helm

BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"placement": {"timeLimitSeconds": -1}}, "/placement/timeLimitSeconds"),
    ({"placement": {"timeLimitSeconds": "5s"}}, "/placement/timeLimitSeconds"),
    ({"placement": {"useMilp": "yes"}}, "/placement/useMilp"),
    ({"trainer": {"maxGpusPerJob": 0}}, "/trainer/maxGpusPerJob"),
    ({"trainer": {"metricsPort": 70000}}, "/trainer/metricsPort"),
    ({"trainer": {"gpuType": "A100 80GB"}}, "/trainer/gpuType"),
    ({"trainer": {"gpuResources": ["gpu"]}}, "/trainer/gpuResources/0"),
    ({"trainer": {"imagePullPolicy": "Sometimes"}}, "/trainer/imagePullPolicy"),
    ({"zoo": {"bucket": "Kiln_Zoo"}}, "/zoo/bucket"),
    ({"zoo": {"bucket": "kiln..zoo"}}, "/zoo/bucket"),
    ({"zoo": {"prefix": "a//b"}}, "/zoo/prefix"),
    ({"fullnameOverride": "Kiln_Op"}, "/fullnameOverride"),
    ({"operator": {"livenessProbe": {"initialDelaySeconds": 3000000000}}},
     "/operator/livenessProbe/initialDelaySeconds"),
    ({"zoo": {"endpoint": "minio:9000/path"}}, "/zoo/endpoint"),
    ({"zoo": {"buckett": "kiln-zoo"}}, "buckett"),
    ({"operator": {"watchNamespaces": ["team-*"]}}, "/operator/watchNamespaces/0"),
    ({"operator": {"extraArgs": ["30"]}}, "/operator/extraArgs/0"),
    ({"serviceMonitor": {"interval": "30 seconds"}}, "/serviceMonitor/interval"),
    ({"grafanaDashboard": {"labels": {"grafana_dashboard": 1}}},
     "/grafanaDashboard/labels/grafana_dashboard"),
    ({"minio": {"rootPassword": "short"}}, "/minio/rootPassword"),
    ({"metrics": {"service": {"type": "Ingress"}}}, "/metrics/service/type"),
    # Rendered without complaint before: the pod failed to pull, or the API server refused it.
    ({"image": {"tag": "0.1 beta"}}, "/image/tag"),
    ({"trainer": {"image": "kiln trainer:0.1"}}, "/trainer/image"),
    ({"operator": {"resources": {"requests": {"cpu": "lots"}}}},
     "/operator/resources/requests/cpu"),
    ({"minio": {"persistence": {"size": "10 gigs"}}}, "/minio/persistence/size"),
    ({"trainer": {"gpuTypeLabel": "nvidia gpu product"}}, "/trainer/gpuTypeLabel"),
    ({"commonLabels": {"team": "ML team"}}, "/commonLabels/team"),
    ({"operator": {"podLabels": {"cost center": "ml"}}}, "/operator/podLabels"),
    ({"operator": {"nodeSelector": {"pool": "gpu-" + "x" * 70}}}, "/operator/nodeSelector/pool"),
]


@pytest.mark.parametrize(("values", "path"), BAD_VALUES, ids=[p for _, p in BAD_VALUES])
def test_bad_values_fail_install_naming_the_value(values: dict[str, Any], path: str) -> None:
    with pytest.raises(helm.HelmFailed) as failure:
        helm.install(values)
    message = str(failure.value)
    assert "values don't meet the specifications of the schema" in message, message
    assert path in message, message
