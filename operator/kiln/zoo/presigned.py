"""Zoo access for one job through presigned URLs: the manifest, `PresignedStore`, and `mint`.

The operator keeps the zoo credential and mints a manifest of presigned URLs for exactly the
objects a job may touch; pods read and write the zoo through `PresignedStore` over it, so the
storage, not Kiln, refuses everything else. Never imports torch.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from urllib.parse import unquote
from xml.etree import ElementTree

import certifi
import urllib3
import urllib3.exceptions

from kiln import contract
from kiln.zoo import store

VERBS = ("get", "put", "delete", "head")
_METHODS = {"get": "GET", "put": "PUT", "delete": "DELETE", "head": "HEAD"}
MAX_LIFETIME = datetime.timedelta(days=7)  # SigV4's limit on a presigned URL
MIN_LIFETIME = datetime.timedelta(minutes=1)  # shorter URLs would die before a pod starts
# The manifest (JSON):
#   {"expires": "<RFC 3339 time the first URL expires>",
#    "record": "<the record id reserved for the job's model, or null>",
#    "objects": {"<key>": {"get": "<url>", "put": "<url>", ...}, ...}}
# An object lists only the verbs granted.


def open_zoo(uri: str, *, env: Mapping[str, str] | None = None) -> store.ObjectStore:
    """The store a zoo URI names: ``presigned:/path/manifest.json`` gives a `PresignedStore`
    (a pod's access to its job's objects, minted by the operator), any other URI what
    `store.open_store` gives. Nothing is contacted yet.

    Raises:
        ValueError: a presigned URI without a path, or one `store.open_store` refuses.
    """
    if not uri.startswith(f"{contract.ZOO_ACCESS_SCHEME}:"):
        return store.open_store(uri, env=env)
    path = unquote(uri.partition(":")[2])
    if not path:
        raise ValueError(f"zoo URI {uri!r}: name the manifest file, as in "
                         "presigned:/var/run/kiln/zoo-access/manifest.json")
    return PresignedStore(path)


class NotGranted(store.StoreMisconfigured):
    """The pod asked for an object or verb its manifest does not grant (a permanent error)."""


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A parsed manifest.

    Attributes:
        expires: when its URLs stop working (UTC).
        record: the record id the operator reserved for the job's model, or None.
        objects: key -> verb -> presigned URL.
    """

    expires: datetime.datetime
    record: str | None
    objects: Mapping[str, Mapping[str, str]]

    def to_json(self) -> str:
        return json.dumps({"expires": self.expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
                           "record": self.record,
                           "objects": {k: dict(v) for k, v in sorted(self.objects.items())}},
                          indent=1)

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str) -> Manifest:
        """Parse and check a manifest.

        Raises:
            store.StoreMisconfigured: not a manifest; the message names `where`.
        """
        try:
            doc = json.loads(text)
            expires = datetime.datetime.strptime(doc["expires"], "%Y-%m-%dT%H:%M:%SZ")
            objects = doc["objects"]
            record = doc.get("record")
            if not isinstance(objects, dict) or not isinstance(record, str | None):
                raise TypeError("objects must be an object and record a string or null")
            if record is not None:
                store.check_key(record)  # one key component: a record id never leaves models/
                if "/" in record:
                    raise ValueError(f"record {record!r} is not a record id")
            for key, urls in objects.items():
                store.check_key(key)
                if not isinstance(urls, dict) or not set(urls) <= set(VERBS) or not all(
                        isinstance(u, str) and u.startswith(("http://", "https://"))
                        for u in urls.values()):
                    raise TypeError(f"object {key!r}: expected verbs {VERBS} -> http(s) URLs")
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            raise store.StoreMisconfigured(
                f"zoo access manifest {where} is unreadable ({type(exc).__name__}: {exc}); the "
                "operator writes it into the job's <job>-zoo-access Secret: check that the "
                "Secret is mounted there and was not edited") from None
        return cls(expires.replace(tzinfo=datetime.UTC), record, objects)


