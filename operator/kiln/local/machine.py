"""This machine's devices for a planned `kiln run`: GPUs here, else CPU worker slots.

Each CPU slot runs one trainer process with cores // slots torch threads (OMP_NUM_THREADS wins
when set). No planning, no launching (`kiln.local.runplan` does both).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import torch

from kiln import contract
from kiln.placement import profile

Launcher = Callable[[int, Sequence[str]], list[str]]


@dataclasses.dataclass(frozen=True)
class Devices:
    """This machine's devices for a planned run.

    Attributes:
        kind: "cpu" or "cuda:<GPU name>" (`profile.device_type`).
        count: GPUs used, or CPU worker slots.
        threads: torch threads per trainer process (CPU: cores // slots).
        launcher: builds the k-process trainer command; None when only single runs here.
    """

    kind: str
    count: int
    threads: int
    launcher: Launcher | None

    @property
    def gpu(self) -> bool:
        return self.kind.startswith("cuda")

    @property
    def noun(self) -> str:
        return "GPUs" if self.gpu else "CPU slots"

    def parallelisms(self) -> tuple[str, ...]:
        if self.launcher is None or self.count < 2:
            return ("single",)
        return ("single", "ddp", "fsdp") if self.gpu else ("single", "ddp")


def default_slots() -> int:
    """CPU worker slots when --slots is not given: half the cores, at least 1."""
    return max(1, (os.cpu_count() or 2) // 2)


def local_devices(slots: int | None) -> Devices:
    """The GPUs here (at most `slots` of them), else `slots` CPU slots (default_slots()).

    Raises:
        ValueError: more CPU slots than cores (`check_slots`).
    """
    cores = os.cpu_count() or 1
    kind = check_slots(slots)
    if kind.startswith("cuda"):
        count = min(torch.cuda.device_count(), slots or torch.cuda.device_count())
    else:
        count = slots or default_slots()
    launcher = contract.trainer_command if count > 1 else None
    return Devices(kind, count, max(1, cores // count), launcher)


def check_slots(slots: int | None) -> str:
    """This machine's device type ("cpu" or "cuda:<name>") if `slots` fit it.

    Raises:
        ValueError: more CPU slots than cores, on a machine without GPUs (each slot needs a
            core of its own).
    """
    kind = profile.device_type("auto")
    cores = os.cpu_count() or 1
    if not kind.startswith("cuda") and slots is not None and slots > cores:
        raise ValueError(f"--slots {slots}: this machine has {cores} CPU cores and no GPU; "
                         f"use at most --slots {cores}")
    return kind

