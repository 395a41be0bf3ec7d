"""The trainer's tests run torch on one intra-op thread: tiny models are fastest so, steady on a
shared 2-core machine, and the freezing reference process takes the other core."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
