"""Object stores for the model zoo and checkpoints: the one namespace callers import.

`ObjectStore` is where the local runner and the cluster differ (STYLE B1.5): `DirStore` keeps
objects as files under a directory (the embedded default ``./.kiln/zoo``); `S3Store` keeps them
in a bucket of MinIO or any S3-compatible server. `open_store(uri)` picks one from a zoo URI,
reading the S3 endpoint and credentials from the environment.

Callers import this module only (``from kiln.zoo import store``; `store.DirStore`,
`store.open_store`, ...): `kiln.zoo.records` (the zoo layout), the trainer's checkpoints, the
CLI, the operator. The code lives in three modules below it, re-exported here under the names
the contract gives them (CONTRACTS.md, kiln.zoo):

  * `objectstore`: the `ObjectStore` protocol, `ObjectNotFound` and `StoreUnavailable`, and
    the key rules (`check_key`, `check_prefix`);
  * `dirstore`: `DirStore`;
  * `s3store`: `S3Store`, its `RetryPolicy` and `parse_endpoint`, and the ``KILN_ZOO_*``
    environment variable names.

Non-goals: no zoo layout or record format (see `records`), no caching, never imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import unquote, urlsplit

from kiln.zoo import dirstore, objectstore, s3store

# Re-exports: the contract's names for the store layer, so call sites keep `store.X`.
ObjectStore = objectstore.ObjectStore
ObjectNotFound = objectstore.ObjectNotFound
StoreUnavailable = objectstore.StoreUnavailable
check_key = objectstore.check_key
check_prefix = objectstore.check_prefix
DirStore = dirstore.DirStore
S3Store = s3store.S3Store
RetryPolicy = s3store.RetryPolicy
parse_endpoint = s3store.parse_endpoint
ENDPOINT_ENV = s3store.ENDPOINT_ENV
ACCESS_KEY_ENV = s3store.ACCESS_KEY_ENV
SECRET_KEY_ENV = s3store.SECRET_KEY_ENV
REGION_ENV = s3store.REGION_ENV
AWS_ACCESS_KEY_ENV = s3store.AWS_ACCESS_KEY_ENV
AWS_SECRET_KEY_ENV = s3store.AWS_SECRET_KEY_ENV

DEFAULT_ZOO_URI = "./.kiln/zoo"
"""The local zoo used when no ``--zoo``/``KILN_ZOO`` is given (relative to the working dir)."""


def open_store(uri: str, *, env: Mapping[str, str] | None = None) -> objectstore.ObjectStore:
    """Open the store a zoo URI names.

    ``/some/dir``, ``./rel/dir`` or ``file:///some/dir`` give a `DirStore`;
    ``s3://bucket[/prefix]`` gives an `S3Store` whose endpoint comes from ``KILN_ZOO_ENDPOINT``
    (``host:port`` or ``http(s)://host:port``), credentials from ``KILN_ZOO_ACCESS_KEY`` and
    ``KILN_ZOO_SECRET_KEY`` (else ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY``; neither
    pair: anonymous) and an optional region from ``KILN_ZOO_REGION``. Nothing is contacted yet.

    Args:
        uri: the zoo URI, e.g. `DEFAULT_ZOO_URI`.
        env: environment variables (default: `os.environ`).

    Raises:
        ValueError: empty URI, unknown scheme, ``file://`` with a host, ``s3://`` without a
            bucket or without ``KILN_ZOO_ENDPOINT``, or only one half of a credential pair.
    """
    env = os.environ if env is None else env
    if not uri.strip():
        raise ValueError(f"zoo URI is empty; use a directory, e.g. {DEFAULT_ZOO_URI}")
    if "://" not in uri:
        return dirstore.DirStore(Path(uri))
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise ValueError(f"zoo URI {uri!r}: write file:///absolute/path, or just a path")
        return dirstore.DirStore(Path(unquote(parts.path)))
    if scheme != "s3":
        raise ValueError(
            f"zoo URI {uri!r}: unsupported scheme {parts.scheme!r}; use a directory path, "
            "file:///path or s3://bucket[/prefix]"
        )
    if not parts.netloc:
        raise ValueError(f"zoo URI {uri!r}: name the bucket, as in s3://bucket[/prefix]")
    endpoint = env.get(ENDPOINT_ENV, "").strip()
    if not endpoint:
        raise ValueError(
            f"zoo URI {uri!r} needs the S3 server address: pass --zoo-endpoint or set "
            f"{ENDPOINT_ENV} to host:port or http(s)://host:port"
        )
    access_key, secret_key = credentials_from_env(env)
    return s3store.S3Store(
        endpoint, parts.netloc, access_key=access_key, secret_key=secret_key,
        region=env.get(REGION_ENV) or None, prefix=unquote(parts.path),
    )


def credentials_from_env(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """S3 (access key, secret key) from Kiln's variables, else AWS's; (None, None) if neither.

    Raises:
        ValueError: a pair is half set (e.g. KILN_ZOO_ACCESS_KEY without KILN_ZOO_SECRET_KEY).
    """
    for access_name, secret_name in (
        (ACCESS_KEY_ENV, SECRET_KEY_ENV), (AWS_ACCESS_KEY_ENV, AWS_SECRET_KEY_ENV)
    ):
        access, secret = env.get(access_name) or None, env.get(secret_name) or None
        if access and secret:
            return access, secret
        if access or secret:
            missing = secret_name if access else access_name
            raise ValueError(f"S3 credentials: {missing} is not set (set both or neither)")
    return None, None
