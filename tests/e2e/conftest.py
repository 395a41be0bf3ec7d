"""Fixtures of the operator's end-to-end tests: one simulated cluster per xdist worker's session.

kmock's emulator with one CPU-only node, the test kubelet, the zoo in a moto S3 bucket, and the
real operator as a subprocess with short intervals. Each test works in its own namespace.
"""

# Every API call the operator makes, in any emulator of the session, is collected in
# `api_calls`; at the end of the run the union over all xdist workers is checked against the
# operator's RBAC rules (`kubesim.usage`).

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubesim import emulator, kubelet, operator_process, scenario, usage

from kiln.zoo import store

NODE = "cpu-node-1"
CPU_SLOTS = 2
# The longest a deleted pod stays Terminating here (the operator asks for 30 s): a trainer
# checkpoints and exits well within it, a process that ignores SIGTERM is killed after it.
MAX_POD_GRACE_SECONDS = 15
ZOO_SECRET = "kiln-zoo"
# Short intervals and retries: the loops are event-driven, these only bound the waits.
OPERATOR_ARGS = [
    "--placement-interval-seconds", "1", "--housekeeping-interval-seconds", "0.5",
    "--no-placement-use-milp", "--cpu-slots-per-node", str(CPU_SLOTS),
    "--zoo-refresh-seconds", "0", "--termination-grace-seconds", "30",
    "--zoo-retry-delay-seconds", "0.5", "--zoo-request-attempts", "1",
]


@pytest.fixture(scope="session")
def api_calls(request: pytest.FixtureRequest) -> set[usage.ApiCall]:
    """Every API call the operator made in this process; add each emulator's when it stops."""
    return usage.recorded(request.config)


@pytest.fixture(scope="session")
def cluster(api_calls: set[usage.ApiCall]) -> Iterator[emulator.Emulator]:
    """The session's emulator with one Ready CPU-only node."""
    with emulator.Emulator(max_pod_grace_seconds=MAX_POD_GRACE_SECONDS) as running:
        running.client.create_node(NODE)
        yield running
        api_calls |= usage.api_calls(running.requests)


@pytest.fixture(scope="session")
def zoo(s3_server: Any) -> scenario.Zoo:
    bucket = f"kiln-e2e-{uuid.uuid4().hex[:12]}"
    endpoint = f"http://{s3_server.endpoint}"
    return scenario.Zoo(uri=f"s3://{bucket}", endpoint=endpoint, access_key=s3_server.access_key,
               secret_key=s3_server.secret_key,
               store=store.S3Store(endpoint, bucket, access_key=s3_server.access_key,
                                   secret_key=s3_server.secret_key))


@pytest.fixture(scope="session")
def node_kubelet(cluster: emulator.Emulator, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[kubelet.Kubelet]:
    running = kubelet.Kubelet(cluster.url, tmp_path_factory.mktemp("kubelet"))
    running.start()
    yield running
    running.stop()
    assert not running.errors, running.errors


@pytest.fixture(scope="session")
def operator_args(zoo: scenario.Zoo) -> list[str]:
    """`kiln operator` options of the e2e operators: the session's zoo, short intervals."""
    return ["--zoo-uri", zoo.uri, "--zoo-endpoint", zoo.endpoint, "--zoo-secret", ZOO_SECRET,
            *OPERATOR_ARGS]


@pytest.fixture(scope="session")
def zoo_secret(zoo: scenario.Zoo) -> tuple[str, dict[str, str]]:
    """Name and data of the Secret trainer pods read the zoo credentials from."""
    return ZOO_SECRET, {"accessKey": zoo.access_key, "secretKey": zoo.secret_key}


@pytest.fixture(scope="session")
def operator(cluster: emulator.Emulator, node_kubelet: kubelet.Kubelet, zoo: scenario.Zoo,
             operator_args: list[str], tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[operator_process.OperatorProcess]:
    """The real operator, cluster-wide, on the session's cluster and zoo."""
    running = operator_process.OperatorProcess(
        cluster, tmp_path_factory.mktemp("operator"), env=zoo.operator_env, args=operator_args)
    running.start()
    yield running
    running.stop()


@pytest.fixture
def namespace(cluster: emulator.Emulator, zoo_secret: tuple[str, dict[str, str]]) -> str:
    """A fresh namespace holding the zoo-credentials Secret trainer pods reference."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.client.create_secret(name, *zoo_secret)
    return name
