"""Admission isolation: latency of ordinary jobs in a burst, with and without poison jobs.

    python bench/admission.py [--quick] [--jobs 40]

Writes bench/results/admission.json and admission.png (``--quick``: 4 jobs, admission_quick.*).
"""

# The real operator runs against kmock's Kubernetes emulator (tests/kubesim) with a directory zoo
# holding one small_cnn, so every ordinary job is validated, traced and matched. Two bursts, each
# on a fresh operator: the ordinary jobs alone (small CNNs and ResNets of varied sizes, so few
# share a cached decision); the same jobs behind a poison job submitted first, a small_cnn 13,000
# layers deep (over Kiln's size limits: rejected at validation); and behind that poison plus a
# ViT 200 layers deep (within the limits, but seconds to validate and to trace; its tracing runs
# in a graph worker process with a 2 s deadline). No kubelet runs: the jobs stay queued.
# ``--quick`` (a smoke run that measures nothing) runs the bursts on one operator, each in its
# own namespace, with a ViT 100 layers deep as the slow poison and a 0.5 s tracing deadline
# (still past it: the same path, half the tracing).
#
# Measured (``summary``): per burst, p50 and p99 of the ordinary jobs' admission latency, from
# the creation request to the operator's first status write (validated, warm start decided,
# queued); ``<burst>_p99_ratio`` = its p99 / the p99 without poison (the goal: at most 2); and
# the seconds from creating each poison job to its first status write.

from __future__ import annotations

import concurrent.futures
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import common
from kubesim import emulator, operator_process

from kiln import api, models
from kiln.warmstart import decision, graph
from kiln.zoo import records, store

NAME = "admission"
SUBMIT_THREADS = 8
WAIT_SECONDS = 600.0
GRAPH_TIMEOUT_SECONDS = 2.0
POISON: dict[str, dict[str, Any]] = {
    "poison-abyss": {"architecture": "small_cnn", "args": {"depth": 13_000, "width": 8},
                     "inputShape": [1, 8, 8]},
    "poison-slow": {"architecture": "vit", "args": {"depth": 200, "width": 8, "heads": 1},
                    "inputShape": [1, 8, 8]},
}
QUICK_POISON: dict[str, dict[str, Any]] = {
    **POISON, "poison-slow": {**POISON["poison-slow"],
                              "args": {"depth": 100, "width": 8, "heads": 1}}}
QUICK_GRAPH_TIMEOUT_SECONDS = 0.5


def job_doc(name: str, model: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
            "spec": {"model": model, "dataset": {"name": "digits"},
                     "training": {"epochs": 5, "batchSize": 64},
                     "freezing": {"enabled": False}}}


def ordinary_model(index: int) -> dict[str, Any]:
    """The index-th ordinary model (deterministic, mostly distinct)."""
    if index % 2:
        return {"architecture": "small_resnet",
                "args": {"blocks": [1, 1 + index % 3, 1], "width": 4 + index},
                "inputShape": [1, 8, 8]}
    return {"architecture": "small_cnn", "args": {"depth": 2 + index % 4, "width": 4 + index},
            "inputShape": [1, 8, 8]}


def seed_zoo(path: Path) -> None:
    """A directory zoo with one small_cnn, so ordinary jobs are matched against it."""
    zoo = store.DirStore(path)
    spec = api.ModelSpec.model_validate({"architecture": "small_cnn",
                                         "args": {"depth": 3, "width": 8},
                                         "inputShape": [1, 8, 8]})
    model = models.build(spec)
    record = records.ZooRecord(
        id=records.new_id("small_cnn"), architecture="small_cnn", args=dict(spec.args),
        input_shape=(1, 8, 8), modality="image", task="classification", dataset="digits",
        metric_name="validation_accuracy", metric_value=0.9, validation_accuracy=0.9,
        validation_loss=0.1, samples_per_second=100.0,
        num_params=sum(p.numel() for p in model.parameters()),
        created_time="2026-12-01T00:00:00Z", job_name="seed",
        job_spec=api.to_wire(api.parse_job(job_doc("seed", api.to_wire(spec))).spec),
        parent=None, similarity=None, weights_sha256="")
    records.write_record(zoo, record, model.state_dict(),
                         graph.to_json(decision.model_graph(spec)))


BURSTS = {"without_poison": (), "with_poison": ("poison-abyss",),
          "with_slow_poison": ("poison-abyss", "poison-slow")}


@contextlib.contextmanager
def operator_on_emulator(work: Path, zoo: Path, *, graph_timeout: float
                         ) -> Iterator[emulator.Emulator]:
    """A fresh emulator with one node and the operator (log in `work`) on it, warmed up."""
    with emulator.Emulator() as cluster:
        cluster.client.create_node("cpu-node-1", cpu="32")
        operator = operator_process.OperatorProcess(
            cluster, work, args=["--zoo-uri", str(zoo), "--zoo-refresh-seconds", "0",
                                 "--warm-start-graph-timeout-seconds",
                                 str(graph_timeout), "--placement-interval-seconds", "2"])
        operator.start()
        try:
            warm_up(cluster)
            yield cluster
        finally:
            operator.stop()


