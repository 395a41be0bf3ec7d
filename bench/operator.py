"""Operator scale: 1,000 TrainingJobs submitted at once to an emulated cluster (needs kmock).

    python bench/operator.py [--quick] [--jobs 1000]

Writes bench/results/operator.json and operator.png (``--quick``: 4 jobs, operator_quick.*).
"""

# The real operator (``python -m kiln.controller``, default settings but a 2 s placement
# interval) runs against kmock's Kubernetes emulator (tests/kubesim: the e2e tests' harness) with
# 16 nodes of 8 GPUs and an empty directory zoo (every job cold-starts; the warm-start search
# itself is measured by bench/zoo_query.py). The jobs are a mix of small CNNs and ResNets on
# digits with 5-40 epochs and automatic GPUs, so the planner chooses k per job. No kubelet runs:
# created pods stay Pending and hold their GPUs, as on a busy cluster.
#
# Measured (``summary`` of the JSON, with the job count and settings):
# * ``seconds_to_place_1000``: from the first submission until every job has a placement
#   decision in its status (status.placement: started now, or planned node and start);
# * ``reconcile_p50_seconds``, ``reconcile_p99_seconds``: per job, from its creation request to
#   the operator's first status write (admission: validated, warm-start decided, queued);
# * ``peak_rss_bytes``: the operator process's peak resident memory (VmHWM).

from __future__ import annotations

import concurrent.futures
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import common
from kubesim import emulator, operator_process

NAME = "operator"
NODES, GPUS_PER_NODE = 16, 8
NAMESPACES = ("team-a", "team-b", "team-c", "team-d")
PLACE_SECONDS = 600.0
SUBMIT_THREADS = 8


def job_doc(index: int) -> dict[str, Any]:
    """The index-th job of the mix (deterministic)."""
    if index % 2:
        model = {"architecture": "small_resnet",
                 "args": {"blocks": [1, 1, 1 + index % 2], "width": 8 + 4 * (index % 3)},
                 "inputShape": [1, 16, 16]}
    else:
        model = {"architecture": "small_cnn", "args": {"depth": 2 + index % 3, "width": 16},
                 "inputShape": [1, 8, 8]}
    return {
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": f"bench-{index:04d}"},
        "spec": {"model": model, "dataset": {"name": "digits"},
                 "training": {"epochs": 5 + (index * 7) % 36, "batchSize": 64},
                 "freezing": {"enabled": False}},
    }


def submit(cluster: emulator.Emulator, count: int) -> dict[str, float]:
    """Create `count` jobs concurrently; returns job key -> monotonic seconds it was sent."""
    sent: dict[str, float] = {}

    def create(index: int) -> None:
        namespace = NAMESPACES[index % len(NAMESPACES)]
        doc = job_doc(index)
        sent[f"{namespace}/{doc['metadata']['name']}"] = time.monotonic()
        cluster.client.create_job(namespace, doc)

    with concurrent.futures.ThreadPoolExecutor(SUBMIT_THREADS) as pool:
        list(pool.map(create, range(count)))
    return sent


def wait_placed(cluster: emulator.Emulator, count: int, started: float) -> list[tuple[float, int]]:
    """Poll until `count` jobs have status.placement; returns (seconds, placed) samples."""
    timeline: list[tuple[float, int]] = []
    deadline = started + PLACE_SECONDS
    while True:
        jobs = cluster.objects("kiln.dev/v1alpha1/trainingjobs")
        placed = sum(1 for j in jobs if (j.get("status") or {}).get("placement"))
        timeline.append((time.monotonic() - started, placed))
        if placed >= count:
            return timeline
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {placed} of {count} jobs placed after {PLACE_SECONDS} s")
        time.sleep(0.5)  # polling the emulator's memory


