"""A job's sources made local: s3:// objects on any S3 server, hf:// repositories, paths.

`fetch` lists an s3:// source, names its cache entry by content (`content_key`: relative keys,
sizes, ETags), and downloads a missing entry into a temporary folder, checks every file against
the listing (`verify`), then renames it into place, so no half-written copy is ever used. The
initializer writes what it fetched to a `Manifest`, which the trainer reads (`local_copy`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import certifi
import minio
import minio.error
import urllib3
import urllib3.exceptions

from kiln import api, contract
from kiln.zoo import store

DEFAULT_CACHE = Path(tempfile.gettempdir()) / "kiln-data"
DEFAULT_SECRETS_DIR = Path("~/.kiln/secrets")
# The keys of a secretRef's Secret, and the zoo variables each stands for (`s3_settings`).
SECRET_KEYS: Mapping[str, str] = {
    "endpoint": contract.Env.ZOO_ENDPOINT, "accessKey": contract.Env.ZOO_ACCESS_KEY,
    "secretKey": contract.Env.ZOO_SECRET_KEY, "sessionToken": contract.Env.ZOO_SESSION_TOKEN,
    "region": contract.Env.ZOO_REGION}
_PLAIN_ETAG = re.compile(r"[0-9a-f]{32}")  # a single-part upload's ETag: the MD5 of the object
_CHUNK = 1 << 20
_log = logging.getLogger(__name__)
# Per attempt, as the zoo's store has them: minio's own are 5 minutes each, retried five times,
# so a server that accepts connections and never answers would hold a job for half an hour.
CONNECT_TIMEOUT_SECONDS = 5.0
READ_TIMEOUT_SECONDS = 60.0  # idle time between bytes, not a download's whole time
# A download's scratch folder untouched this long was left by a process that died (a live one
# writes at least every READ_TIMEOUT_SECONDS); the next download from that cache removes it.
STALE_SCRATCH_SECONDS = 3600.0


class SourceError(ValueError):
    """A source that cannot be made local; the message names the field and the fix."""


@dataclasses.dataclass(frozen=True)
class Listed:
    """One object of an s3:// source, as listed: its path in the local copy, size and ETag."""

    relative: str
    size: int
    etag: str


@dataclasses.dataclass(frozen=True)
class Fetched:
    """A source made local.

    Attributes:
        uri: the source as the spec names it.
        secret: its secretRef's name ("" for none).
        path: the local file or folder.
        objects: an s3:// source's listing (a lone object's relative path is its name); () else.
        single: the uri named one object (`path` is that file), not a prefix.
        downloaded: this call downloaded it (False: found in the cache, or not s3://).
    """

    uri: str
    secret: str
    path: str
    objects: tuple[Listed, ...] = ()
    single: bool = False
    downloaded: bool = False


def content_key(objects: Sequence[Listed], *, single: bool) -> str:
    """The cache entry's name: a SHA-256 of the listing (relative paths, sizes, ETags), so the
    same content under any bucket, prefix or server shares one entry."""
    listing = [[o.relative, o.size, o.etag] for o in sorted(objects, key=lambda o: o.relative)]
    return hashlib.sha256(json.dumps([single, listing]).encode()).hexdigest()[:32]


def secret_folder(name: str, environ: Mapping[str, str]) -> Path:
    """Where the keys of Secret `name` are files: ``$KILN_SECRETS_DIR/<name>``."""
    root = environ.get(contract.Env.SECRETS_DIR) or str(DEFAULT_SECRETS_DIR)
    return Path(root).expanduser() / name


