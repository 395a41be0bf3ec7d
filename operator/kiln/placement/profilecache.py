"""Profile results and their cache file: `Measurement`, its statuses, read, look up, write.

The cache is one JSON file (default ``.kiln/profiles.json``), ``{"version": 1, "entries":
{"<key>": {"step_seconds": 0.012, "status": "ok", ...}}}``, written by `profile` and read by
`estimate`. No measuring, no estimates; never imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from kiln import api

CACHE_VERSION = 1
DEFAULT_CACHE = Path(".kiln/profiles.json")

STATUS_OK, STATUS_OOM, STATUS_UNSUPPORTED, STATUS_FAILED = "ok", "oom", "unsupported", "failed"


class ProfileCacheError(ValueError):
    """The profile cache file exists but cannot be used (not JSON, wrong layout or version)."""


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One config's profile.

    Attributes:
        parallelism: "single", "ddp" or "fsdp".
        gpus: k, devices used (GPUs, or CPU processes).
        step_seconds: wall seconds of the timed (second) mini-batch at the global batch size;
            None unless status is "ok".
        status: "ok", "oom" (infeasible: out of memory), "unsupported" (cannot run here) or
            "failed" (another error; see detail).
        detail: why, for statuses other than "ok".
        cached: True when it came from the cache instead of a run.
    """

    parallelism: str
    gpus: int
    step_seconds: float | None
    status: str
    detail: str = ""
    cached: bool = False

    @property
    def feasible(self) -> bool:
        """False only for a measured out-of-memory (unsupported/failed say nothing)."""
        return self.status != STATUS_OOM


def cache_key(model: api.ModelSpec, *, batch_size: int, parallelism: str, gpus: int,
              kind: str) -> str:
    """The cache key of one config: JSON of (architecture, args, input shape, batch, ...)."""
    return json.dumps([model.label, model.args, list(model.input_shape), batch_size,
                       parallelism, gpus, kind], sort_keys=True, separators=(",", ":"))


def read_cache(path: Path) -> dict[str, dict[str, Any]]:
    """The cache's entries by key; {} when the file does not exist.

    Raises:
        ProfileCacheError: the file is not a version-1 Kiln profile cache (names the file).
    """
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ProfileCacheError(f"profile cache {path}: cannot read it ({exc}); delete it or "
                                "point --cache (kiln profile) or --profile-cache (kiln run) "
                                "elsewhere") from None
    if not isinstance(doc, dict) or doc.get("version") != CACHE_VERSION or \
            not isinstance(doc.get("entries"), dict):
        raise ProfileCacheError(f"profile cache {path}: not a version-{CACHE_VERSION} Kiln "
                                "profile cache; delete it or point --cache (kiln profile) or "
                                "--profile-cache (kiln run) elsewhere")
    entries: dict[str, dict[str, Any]] = doc["entries"]
    return entries


def lookup(entries: dict[str, dict[str, Any]], key: str) -> Measurement | None:
    """The cached measurement under `key`, or None (also for a malformed entry)."""
    entry = entries.get(key)
    if not isinstance(entry, dict):
        return None
    try:
        step = entry.get("step_seconds")
        return Measurement(str(entry["parallelism"]), int(entry["gpus"]),
                           None if step is None else float(step), str(entry["status"]),
                           str(entry.get("detail", "")), cached=True)
    except (KeyError, TypeError, ValueError):
        return None


def write_cache(path: Path, entries: dict[str, dict[str, Any]]) -> None:
    """Atomically replace the cache file (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1, sort_keys=True)
    fd, tmp = tempfile.mkstemp(prefix=".profiles-", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    os.replace(tmp, path)
