"""A benchmark script run as ``python bench/NAME.py ARGS`` would run it, in a process forked from
a multiprocessing fork server that imported torch and Kiln once (`start`): a fresh interpreter
spends longer importing them than most `--quick` runs spend working.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
from multiprocessing.process import BaseProcess
from pathlib import Path

# What the fork server imports before it forks anything.
PRELOAD = ["torch", "kiln_trainer.loop"]


def start(path: Path, args: list[str], output: Path) -> BaseProcess:
    """Start `path` with `args` (stdout and stderr to `output`) in a child of the fork server.

    The server is a process of its own with no thread but its main one (unlike a pytest-xdist
    worker, whose threads make a plain fork unsafe), started on first use and kept.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    process = context.Process(target=_run, args=(path, args, output), daemon=False)
    process.start()
    return process


def _run(path: Path, args: list[str], output: Path) -> None:
    with output.open("w", encoding="utf-8") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    sys.stdout = open(1, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
    os.environ["OMP_NUM_THREADS"] = "1"  # the benchmarks' own processes: one thread each
    # A forkserver child inherits "forkserver" as its default start method: a process pool of
    # the script's (the zoo index's) would then start a fresh server, whose workers each import
    # torch again (15 CPU-seconds in the zoo query's). A script's own run has the default.
    multiprocessing.set_start_method(None, force=True)
    import torch

    torch.set_num_threads(1)
    sys.argv = [str(path), *args]
    runpy.run_path(str(path), run_name="__main__")
