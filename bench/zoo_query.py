"""Warm-start zoo query cost: seconds per (parent, child) pair, and per query by zoo size.

Writes bench/results/zoo_query.json and .png (method in the comment below the imports).

    python bench/zoo_query.py [--quick] [--sizes 100,1000,10000] [--queries 20]
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import os
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
import torch
import torchvision.models as tvm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

from kiln import models
from kiln.warmstart import graph, index, match
from kiln.zoo import records

# 1. Pair cost. Measures `kiln.warmstart.match.similarity` (the call a zoo query makes per
#    candidate) on one thread, with graphs extracted and prepared beforehand as a zoo index holds
#    them, and reports the median of several runs per pair. The baseline is the published
#    ModelKeeper C++ matcher (`modelkeeper/backend/bin/matcher.so`, one thread), whose per-pair
#    times were measured on this kind of 2-core machine; the .so itself is not run here.
#    Also times `match.align` (score + backtrack, run once per query for the chosen parent).
# 2. Query latency by zoo size (`measure_query_latency`). A few dozen real graphs (small_resnet
#    blocks/widths, small_cnn depths/widths, vit and char_transformer depths/widths, torchvision
#    resnet18/34/50) are extracted on the meta device; a zoo of N entries is made of variants of
#    them, each with some weight tensors widened in the graph JSON so that all N graphs differ
#    (no help from de-duplication: a worst case). `kiln.warmstart.index.ZooIndex.from_records`
#    loads them; above the exhaustive limit (1,000) clusters are built (CLARA-style k-medoids,
#    kiln.warmstart.clusters). Then held-out children (variants not in the zoo) are queried with
#    their modality and task, after one untimed warm-up query (the operator's pool is persistent).
#    Reports p50/p95 seconds per query, index load and cluster build seconds, peak RSS, and at
#    1,000 models how often a clustered search finds the exhaustive search's best parent.
#
# Writes bench/results/zoo_query.json (`summary.pair_seconds` {"parent->child": seconds},
# `summary.speedup_vs_modelkeeper`, `summary.similarity`, `summary.p50_seconds_at_<N>`,
# `summary.p95_seconds_at_<N>`, `summary.peak_rss_bytes_at_10000`, ...) and
# bench/results/zoo_query.png, zoo_query_png. Each measurement is one function returning
# its part of the summary; `main` runs them in order.

NAME = "zoo_query"
INPUT_SHAPE = (3, 224, 224)
# Published C++ matcher, one thread, seconds per pair (measured on a 2-core machine).
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
        graph.prepare(graphs[name]).segments()  # what a zoo index caches per stored model
    return graphs


def _median_seconds(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    fn()  # warm-up (also fills the child's cached self-score, as in a real query)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), min(samples)


def measure_pair_seconds(graphs: dict[str, nx.DiGraph], *, repeats: int,
                         pairs: dict[tuple[str, str], float] = MODELKEEPER_CPP_SECONDS,
                         ) -> list[PairTiming]:
    """Median seconds of `match.similarity` (and `match.align`) per pair of `pairs` (parent,
    child -> the C++ matcher's seconds)."""
    timings = []
    for (parent, child), cpp_seconds in pairs.items():
        p, c = graph.prepare(graphs[parent]), graph.prepare(graphs[child])
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
    return common.save_figure(fig, path, dpi=120)


# ----------------------------------------------------------------------------------------------
# Query latency by zoo size

ZOO_IMAGE_SHAPE = (3, 32, 32)
ZOO_TEXT_SHAPE = (64,)
ZOO_BASES: list[tuple[str, dict[str, Any]]] = [
    *[("small_resnet", {"blocks": b, "width": w})
      for b in ([1, 1, 1], [2, 2, 2], [3, 3, 3], [1, 2, 3], [2, 2], [1, 1, 1, 1])
      for w in (8, 16, 32)],
    *[("small_cnn", {"depth": d, "width": w}) for d in (2, 3, 4, 5) for w in (16, 32)],
    *[("vit", {"depth": d, "width": w}) for d in (2, 4, 6) for w in (32, 64)],
    *[("char_transformer", {"depth": d, "width": w}) for d in (1, 2, 4, 6) for w in (32, 64)],
    ("resnet18", {}), ("resnet34", {}), ("resnet50", {}),
]
"""The real architectures the generated zoos are variants of (43 graphs, 8-173 nodes)."""


@dataclasses.dataclass(frozen=True)
class BaseGraph:
    """One extracted architecture: registry name, args, modality, task, graph JSON."""

    architecture: str
    args: dict[str, Any]
    input_shape: tuple[int, ...]
    modality: str
    task: str
    doc: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class SizeTiming:
    """Query latency at one zoo size (seconds per query over held-out children)."""

    size: int
    mode: str
    queries: int
    p50_seconds: float
    p95_seconds: float
    cpu_p50_seconds: float
    mean_scored: float
    mean_clusters_visited: float
    timed_out: int
    warmup_seconds: float
    load_seconds: float
    cluster_build_seconds: float | None
    cluster_pairs: int | None
    prepared_bytes: int
    rss_bytes_before_load: int
    rss_bytes_after_load: int
    peak_rss_bytes: int
    peak_worker_rss_bytes: int
    clustered_p50_seconds: float | None = None
    clustered_found_best: float | None = None
    clustered_similarity_ratio: float | None = None


def extract_zoo_bases(architectures: Sequence[tuple[str, dict[str, Any]]] = ZOO_BASES,
                      ) -> list[BaseGraph]:
    """Graph JSON of every (registry name, args) in `architectures` (meta device: no weights)."""
    bases = []
    for name, args in architectures:
        info = models.get_info(name)
        shape = ZOO_TEXT_SHAPE if str(info.modality) == "text" else ZOO_IMAGE_SHAPE
        with torch.device("meta"):
            model = models.get_model(name, input_shape=shape, **args)
        doc = graph.to_json(graph.extract(model, shape, name=name))
        bases.append(BaseGraph(name, args, shape, str(info.modality), str(info.task), doc))
    return bases


def widen(doc: dict[str, Any], rng: random.Random, *, held_out: bool = False) -> dict[str, Any]:
    """A variant: about 30% of weight tensors get +1..8 on every dimension >= 8 (channels).

    A held-out variant also gets +9..12 on one more tensor, so that it differs from every zoo
    variant (those never add more than 8).
    """
    weighted = [k for k, node in enumerate(doc["nodes"]) if max(node["weight_shape"], default=0)
                >= 8]
    bumped = rng.choice(weighted) if held_out and weighted else -1
    nodes = []
    for k, node in enumerate(doc["nodes"]):
        extra = rng.randint(1, 8) if node["weight_shape"] and rng.random() < 0.3 else 0
        extra += rng.randint(9, 12) if k == bumped else 0
        if extra:
            node = dict(node, weight_shape=[d + extra if d >= 8 else d
                                            for d in node["weight_shape"]])
        nodes.append(node)
    return dict(doc, nodes=nodes)


def zoo_entries(bases: Sequence[BaseGraph], n: int, *, seed: int, seen: set[str]
                ) -> Iterator[tuple[records.ZooRecord, dict[str, Any]]]:
    """n (record, graph JSON) pairs, round-robin over the bases, every graph distinct.

    `seen` collects the fingerprints handed out.
    """
    rng = random.Random(seed)
    for k in range(n):
        base = bases[k % len(bases)]
        while True:
            doc = widen(base.doc, rng)
            key = index.fingerprint(doc)
            if key not in seen:
                break
        seen.add(key)
        record = records.ZooRecord(
            id=records.ZooModelId(f"{base.architecture}-{k:08x}"), architecture=base.architecture,
            args=base.args, input_shape=base.input_shape, modality=base.modality, task=base.task,
            dataset="synthetic", metric_name="validation_accuracy", metric_value=0.5,
            validation_accuracy=0.5, num_params=0, created_time="2024-05-01T12:00:00Z",
            job_name=f"bench-{k}", job_spec={})
        yield record, doc


def held_out_children(bases: Sequence[BaseGraph], count: int, *, seed: int
                      ) -> list[tuple[BaseGraph, dict[str, Any]]]:
    """Variants that are in no zoo (`widen(held_out=True)`), of randomly chosen bases."""
    rng = random.Random(seed)
    return [(base, widen(base.doc, rng, held_out=True))
            for base in (bases[rng.randrange(len(bases))] for _ in range(count))]


def _rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes(who: int = resource.RUSAGE_SELF) -> int:
    return resource.getrusage(who).ru_maxrss * 1024  # Linux reports KiB


def _cpu_seconds() -> float:
    """CPU seconds used so far by this process and its live children (the pool's workers).

    Unlike wall time this barely moves when other jobs share the machine's cores.
    """
    total = time.process_time()
    me = str(os.getpid())
    tick = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended meanwhile
        if fields[1] == me:  # ppid; then utime, stime are fields 11 and 12 after the name
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _time_queries(idx: index.ZooIndex, children: Sequence[tuple[BaseGraph, dict[str, Any]]],
                  *, timeout_seconds: float
                  ) -> tuple[list[float], list[float], list[index.QueryResult]]:
    """Wall seconds, CPU seconds (all processes) and result of each query."""
    seconds, cpu_seconds, results = [], [], []
    for base, doc in children:
        cpu_start = _cpu_seconds()
        start = time.perf_counter()
        result = idx.query(doc, modality=base.modality, task=base.task,
                           timeout_seconds=timeout_seconds)
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(_cpu_seconds() - cpu_start)
        results.append(result)
    return seconds, cpu_seconds, results


def _p95(values: Sequence[float]) -> float:
    return float(np.percentile(values, 95))


def measure_query_latency(sizes: Sequence[int] = (100, 1000, 10000), *, queries: int = 20,
                          exhaustive_limit: int = index.EXHAUSTIVE_LIMIT, seed: int = 0,
                          timeout_seconds: float = 120.0, compare_clustered: bool = True,
                          architectures: Sequence[tuple[str, dict[str, Any]]] = ZOO_BASES,
                          ) -> list[SizeTiming]:
    """p50/p95 seconds per zoo query at each size, with build cost and memory (docstring, 2).

    Args:
        sizes: zoo sizes N, measured in increasing order (peak RSS only grows).
        queries: timed held-out queries per size (after one untimed warm-up query).
        exhaustive_limit: the index's exhaustive limit; larger zoos are clustered.
        seed: seeds the zoo variants, the children and the clustering.
        timeout_seconds: per-query deadline (generous: a timeout would flatter latency).
        compare_clustered: at sizes <= the limit, also build clusters and report how often the
            clustered search finds the exhaustive best (`clustered_found_best`).
        architectures: the real architectures the zoo entries are variants of.

    Returns:
        One `SizeTiming` per size.
    """
    bases = extract_zoo_bases(architectures)
    children = held_out_children(bases, queries + 1, seed=seed + 1)
    timings = []
    for n in sorted(sizes):
        gc.collect()
        rss_before_load = _rss_bytes()
        start = time.perf_counter()
        idx = index.ZooIndex.from_records(
            zoo_entries(bases, n, seed=seed, seen=set()),
            settings=index.IndexSettings(exhaustive_limit=exhaustive_limit))
        load_seconds = time.perf_counter() - start
        rss_after_load = _rss_bytes()
        build_seconds = pairs = None
        if n > exhaustive_limit:
            stats = idx.build_clusters(seed=seed)
            build_seconds = sum(s.wall_seconds for s in stats)
            pairs = sum(s.pairs_requested for s in stats)
        warmup = _time_queries(idx, children[:1], timeout_seconds=timeout_seconds)[0][0]
        seconds, cpu_seconds, results = _time_queries(idx, children[1:],
                                                      timeout_seconds=timeout_seconds)
        timing = SizeTiming(
            size=n, mode="/".join(sorted({str(r.mode) for r in results})), queries=len(seconds),
            p50_seconds=statistics.median(seconds), p95_seconds=_p95(seconds),
            cpu_p50_seconds=statistics.median(cpu_seconds),
            mean_scored=statistics.mean(r.scored for r in results),
            mean_clusters_visited=statistics.mean(r.clusters_visited for r in results),
            timed_out=sum(r.timed_out for r in results), warmup_seconds=warmup,
            load_seconds=load_seconds, cluster_build_seconds=build_seconds,
            cluster_pairs=pairs, prepared_bytes=idx.prepared_bytes(),
            rss_bytes_before_load=rss_before_load, rss_bytes_after_load=rss_after_load, peak_rss_bytes=_peak_rss_bytes(),
            peak_worker_rss_bytes=_peak_rss_bytes(resource.RUSAGE_CHILDREN))
        idx.close()
        if compare_clustered and n <= exhaustive_limit and n >= 100:
            timing = _compare_clustered(timing, bases, children[1:], results, seed=seed,
                                        timeout_seconds=timeout_seconds)
        timings.append(timing)
        print(f"zoo of {n}: {timing.mode} p50 {timing.p50_seconds:.3f} s, "
              f"p95 {timing.p95_seconds:.3f} s", flush=True)
        del idx
    return timings


def _compare_clustered(timing: SizeTiming, bases: Sequence[BaseGraph],
                       children: Sequence[tuple[BaseGraph, dict[str, Any]]],
                       exhaustive: Sequence[index.QueryResult], *, seed: int,
                       timeout_seconds: float) -> SizeTiming:
    """Cluster the same zoo (limit lowered) and compare its answers with the exhaustive ones."""
    settings = index.IndexSettings(exhaustive_limit=max(1, timing.size // 10))
    with index.ZooIndex.from_records(zoo_entries(bases, timing.size, seed=seed, seen=set()),
                                     settings=settings) as idx:
        idx.build_clusters(seed=seed)
        seconds, _, results = _time_queries(idx, children, timeout_seconds=timeout_seconds)
    pairs = [(c.best, e.best) for c, e in zip(results, exhaustive)
             if c.mode is index.SearchMode.CLUSTERED and c.best is not None
             and e.best is not None and e.best.similarity > 0]
    if not pairs:
        return timing
    return dataclasses.replace(
        timing, clustered_p50_seconds=statistics.median(seconds),
        clustered_found_best=statistics.mean(c.similarity >= e.similarity - 1e-12
                                             for c, e in pairs),
        clustered_similarity_ratio=statistics.mean(c.similarity / e.similarity
                                                   for c, e in pairs))


def latency_summary(timings: Sequence[SizeTiming]) -> dict[str, Any]:
    """The `summary` entries of the latency measurement, keyed by size."""
    summary: dict[str, Any] = {}
    for t in timings:
        summary[f"p50_seconds_at_{t.size}"] = t.p50_seconds
        summary[f"p95_seconds_at_{t.size}"] = t.p95_seconds
        summary[f"cpu_p50_seconds_at_{t.size}"] = t.cpu_p50_seconds
        summary[f"search_mode_at_{t.size}"] = t.mode
        summary[f"index_load_seconds_at_{t.size}"] = t.load_seconds
        summary[f"peak_rss_bytes_at_{t.size}"] = t.peak_rss_bytes
        summary[f"index_rss_bytes_at_{t.size}"] = t.rss_bytes_after_load - t.rss_bytes_before_load
        if t.cluster_build_seconds is not None:
            summary[f"cluster_build_seconds_at_{t.size}"] = t.cluster_build_seconds
            summary[f"cluster_build_pairs_at_{t.size}"] = t.cluster_pairs
        if t.clustered_found_best is not None:
            summary[f"clustered_found_best_at_{t.size}"] = t.clustered_found_best
            summary[f"clustered_similarity_ratio_at_{t.size}"] = t.clustered_similarity_ratio
    return summary


def print_latency_table(timings: Sequence[SizeTiming]) -> None:
    print(f"{'models':>7} {'mode':>20} {'p50 s':>7} {'p95 s':>7} {'CPU s':>7} {'scored':>7} "
          f"{'load s':>7} {'build s':>8} {'index MiB':>9} {'peak RSS MiB':>12}")
    for t in timings:
        build = f"{t.cluster_build_seconds:8.1f}" if t.cluster_build_seconds is not None else (
            f"{'-':>8}")
        print(f"{t.size:>7} {t.mode:>20} {t.p50_seconds:>7.3f} {t.p95_seconds:>7.3f} "
              f"{t.cpu_p50_seconds:>7.3f} {t.mean_scored:>7.0f} {t.load_seconds:>7.1f} {build} "
              f"{t.prepared_bytes / 2**20:>9.1f} {t.peak_rss_bytes / 2**20:>12.0f}")
    for t in timings:
        if t.clustered_found_best is not None:
            print(f"clustered search on the {t.size}-model zoo: p50 {t.clustered_p50_seconds:.3f} "
                  f"s, found the exhaustive best in {t.clustered_found_best:.0%} of queries, "
                  f"mean best-similarity ratio {t.clustered_similarity_ratio:.3f}")


def plot_latency(timings: Sequence[SizeTiming], path: Path) -> Path | None:
    """p50/p95 seconds per query against zoo size, log-log."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    sizes = [t.size for t in timings]
    ax.plot(sizes, [t.p50_seconds for t in timings], "o-", label="p50")
    ax.plot(sizes, [t.p95_seconds for t in timings], "s--", label="p95")
    for t in timings:
        ax.annotate(t.mode, (t.size, t.p50_seconds), textcoords="offset points", xytext=(4, -12),
                    fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("zoo models")
    ax.set_ylabel("seconds per query")
    ax.set_title("Zoo parent search latency (held-out children)")
    ax.legend()
    return common.save_figure(fig, path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.arguments(__doc__, "one pair, fewer repeats, small zoos of a quarter of the "
                              "architectures (CI smoke run)")
    parser.add_argument("--sizes", help="zoo sizes, comma-separated (default 100,1000,10000; "
                        "--quick: 30,50 with the exhaustive limit lowered to 40)")
    parser.add_argument("--queries", type=int, help="timed queries per size (default 20)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    repeats = 3 if args.quick else 31
    pairs = (dict(list(MODELKEEPER_CPP_SECONDS.items())[:1]) if args.quick
             else MODELKEEPER_CPP_SECONDS)
    graphs = extract_graphs(sorted({name for pair in pairs for name in pair}))

    timings = measure_pair_seconds(graphs, repeats=repeats, pairs=pairs)
    summary = pair_summary(timings)
    print_pair_table(timings)

    sizes = (tuple(int(x) for x in args.sizes.split(",")) if args.sizes
             else (30, 50) if args.quick else (100, 1000, 10000))
    queries = args.queries or (3 if args.quick else 20)
    limit = 40 if args.quick and not args.sizes else index.EXHAUSTIVE_LIMIT
    by_size = measure_query_latency(sizes, queries=queries, exhaustive_limit=limit,
                                    compare_clustered=not args.quick,
                                    architectures=ZOO_BASES[::4] if args.quick else ZOO_BASES)
    summary.update(latency_summary(by_size))
    print_latency_table(by_size)

    details = {
        "settings": {"repeats": repeats, "quick": args.quick, "torch_threads": 1,
                     "input_shape": list(INPUT_SHAPE), "statistic": "median seconds per call",
                     "latency_sizes": list(sizes), "latency_queries": queries,
                     "exhaustive_limit": limit},
        "pairs": [dataclasses.asdict(t) for t in timings],
        "query_latency": [dataclasses.asdict(t) for t in by_size],
    }
    name = NAME + ("_quick" if args.quick else "")  # a smoke run never replaces the full results
    print(f"wrote {common.write_results(name, summary, details)}")
    for plot in (plot_pairs(timings, common.plot_path(name)),
                 plot_latency(by_size, common.plot_path(name + "_latency"))):
        if plot is not None:
            print(f"wrote {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
