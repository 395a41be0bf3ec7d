"""Every global RNG's state (Python, NumPy, torch CPU and CUDA) as checkpoint-safe values.

`rng_state` returns the states as tensors and plain Python values only, so a checkpoint holding
them loads with ``torch.load(weights_only=True)`` (NumPy's key array travels as an int64
tensor); `set_rng_state` restores them, CUDA's only when the device count matches.

Callers: `kiln_trainer.checkpoint` (which keeps them under `RNG_KEY` and `RANK_RNG_KEY`, and
re-exports both names). Non-goals: no seeding policy (`kiln_trainer.runtime.seed_everything`,
`checkpoint.set_rank_rng_state`), no I/O.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain values (loadable with weights_only=True)."""
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "python": random.getstate(),
        "numpy": [torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss),
                  float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned; CUDA states only when the device count matches."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])
