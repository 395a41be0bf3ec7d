"""A minimal asynchronous Kubernetes API client for the operator's own calls.

JSON over aiohttp with kopf's credentials; merge patches only. No watches (kopf watches), no
retries (callers turn `ApiError` into kopf's temporary errors), no PUT, no server-side apply.
"""

# kopf watches and patches the TrainingJobs it handles, but it is not an API client: pods,
# nodes, job status written outside a handler, and events go through this module. Every call
# it can make is a (verb, group, resource) pair that the Helm chart's RBAC must grant;
# `kiln.controller.rbac` lists them and the e2e tests check the list against the calls the API
# emulator records.

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import kopf

from kiln import api

USER_AGENT = "kiln-operator/0.1"
MERGE_PATCH = "application/merge-patch+json"

# A Kubernetes object (or a merge patch of one) as the API server's JSON. The operator's own
# parts of them, a TrainingJob's status above all, are built and read as `kiln.api` types.
Object = dict[str, Any]

_log = logging.getLogger(__name__)


class ApiError(RuntimeError):
    """The API server refused a request, or could not be reached (status 0).

    Attributes:
        status: the HTTP status (404 not found, 409 conflict, ...), 0 for a network error.
        message: the server's words (its Status message), or the network error.
    """

    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        self.status = status
        self.message = message
        super().__init__(f"{method} {path}: {status or 'no answer'}: {message[:300]}")

    @property
    def retryable(self) -> bool:
        """Network errors, throttling and server errors: worth trying again later."""
        return self.status in (0, 429) or self.status >= 500


def connection_info(*, kubeconfig: Path | None) -> kopf.ConnectionInfo:
    """Credentials for the API server: `kubeconfig`, else $KUBECONFIG, else in-cluster.

    The operator's kopf login handler returns the same object, so kopf and this client act as
    one identity (one RBAC subject).

    Raises:
        kopf.LoginError: no kubeconfig and no service account token (not inside a pod).
    """
    settings = kopf.OperatorSettings()
    if kubeconfig is not None:
        os.environ["KUBECONFIG"] = str(kubeconfig)  # kopf's reader looks only here
    info = kopf.login_with_kubeconfig(settings=settings) if (
        kubeconfig is not None or os.environ.get("KUBECONFIG")
    ) else None
    info = info or kopf.login_with_service_account(settings=settings)
    if info is None:
        raise kopf.LoginError(
            "no Kubernetes credentials: pass --kubeconfig (or set KUBECONFIG), or run in a pod "
            "with a service account")
    return info


async def unreachable(info: kopf.ConnectionInfo, *, attempts: int = 5,
                      delay_seconds: float = 2.0, timeout_seconds: float = 5.0) -> str | None:
    """Why the API server at ``info.server`` does not answer ``GET /version``, or None.

    Tried `attempts` times, `delay_seconds` apart, so an API server that is briefly away (a
    control-plane restart) is waited for, while a wrong address, a TLS mismatch, a server that
    never answers or one that is not Kubernetes fails in seconds with one message instead of
    kopf's retries and tracebacks. /version needs no RBAC rule.
    """
    client = Client(info, request_timeout_seconds=timeout_seconds)
    problem = ""
    try:
        for attempt in range(attempts):
            try:
                answer = await client.request("GET", "/version")
            except ApiError as exc:
                problem = str(exc)
            except (ssl.SSLError, OSError, ValueError) as exc:  # unusable TLS settings
                return f"cannot connect to the API server {client.server}: {exc}"
            else:
                if isinstance(answer, dict) and "gitVersion" in answer:
                    return None
                return (f"{client.server} answered GET /version, but not as a Kubernetes API "
                        "server")
            if attempt + 1 < attempts:
                await asyncio.sleep(delay_seconds)
    finally:
        await client.close()
    return f"cannot reach the API server {client.server} ({problem}; {attempts} attempts)"


class Paths:
    """URL paths of the objects the operator touches."""

    @staticmethod
    def job(namespace: str, name: str, *, status: bool = False) -> str:
        path = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{namespace}/{api.PLURAL}/{name}"
        return path + "/status" if status else path

    @staticmethod
    def jobs(namespace: str | None = None) -> str:
        where = f"/namespaces/{namespace}" if namespace else ""
        return f"/apis/{api.GROUP}/{api.VERSION}{where}/{api.PLURAL}"

    @staticmethod
    def sweep(namespace: str, name: str, *, status: bool = False) -> str:
        path = (f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{namespace}/"
                f"{api.sweep.SWEEP_PLURAL}/{name}")
        return path + "/status" if status else path

    @staticmethod
    def pods(namespace: str | None = None) -> str:
        return f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"

    @staticmethod
    def pod(namespace: str, name: str) -> str:
        return f"/api/v1/namespaces/{namespace}/pods/{name}"

    @staticmethod
    def nodes() -> str:
        return "/api/v1/nodes"

    @staticmethod
    def services(namespace: str) -> str:
        return f"/api/v1/namespaces/{namespace}/services"

    @staticmethod
    def events(namespace: str) -> str:
        return f"/api/v1/namespaces/{namespace}/events"


