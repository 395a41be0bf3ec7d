"""`S3Store`: an `ObjectStore` in a bucket of MinIO or any S3-compatible server (minio SDK).

The bucket is created on first use. Every request is retried on network errors, 5xx responses
and S3's busy codes with bounded exponential backoff (`RetryPolicy`), then `StoreUnavailable`
names the endpoint and what to check; credential errors are not retried. The operator turns
that error into ``WarmStarted=False, reason=ZooUnavailable`` and tries again later. Also here:
the environment variables that configure an S3 zoo (read by `store.open_store`) and that the
error messages name.

Callers: `store.open_store` (``s3://`` URIs), the operator's zoo setup; all through
`store.S3Store` and `store.RetryPolicy`. Non-goals: no multi-part tuning, no caching, no zoo
layout, never imports torch.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

import certifi
import minio
import minio.error
import minio.helpers
import urllib3
import urllib3.exceptions

from kiln.zoo import objectstore

ENDPOINT_ENV = "KILN_ZOO_ENDPOINT"
ACCESS_KEY_ENV = "KILN_ZOO_ACCESS_KEY"
SECRET_KEY_ENV = "KILN_ZOO_SECRET_KEY"
REGION_ENV = "KILN_ZOO_REGION"
AWS_ACCESS_KEY_ENV = "AWS_ACCESS_KEY_ID"
AWS_SECRET_KEY_ENV = "AWS_SECRET_ACCESS_KEY"

# S3 error codes that mean "who you are or what you may do", never worth retrying.
_CREDENTIAL_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
     "InvalidToken", "AllAccessDisabled"}
)
# S3 error codes that a server returns when it is busy or restarting: retry these.
_TRANSIENT_CODES = frozenset(
    {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "OperationAborted",
     "XMinioServerNotInitialized"}
)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How `S3Store` retries transient failures: `attempts` tries, waiting in between
    `first_backoff_seconds`, then `multiplier` times longer each time, at most
    `max_backoff_seconds`. The defaults give up after 5 tries and 7.5 s of waiting."""

    attempts: int = 5
    first_backoff_seconds: float = 0.5
    max_backoff_seconds: float = 8.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1 (got {self.attempts})")
        if self.first_backoff_seconds < 0 or self.max_backoff_seconds < 0:
            raise ValueError("RetryPolicy backoffs must be >= 0 seconds")

    def backoffs_seconds(self) -> list[float]:
        """The waits between attempts, in seconds (``attempts - 1`` of them)."""
        return [
            min(self.first_backoff_seconds * self.multiplier**i, self.max_backoff_seconds)
            for i in range(self.attempts - 1)
        ]


def parse_endpoint(endpoint: str, *, secure: bool = False) -> tuple[str, bool]:
    """Split ``host:port`` or ``http(s)://host:port`` into (host:port, use TLS).

    Raises:
        ValueError: empty, another scheme, or a path/query after the host.
    """
    text = endpoint.strip()
    if "://" in text:
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https") or parts.path not in ("", "/") or parts.query:
            raise ValueError(
                f"invalid S3 endpoint {endpoint!r}: use host:port or http(s)://host:port"
            )
        text, secure = parts.netloc, parts.scheme == "https"
    if not text or "/" in text:
        raise ValueError(f"invalid S3 endpoint {endpoint!r}: use host:port or http(s)://host:port")
    return text, secure


