"""Object stores for the model zoo and checkpoints: the `ObjectStore` protocol and two stores.

`DirStore` keeps objects as files under a directory (the default ``./.kiln/zoo``), `S3Store`
in a bucket of MinIO or any S3 server; `open_store(uri)` picks one from a zoo URI. No zoo
layout (that is `records`), no caching; never imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol, TypeVar
from urllib.parse import unquote, urlsplit

import certifi
import minio
import minio.credentials.providers
import minio.error
import minio.helpers
import urllib3
import urllib3.exceptions

from kiln import contract

# Keys are ``/``-separated relative names (``models/<id>/meta.json``); `check_key` rejects empty
# components, ``.``/``..``, absolute keys and the reserved temporary-file prefix, so a key can
# never leave its store. `ObjectNotFound` (a `KeyError`) means a missing key; `StoreUnavailable`
# means the store cannot be reached or fails (network, permissions, full disk), which may pass;
# `StoreMisconfigured` means S3 refused the credentials, which waiting never fixes.
TMP_PREFIX = ".kiln-tmp-"
"""Reserved for temporary files: `DirStore` writes into files named so, then renames
them into place; keys may not use it, and listings hide it."""


class StoreUnavailable(RuntimeError):
    """The store cannot be reached or refuses the request; the message says what to check."""


class StoreMisconfigured(ValueError):
    """S3 refused the credentials (unknown key, wrong secret, no access to the bucket): a
    permanent configuration error, not an outage, so retrying is pointless. The message names
    the credential settings and the fix."""


class ObjectNotFound(KeyError):
    """No object under this key. A `KeyError`, so ``except KeyError`` also catches it.

    Attributes:
        key: the missing key.
        where: the store, as `ObjectStore.describe` gives it.
    """

    def __init__(self, key: str, where: str) -> None:
        super().__init__(key)
        self.key = key
        self.where = where

    def __str__(self) -> str:  # KeyError's own __str__ shows only repr(key)
        return f"no object {self.key!r} in {self.where}"


class ObjectStore(Protocol):
    """A flat map from ``/``-separated keys to bytes; `DirStore` and `S3Store` implement it."""

    def put_bytes(self, key: str, data: bytes) -> None:
        """Store `data` under `key`, replacing any object there; readers see all or nothing."""

    def get_bytes(self, key: str) -> bytes:
        """The object's bytes. Raises `ObjectNotFound` when there is none."""

    def list_keys(self, prefix: str) -> list[str]:
        """Every key starting with `prefix` (a plain string prefix), sorted."""

    def delete(self, key: str) -> None:
        """Remove the object if present (deleting a missing key is not an error)."""

    def exists(self, key: str) -> bool:
        """Whether an object is stored under `key`."""

    def size_bytes(self, key: str) -> int:
        """The object's size in bytes. Raises `ObjectNotFound` when there is none."""

    def describe(self) -> str:
        """Where the store lives, for messages (``directory /x`` or ``s3://b/p at http://h``)."""


def check_key(key: str) -> str:
    """Return `key` if it is a safe relative object key.

    Raises:
        ValueError: the key is empty, absolute, has a backslash or NUL, an empty, ``.`` or
            ``..`` component, or a component starting with the temporary-file prefix.
    """
    if not key:
        raise ValueError("object key is empty")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise ValueError(f"object key {key!r} must be relative, '/'-separated, without '\\'")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise ValueError(f"object key {key!r} has an empty, '.' or '..' component")
        if part.startswith(TMP_PREFIX):
            raise ValueError(f"object key {key!r}: names starting {TMP_PREFIX!r} are reserved")
    return key


def check_prefix(prefix: str) -> str:
    """Return `prefix` if keys could start with it: '' or a key, optionally ending in '/'.

    Raises:
        ValueError: as `check_key` for every complete component.
    """
    head, _, _ = prefix.rpartition("/")
    if head:
        check_key(head)
    elif prefix.startswith("/"):
        raise ValueError(f"key prefix {prefix!r} must be relative")
    return prefix