class PresignedStore:
    """The zoo as one job sees it: the objects of a manifest of presigned URLs.

    The manifest file is read again whenever it changes (a mounted Secret is updated in place
    when the operator re-mints its URLs). Requests are retried like `store.S3Store`'s, with the
    same errors; a key or verb the manifest does not grant raises `NotGranted`, and a URL that
    S3 refuses (expired, or signed by a revoked key) raises `store.StoreMisconfigured`.
    """

    def __init__(self, path: Path | str, *, retry: store.RetryPolicy | None = None,
                 connect_timeout_seconds: float = 5.0, read_timeout_seconds: float = 60.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        """Use the manifest at `path`; it is first read by the first request."""
        self.path = Path(path)
        self._retry = retry or store.RetryPolicy()
        self._sleep = sleep
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._manifest: Manifest | None = None
        self._http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=connect_timeout_seconds, read=read_timeout_seconds),
            retries=False, maxsize=10, cert_reqs="CERT_REQUIRED",
            ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
        )

    def describe(self) -> str:
        return f"the zoo through presigned URLs of {self.path}"

    def manifest(self) -> Manifest:
        """The manifest, read again when the file changed since the last read.

        Raises:
            store.StoreMisconfigured: the file is missing or is not a manifest.
        """
        with self._lock:
            try:
                # Secret volumes swap a symlink: the inode changes, the mtime may not.
                info = self.path.stat()
                seen = (info.st_ino, info.st_mtime_ns, info.st_size)
                if self._manifest is None or seen != self._seen:
                    self._manifest = Manifest.from_json(self.path.read_bytes(),
                                                        where=str(self.path))
                    self._seen = seen
            except OSError as exc:
                raise store.StoreMisconfigured(
                    f"cannot read the zoo access manifest {self.path}: {exc.strerror or exc}; "
                    "the operator mounts it from the job's <job>-zoo-access Secret") from exc
            return self._manifest

    @property
    def reserved_record(self) -> str | None:
        """The record id the operator reserved for this job's model (keys are granted for it)."""
        return self.manifest().record

    def granted(self, prefix: str, verb: str) -> list[str]:
        """The keys under `prefix` that this pod may use with `verb`, sorted."""
        return sorted(k for k, urls in self.manifest().objects.items()
                      if k.startswith(prefix) and verb in urls)

    def _url(self, key: str, verb: str) -> str:
        manifest = self.manifest()
        url = manifest.objects.get(store.check_key(key), {}).get(verb)
        if url is None:
            raise NotGranted(
                f"zoo object {key!r}: this pod may not {verb} it; its zoo access "
                f"({self.path}) grants only its job's objects (its checkpoint, profile and "
                "record, and the parents it may start from); a pinned or decided parent is "
                "granted by the operator when it creates the pod")
        return url

    def put_bytes(self, key: str, data: bytes) -> None:
        """Upload `data` with the key's presigned PUT URL.

        Raises:
            NotGranted: no PUT URL for the key.
            store.StoreUnavailable: unreachable after retries.
            store.StoreMisconfigured: S3 refused the URL (expired or revoked).
        """
        self._request("put", key, body=data)

    def get_bytes(self, key: str) -> bytes:
        """Download the object under `key`.

        Raises:
            store.ObjectNotFound: no object under the key.
            NotGranted: no GET URL for the key.
            store.StoreUnavailable: unreachable after retries.
            store.StoreMisconfigured: S3 refused the URL.
        """
        return self._request("get", key).data

    def list_keys(self, prefix: str) -> list[str]:
        """The manifest's keys starting with `prefix`, sorted (the bucket is not listed: a
        granted key may have no object yet)."""
        store.check_prefix(prefix)
        return sorted(k for k in self.manifest().objects if k.startswith(prefix))

    def delete(self, key: str) -> None:
        """Remove the object, if any, with the key's presigned DELETE URL.

        Raises:
            NotGranted: no DELETE URL for the key.
            store.StoreUnavailable: unreachable after retries.
            store.StoreMisconfigured: S3 refused the URL.
        """
        try:
            self._request("delete", key)
        except store.ObjectNotFound:
            return

    def exists(self, key: str) -> bool:
        """Whether an object is stored under `key` (a HEAD request).

        Raises:
            NotGranted: no HEAD URL for the key.
            store.StoreUnavailable: unreachable after retries.
            store.StoreMisconfigured: S3 refused the URL.
        """
        try:
            self._request("head", key)
        except store.ObjectNotFound:
            return False
        return True

    def size_bytes(self, key: str) -> int:
        """The object's size, from a HEAD request.

        Raises:
            store.ObjectNotFound: no object under the key.
            NotGranted: no HEAD URL for the key.
        """
        response = self._request("head", key)
        return int(response.headers.get("Content-Length") or 0)

    def _request(self, verb: str, key: str, *, body: bytes | None = None
                 ) -> urllib3.BaseHTTPResponse:
        """Send one presigned request, retrying transient failures; translate failures."""
        url = self._url(key, verb)
        waits = self._retry.backoffs_seconds()
        last: Exception | str | None = None
        for attempt in range(self._retry.attempts):
            try:
                response = self._http.request(_METHODS[verb], url, body=body,
                                              preload_content=True)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                last = exc  # connection refused/reset, timeouts, DNS
            else:
                if response.status < 300:
                    return response
                code = _error_code(response.data) if verb != "head" else ""
                if response.status == 404:
                    raise store.ObjectNotFound(key, self.describe())
                if response.status in (401, 403) or code in store.CREDENTIAL_CODES:
                    expires = self.manifest().expires.strftime("%Y-%m-%dT%H:%M:%SZ")
                    raise store.StoreMisconfigured(
                        f"S3 refused to {verb} zoo object {key!r} with the presigned URL of "
                        f"{self.path} (HTTP {response.status} {code or ''}; its URLs expire "
                        f"{expires}): the URL expired or its signing key was revoked; the "
                        "operator re-mints the job's <job>-zoo-access Secret before half its "
                        "lifetime has passed: check that it runs, and its --zoo-access-hours")
                if response.status < 500 and code not in store.TRANSIENT_CODES:
                    raise store.StoreUnavailable(
                        f"S3 answered {verb} {key!r} (presigned, {self.path}) with HTTP "
                        f"{response.status} {code}; check the server's logs")
                last = f"HTTP {response.status} {code}"
            if attempt < len(waits):
                self._sleep(waits[attempt])
        raise store.StoreUnavailable(
            f"the zoo is unavailable: {verb} {key!r} through {self.path} failed "
            f"{self._retry.attempts} times over {sum(waits):.1f} s of backoff (last error: "
            f"{last}); check that the S3 server in the manifest's URLs is reachable from the pod")