def burst(cluster: emulator.Emulator, count: int, *, poison: tuple[str, ...],
          namespace: str, poison_models: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Submit one burst in `namespace`; returns job name -> admission latency (s)."""
    docs = [job_doc(name, poison_models[name]) for name in poison]
    docs += [job_doc(f"job-{i:03d}", ordinary_model(i)) for i in range(count)]
    with concurrent.futures.ThreadPoolExecutor(SUBMIT_THREADS) as pool:
        list(pool.map(lambda doc: cluster.client.create_job(namespace, doc), docs))
    return wait_admitted(cluster, {doc["metadata"]["name"] for doc in docs}, namespace=namespace)


def warm_up(cluster: emulator.Emulator) -> None:
    """Admit one job first, so both bursts find the operator's workers started."""
    cluster.client.create_job("warm-up", job_doc("warm-up", ordinary_model(999)))
    wait_admitted(cluster, {"warm-up"}, namespace="warm-up")


def wait_admitted(cluster: emulator.Emulator, names: set[str], *,
                  namespace: str) -> dict[str, float]:
    """Poll until every job has a status write; returns name -> creation-to-write seconds."""
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        created: dict[str, float] = {}
        written: dict[str, float] = {}
        for r in cluster.requests:
            if r.resource != "trainingjobs" or r.namespace != namespace:
                continue
            if r.action == "CREATE" and isinstance(r.body, dict):
                created.setdefault(r.body["metadata"]["name"], r.seconds)
            elif r.action == "UPDATE" and r.subresource == "status" and r.name:
                written.setdefault(r.name, r.seconds)
        if names <= set(written) and names <= set(created):
            return {n: written[n] - created[n] for n in names}
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(names - set(written))} jobs not admitted after "
                               f"{WAIT_SECONDS} s")
        time.sleep(0.2)  # polling the emulator's memory


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 1000) - 1]


def main() -> None:
    parser = common.arguments(__doc__, "4 jobs, one operator for every burst (CI smoke)")
    parser.add_argument("--jobs", type=int, default=None, help="ordinary jobs (default 40)")
    args = parser.parse_args()
    count = args.jobs or (4 if args.quick else 40)
    name = f"{NAME}_quick" if args.quick else NAME
    poison_models = QUICK_POISON if args.quick else POISON
    graph_timeout = QUICK_GRAPH_TIMEOUT_SECONDS if args.quick else GRAPH_TIMEOUT_SECONDS
    seen: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-admission-") as tmp:
        zoo = Path(tmp) / "zoo"
        seed_zoo(zoo)
        with contextlib.ExitStack() as shared:
            quick = (shared.enter_context(operator_on_emulator(Path(tmp) / "quick", zoo,
                                                              graph_timeout=graph_timeout))
                     if args.quick else None)
            for arm, poison in BURSTS.items():
                with contextlib.ExitStack() as own:
                    cluster = quick or own.enter_context(
                        operator_on_emulator(Path(tmp) / arm, zoo, graph_timeout=graph_timeout))
                    seen[arm] = burst(cluster, count, poison=poison, poison_models=poison_models,
                                      namespace=arm.replace("_", "-"))
    ordinary = {arm: sorted(v for k, v in got.items() if k not in POISON)
                for arm, got in seen.items()}
    summary: dict[str, Any] = {"jobs": count, "quick": args.quick,
                               "graph_timeout_seconds": graph_timeout,
                               "slow_poison_depth": poison_models["poison-slow"]["args"]["depth"]}
    for arm, values in ordinary.items():
        summary[f"{arm}_p50_seconds"] = round(percentile(values, 0.50), 3)
        summary[f"{arm}_p99_seconds"] = round(percentile(values, 0.99), 3)
    for arm in ("with_poison", "with_slow_poison"):
        summary[f"{arm}_p99_ratio"] = round(summary[f"{arm}_p99_seconds"]
                                            / summary["without_poison_p99_seconds"], 2)
    for job_name in POISON:
        summary[f"{job_name}_seconds"] = round(seen["with_slow_poison"][job_name], 3)
    path = common.write_results(name, summary, {"latencies_seconds": ordinary})
    _plot(ordinary, name)
    print(f"{'burst':18s} {'p50 (s)':>10s} {'p99 (s)':>10s}")
    for arm in ordinary:
        print(f"{arm:18s} {summary[f'{arm}_p50_seconds']:10.3f} "
              f"{summary[f'{arm}_p99_seconds']:10.3f}")
    for arm in ("with_poison", "with_slow_poison"):
        print(f"{arm + ' p99 ratio':28s} {summary[f'{arm}_p99_ratio']:10.2f}")
    for job_name in POISON:
        print(f"{job_name + ' (s)':28s} {summary[f'{job_name}_seconds']:10.3f}")
    print(f"wrote {path}")


def _plot(ordinary: dict[str, list[float]], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, values in ordinary.items():
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))],
                label=arm.replace("_", " "))
    ax.set_xlabel("admission latency: creation -> first status write (s)")
    ax.set_ylabel("fraction of ordinary jobs")
    ax.legend()
    common.save_figure(fig, common.plot_path(name), title="Kiln admission with poison jobs")


if __name__ == "__main__":
    main()
