"""Warm-start zoo query cost: seconds to score one (parent, child) pair, against ModelKeeper.

Measures `kiln.warmstart.match.similarity` (the call a zoo query makes per candidate) on one
thread, with graphs extracted and prepared beforehand as a zoo index holds them, and reports the
median of several runs per pair. The baseline is the published ModelKeeper C++ matcher
(`modelkeeper/backend/bin/matcher.so`, one thread), whose per-pair times were measured on this
kind of 2-core machine (shared/research/modelkeeper.md §1.2); the .so itself is not run here.
Also times `match.align` (score + backtrack, run once per query for the chosen parent).

Writes bench/results/zoo_query.json (`summary.pair_seconds` {"parent->child": seconds},
`summary.speedup_vs_modelkeeper`, `summary.similarity`) and bench/results/zoo_query.png.
Each measurement is one function returning its part of the summary; `main` runs them in order.

    python bench/zoo_query.py [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import networkx as nx
import torch
import torchvision.models as tvm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

from kiln.warmstart import dag, graph, match

NAME = "zoo_query"
INPUT_SHAPE = (3, 224, 224)
# Published C++ matcher, one thread, seconds per pair (research digest §1.2, [measured]).
MODELKEEPER_CPP_SECONDS = {
    ("resnet18", "resnet34"): 0.11,
    ("resnet50", "resnet101"): 0.65,
    ("densenet121", "resnet50"): 0.81,
}


@dataclasses.dataclass(frozen=True)
class PairTiming:
    """One parent->child pair: sizes, similarity and seconds per call (median and min)."""

    parent: str
    child: str
    parent_nodes: int
    child_nodes: int
    similarity: float
    similarity_seconds: float
    similarity_seconds_min: float
    align_seconds: float
    modelkeeper_seconds: float

    @property
    def label(self) -> str:
        return f"{self.parent}->{self.child}"

    @property
    def speedup(self) -> float:
        return self.modelkeeper_seconds / self.similarity_seconds


def extract_graphs(names: Sequence[str]) -> dict[str, nx.DiGraph]:
    """Architecture graphs of torchvision models (built on the meta device: no weights)."""
    graphs = {}
    for name in names:
        with torch.device("meta"):
            model = getattr(tvm, name)()
        graphs[name] = graph.extract(model, INPUT_SHAPE, name=name)
        dag.prepare(graphs[name]).segments()  # what a zoo index caches per stored model
    return graphs


def _median_seconds(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    fn()  # warm-up (also fills the child's cached self-score, as in a real query)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), min(samples)


def measure_pair_seconds(graphs: dict[str, nx.DiGraph], *, repeats: int) -> list[PairTiming]:
    """Median seconds of `match.similarity` (and `match.align`) per benchmark pair."""
    timings = []
    for (parent, child), cpp_seconds in MODELKEEPER_CPP_SECONDS.items():
        p, c = dag.prepare(graphs[parent]), dag.prepare(graphs[child])
        median, fastest = _median_seconds(functools.partial(match.similarity, p, c), repeats)
        align_median, _ = _median_seconds(functools.partial(match.align, p, c),
                                          max(3, repeats // 4))
        timings.append(PairTiming(
            parent=parent, child=child, parent_nodes=p.n, child_nodes=c.n,
            similarity=match.similarity(p, c), similarity_seconds=median,
            similarity_seconds_min=fastest, align_seconds=align_median,
            modelkeeper_seconds=cpp_seconds))
    return timings


def pair_summary(timings: list[PairTiming]) -> dict[str, Any]:
    """The `summary` entries of the per-pair measurement."""
    return {
        "pair_seconds": {t.label: t.similarity_seconds for t in timings},
        "align_seconds": {t.label: t.align_seconds for t in timings},
        "modelkeeper_cpp_seconds": {t.label: t.modelkeeper_seconds for t in timings},
        "speedup_vs_modelkeeper": {t.label: t.speedup for t in timings},
        "similarity": {t.label: t.similarity for t in timings},
        "min_speedup_vs_modelkeeper": min(t.speedup for t in timings),
    }


def print_pair_table(timings: list[PairTiming]) -> None:
    print(f"{'pair':<24} {'nodes':>9} {'sim':>6} {'kiln s':>9} {'min s':>9} {'align s':>9} "
          f"{'C++ s':>7} {'speedup':>8}")
    for t in timings:
        print(f"{t.label:<24} {t.parent_nodes:>4}x{t.child_nodes:<4} {t.similarity:>6.3f} "
              f"{t.similarity_seconds:>9.4f} {t.similarity_seconds_min:>9.4f} "
              f"{t.align_seconds:>9.4f} {t.modelkeeper_seconds:>7.2f} {t.speedup:>7.0f}x")


def plot_pairs(timings: list[PairTiming], path: Path) -> Path | None:
    """Bar chart, log scale: Kiln similarity and align vs the C++ matcher, per pair."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(timings))
    width = 0.27
    for k, (label, values) in enumerate([
            ("ModelKeeper C++ (published)", [t.modelkeeper_seconds for t in timings]),
            ("Kiln align (score + pairs)", [t.align_seconds for t in timings]),
            ("Kiln similarity (score)", [t.similarity_seconds for t in timings])]):
        ax.bar([x + (k - 1) * width for x in xs], values, width, label=label)
    ax.set_xticks(list(xs), [f"{t.label}\n{t.parent_nodes}x{t.child_nodes} nodes" for t in timings])
    ax.set_yscale("log")
    ax.set_ylabel("seconds per pair (one thread)")
    ax.set_title("Zoo matching cost per parent/child pair")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (CI smoke run)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    repeats = 5 if args.quick else 31
    names = sorted({name for pair in MODELKEEPER_CPP_SECONDS for name in pair})
    graphs = extract_graphs(names)

    timings = measure_pair_seconds(graphs, repeats=repeats)
    summary = pair_summary(timings)
    print_pair_table(timings)

    details = {
        "settings": {"repeats": repeats, "quick": args.quick, "torch_threads": 1,
                     "input_shape": list(INPUT_SHAPE), "statistic": "median seconds per call"},
        "pairs": [dataclasses.asdict(t) for t in timings],
    }
    print(f"wrote {common.write_results(NAME, summary, details)}")
    plot = plot_pairs(timings, common.plot_path(NAME))
    if plot is not None:
        print(f"wrote {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