def s3_settings(secret: str, *, field: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The zoo variables (`contract.Env`) for an s3:// source: the zoo's own from `environ`
    without a secretRef, else the Secret's keys (`SECRET_KEYS`) read from `secret_folder`.

    Raises:
        SourceError: the Secret's folder is missing, or it has no endpoint key.
    """
    if not secret:
        return dict(environ)
    folder = secret_folder(secret, environ)
    fix = (f"kubectl create secret generic {secret} --from-literal=endpoint=HOST:PORT "
           "--from-literal=accessKey=... --from-literal=secretKey=... (`kiln run`: one file per "
           f"key in {folder})")
    if not folder.is_dir():
        raise SourceError(f"{field}: its secretRef, Secret {secret}, is not there ({folder} "
                          f"is missing); create it: {fix}")
    settings = {}
    for key, variable in SECRET_KEYS.items():
        path = folder / key
        if path.is_file():
            settings[variable] = path.read_text(encoding="utf-8").strip()
    if not settings.get(contract.Env.ZOO_ENDPOINT):
        raise SourceError(f"{field}: its secretRef, Secret {secret}, has no key endpoint (the "
                          f"S3 server, host:port or http(s)://host:port); add it: {fix}")
    pair = {key: bool(settings.get(SECRET_KEYS[key])) for key in ("accessKey", "secretKey")}
    if len(set(pair.values())) == 2:  # the zoo's own message would name its variables
        missing = next(key for key, there in pair.items() if not there)
        raise SourceError(f"{field}: its secretRef, Secret {secret}, has an empty or no key "
                          f"{missing}; give accessKey and secretKey both (or neither: "
                          f"anonymous): {fix}")
    return settings


def fetch(uri: str, *, field: str, secret: str = "", environ: Mapping[str, str],
          cache: Path) -> Fetched:
    """`uri` made local: a path as it is; an s3:// source copied into `cache` once per content.

    Raises:
        SourceError: a bad uri, an hf:// source without the Hub, a missing Secret or endpoint,
            bad credentials, no such bucket, nothing under the key, a key leaving its folder,
            a download that does not match its listing, or a cache that cannot be written.
        store.StoreUnavailable: the S3 server did not answer.
    """
    try:
        source = api.split_source(uri)
    except ValueError as exc:
        raise SourceError(f"{field}: {exc}") from None
    if source.scheme == "path":
        return Fetched(uri, secret, source.key)
    if source.scheme == "hf":
        return _hub(uri, source, field=field, cache=cache)
    settings = s3_settings(secret, field=field, environ=environ)
    endpoint = settings.get(contract.Env.ZOO_ENDPOINT, "").strip()
    if not endpoint:
        raise SourceError(f"{field}: {uri} needs the S3 server address; set "
                          f"{contract.Env.ZOO_ENDPOINT} (the zoo's endpoint, host:port), or "
                          "give the source a secretRef whose Secret has an endpoint key")
    try:
        host, secure = store.parse_endpoint(endpoint)
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=CONNECT_TIMEOUT_SECONDS, read=READ_TIMEOUT_SECONDS),
            retries=urllib3.Retry(total=3, read=1, backoff_factor=0.5,
                                  status_forcelist=(500, 502, 503, 504)),
            cert_reqs="CERT_REQUIRED", ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where())
        client = minio.Minio(host, credentials=store.credentials_provider(settings),
                             secure=secure, region=settings.get(contract.Env.ZOO_REGION) or None,
                             http_client=http)
        objects, single = _list(client, source, field=field)
        _remove_stale_scratch(cache)
        entry = cache / content_key(objects, single=single)
        downloaded = not _intact(entry, objects)
        if downloaded:
            _download(client, source, objects, entry, single=single, field=field)
    except SourceError:
        raise
    except minio.error.S3Error as exc:
        keyless = not secret and store.credentials_provider(settings) is None  # anonymous
        raise SourceError(f"{field}: cannot read {uri} ({exc.code}: {exc.message}); check "
                          "the bucket, the key and the credentials" + (
                              " (none were given: pods hold no zoo credentials when the "
                              "operator gives them presigned URLs, its default; give the "
                              "source a secretRef)" if keyless else "")) from None
    except (minio.error.ServerError, urllib3.exceptions.HTTPError, ConnectionError) as exc:
        raise store.StoreUnavailable(f"S3 server {endpoint} for {field} {uri}: {exc}"
                                     ) from None
    except OSError as exc:
        raise SourceError(f"{field}: cannot cache {uri} in {cache} ({exc}); set "
                          f"{contract.Env.DATA_CACHE} to a writable folder") from None
    except ValueError as exc:  # a malformed endpoint, half a credential pair
        raise SourceError(f"{field}: {uri}: {exc}") from None
    local = entry / objects[0].relative if single else entry
    return Fetched(uri, secret, str(local), tuple(objects), single, downloaded)


def verify(folder: Path, objects: Sequence[Listed]) -> None:
    """Check a downloaded copy against its listing: every file's size, and its MD5 where the
    ETag is one (single-part uploads).

    Raises:
        SourceError: a file is missing or differs (the object changed while downloading).
    """
    for obj in objects:
        path = folder.joinpath(*PurePosixPath(obj.relative).parts)
        size = path.stat().st_size if path.is_file() else -1
        if size != obj.size:
            raise SourceError(f"{obj.relative}: downloaded {max(size, 0)} bytes, listed "
                              f"{obj.size}; it changed while downloading, try again")
        etag = obj.etag.strip('"')
        if _PLAIN_ETAG.fullmatch(etag):
            digest = hashlib.md5(usedforsecurity=False)
            with path.open("rb") as file:
                while chunk := file.read(_CHUNK):
                    digest.update(chunk)
            if digest.hexdigest() != etag:
                raise SourceError(f"{obj.relative}: its MD5 is not its ETag {etag}; it changed "
                                  "while downloading, try again")


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What an initializer fetched, for the trainer: ``{"sources": [Fetched...]}`` as JSON."""

    sources: tuple[Fetched, ...]

    def write(self, path: Path) -> None:
        """Write it atomically (a temporary file renamed into place)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        scratch.write_text(json.dumps({"sources": [
            {**dataclasses.asdict(f), "objects": [dataclasses.asdict(o) for o in f.objects]}
            for f in self.sources]}, indent=1), encoding="utf-8")
        os.replace(scratch, path)

    @classmethod
    def read(cls, path: Path) -> Manifest:
        """Read `write`'s file; an absent one is empty.

        Raises:
            SourceError: it is not a manifest (damaged).
        """
        if not path.is_file():
            return cls(())
        try:
            doc: Any = json.loads(path.read_text(encoding="utf-8"))
            return cls(tuple(
                Fetched(**{**f, "objects": tuple(Listed(**o) for o in f["objects"])})
                for f in doc["sources"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise SourceError(f"{path}: not a sources manifest ({exc}); run the initializer "
                              "again") from None

    def find(self, uri: str, secret: str) -> Fetched | None:
        """The copy of `uri` fetched with Secret `secret`, if it is still there."""
        return next((f for f in self.sources if (f.uri, f.secret) == (uri, secret)
                     and Path(f.path).exists()), None)


def cache_root(environ: Mapping[str, str]) -> Path:
    """The cache folder: ``$KILN_DATA_CACHE``, else `DEFAULT_CACHE`."""
    return Path(environ.get(contract.Env.DATA_CACHE) or DEFAULT_CACHE)


def local_copy(uri: str, *, field: str, secret: str = "", environ: Mapping[str, str]
               ) -> Fetched:
    """The trainer's copy of a source: the one the manifest (``$KILN_SOURCES``) names, else
    fetched now (`fetch`, into `cache_root`). Raises as `fetch` does."""
    manifest = environ.get(contract.Env.SOURCES)
    found = Manifest.read(Path(manifest)).find(uri, secret) if manifest else None
    return found or fetch(uri, field=field, secret=secret, environ=environ,
                          cache=cache_root(environ))


def job_sources(spec: api.TrainingJobSpec) -> list[tuple[str, str, str]]:
    """(field, uri, secret name) of each source `spec` downloads before training: s3:// and
    hf:// uris of spec.model.pretrained and spec.dataset."""
    found = []
    pretrained, dataset = spec.model.pretrained, spec.dataset
    for field, uri, ref in (
            ("spec.model.pretrained.uri", pretrained.uri if pretrained else None,
             pretrained.secret_ref if pretrained else None),
            ("spec.dataset.uri", dataset.uri, dataset.secret_ref)):
        if uri is not None and "://" in uri and not uri.startswith("file://"):
            found.append((field, uri, ref.name if ref else ""))
    return found


def _list(client: minio.Minio, source: api.SourceUri, *, field: str
          ) -> tuple[list[Listed], bool]:
    """The objects under the source's key (the one object it names, or those under it as a
    folder), with their paths in the local copy; and whether it named one object."""
    key = source.key
    found = sorted(
        (o for o in client.list_objects(source.bucket, prefix=key or None, recursive=True)
         if o.object_name and not o.is_dir
         and (not key or o.object_name == key or o.object_name.startswith(key + "/"))),
        key=lambda o: str(o.object_name))
    if not found:
        raise SourceError(f"{field}: nothing under s3://{source.bucket}/{key}; upload it "
                          "there or fix the bucket and key")
    single = len(found) == 1 and found[0].object_name == key
    objects = []
    for o in found:
        name = str(o.object_name)
        relative = PurePosixPath(name).name if single else name[len(key):].lstrip("/")
        parts = PurePosixPath(relative).parts
        if not parts or any(part in ("..", ".") for part in parts):
            raise SourceError(f"{field}: object {name!r} has a key that leaves its folder; "
                              "rename it")
        if not single and "/".join(p for p in (key, relative) if p) != name:
            # an empty part ("a//b", "/a"): no folder holds it as named, and "a/b" is another
            # object's key
            raise SourceError(f"{field}: object {name!r} has an empty part in its key ('//' "
                              "or a leading '/'), which no local folder can hold; rename it")
        objects.append(Listed(relative, int(o.size or 0), str(o.etag or "").strip('"')))
    return objects, single


def _intact(entry: Path, objects: Sequence[Listed]) -> bool:
    """Whether the cache entry is there with every file at its listed size. It was verified
    when renamed into place, but a node that crashed before its files reached the disk, or a
    hand in the cache, can leave it short; a damaged entry is moved aside, to download again."""
    if not entry.is_dir():
        return False
    try:
        whole = all(entry.joinpath(*PurePosixPath(o.relative).parts).stat().st_size == o.size
                    for o in objects)
    except OSError:
        whole = False
    if not whole:
        _log.warning("cache entry %s differs from its listing; downloading it again", entry)
        aside = entry.parent / f".{entry.name}.{uuid.uuid4().hex[:8]}.damaged"
        with contextlib.suppress(FileNotFoundError):  # another download moved it first
            os.rename(entry, aside)
        shutil.rmtree(aside, ignore_errors=True)
    return whole


def _remove_stale_scratch(cache: Path) -> None:
    """Remove the scratch folders of downloads that died (killed mid-way): nothing uses them,
    and the cache may be a volume shared by many pods, so only those untouched for
    STALE_SCRATCH_SECONDS go (another pod's download in progress is newer)."""
    now = time.time()
    for scratch in cache.glob(".*.partial") if cache.is_dir() else ():
        try:
            newest = max(p.stat().st_mtime for p in (scratch, *scratch.rglob("*")))
        except OSError:  # removed meanwhile
            continue
        if now - newest > STALE_SCRATCH_SECONDS:
            _log.info("removing %s: a download into it stopped %.0f s ago", scratch, now - newest)
            shutil.rmtree(scratch, ignore_errors=True)


def _download(client: minio.Minio, source: api.SourceUri, objects: Sequence[Listed],
              entry: Path, *, single: bool, field: str) -> None:
    """Download `objects` into a temporary folder beside `entry`, `verify` it, rename it into
    place; a concurrent download that finished first wins (its copy is the same content)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    scratch = entry.parent / f".{entry.name}.{uuid.uuid4().hex[:8]}.partial"
    try:
        for obj in objects:
            name = source.key if single else "/".join(p for p in (source.key, obj.relative) if p)
            target = scratch.joinpath(*PurePosixPath(obj.relative).parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            client.fget_object(source.bucket, name, str(target))
        try:
            verify(scratch, objects)
        except SourceError as exc:
            raise SourceError(f"{field}: {exc}") from None
        try:
            os.rename(scratch, entry)
        except OSError:
            if not entry.is_dir():  # not a concurrent download that finished first
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _hub(uri: str, source: api.SourceUri, *, field: str, cache: Path) -> Fetched:
    """An hf:// repository through huggingface_hub's own cache (which never exposes a partial
    file); any failure to reach the Hub is a `SourceError` saying so."""
    repo = f"{source.bucket}/{source.key}"
    no_hub = (f"{field}: {uri} needs network access to the Hugging Face Hub, which this "
              f"machine does not have; download it where there is (`hf download "
              f"{repo} --local-dir DIR`) and give DIR, or an s3:// copy, as {field}")
    try:
        import huggingface_hub
        import huggingface_hub.errors
    except ImportError:
        raise SourceError(f"{no_hub} (huggingface_hub is not installed: pip install "
                          "'kiln-operator[trainer]')") from None
    try:
        path = huggingface_hub.snapshot_download(repo, cache_dir=str(cache / "hf"))
    except huggingface_hub.errors.RepositoryNotFoundError:
        raise SourceError(f"{field}: {uri}: no such repository on the Hugging Face Hub "
                          "(or it is private); check org/name") from None
    except (huggingface_hub.errors.LocalEntryNotFoundError,
            huggingface_hub.errors.OfflineModeIsEnabled, OSError) as exc:
        raise SourceError(f"{no_hub} ({type(exc).__name__})") from None
    return Fetched(uri, "", str(path))
