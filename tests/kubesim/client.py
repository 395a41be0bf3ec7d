"""A small synchronous Kubernetes client for tests, and polling with a deadline.

`Client` speaks JSON over urllib to the emulator (or any API server without TLS); its
User-Agent tells its requests apart in the emulator's log. No watches, no authentication.
"""

from __future__ import annotations

import base64
import http.server
import itertools
import json
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from kiln import api

T = TypeVar("T")
TEST_USER_AGENT = "kubesim-test"


class ApiError(RuntimeError):
    """The emulator answered with an error status."""

    def __init__(self, status: int, method: str, path: str, text: str) -> None:
        self.status = status
        super().__init__(f"{method} {path}: HTTP {status}: {text[:500]}")


class Client:
    """A small synchronous Kubernetes client for tests (JSON over urllib).

    Args:
        url: the API server's base URL.
        user_agent: sent with every request (the request log is filtered by it).
    """

    def __init__(self, url: str, *, user_agent: str = TEST_USER_AGENT) -> None:
        self.url = url
        self.user_agent = user_agent

    def request(self, method: str, path: str, body: Any = None, *,
                content_type: str = "application/json") -> Any:
        """Send one request; returns the decoded JSON answer.

        Raises:
            ApiError: any status >= 400.
        """
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("User-Agent", self.user_agent)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=30) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, method, path, exc.read().decode(errors="replace")) from None
        return json.loads(text) if text else None

    def get(self, path: str) -> dict[str, Any] | None:
        """The object at `path`, or None when it does not exist."""
        try:
            answer: dict[str, Any] = self.request("GET", path)
            return answer
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, path: str) -> list[dict[str, Any]]:
        """Items of a collection."""
        items: list[dict[str, Any]] = self.request("GET", path)["items"]
        return items

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `body` to a collection, filling what a real API server would.

        The emulator keeps no uid, resourceVersion or creationTimestamp of its own; kopf needs
        the first two (owner references, JSON-patch tests), so they are set here.
        """
        meta = body.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("resourceVersion", "1")
        meta.setdefault("creationTimestamp",
                        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        created: dict[str, Any] = self.request("POST", path, body)
        return created

    def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch."""
        answer: dict[str, Any] = self.request("PATCH", path, patch,
                                              content_type="application/merge-patch+json")
        return answer

    def delete(self, path: str) -> None:
        """DELETE an object; a missing one is not an error."""
        try:
            self.request("DELETE", path)
        except ApiError as exc:
            if exc.status != 404:
                raise

    # -- paths ------------------------------------------------------------------------------

    @staticmethod
    def jobs_path(namespace: str, name: str = "") -> str:
        base = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{namespace}/{api.PLURAL}"
        return f"{base}/{name}" if name else base

    @staticmethod
    def pods_path(namespace: str | None = None, name: str = "") -> str:
        base = f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"
        return f"{base}/{name}" if name else base

    def create_job(self, namespace: str, doc: dict[str, Any]) -> dict[str, Any]:
        """Create a TrainingJob from its document (namespace filled in)."""
        doc = json.loads(json.dumps(doc))
        doc.setdefault("metadata", {})["namespace"] = namespace
        return self.create(self.jobs_path(namespace), doc)

    def job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.get(self.jobs_path(namespace, name))

    def pods(self, namespace: str, job_name: str | None = None) -> list[dict[str, Any]]:
        """Pods of a namespace, of one job when `job_name` is given (by its label)."""
        pods = self.list(self.pods_path(namespace))
        if job_name is None:
            return pods
        return [p for p in pods
                if p.get("metadata", {}).get("labels", {}).get("kiln.dev/job-name") == job_name]

    def create_node(self, name: str, *, gpus: int = 0, cpu: str = "2") -> dict[str, Any]:
        """A Ready node with `gpus` allocatable nvidia.com/gpu (0: a CPU-only node)."""
        allocatable = {"cpu": cpu, "memory": "8Gi", "pods": "110"}
        if gpus:
            allocatable["nvidia.com/gpu"] = str(gpus)
        return self.create("/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "status": {"allocatable": allocatable, "capacity": dict(allocatable),
                       "conditions": [{"type": "Ready", "status": "True"}]},
        })

    def create_secret(self, namespace: str, name: str, data: dict[str, str]) -> None:
        """An Opaque Secret with `data` (plain strings, base64-encoded here)."""
        self.create(f"/api/v1/namespaces/{namespace}/secrets", {
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": namespace},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
        })


def wait_until(predicate: Callable[[], T], *, timeout_seconds: float, what: str,
               poll_seconds: float = 0.1, details: Callable[[], str] | None = None) -> T:
    """Poll `predicate` until it returns something truthy; return that.

    Raises:
        AssertionError: still falsy after `timeout_seconds`; the message says `what` was
            awaited, plus `details()` when given (e.g. the job's status, the operator's log).
    """
    deadline = time.monotonic() + timeout_seconds
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f"\n{details()}" if details is not None else ""
            raise AssertionError(f"timed out after {timeout_seconds:.0f} s waiting for {what}"
                                 f"{extra}")
        time.sleep(poll_seconds)  # polling a real server with a deadline


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the caller binds it soon after).

    Drawn below the kernel's ephemeral range (32768-60999), where a port bound to 0 would land,
    so no outgoing connection can take it between this check and the caller's bind; each pytest
    worker draws from its own slice so two workers never hand out the same port.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    low = _PORT_BASE + (index % _PORT_SLICES) * _PORT_SLICE
    for _ in range(_PORT_SLICE):
        port = low + next(_port_turn) % _PORT_SLICE
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken: by a server of this worker still running, or another program
            return port
    raise AssertionError(f"no free port in {low}-{low + _PORT_SLICE - 1}")


_PORT_BASE, _PORT_SLICE, _PORT_SLICES = 12000, 1250, 16  # 12000-31999
_port_turn = itertools.count(random.randrange(_PORT_SLICE))  # a restarted worker starts elsewhere


def serve_text(answer: Callable[[str], tuple[int, bytes]], *, name: str
               ) -> http.server.ThreadingHTTPServer:
    """A plain-text (Prometheus exposition) endpoint on 127.0.0.1 at a free port, serving from
    a daemon thread: each GET answers with `answer(path)`'s status and body. Stop it with
    ``shutdown()`` then ``server_close()``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's name
            status, body = answer(self.path)
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server
