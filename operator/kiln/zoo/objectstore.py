"""The `ObjectStore` protocol, its two errors, and the key rules every store enforces.

Keys are ``/``-separated relative names (``models/<id>/meta.json``); `check_key` rejects empty
components, ``.``/``..``, absolute keys and the reserved temporary-file prefix, so a key can
never leave its store. `ObjectNotFound` (a `KeyError`) means a missing key; `StoreUnavailable`
means the store cannot be reached or refuses us (network, credentials, permissions, full disk).

Callers: `dirstore` and `s3store` (the implementations), and through `store`, which re-exports
these names, everyone else. Non-goals: no I/O, no implementation, never imports torch.
"""

from __future__ import annotations

from typing import Protocol

TMP_PREFIX = ".kiln-tmp-"
"""Reserved for temporary files: `dirstore.DirStore` writes into files named so, then renames
them into place; keys may not use it, and listings hide it."""


class StoreUnavailable(RuntimeError):
    """The store cannot be reached or refuses the request; the message says what to check."""


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