def reconcile_latencies(cluster: emulator.Emulator, sent: dict[str, float]) -> list[float]:
    """Per job: its creation request -> the operator's first status write, in seconds."""
    created: dict[str, float] = {}
    first_write: dict[str, float] = {}
    for r in cluster.requests:
        if r.resource != "trainingjobs" or r.namespace is None:
            continue
        if r.action == "CREATE" and isinstance(r.body, dict):
            created.setdefault(f"{r.namespace}/{r.body['metadata']['name']}", r.seconds)
        elif r.action == "UPDATE" and r.subresource == "status" and r.name:
            first_write.setdefault(f"{r.namespace}/{r.name}", r.seconds)
    return sorted(first_write[k] - created[k] for k in sent if k in created and k in first_write)


def peak_rss_bytes(pid: int) -> int:
    """VmHWM of a process, in bytes (0 when unreadable)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; nan for no values."""
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 1000) - 1] \
        if len(values) > 1 else values[0]


def main() -> None:
    parser = common.arguments(__doc__, "4 jobs (CI smoke)")
    parser.add_argument("--jobs", type=int, default=None, help="jobs to submit (default 1000)")
    args = parser.parse_args()
    count = args.jobs or (4 if args.quick else 1000)
    name = f"{NAME}_quick" if args.quick else NAME
    with tempfile.TemporaryDirectory(prefix="kiln-bench-operator-") as tmp, \
            emulator.Emulator() as cluster:
        for n in range(NODES):
            cluster.client.create_node(f"gpu-node-{n:02d}", gpus=GPUS_PER_NODE, cpu="32")
        operator = operator_process.OperatorProcess(
            cluster, Path(tmp), args=["--zoo-uri", str(Path(tmp) / "zoo"),
                                      "--placement-interval-seconds", "2",
                                      # no kubelet runs pods here: a profiling pod would never
                                      # finish, and this measures placement alone
                                      "--no-profile-unmeasured"])
        operator.start()
        try:
            started = time.monotonic()
            sent = submit(cluster, count)
            submitted = time.monotonic() - started
            timeline = wait_placed(cluster, count, started)
            seconds_to_place = timeline[-1][0]
            assert operator.process is not None
            rss = peak_rss_bytes(operator.process.pid)
            latencies = reconcile_latencies(cluster, sent)
            pods = len(cluster.objects("v1/pods"))
        finally:
            operator.stop()
    summary = {
        f"seconds_to_place_{count}": round(seconds_to_place, 2),
        "seconds_to_place_1000": round(seconds_to_place, 2) if count == 1000 else None,
        "reconcile_p50_seconds": round(percentile(latencies, 0.50), 3),
        "reconcile_p99_seconds": round(percentile(latencies, 0.99), 3),
        "peak_rss_bytes": rss,
        "jobs": count, "submit_seconds": round(submitted, 2), "pods_started": pods,
        "nodes": NODES, "gpus_per_node": GPUS_PER_NODE, "quick": args.quick,
    }
    details = {"placed_over_time": timeline, "reconcile_seconds": latencies,
               "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    path = common.write_results(name, summary, details)
    _plot(timeline, latencies, count, name)
    print(f"{'jobs':28s} {count}")
    print(f"{'seconds to place all':28s} {seconds_to_place:10.1f}")
    print(f"{'reconcile p50 / p99 (s)':28s} {summary['reconcile_p50_seconds']:10.3f} "
          f"{summary['reconcile_p99_seconds']:10.3f}")
    print(f"{'operator peak RSS (MiB)':28s} {rss / 2**20:10.1f}")
    print(f"{'pods started':28s} {pods}")
    print(f"wrote {path}")


def _plot(timeline: list[tuple[float, int]], latencies: list[float], count: int,
          name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot([t for t, _ in timeline], [p for _, p in timeline], color="tab:blue")
    left.axhline(count, color="grey", linestyle=":")
    left.set_xlabel("seconds since the first submission")
    left.set_ylabel("jobs with a placement decision")
    right.plot(latencies, [(i + 1) / len(latencies) for i in range(len(latencies))],
               color="tab:orange")
    right.set_xlabel("reconcile latency: creation -> first status write (s)")
    right.set_ylabel("fraction of jobs")
    fig.suptitle(f"Kiln operator: {count} TrainingJobs submitted at once")
    common.save_figure(fig, common.plot_path(name))


if __name__ == "__main__":
    main()
