"""A text classification dataset for the BERT example: is a byte window code or prose?

Entrypoint ``corpus:code_or_prose`` for ``spec.dataset.entrypoint``: windows of Python sources
(class 0) and of Markdown pages (class 1), read from local folders (nothing is downloaded).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils import data


class Windows(data.Dataset[tuple[torch.Tensor, int]]):
    """Byte windows and their class: (LongTensor[T], class index)."""

    def __init__(self, windows: torch.Tensor, labels: list[int]) -> None:
        self.windows = windows
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.windows[index], self.labels[index]


def code_or_prose(*, code: str = "operator/kiln", prose: str = "docs", length: int = 64,
                  per_class: int = 1000, validation_fraction: float = 0.2,
                  seed: int = 0) -> tuple[Windows, Windows]:
    """Balanced windows of `length` bytes from `code` (*.py) and `prose` (*.md) folders.

    Args:
        code: folder of Python sources (class 0), relative to the working directory.
        prose: folder of Markdown pages (class 1).
        length: T, the window length in bytes.
        per_class: windows per class (fewer when a folder holds less text).
        validation_fraction: share of each class held out for validation.
        seed: seeds the shuffle and the split.

    Raises:
        ValueError: a folder holds no matching file.
    """
    generator = torch.Generator().manual_seed(seed)
    train, validation = [], []
    for label, (folder, pattern) in enumerate(((code, "*.py"), (prose, "*.md"))):
        files = sorted(Path(folder).rglob(pattern))
        if not files:
            raise ValueError(f"{folder}: no {pattern} files (run from the repository root)")
        raw = b"\n".join(f.read_bytes() for f in files)
        count = min(per_class, len(raw) // length)
        tokens = torch.frombuffer(bytearray(raw[: len(raw) // length * length]), dtype=torch.uint8)
        windows = tokens.view(-1, length).long()
        picked = windows[torch.randperm(len(windows), generator=generator)[:count]]
        held = max(1, int(count * validation_fraction))
        validation += [(w, label) for w in picked[:held]]
        train += [(w, label) for w in picked[held:]]
    return _stack(train), _stack(validation)


def _stack(pairs: list[tuple[torch.Tensor, int]]) -> Windows:
    return Windows(torch.stack([w for w, _ in pairs]), [label for _, label in pairs])
