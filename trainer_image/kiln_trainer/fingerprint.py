"""Fingerprints of the data a trainer loaded: what a zoo record says its model was trained on.

A fingerprint names its kind: ``content:sha256:<hex>`` (the files or built-in arrays),
``sample:sha256:<hex>`` (an entrypoint's first samples) or ``user:<value>`` (the job's
``spec.dataset.fingerprint``, trusted as given). Computing one never changes the random state.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch

CONTENT = "content:sha256:"
"""Prefix of a fingerprint of the data's bytes (files, or a built-in loader's arrays)."""
SAMPLE = "sample:sha256:"
"""Prefix of a fingerprint of an entrypoint dataset's first samples and its length."""
USER = "user:"
"""Prefix of the job's own ``spec.dataset.fingerprint``."""

SAMPLES = 256
"""Samples of each split an entrypoint's sample fingerprint reads (all if fewer)."""

_CHUNK_BYTES = 1 << 20


def user(value: str) -> str:
    """``user:<value>``: the fingerprint the job set, which no hashing overrides."""
    return USER + value


def of_arrays(*arrays: Any) -> str:
    """The content fingerprint of arrays (numpy or torch): their dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    for array in arrays:
        _add_tensor(digest, torch.as_tensor(array))
    return CONTENT + digest.hexdigest()


def of_files(root: Path, files: Iterable[Path]) -> str:
    """The content fingerprint of local files: each read once and streamed through SHA-256,
    named by its path relative to `root` (a file `root` is named ``""``).

    What the loaders skip anyway (hidden entries, ``__pycache__``: `skipped`) is left out, so
    a byte-compiled cache appearing in a text corpus does not change it. `root` itself is not
    part of it: the same files elsewhere give the same fingerprint.
    """
    entries = []
    for file in files:
        relative = "" if file == root else file.relative_to(root).as_posix()
        if not skipped(relative):
            entries.append((relative, file.stat().st_size, _file_sha256(file)))
    return listed(entries)


def listed(entries: Iterable[tuple[str, int, str]]) -> str:
    """The content fingerprint of a listing of (relative path, size in bytes, content digest),
    in any order: an S3 prefix's objects with their ETags, or `of_files`'s files."""
    lines = sorted(json.dumps([name, size, digest]) for name, size, digest in entries)
    return CONTENT + hashlib.sha256("\n".join(lines).encode()).hexdigest()


def skipped(relative: str) -> bool:
    """Whether a file at this relative path is left out of a folder's fingerprint: hidden
    (a part starting with '.') or under ``__pycache__``."""
    return any(part.startswith(".") or part == "__pycache__"
               for part in PurePosixPath(relative).parts)


def combined(parts: Sequence[str]) -> str:
    """One content fingerprint for several (``path`` and ``validationPath``); one stays as is."""
    if len(parts) == 1:
        return parts[0]
    return CONTENT + hashlib.sha256("\n".join(parts).encode()).hexdigest()


def of_samples(*splits: Any, count: int = SAMPLES) -> str:
    """The sample fingerprint of map-style datasets of (input, target) pairs: each split's
    length and its first `count` samples (inputs and targets as tensors, dtype and shape
    included).

    The samples are read under fixed seeds of torch's, numpy's and Python's global generators,
    all restored afterwards, so random augmentation drawn from them reads the same every run.
    Data that changes beyond those samples keeps the fingerprint: it is a sample, not the
    content.
    """
    digest = hashlib.sha256()
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        try:
            for split in splits:
                length = len(split)
                digest.update(f"split {length}\n".encode())
                for index in range(min(count, length)):
                    inputs, target = split[index]
                    _add_tensor(digest, torch.as_tensor(inputs))
                    _add_tensor(digest, torch.as_tensor(target))
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
    return SAMPLE + digest.hexdigest()


def _add_tensor(digest: Any, tensor: torch.Tensor) -> None:
    """Feed a tensor's dtype, shape and bytes (CPU, contiguous) to `digest`."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    digest.update(f"{flat.dtype} {list(tensor.shape)}\n".encode())
    digest.update(flat.view(torch.uint8).numpy().tobytes())


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def same_data(parent: str | None, child: str | None) -> bool | None:
    """Whether two fingerprints say the same data: True or False when both are of one kind,
    None when either is unknown or their kinds differ (a content hash says nothing about a
    user's version string)."""
    if not parent or not child or kind(parent) != kind(child):
        return None
    return parent == child


def kind(value: str) -> str:
    """A fingerprint's kind: ``content``, ``sample``, ``user`` or ``spec``."""
    return value.split(":", 1)[0]


def short(value: str) -> str:
    """The fingerprint cut for a sentence: its kind and 12 hex digits, or 40 characters."""
    for prefix in (CONTENT, SAMPLE):
        if value.startswith(prefix):
            return value[: len(prefix) + 12] + "…"
    return value if len(value) <= 40 else value[:39] + "…"