class Client:
    """JSON requests to the API server with the operator's credentials.

    Args:
        info: server address and credentials (`connection_info`).
        relogin: fresh credentials after a 401 (service-account tokens rotate); None: none.
        request_timeout_seconds: total time allowed for one request.
    """

    def __init__(self, info: kopf.ConnectionInfo, *,
                 relogin: Callable[[], kopf.ConnectionInfo] | None = None,
                 request_timeout_seconds: float = 30.0) -> None:
        self._info = info
        self._relogin = relogin
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_seconds)
        self._session: aiohttp.ClientSession | None = None
        self.server = str(info.server).rstrip("/")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _ssl(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        if self._info.insecure:
            return False
        return self._info.as_ssl_context()

    async def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            headers = {"User-Agent": USER_AGENT, "Accept": "application/json",
                       **self._info.as_http_headers()}
            self._session = aiohttp.ClientSession(
                headers=headers, timeout=self._timeout,
                connector=aiohttp.TCPConnector(ssl=self._ssl(), limit=32))
        return self._session

    async def request(self, method: str, path: str, body: Any = None, *,
                      content_type: str = "application/json",
                      params: dict[str, str] | None = None) -> Any:
        """One API request; returns the decoded JSON answer (None for an empty body).

        Raises:
            ApiError: an HTTP status >= 400, or no answer at all (status 0).
        """
        try:
            return await self._request(method, path, body, content_type=content_type,
                                       params=params)
        except ApiError as exc:
            if exc.status != 401 or self._relogin is None:
                raise
            _log.info("API server said 401 Unauthorized; logging in again")
            self._info = self._relogin()
            await self.close()  # the next session carries the new credentials
            return await self._request(method, path, body, content_type=content_type,
                                       params=params)

    async def _request(self, method: str, path: str, body: Any, *, content_type: str,
                       params: dict[str, str] | None) -> Any:
        session = await self._get_session()
        headers = {"Content-Type": content_type} if body is not None else {}
        try:
            async with session.request(method, self.server + path, json=body, headers=headers,
                                       params=params) as response:
                text = await response.text()
                if response.status >= 400:
                    raise ApiError(response.status, method, path, _status_message(text))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ApiError(0, method, path, f"{type(exc).__name__}: {exc}") from exc
        if not text:
            return None
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ApiError(502, method, path, f"answer is not JSON: {text[:200]}") from exc

    async def get(self, path: str) -> Object | None:
        """The object at `path`, or None when it does not exist (404)."""
        try:
            found: Object = await self.request("GET", path)
            return found
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, path: str, *, label_selector: str | None = None,
                   field_selector: str | None = None) -> list[Object]:
        """The items of a collection, filtered by the API server.

        Args:
            path: the collection, e.g. `Paths.pods(namespace)`.
            label_selector: e.g. ``kiln.dev/job-name`` or ``kiln.dev/job-name=digits``.
            field_selector: e.g. ``spec.nodeName=gpu-1,status.phase!=Succeeded``.
        """
        params = {key: value for key, value in (("labelSelector", label_selector),
                                                ("fieldSelector", field_selector)) if value}
        answer = await self.request("GET", path, params=params or None)
        items: list[Object] = (answer or {}).get("items") or []
        return items

    async def create(self, path: str, body: Object) -> Object | None:
        """Create an object; None when an object of that name already exists (409)."""
        try:
            created: Object = await self.request("POST", path, body)
            return created
        except ApiError as exc:
            if exc.status == 409:
                return None
            raise

    async def merge_patch(self, path: str, patch: Object) -> Object | None:
        """Apply a JSON merge patch; None when the object is gone (404)."""
        try:
            patched: Object = await self.request("PATCH", path, patch,
                                                         content_type=MERGE_PATCH)
            return patched
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def delete(self, path: str, *, grace_period_seconds: int | None = None) -> bool:
        """Delete an object; False when it was already gone (404)."""
        body = None
        if grace_period_seconds is not None:
            body = {"apiVersion": "v1", "kind": "DeleteOptions",
                    "gracePeriodSeconds": grace_period_seconds,
                    "propagationPolicy": "Background"}
        try:
            await self.request("DELETE", path, body)
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise


def _status_message(text: str) -> str:
    """The `message` of a Kubernetes Status answer, else the raw text."""
    try:
        decoded = json.loads(text)
    except ValueError:
        return text
    if isinstance(decoded, dict) and decoded.get("message"):
        return str(decoded["message"])
    return text
