"""Shared plumbing for Kiln's benchmarks: result files and plots.

Every benchmark prints a table, writes `bench/results/<name>.json` with a top-level `summary`
object, and a PNG plot beside it. Benchmarks are not tests: nothing here asserts on speed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
    }


def write_results(name: str, summary: dict[str, Any], details: dict[str, Any]) -> Path:
    """Write bench/results/<name>.json: {summary, details, machine, created}."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {
        "summary": summary,
        "details": details,
        "machine": machine(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def arguments(doc: str, quick_help: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser: the docstring's first line and ``--quick``."""
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    return parser


def one_thread(log_level: int = logging.WARNING) -> None:
    """Measure on one torch thread (arms compare fairly on a shared machine); quiet logs."""
    torch.set_num_threads(1)
    logging.getLogger().setLevel(log_level)


def save_figure(fig: Any, path: Path, *, title: str | None = None, dpi: int = 100) -> Path:
    """Lay out a matplotlib figure, write it to `path` and close it."""
    import matplotlib.pyplot as plt  # the caller chose the backend (Agg) before

    if title is not None:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_path(name: str) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return RESULTS_DIR / f"{name}.png"