def _error_code(body: bytes) -> str:
    """The ``<Code>`` of an S3 XML error body, or ''."""
    try:
        return ElementTree.fromstring(body).findtext("Code") or ""
    except ElementTree.ParseError:
        return ""


@dataclasses.dataclass(frozen=True)
class Grants:
    """What one job's pods may do in the zoo: key -> verbs."""

    objects: Mapping[str, frozenset[str]]
    record: str | None = None

    @classmethod
    def of(cls, entries: Iterable[tuple[str, Iterable[str]]], *, record: str | None = None
           ) -> Grants:
        merged: dict[str, set[str]] = {}
        for key, verbs in entries:
            merged.setdefault(store.check_key(key), set()).update(verbs)
        return cls({k: frozenset(v) for k, v in merged.items()}, record)


def mint(zoo: store.S3Store, grants: Grants, *, lifetime: datetime.timedelta,
         now: datetime.datetime) -> Manifest:
    """Sign one presigned URL per granted key and verb with the operator's credential.

    Args:
        zoo: the zoo, opened with the operator's credential.
        grants: the keys and verbs.
        lifetime: how long the URLs work, at most `MAX_LIFETIME`.
        now: the signing time (UTC).

    Raises:
        ValueError: a lifetime outside (0, 7 days].
        store.StoreUnavailable: the bucket's region could not be asked.
    """
    if not datetime.timedelta(0) < lifetime <= MAX_LIFETIME:
        raise ValueError(f"presigned zoo access lifetime {lifetime}: SigV4 allows up to 7 days")
    expiry = zoo.credential_expiry(now)
    if expiry is not None:  # a URL works only while the credential that signed it does
        lifetime = min(lifetime, expiry - now)
        if lifetime < MIN_LIFETIME:
            raise store.StoreUnavailable(
                f"the operator's zoo credential expires at {expiry.isoformat()}, too soon to "
                "sign pods' URLs; it is renewed by its provider (check the operator's "
                "KILN_ZOO_CREDENTIALS / session token settings)")
    objects = {key: {verb: zoo.presigned_url(_METHODS[verb], key, lifetime=lifetime, now=now)
                     for verb in sorted(verbs)}
               for key, verbs in grants.objects.items()}
    return Manifest(expires=(now + lifetime).replace(microsecond=0), record=grants.record,
                    objects=objects)
