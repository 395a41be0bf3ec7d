"""Objects of one collection kept current by a watch, as client-go's informer keeps them.

Each (re)connection asks for the initial events (``sendInitialEvents``) and swaps in the view
they give once the API server's initial-events-end bookmark says that it is complete.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

from kubesim import client

RETRY_SECONDS = 0.5
INITIAL_EVENTS_END = "k8s.io/initial-events-end"


class Informer:
    """The objects of a collection by uid, kept by a watch in a daemon thread.

    `objects` is replaced or changed only by that thread: read it by key (``get``, ``in``),
    never iterate it from another thread; `take_changed` says which uids to look at again.

    Args:
        url: the API server's base URL.
        path: the collection, e.g. ``/api/v1/pods`` (every namespace).
        user_agent: sent with the watch request.
        changed: called (from the watch thread) after each change.
        errors: where a broken watch is reported before it reconnects.
    """

    def __init__(self, url: str, path: str, *, user_agent: str, changed: Callable[[], None],
                 errors: list[str]) -> None:
        parts = urllib.parse.urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.path = path
        self.user_agent = user_agent
        self.objects: dict[str, dict[str, Any]] = {}
        self._changed = changed
        self._errors = errors
        self._dirty: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._socket: socket.socket | None = None
        self._thread = threading.Thread(target=self._main, name="kubesim-informer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the watch (its connection shut, so a blocked read returns) and the thread."""
        self._stop.set()
        sock = self._socket
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed
        self._thread.join(timeout=30)

    def take_changed(self) -> set[str]:
        """The uids added, changed or removed since the last call."""
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        return dirty

    def _main(self) -> None:
        while not self._stop.is_set():
            try:
                self._watch()
            except (OSError, http.client.HTTPException, ValueError, client.ApiError) as exc:
                if self._stop.is_set():
                    return
                self._errors.append(f"watch {self.path}: {type(exc).__name__}: {exc}")
            self._stop.wait(RETRY_SECONDS)

    def _watch(self) -> None:
        """One watch connection: the initial events, then each change until it ends."""
        connection = http.client.HTTPConnection(self.host, self.port)
        try:
            connection.connect()
            self._socket = connection.sock
            if self._stop.is_set():
                return
            connection.request("GET", f"{self.path}?watch=true&sendInitialEvents=true"
                               "&allowWatchBookmarks=true&resourceVersionMatch=NotOlderThan",
                               headers={"User-Agent": self.user_agent,
                                        "Accept": "application/json"})
            response = connection.getresponse()
            if response.status != 200:
                raise client.ApiError(response.status, "GET", self.path,
                                      response.read().decode(errors="replace"))
            initial: dict[str, dict[str, Any]] | None = {}
            while line := response.readline():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                meta = obj.get("metadata") or {}
                if kind == "BOOKMARK":
                    if initial is not None and (meta.get("annotations") or {}).get(
                            INITIAL_EVENTS_END) == "true":
                        self._replace(initial)
                        initial = None
                    continue
                if kind == "ERROR":
                    raise ConnectionError(f"the watch ended with {obj}")
                uid, gone = str(meta.get("uid", "")), kind == "DELETED"
                if initial is None:
                    self._apply(uid, None if gone else obj)
                elif gone:
                    initial.pop(uid, None)
                else:
                    initial[uid] = obj
            if not self._stop.is_set():
                raise ConnectionError("the API server ended the watch")
        finally:
            self._socket = None
            connection.close()

    def _replace(self, objects: dict[str, dict[str, Any]]) -> None:
        with self._lock:
            self._dirty |= self.objects.keys() | objects.keys()
            self.objects = objects
        self._changed()

    def _apply(self, uid: str, obj: dict[str, Any] | None) -> None:
        with self._lock:
            if obj is None:
                self.objects.pop(uid, None)
            else:
                self.objects[uid] = obj
            self._dirty.add(uid)
        self._changed()
