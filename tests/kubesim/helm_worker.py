"""Run one Helm action with the Helm library bundled by helm-sdkpy; print its JSON result.

    python helm_worker.py lint CHART
    python helm_worker.py install CHART RELEASE NAMESPACE KUBECONFIG VALUES_JSON
"""

# Helm runs in this separate process because its Go runtime reads the environment once, when
# the library loads: ``HELM_DRIVER=memory`` (set by `kubesim.helm`) keeps release records in
# memory instead of a protobuf-encoded Secret, which the API emulator cannot decode. Exit code
# 0 with the result on stdout; 1 with Helm's error message on stdout.

from __future__ import annotations

import asyncio
import json
import sys

import helm_sdkpy

# A kubeconfig for lint, which never contacts a cluster but needs a configuration.
_OFFLINE_KUBECONFIG = """
apiVersion: v1
kind: Config
clusters: [{name: none, cluster: {server: "http://127.0.0.1:9"}}]
users: [{name: none, user: {token: none}}]
contexts: [{name: none, context: {cluster: none, user: none}}]
current-context: none
"""


def main(argv: list[str]) -> int:
    action, chart = argv[0], argv[1]
    try:
        if action == "lint":
            config = helm_sdkpy.Configuration(kubeconfig=_OFFLINE_KUBECONFIG)
            result = asyncio.run(helm_sdkpy.Lint(config).run(chart))
        else:
            release, namespace, kubeconfig, values = argv[2:6]
            config = helm_sdkpy.Configuration(namespace=namespace, kubeconfig=kubeconfig)
            result = asyncio.run(helm_sdkpy.Install(config).run(
                release, chart, values=json.loads(values), wait=False, timeout=60))
    except helm_sdkpy.HelmError as exc:
        print(json.dumps({"error": str(exc)}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