class DirStore:
    """Objects as files under `root`; a key ``a/b/c`` is the file ``root/a/b/c``.

    Writes go to a temporary file in the target directory, are flushed to disk, then renamed
    over the target, so a reader never sees a partial object, even across processes. The root
    is created on the first write.
    """

    def __init__(self, root: Path | str) -> None:
        """Use (and on the first write create) the directory `root`.

        Args:
            root: the directory; a relative path is taken from the current working directory now.

        Raises:
            ValueError: `root`, or a folder above it, is an existing file: no object could ever
                be written there (checked now, so a run fails before training, not after).
        """
        self.root = Path(root).expanduser().absolute()
        for path in (self.root, *self.root.parents):
            if path.is_dir():
                break
            if path.exists():
                where = "" if path == self.root else f" (it lies under {path})"
                raise ValueError(f"{path} is a file, not a directory{where}; point the zoo at a "
                                 "directory")

    def describe(self) -> str:
        return f"directory {self.root}"

    def check_writable(self) -> None:
        """Check that objects can be written here now, by creating and removing a temporary
        file in the root, or (the root not made yet) in the nearest folder above it.

        Raises:
            StoreUnavailable: that folder cannot be written (permissions, read-only mount).
        """
        folder = next(p for p in (self.root, *self.root.parents) if p.is_dir())
        try:
            fd, name = tempfile.mkstemp(prefix=TMP_PREFIX, dir=folder)
            os.close(fd)
            os.unlink(name)
        except OSError as exc:
            making = "" if folder == self.root else f" (nor make it in {folder})"
            raise StoreUnavailable(f"cannot write to {self.describe()}{making}: "
                                   f"{exc.strerror or exc}") from exc

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write atomically (temp file, fsync, rename).

        Raises:
            ValueError: bad key, or the key clashes with a directory (``a`` beside ``a/b``).
            StoreUnavailable: the directory is not writable or the disk is full.
        """
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(prefix=TMP_PREFIX, dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as file:
                    os.fchmod(file.fileno(), 0o644)  # mkstemp makes 0600; others read the zoo
                    file.write(data)
                    file.flush()
                    os.fsync(file.fileno())
                os.replace(tmp_name, path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp_name)
                raise
        except (IsADirectoryError, NotADirectoryError, FileExistsError) as exc:
            raise ValueError(
                f"object key {key!r} clashes with another key in {self.describe()}: a directory "
                "store cannot hold both 'a' and 'a/b'"
            ) from exc
        except OSError as exc:
            raise StoreUnavailable(
                f"cannot write {key!r} to {self.describe()}: {exc.strerror or exc}; check that "
                "the directory is writable and the disk has space"
            ) from exc

    def get_bytes(self, key: str) -> bytes:
        """Read the file under `key`.

        Raises:
            ObjectNotFound: no file under the key.
            StoreUnavailable: the file exists but cannot be read (permissions, I/O error).
        """
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(key, self.describe()) from None
        except OSError as exc:
            raise StoreUnavailable(
                f"cannot read {key!r} from {self.describe()}: {exc.strerror or exc}; check the "
                "file's permissions"
            ) from exc

    def list_keys(self, prefix: str) -> list[str]:
        """Every key starting with `prefix`, sorted; temporary files are hidden.

        Raises:
            StoreUnavailable: a directory under the root cannot be listed.
        """
        head, _, _ = check_prefix(prefix).rpartition("/")
        base = self.root.joinpath(*head.split("/")) if head else self.root

        def fail(exc: OSError) -> None:
            if not isinstance(exc, FileNotFoundError | NotADirectoryError):  # absent, or gone
                raise StoreUnavailable(
                    f"cannot list {exc.filename} in {self.describe()}: {exc.strerror or exc}"
                ) from exc

        keys = []
        for dir_path, _, file_names in os.walk(base, onerror=fail):
            rel = Path(dir_path).relative_to(self.root).as_posix()
            for name in file_names:
                key = name if rel == "." else f"{rel}/{name}"
                if not name.startswith(TMP_PREFIX) and key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        """Remove the file under `key`, if any (empty directories stay).

        Raises:
            StoreUnavailable: the file exists but cannot be removed.
        """
        try:
            self._path(key).unlink(missing_ok=True)
        except (IsADirectoryError, NotADirectoryError):
            return  # no object under this key, only longer keys
        except OSError as exc:
            raise StoreUnavailable(
                f"cannot delete {key!r} from {self.describe()}: {exc.strerror or exc}"
            ) from exc

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size_bytes(self, key: str) -> int:
        """The file's size.

        Raises:
            ObjectNotFound: no file under the key.
        """
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFound(key, self.describe())
        return path.stat().st_size


# S3: the bucket is created on first use. Every request is retried on network errors, 5xx
# responses and S3's busy codes with bounded exponential backoff (`RetryPolicy`), then
# `StoreUnavailable` names the endpoint and what to check; refused credentials are not retried
# but raise `StoreMisconfigured`.
# The operator turns that error into WarmStarted=False/ZooUnavailable and tries again later.
AWS_ACCESS_KEY_ENV = "AWS_ACCESS_KEY_ID"
AWS_SECRET_KEY_ENV = "AWS_SECRET_ACCESS_KEY"

# S3 error codes that mean "who you are or what you may do", never worth retrying.
CREDENTIAL_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
     "InvalidToken", "AllAccessDisabled"}
)
# S3 error codes that a server returns when it is busy or restarting: retry these.
TRANSIENT_CODES = frozenset(
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
    if not text or "/" in text or any(ch.isspace() for ch in text):
        raise ValueError(f"invalid S3 endpoint {endpoint!r}: use host:port or http(s)://host:port")
    return text, secure


UNKNOWN_TOKEN_LIFETIME = datetime.timedelta(hours=1)
"""How long a session token that carries no expiry is assumed to work: STS's default."""


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
        credentials: minio.credentials.providers.Provider | None = None,
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
            credentials: a minio credential provider (`credentials_provider`: session tokens,
                IAM roles, web identity) instead of the two keys, which must then be None.
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
        if credentials is not None and access_key is not None:
            raise ValueError("S3 credentials: give keys or a credential provider, not both")
        prefix = prefix.strip("/")
        self._prefix = check_key(prefix) + "/" if prefix else ""
        self._bucket = bucket
        self._region = region
        self._retry = retry
        self._sleep = sleep
        self._bucket_ready = False
        self._lock = threading.Lock()
        self._credentials = credentials
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
                region=region, http_client=http, credentials=credentials,
            )
        except ValueError as exc:
            raise ValueError(f"invalid S3 store {self.describe()}: {exc}") from exc

    def describe(self) -> str:
        return f"s3://{self._bucket}/{self._prefix} at {self._endpoint_url}"

    def _name(self, key: str) -> str:
        return self._prefix + check_key(key)

    def put_bytes(self, key: str, data: bytes) -> None:
        """Upload `data` (one PUT; S3 makes it visible all at once).

        Raises:
            StoreUnavailable: unreachable after retries.
            StoreMisconfigured: the credentials were refused.
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
            StoreUnavailable: unreachable after retries.
            StoreMisconfigured: the credentials were refused.
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
            StoreUnavailable: unreachable after retries.
            StoreMisconfigured: the credentials were refused.
        """
        full = self._prefix + check_prefix(prefix)

        def names() -> list[str]:  # retried as a whole: the listing pages lazily
            found = self._client.list_objects(self._bucket, prefix=full, recursive=True)
            return [o.object_name for o in found if o.object_name is not None]

        start = len(self._prefix)
        return sorted(name[start:] for name in self._call(f"list {prefix!r}", None, names))

    def delete(self, key: str) -> None:
        """Remove the object under `key`, if any.

        Raises:
            StoreUnavailable: unreachable after retries.
            StoreMisconfigured: the credentials were refused.
        """
        name = self._name(key)
        self._call(f"delete {key!r}", None, lambda: self._client.remove_object(self._bucket, name))

    def exists(self, key: str) -> bool:
        """Whether an object is stored under `key` (a HEAD request).

        Raises:
            StoreUnavailable: unreachable after retries.
            StoreMisconfigured: the credentials were refused.
        """
        name = self._name(key)
        try:
            self._call(f"stat {key!r}", key, lambda: self._client.stat_object(self._bucket, name))
        except ObjectNotFound:
            return False
        return True

    def size_bytes(self, key: str) -> int:
        """The object's size, from a HEAD request.

        Raises:
            ObjectNotFound: no object under the key.
            StoreUnavailable: unreachable after retries.
            StoreMisconfigured: the credentials were refused.
        """
        name = self._name(key)
        found = self._call(f"stat {key!r}", key,
                           lambda: self._client.stat_object(self._bucket, name))
        return int(found.size or 0)

    def presigned_url(self, method: str, key: str, *, lifetime: datetime.timedelta,
                      now: datetime.datetime) -> str:
        """A URL that lets its holder send one `method` request for `key` until `now` +
        `lifetime` (SigV4 query signing, with this store's credentials).

        Signing is local, except that minio asks the server once for the bucket's region
        when none is configured.

        Raises:
            StoreUnavailable: the region lookup failed after retries.
            StoreMisconfigured: the credentials were refused.
        """
        name = self._name(key)
        return self._call(f"sign {method} {key!r}", None, lambda: self._client.get_presigned_url(
            method, self._bucket, name, expires=lifetime, request_date=now))

    def credential_expiry(self, now: datetime.datetime) -> datetime.datetime | None:
        """When the credential that signs this store's requests stops working: None for
        static keys; a temporary credential's expiry (a URL signed with it dies with it), or
        `UNKNOWN_TOKEN_LIFETIME` from `now` for a session token that does not say.

        Raises:
            StoreUnavailable: the credential provider could not be asked.
        """
        if self._credentials is None:
            return None
        credentials = self._call("read the credentials", None, self._credentials.retrieve)
        if credentials.expiration is not None:
            expiry = credentials.expiration
            return expiry if expiry.tzinfo else expiry.replace(tzinfo=datetime.UTC)
        return now + UNKNOWN_TOKEN_LIFETIME if credentials.session_token else None

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
            StoreMisconfigured: the credentials were refused.
            StoreUnavailable: an unexpected S3 error, or transient failures on every attempt.
        """
        waits = self._retry.backoffs_seconds()
        last: Exception | None = None
        for attempt in range(self._retry.attempts):
            try:
                return request()
            except minio.error.S3Error as exc:
                if exc.code == "NoSuchKey" and key is not None:
                    raise ObjectNotFound(key, self.describe()) from None
                if exc.code in CREDENTIAL_CODES:
                    raise StoreMisconfigured(
                        f"S3 store {self.describe()} refused to {action}: {exc.code} (the "
                        "credentials are wrong or may not use the bucket; retrying will not "
                        f"help); set {contract.Env.ZOO_ACCESS_KEY} and "
                        f"{contract.Env.ZOO_SECRET_KEY} (or {AWS_ACCESS_KEY_ENV}/"
                        f"{AWS_SECRET_KEY_ENV}; in the cluster, the secret the operator's "
                        "--zoo-secret names) to a key pair allowed to use the bucket"
                    ) from exc
                if exc.code not in TRANSIENT_CODES:
                    raise StoreUnavailable(
                        f"S3 store {self.describe()} failed to {action}: {exc.code}: "
                        f"{exc.message}; check the bucket name, region and server logs"
                    ) from exc
                last = exc
            except minio.error.InvalidResponseError as exc:
                status = getattr(exc, "_code", 0)  # minio keeps the HTTP status private
                if not isinstance(status, int) or status < 500:
                    raise StoreUnavailable(
                        f"{self._endpoint_url} answered {action} with a non-S3 response "
                        f"(HTTP {status}); check that {contract.Env.ZOO_ENDPOINT} points at the S3 API port"
                    ) from exc
                last = exc
            except (minio.error.ServerError, urllib3.exceptions.HTTPError, OSError) as exc:
                last = exc  # connection refused/reset, timeouts, DNS, HTTP 5xx
            if attempt < len(waits):
                self._sleep(waits[attempt])
        raise StoreUnavailable(
            f"S3 endpoint {self._endpoint_url} is unavailable: {action} failed "
            f"{self._retry.attempts} times over {sum(waits):.1f} s of backoff (last error: "
            f"{last}); check that the server is running and reachable there, and {contract.Env.ZOO_ENDPOINT} "
            "(host:port, or http(s)://host:port)"
        ) from last


DEFAULT_ZOO_URI = "./.kiln/zoo"
"""The local zoo used when no ``--zoo``/``KILN_ZOO`` is given (relative to the working dir)."""


def open_store(uri: str, *, env: Mapping[str, str] | None = None) -> ObjectStore:
    """Open the store a zoo URI names.

    ``/some/dir``, ``./rel/dir`` or ``file:///some/dir`` give a `DirStore`;
    ``s3://bucket[/prefix]`` gives an `S3Store` whose endpoint comes from ``KILN_ZOO_ENDPOINT``
    (``host:port`` or ``http(s)://host:port``), credentials from ``KILN_ZOO_ACCESS_KEY`` and
    ``KILN_ZOO_SECRET_KEY`` (else ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY``; neither
    pair: anonymous) with an optional session token, or from the cloud's identity with
    ``KILN_ZOO_CREDENTIALS=iam`` (`credentials_provider`), and an optional region from
    ``KILN_ZOO_REGION``. Nothing is contacted yet.

    Args:
        uri: the zoo URI, e.g. `DEFAULT_ZOO_URI`.
        env: environment variables (default: `os.environ`).

    Raises:
        ValueError: empty URI, unknown scheme, ``file://`` with a host, ``s3://`` without a
            bucket or without ``KILN_ZOO_ENDPOINT``, unusable credential settings, or a
            pod's ``presigned:`` access (`presigned.open_zoo` opens that).
    """
    env = os.environ if env is None else env
    if not uri.strip():
        raise ValueError(f"zoo URI is empty; use a directory, e.g. {DEFAULT_ZOO_URI}")
    if uri.startswith(f"{contract.ZOO_ACCESS_SCHEME}:"):
        raise ValueError(f"zoo URI {uri!r} is a trainer pod's presigned access, which only "
                         "the trainer opens; use a directory, file:///path or s3://bucket")
    if "://" not in uri:
        return DirStore(Path(uri))
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise ValueError(f"zoo URI {uri!r}: write file:///absolute/path, or just a path")
        return DirStore(Path(unquote(parts.path)))
    if scheme != "s3":
        raise ValueError(
            f"zoo URI {uri!r}: unsupported scheme {parts.scheme!r}; use a directory path, "
            "file:///path or s3://bucket[/prefix]"
        )
    if not parts.netloc:
        raise ValueError(f"zoo URI {uri!r}: name the bucket, as in s3://bucket[/prefix]")
    endpoint = env.get(contract.Env.ZOO_ENDPOINT, "").strip()
    if not endpoint:
        raise ValueError(
            f"zoo URI {uri!r} needs the S3 server address: pass --zoo-endpoint or set "
            f"{contract.Env.ZOO_ENDPOINT} to host:port or http(s)://host:port"
        )
    return S3Store(
        endpoint, parts.netloc, access_key=None, secret_key=None,
        credentials=credentials_provider(env), region=env.get(contract.Env.ZOO_REGION) or None,
        prefix=unquote(parts.path),
    )


# `credentials_provider`'s choices (KILN_ZOO_CREDENTIALS): keys from the environment, or the
# cloud's identity. "iam" is minio's `IamAwsProvider`: a web identity token (AWS_ROLE_ARN and
# AWS_WEB_IDENTITY_TOKEN_FILE, as EKS service accounts get them), else the container's
# credentials endpoint (ECS), else the instance's metadata service (EC2); temporary
# credentials are renewed before they expire.
CREDENTIAL_SOURCES = ("keys", "iam")
AWS_SESSION_TOKEN_ENV = "AWS_SESSION_TOKEN"
# Variables a cloud sets in pods that have an identity; without keys they select "iam" (the
# metadata service alone does not: probing it off the cloud would hang every local run).
_CLOUD_IDENTITY_ENV = ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                       "AWS_CONTAINER_CREDENTIALS_FULL_URI")


def credentials_provider(env: Mapping[str, str]) -> minio.credentials.providers.Provider | None:
    """The S3 credentials `env` asks for, as a minio provider; None: anonymous requests.

    ``KILN_ZOO_CREDENTIALS=iam`` uses the cloud identity (see `CREDENTIAL_SOURCES`); unset
    or ``keys``: the key pair of `credentials_from_env` with an optional session token
    (``KILN_ZOO_SESSION_TOKEN``, else ``AWS_SESSION_TOKEN``); unset without keys: the cloud
    identity when a web identity token or container credentials are set, else anonymous.

    Raises:
        ValueError: an unknown KILN_ZOO_CREDENTIALS, half a key pair, or a session token
            without keys.
    """
    chosen = (env.get(contract.Env.ZOO_CREDENTIALS) or "").strip().lower()
    source = chosen or "keys"
    if source not in CREDENTIAL_SOURCES:
        raise ValueError(f"{contract.Env.ZOO_CREDENTIALS}={source!r}: use keys (the default: "
                         f"{contract.Env.ZOO_ACCESS_KEY}/{contract.Env.ZOO_SECRET_KEY}) or iam "
                         "(an IAM role or web identity)")
    if source == "iam":
        return minio.credentials.providers.IamAwsProvider()
    access_key, secret_key = credentials_from_env(env)
    token = env.get(contract.Env.ZOO_SESSION_TOKEN) or env.get(AWS_SESSION_TOKEN_ENV) or None
    if access_key is None or secret_key is None:
        if token:
            raise ValueError(f"S3 credentials: a session token is set, but no "
                             f"{contract.Env.ZOO_ACCESS_KEY}/{contract.Env.ZOO_SECRET_KEY}; "
                             "temporary credentials need all three")
        if not chosen and any(env.get(name) for name in _CLOUD_IDENTITY_ENV):
            return minio.credentials.providers.IamAwsProvider()
        return None
    return minio.credentials.providers.StaticProvider(access_key, secret_key, token)


def credentials_from_env(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """S3 (access key, secret key) from Kiln's variables, else AWS's; (None, None) if neither.

    Raises:
        ValueError: a pair is half set (e.g. KILN_ZOO_ACCESS_KEY without KILN_ZOO_SECRET_KEY).
    """
    for access_name, secret_name in (
        (contract.Env.ZOO_ACCESS_KEY, contract.Env.ZOO_SECRET_KEY), (AWS_ACCESS_KEY_ENV, AWS_SECRET_KEY_ENV)
    ):
        access, secret = env.get(access_name) or None, env.get(secret_name) or None
        if access and secret:
            return access, secret
        if access or secret:
            missing = secret_name if access else access_name
            raise ValueError(f"S3 credentials: {missing} is not set (set both or neither)")
    return None, None