class S3Store:
    """Objects in an S3 bucket (MinIO, or any S3-compatible server), under an optional prefix.

    The bucket is created on first use if it is missing. Every request is retried on network
    errors, 5xx responses and S3's busy codes, following `retry`; then `StoreUnavailable` names
    the endpoint and what to check. Credential errors are not retried.
    """

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        *,
        access_key: str | None,
        secret_key: str | None,
        secure: bool = False,
        region: str | None = None,
        prefix: str = "",
        retry: RetryPolicy = RetryPolicy(),
        connect_timeout_seconds: float = 5.0,
        read_timeout_seconds: float = 60.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Describe the store; nothing is contacted until the first request.

        Args:
            endpoint: ``host:port`` or ``http(s)://host:port`` (a scheme overrides `secure`).
            bucket: bucket name (created if missing).
            access_key: S3 access key, or None for anonymous requests.
            secret_key: S3 secret key, or None for anonymous requests.
            secure: use HTTPS.
            region: bucket region; None asks the server.
            prefix: key prefix inside the bucket, e.g. ``team-a/zoo``.
            retry: retry policy for transient failures.
            connect_timeout_seconds: TCP connect timeout per attempt.
            read_timeout_seconds: socket read timeout per attempt (idle time, not total).
            sleep: waits between retries (injected in tests).

        Raises:
            ValueError: invalid endpoint, bucket name or prefix, or only one of the two keys.
        """
        host_port, self._secure = parse_endpoint(endpoint, secure=secure)
        self._endpoint_url = f"{'https' if self._secure else 'http'}://{host_port}"
        if (access_key is None) != (secret_key is None):
            raise ValueError("S3 credentials need both an access key and a secret key")
        prefix = prefix.strip("/")
        self._prefix = objectstore.check_key(prefix) + "/" if prefix else ""
        self._bucket = bucket
        self._region = region
        self._retry = retry
        self._sleep = sleep
        self._bucket_ready = False
        self._lock = threading.Lock()
        http = urllib3.PoolManager(  # our retries, not urllib3's: they are bounded and reported
            timeout=urllib3.Timeout(connect=connect_timeout_seconds, read=read_timeout_seconds),
            retries=False,
            maxsize=10,
            cert_reqs="CERT_REQUIRED",
            ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
        )
        try:
            minio.helpers.check_bucket_name(bucket, strict=True)
            self._client = minio.Minio(
                host_port, access_key=access_key, secret_key=secret_key, secure=self._secure,
                region=region, http_client=http,
            )
        except ValueError as exc:
            raise ValueError(f"invalid S3 store {self.describe()}: {exc}") from exc

    def describe(self) -> str:
        return f"s3://{self._bucket}/{self._prefix} at {self._endpoint_url}"

    def _name(self, key: str) -> str:
        return self._prefix + objectstore.check_key(key)

    def put_bytes(self, key: str, data: bytes) -> None:
        """Upload `data` (one PUT; S3 makes it visible all at once).

        Raises:
            StoreUnavailable: unreachable after retries, or credentials refused.
        """
        name = self._name(key)
        kind = "application/json" if key.endswith(".json") else "application/octet-stream"
        self._call(
            f"put {key!r}", None,
            lambda: self._client.put_object(
                self._bucket, name, io.BytesIO(data), len(data), content_type=kind
            ),
        )

    def get_bytes(self, key: str) -> bytes:
        """Download the object under `key`.

        Raises:
            ObjectNotFound: no object under the key.
            StoreUnavailable: unreachable after retries, or credentials refused.
        """
        name = self._name(key)

        def fetch() -> bytes:
            response = self._client.get_object(self._bucket, name)
            try:
                return response.read()
            finally:
                response.close()
                response.release_conn()

        return self._call(f"get {key!r}", key, fetch)

    def list_keys(self, prefix: str) -> list[str]:
        """Every key starting with `prefix` (below the store's prefix), sorted.

        Raises:
            StoreUnavailable: unreachable after retries, or credentials refused.
        """
        full = self._prefix + objectstore.check_prefix(prefix)

        def names() -> list[str]:  # retried as a whole: the listing pages lazily
            found = self._client.list_objects(self._bucket, prefix=full, recursive=True)
            return [o.object_name for o in found if o.object_name is not None]

        start = len(self._prefix)
        return sorted(name[start:] for name in self._call(f"list {prefix!r}", None, names))

    def delete(self, key: str) -> None:
        """Remove the object under `key`, if any.

        Raises:
            StoreUnavailable: unreachable after retries, or credentials refused.
        """
        name = self._name(key)
        self._call(f"delete {key!r}", None, lambda: self._client.remove_object(self._bucket, name))

    def exists(self, key: str) -> bool:
        """Whether an object is stored under `key` (a HEAD request).

        Raises:
            StoreUnavailable: unreachable after retries, or credentials refused.
        """
        name = self._name(key)
        try:
            self._call(f"stat {key!r}", key, lambda: self._client.stat_object(self._bucket, name))
        except objectstore.ObjectNotFound:
            return False
        return True

    def _ensure_bucket(self) -> None:
        """Create the bucket on first use; two creators racing is fine."""
        with self._lock:
            if self._bucket_ready:
                return

            def create() -> None:
                if self._client.bucket_exists(self._bucket):
                    return
                try:
                    self._client.make_bucket(self._bucket, self._region)
                except minio.error.S3Error as exc:
                    if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        raise

            self._with_retries(f"create bucket {self._bucket!r}", None, create)
            self._bucket_ready = True

    def _call(self, action: str, key: str | None, request: Callable[[], T]) -> T:
        self._ensure_bucket()
        return self._with_retries(action, key, request)

    def _with_retries(self, action: str, key: str | None, request: Callable[[], T]) -> T:
        """Run `request`, retrying transient failures; translate every S3 failure.

        Raises:
            ObjectNotFound: S3 said NoSuchKey and `key` is given.
            StoreUnavailable: credentials refused, an unexpected S3 error, or transient failures
                on every attempt.
        """
        waits = self._retry.backoffs_seconds()
        last: Exception | None = None
        for attempt in range(self._retry.attempts):
            try:
                return request()
            except minio.error.S3Error as exc:
                if exc.code == "NoSuchKey" and key is not None:
                    raise objectstore.ObjectNotFound(key, self.describe()) from None
                if exc.code in _CREDENTIAL_CODES:
                    raise objectstore.StoreUnavailable(
                        f"S3 store {self.describe()} refused to {action}: {exc.code}; check "
                        f"{ACCESS_KEY_ENV}/{SECRET_KEY_ENV} (or {AWS_ACCESS_KEY_ENV}/"
                        f"{AWS_SECRET_KEY_ENV}) and that these credentials may use the bucket"
                    ) from exc
                if exc.code not in _TRANSIENT_CODES:
                    raise objectstore.StoreUnavailable(
                        f"S3 store {self.describe()} failed to {action}: {exc.code}: "
                        f"{exc.message}; check the bucket name, region and server logs"
                    ) from exc
                last = exc
            except minio.error.InvalidResponseError as exc:
                status = getattr(exc, "_code", 0)  # minio keeps the HTTP status private
                if not isinstance(status, int) or status < 500:
                    raise objectstore.StoreUnavailable(
                        f"{self._endpoint_url} answered {action} with a non-S3 response "
                        f"(HTTP {status}); check that {ENDPOINT_ENV} points at the S3 API port"
                    ) from exc
                last = exc
            except (minio.error.ServerError, urllib3.exceptions.HTTPError, OSError) as exc:
                last = exc  # connection refused/reset, timeouts, DNS, HTTP 5xx
            if attempt < len(waits):
                self._sleep(waits[attempt])
        raise objectstore.StoreUnavailable(
            f"S3 endpoint {self._endpoint_url} is unavailable: {action} failed "
            f"{self._retry.attempts} times over {sum(waits):.1f} s of backoff (last error: "
            f"{last}); check that the server is running and reachable there, and {ENDPOINT_ENV} "
            "(host:port, or http(s)://host:port)"
        ) from last
