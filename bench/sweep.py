"""Sweeps: how soon a search finds the baseline's best, Kiln against a Katib/Ray Tune-style run.

Writes bench/results/sweep.json and .png, sweep_quick.* with ``--quick``, or sweep_partial.* for
some ``--searches``, ``--seeds`` or ``--arms`` (method below the imports).

    python bench/sweep.py [--quick] [--seeds 0,1,2] [--searches fashion,text] [--arms kiln]
    python bench/sweep.py --seeds 1,2 --merge bench/results/sweep_partial.json  # in parts
    python bench/sweep.py --baseline-from bench/results/sweep_partial.json  # Kiln's arms only
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # each trial's trainer: one steady thread

import contextlib
import dataclasses
import datetime
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import yaml

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(BENCH)]
import common
import fashion_mnist

# 1. Searches. Two spaces on real data, each a TrainingSweep file run by `kiln sweep run`
#    exactly as a user runs it (a subprocess, `-o json`), random search with ASHA in every arm:
#    - fashion: small ResNets on Fashion-MNIST (6,000 images, a quarter held out: 1,500
#      validation images, one image is 0.07 points): blocks per stage, width, learning rate,
#      weight decay; objective validation accuracy.
#    - text: a character-level transformer on this repository's documentation (prose the
#      project wrote): layers, width, learning rate; objective validation loss.
# 2. Arms, same sampler seed, so they draw the same values in the same order; each in a fresh
#    working directory with an empty zoo (no arm reuses another's models):
#    - baseline: what Katib or Ray Tune would run: cold trials (warmStart independent), no
#      freezing, the same slots;
#    - kiln: warm-start chaining (each trial may start from the sweep's own models so far) and
#      freezing on, the product's defaults;
#    - kiln-unfrozen (only when asked for): chaining with freezing off, so freezing's share in a
#      chain can be told apart (results in sweep_unfrozen*.json);
#    - kiln-independent: Kiln without chaining (cold trials, freezing on), so the warm-start
#      share of the difference can be told from the rest.
#    The arms run back to back, their order rotated per seed; the machine is shared, so wall
#    time is reported beside epochs trained (which load cannot change).
# 3. Measures, per search and seed. The baseline's best is its best objective at the end; the
#    bar is that best less 0.1 points of accuracy (text: plus 0.01 nats of loss). For each arm:
#    wall seconds from the start of the sweep until any trial's evaluation meets the bar, the
#    CPU seconds the arm's processes had used by then (sampled every second: other work on the
#    machine moves wall seconds, hardly these), and the epochs all trials had trained by then; the arm's best within the baseline's whole wall
#    time; CPU seconds of the whole sweep. The ratio is the baseline's time to its own bar
#    divided by the arm's (above 1: the arm got there sooner); an arm that never meets the bar
#    counts at its whole time and is flagged. Medians over seeds and searches; the worst best
#    delta (arm's best within budget minus the baseline's best, in points) is the minimum.

NAME = "sweep"
ARMS = ("baseline", "kiln", "kiln-independent", "kiln-unfrozen")
DEFAULT_ARMS = ARMS[:3]
GOAL = {"median_time_to_baseline_best_ratio": 2.5, "worst_best_metric_delta": -0.1}
ACCURACY_BAR = 0.001  # 0.1 points below the baseline's best
LOSS_BAR = 0.01  # nats above the baseline's best


@dataclasses.dataclass(frozen=True)
class Search:
    label: str
    template: dict[str, Any]
    parameters: list[dict[str, Any]]
    metric: str  # validation_accuracy or validation_loss
    trials: int


def searches(*, quick: bool, fashion_root: Path, trials: int | None = None,
             epochs: int | None = None) -> list[Search]:
    epochs = epochs or (2 if quick else 6)
    trials = trials or (6 if quick else 32)
    fashion = Search(
        "fashion",
        {"model": {"architecture": "small_resnet", "args": {"blocks": 1, "width": 16},
                   "inputShape": [1, 28, 28]},
         "dataset": {"name": "torchvision", "torchvisionClass": "FashionMNIST",
                     "path": str(fashion_root), "maxSamples": 1200 if quick else 6000,
                     "validationFraction": 0.25},
         "training": {"epochs": epochs, "batchSize": 64, "device": "cpu",
                      "optimizer": {"name": "adam", "lr": 3e-3, "weightDecay": 0.0},
                      "lrSchedule": {"name": "cosine"}}},
        [{"path": "model.args.blocks", "int": {"min": 1, "max": 3}},
         {"path": "model.args.width", "categorical": [8, 16, 24, 32]},
         {"path": "training.optimizer.lr", "float": {"min": 3e-4, "max": 3e-2, "log": True}},
         {"path": "training.optimizer.weightDecay",
          "float": {"min": 1e-6, "max": 1e-2, "log": True}}],
        "validation_accuracy", trials)
    # quick: windows of 32 bytes in batches of 32, at most 2 layers of width 16-48, so a step
    # costs a twentieth of the full run's; still 18 steps an epoch, 36 in all: freezing still
    # runs (its first decision needs 30) and sees the learning rate fall, as in the full run
    batch = 32 if quick else 64
    text = Search(
        "text",
        {"model": {"architecture": "char_transformer", "args": {"depth": 2, "width": 64,
                                                                "heads": 4},
                   "inputShape": [32 if quick else 64]},
         "dataset": {"name": "text", "path": str(REPO / "docs"), "validationFraction": 0.1,
                     "maxSamples": 640 if quick else 400_000},
         "training": {"epochs": epochs, "batchSize": batch, "device": "cpu",
                      "optimizer": {"name": "adamw", "lr": 3e-3, "weightDecay": 0.01},
                      "lrSchedule": {"name": "cosine"}}},
        [{"path": "model.args.depth", "int": {"min": 1, "max": 2 if quick else 3}},
         {"path": "model.args.width", "categorical": [16, 32, 48] if quick else [32, 64, 96]},
         {"path": "training.optimizer.lr", "float": {"min": 3e-4, "max": 1e-2, "log": True}}],
        "validation_loss", trials)
    return [fashion, text]


def sweep_doc(search: Search, arm: str, seed: int, slots: int) -> dict[str, Any]:
    template = json.loads(json.dumps(search.template))
    template["training"]["seed"] = seed
    template["freezing"] = {"enabled": arm not in ("baseline", "kiln-unfrozen")}
    return {
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSweep",
        "metadata": {"name": f"{search.label}-{arm}-s{seed}"},
        "spec": {
            "template": template, "parameters": search.parameters,
            "objective": {"metric": search.metric},
            "algorithm": {"name": "random", "seed": seed},
            "earlyStopping": {"name": "asha", "minEpochs": 1, "reductionFactor": 3},
            "maxTrials": search.trials, "parallelTrials": slots,
            "maxFailedTrials": search.trials,
            "warmStart": "chain" if arm in ("kiln", "kiln-unfrozen") else "independent",
        },
    }


def tree_cpu_seconds(root: psutil.Process) -> float:
    """CPU seconds `root` and its descendants have used: each live process's own, plus what its
    children that already ended used (counted in the parent that waited for them)."""
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def run_arm(search: Search, arm: str, seed: int, slots: int) -> dict[str, Any]:
    """One arm: `kiln sweep run` in a fresh directory (empty zoo); its sweep document, wall and
    CPU seconds, and the CPU seconds its process tree had used, sampled every second
    ([unix time, CPU seconds]), which times the evaluations in CPU as well as wall."""
    with tempfile.TemporaryDirectory(prefix=f"kiln-sweep-{arm}-") as tmp:
        work = Path(tmp)
        path = work / "sweep.yaml"
        path.write_text(yaml.safe_dump(sweep_doc(search, arm, seed, slots)), encoding="utf-8")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        began = time.perf_counter()
        with subprocess.Popen(
                [str(Path(sys.executable).parent / "kiln"), "sweep", "run", str(path),
                 "--slots", str(slots), "--zoo", str(work / "zoo"), "-o", "json"],
                cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
            timeline: list[tuple[float, float]] = []
            done = threading.Event()
            root = psutil.Process(proc.pid)

            def sample() -> None:
                while not done.wait(1.0):
                    timeline.append((time.time(), tree_cpu_seconds(root)))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            stdout, stderr = proc.communicate()
            done.set()
            sampler.join()
        wall = time.perf_counter() - began
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{search.label}/{arm}/seed {seed}: kiln sweep run exited "
                         f"{proc.returncode}:\n{stderr[-4000:]}")
    doc = json.loads(stdout)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    timeline.append((time.time(), cpu))
    return {"doc": doc, "wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1),
            "cpu_timeline": [[round(t, 2), round(c, 2)] for t, c in timeline]}


def cpu_at(run: dict[str, Any], seconds: float) -> float:
    """CPU seconds the arm's processes had used `seconds` into its sweep (the sweep's own
    clock, as its evaluations are timed), read off the sampled timeline."""
    start = datetime.datetime.fromisoformat(
        run["doc"]["status"]["startTime"]).timestamp()
    when = start + seconds
    points = run["cpu_timeline"]
    after = next((i for i, (t, _) in enumerate(points) if t >= when), len(points) - 1)
    if after == 0:
        return float(points[0][1])
    (t0, c0), (t1, c1) = points[after - 1], points[after]
    share = 1.0 if t1 <= t0 else min(1.0, max(0.0, (when - t0) / (t1 - t0)))
    return float(c0 + share * (c1 - c0))


def evaluations(doc: dict[str, Any]) -> list[tuple[float, int, float]]:
    """(seconds since the sweep started, trial index, objective) of every evaluation, in time
    order."""
    points = []
    for trial in doc["status"]["history"]:
        for entry in trial.get("evaluations", []):
            if len(entry) < 3:
                raise SystemExit("the sweep's evaluations carry no times: [epoch, value, seconds]"
                                 " expected")
            points.append((float(entry[2]), int(trial["index"]), float(entry[1])))
    return sorted(points)


def epochs_by(doc: dict[str, Any], seconds: float) -> int:
    """Epochs every trial had evaluated by `seconds`."""
    return sum(1 for trial in doc["status"]["history"] for entry in trial.get("evaluations", [])
               if float(entry[2]) <= seconds)


def measure(search: Search, runs: dict[str, dict[str, Any]],
            kept: dict[str, Any] | None = None) -> dict[str, Any]:
    """The row of one search and seed: each arm's time, CPU and epochs to the bar. `kept`: the
    baseline's row from an earlier result (`--baseline-from`), in place of running it."""
    maximize = search.metric == "validation_accuracy"
    better = (lambda a, b: a >= b) if maximize else (lambda a, b: a <= b)
    if kept is None:
        values = [v for _, _, v in evaluations(runs["baseline"]["doc"])]
        base_best = max(values) if maximize else min(values)
        budget = runs["baseline"]["wall_seconds"]
    else:
        base_best, budget = kept["baseline_best"], kept["baseline"]["wall_seconds"]
    bar = base_best - ACCURACY_BAR if maximize else base_best + LOSS_BAR
    row: dict[str, Any] = {"baseline_best": round(base_best, 4), "bar": round(bar, 4)}
    if kept is not None:
        row["baseline"] = kept["baseline"]
    for arm, run in runs.items():
        points = evaluations(run["doc"])
        hit = next((t for t, _, v in points if better(v, bar)), None)
        within = [v for t, _, v in points if t <= budget]
        best = (max(within) if maximize else min(within)) if within else None
        history = run["doc"]["status"]["history"]
        row[arm] = {
            "seconds_to_bar": round(hit if hit is not None else run["wall_seconds"], 1),
            "cpu_seconds_to_bar": round(cpu_at(run, hit) if hit is not None
                                        else run["cpu_seconds"], 1),
            "reached": hit is not None,
            "epochs_to_bar": epochs_by(run["doc"], hit if hit is not None else float("inf")),
            "epochs_total": epochs_by(run["doc"], float("inf")),
            "best_within_budget": None if best is None else round(best, 4),
            # Points for accuracy (higher is better); for loss, nats below the baseline's.
            "best_delta": None if best is None else round(
                (best - base_best) * 100 if maximize else base_best - best, 3),
            "wall_seconds": run["wall_seconds"], "cpu_seconds": run["cpu_seconds"],
            "trials": {s: sum(1 for t in history if t["state"] == s)
                       for s in ("Succeeded", "Pruned", "Failed")},
            "warm_trials": sum(1 for t in history if t.get("parent")),
        }
    for arm in [*runs, *(["baseline"] if kept is not None else [])]:
        arm_row = row[arm]
        # An arm that never met the bar gets no speed-up (0): its whole sweep may have been
        # shorter than the baseline's time to the bar, which would read as a ratio above 1.
        reached = arm == "baseline" or arm_row["reached"]
        for ratio, to_bar, floor in (("time_ratio", "seconds_to_bar", 1e-9),
                                     ("cpu_ratio", "cpu_seconds_to_bar", 1e-9),
                                     ("epochs_ratio", "epochs_to_bar", 1)):
            arm_row[ratio] = round(row["baseline"][to_bar] / max(arm_row[to_bar], floor), 3) \
                if reached else 0.0
    return row


def summarize(rows: dict[str, dict[int, dict[str, Any]]], arms: Sequence[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for arm in arms[1:]:
        cells = [r[arm] for by_seed in rows.values() for r in by_seed.values()]
        deltas = [c["best_delta"] for label, by_seed in rows.items() for c in
                  (r[arm] for r in by_seed.values())
                  if label == "fashion" and c["best_delta"] is not None]
        summary[arm] = {
            "median_time_to_baseline_best_ratio": round(
                statistics.median(c["time_ratio"] for c in cells), 3),
            "min_time_to_baseline_best_ratio": round(min(c["time_ratio"] for c in cells), 3),
            # CPU seconds, not wall: what the arms' processes used until the bar; the load of
            # other work on the machine moves wall seconds, not these.
            "median_cpu_to_baseline_best_ratio": round(
                statistics.median(c["cpu_ratio"] for c in cells), 3),
            "median_epochs_to_baseline_best_ratio": round(
                statistics.median(c["epochs_ratio"] for c in cells), 3),
            "worst_best_metric_delta": min(deltas) if deltas else None,
            "unreached": sum(not c["reached"] for c in cells),
            "per_search": {label: {
                "median_time_ratio": round(statistics.median(
                    r[arm]["time_ratio"] for r in by_seed.values()), 3),
                "median_cpu_ratio": round(statistics.median(
                    r[arm]["cpu_ratio"] for r in by_seed.values()), 3),
                "median_epochs_ratio": round(statistics.median(
                    r[arm]["epochs_ratio"] for r in by_seed.values()), 3),
                "worst_best_delta": min(r[arm]["best_delta"] for r in by_seed.values()
                                        if r[arm]["best_delta"] is not None)}
                for label, by_seed in rows.items()},
        }
    summary["goal"] = GOAL
    if "kiln" not in summary:
        return summary
    kiln = summary["kiln"]
    summary["goal_met"] = (kiln["median_time_to_baseline_best_ratio"]
                           >= GOAL["median_time_to_baseline_best_ratio"]
                           and (kiln["worst_best_metric_delta"] or 0)
                           >= GOAL["worst_best_metric_delta"])
    # The split: chaining is kiln against kiln-independent; freezing (and the local scheduler,
    # the same in every arm here) is kiln-independent against the baseline; pruning is on in
    # every arm, so its share is the epochs it skipped.
    if "kiln-independent" not in summary:
        return summary
    summary["split"] = {
        "warm_start_chaining": round(kiln["median_time_to_baseline_best_ratio"]
                                     / summary["kiln-independent"][
                                         "median_time_to_baseline_best_ratio"], 3),
        "freezing": summary["kiln-independent"]["median_time_to_baseline_best_ratio"],
    }
    return summary


def print_table(label: str, seed: int, row: dict[str, Any]) -> None:
    print(f"\n{label} seed {seed}: baseline best {row['baseline_best']} (bar {row['bar']})")
    print(f"  {'arm':18} {'s to bar':>9} {'cpu to bar':>10} {'epochs':>7} {'ratio':>6} "
          f"{'cpu ratio':>9} {'ep.ratio':>8} "
          f"{'best':>8} {'delta':>7} {'wall':>7} {'cpu':>7} {'warm':>5} {'pruned':>6}")
    for arm in ARMS:
        if arm not in row:
            continue
        c = row[arm]
        print(f"  {arm:18} {c['seconds_to_bar']:>9} {c['cpu_seconds_to_bar']:>10} "
              f"{c['epochs_to_bar']:>7} {c['time_ratio']:>6} {c['cpu_ratio']:>9} "
              f"{c['epochs_ratio']:>8} {c['best_within_budget']!s:>8} "
              f"{c['best_delta']!s:>7} {c['wall_seconds']:>7} {c['cpu_seconds']:>7} "
              f"{c['warm_trials']:>5} {c['trials']['Pruned']:>6}"
              + ("" if c["reached"] else "  (bar not reached)"), flush=True)


def plot(rows: dict[str, dict[int, dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4.2), squeeze=False)
    for ax, (label, by_seed) in zip(axes[0], rows.items(), strict=True):
        seeds = sorted(by_seed)
        arms = [arm for arm in ARMS[1:] if arm in by_seed[seeds[0]]]
        for offset, arm in enumerate(arms):
            ax.bar([i + 0.4 * offset for i in range(len(seeds))],
                   [by_seed[s][arm]["time_ratio"] for s in seeds], width=0.4, label=arm)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(GOAL["median_time_to_baseline_best_ratio"], color="tab:red", linewidth=0.8,
                   linestyle="--")
        ax.set_xticks([i + 0.2 for i in range(len(seeds))], [f"seed {s}" for s in seeds])
        ax.set_ylabel("time to the baseline's best: baseline / arm")
        ax.set_title(label, fontsize=10)
        ax.legend(fontsize=8)
    common.save_figure(fig, path, title=title)


def read_earlier(path: Path, flag: str, config: dict[str, Any], keys: Sequence[str]
                 ) -> dict[str, Any]:
    """An earlier result of this benchmark ({summary, details, created}), run with this run's
    `keys` settings and trials per search (a search it did not run is no conflict).

    Raises:
        SystemExit: the file is unreadable, or was run with other settings (named).
    """
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
        summary = payload["summary"]
        if not isinstance(payload["details"], dict):
            raise TypeError("its details are not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"{flag} {path}: not a result of this benchmark ({exc})") from None
    for key in keys:
        if summary.get(key) != config[key]:
            raise SystemExit(f"{flag} {path}: its {key} is {summary.get(key)!r}, this run's "
                             f"{config[key]!r}; only runs with the same settings combine")
    trials = summary.get("trials") or {}
    for label, count in config["trials"].items():
        if trials.get(label, count) != count:
            raise SystemExit(f"{flag} {path}: its {label} search ran {trials[label]} trials, "
                             f"this run {count}; only runs with the same settings combine")
    return dict(payload)


def load_earlier(path: Path | None, config: dict[str, Any], repeated: set[tuple[str, int]]
                 ) -> tuple[dict[str, dict[int, dict[str, Any]]], dict[str, Any], dict[str, int]]:
    """An earlier result's rows and details by search and seed, less those this run repeats,
    and its trials per search; nothing without `path` (`--merge`)."""
    if path is None:
        return {}, {}, {}
    payload = read_earlier(path, "--merge", config, ("quick", "slots", "arms", "epochs"))
    rows: dict[str, dict[int, dict[str, Any]]] = {}
    details: dict[str, Any] = {}
    for key, detail in payload["details"].items():
        label, seed = key.rsplit("/", 1)
        if (label, int(seed)) not in repeated:
            rows.setdefault(label, {})[int(seed)] = detail["row"]
            details[key] = detail
    return rows, details, payload["summary"].get("trials") or {}


def load_baselines(path: Path, config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """An earlier result's baseline rows and histories by "search/seed" (`--baseline-from`),
    for a run of Kiln's arms alone: the baseline runs cold trials without freezing, which
    Kiln's changes leave as they were, so a long benchmark need not run it again."""
    payload = read_earlier(path, "--baseline-from", config, ("quick", "slots", "epochs"))
    return {key: {"row": detail["row"], "history": detail["histories"]["baseline"],
                  "created": payload.get("created")}
            for key, detail in payload["details"].items()}


def result_name(arms: Sequence[str], *, quick: bool, partial: bool) -> str:
    """The results' file name: an opt-in arm, or an arm run without Kiln's, is named in it, so
    that such a run never overwrites the result of the arms the summary's goal scores."""
    named = [arm.removeprefix("kiln-") for arm in arms[1:]
             if arm == "kiln-unfrozen" or "kiln" not in arms]
    return NAME + ("_quick" if quick else "") + "".join(f"_{arm}" for arm in named) + (
        "_partial" if partial else "")


def main() -> None:
    parser = common.arguments(__doc__, "small smoke run: 6 trials of 2 epochs, one seed")
    parser.add_argument("--seeds", default=None, help="comma-separated (default 0,1,2)")
    parser.add_argument("--searches", default=None, help="comma-separated: fashion,text")
    parser.add_argument("--trials", type=int, default=None,
                        help="trials per sweep (default 32; quick 6): fewer is a partial run")
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs per trial (default 6; quick 2): fewer is a partial run")
    parser.add_argument("--slots", type=int, default=min(4, os.cpu_count() or 1),
                        help="parallel trials (default 4, at most the CPU cores: `kiln sweep "
                             "run` gives each CPU trial a core)")
    parser.add_argument("--arms", default=None,
                        help="comma-separated arms beside the baseline (default "
                             f"{','.join(DEFAULT_ARMS[1:])}; kiln-unfrozen: chaining without "
                             "freezing): fewer is a partial run")
    parser.add_argument("--fashion-root", type=Path, default=fashion_mnist.DEFAULT_ROOT,
                        help="Fashion-MNIST root (prepared with npm when absent)")
    parser.add_argument("--merge", type=Path, default=None,
                        help="an earlier result of this benchmark, run with the same trials, "
                             "epochs, slots and arms: its searches and seeds that this run "
                             "does not repeat join the summary (a long benchmark in parts)")
    parser.add_argument("--baseline-from", type=Path, default=None,
                        help="an earlier result of this benchmark, run with the same trials, "
                             "epochs and slots: its baseline rows stand in for running the "
                             "baseline again (Kiln's arms only; the summary names the file)")
    args = parser.parse_args()
    quick = args.quick
    arms = DEFAULT_ARMS if not args.arms else ("baseline", *(
        arm for arm in ARMS[1:] if arm in args.arms.split(",")))
    unknown = set(args.arms.split(",")) - set(ARMS[1:]) if args.arms else set()
    if unknown or len(arms) == 1:
        parser.error(f"--arms {args.arms}: choose among {','.join(ARMS[1:])}")
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else ([0] if quick
                                                                       else [0, 1, 2])
    chosen = searches(quick=quick, fashion_root=args.fashion_root, trials=args.trials,
                      epochs=args.epochs)
    full = {(s.label, seed) for s in chosen for seed in ([0] if quick else [0, 1, 2])}
    if args.searches:
        chosen = [s for s in chosen if s.label in args.searches.split(",")]
    config = {"quick": quick, "slots": args.slots, "arms": list(arms),
              "trials": {s.label: s.trials for s in chosen},
              "epochs": chosen[0].template["training"]["epochs"] if chosen else None}
    earlier, details, earlier_trials = load_earlier(
        args.merge, config, {(s.label, seed) for s in chosen for seed in seeds})
    baselines = load_baselines(args.baseline_from, config) if args.baseline_from else {}
    for search in chosen:
        for seed in seeds:
            if baselines and f"{search.label}/{seed}" not in baselines:
                raise SystemExit(f"--baseline-from {args.baseline_from}: no {search.label} "
                                 f"baseline for seed {seed}; run that seed with its baseline")
    done = {(label, seed) for label, by_seed in earlier.items() for seed in by_seed}
    done |= {(s.label, seed) for s in chosen for seed in seeds}
    partial = bool(args.trials or args.epochs or args.arms) or done != full
    name = result_name(arms, quick=quick, partial=partial)
    if any(s.label == "fashion" for s in chosen):
        fashion_mnist.prepare(args.fashion_root)
    load_before, began = os.getloadavg(), time.perf_counter()
    rows = earlier
    for search in chosen:
        rows.setdefault(search.label, {})
        for seed in seeds:
            kept = baselines.get(f"{search.label}/{seed}")
            order = arms[seed % len(arms):] + arms[:seed % len(arms)]
            runs = {arm: run_arm(search, arm, seed, args.slots) for arm in order
                    if kept is None or arm != "baseline"}
            row = measure(search, runs, kept["row"] if kept else None)
            if kept is not None:  # said in the row, so a later --merge keeps saying it
                row["baseline_from"] = f"{args.baseline_from} (run {kept['created']})"
            rows[search.label][seed] = row
            print_table(search.label, seed, row)
            histories = {arm: run["doc"]["status"]["history"] for arm, run in runs.items()}
            if kept is not None:
                histories["baseline"] = kept["history"]
            details[f"{search.label}/{seed}"] = {"row": row, "histories": histories}
    summary = summarize(rows, arms)
    summary.update({**config, "seeds": sorted({seed for by_seed in rows.values()
                                               for seed in by_seed}),
                    "searches": sorted(rows),
                    "trials": {**earlier_trials, **config["trials"]},
                    "merged": sorted(f"{label}/{seed}" for label, seed in done - {
                        (s.label, seed) for s in chosen for seed in seeds}),
                    "bench_seconds": round(time.perf_counter() - began, 1),
                    "baseline_from": sorted({f"{label}/{seed}: {row['baseline_from']}"
                                             for label, by_seed in rows.items()
                                             for seed, row in by_seed.items()
                                             if "baseline_from" in row}),
                    "load_average_before_after": [round(load_before[0], 2),
                                                  round(os.getloadavg()[0], 2)]})
    path = common.write_results(name, summary, details)
    plot(rows, path.with_suffix(".png"), "Sweeps: time to the baseline's best")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
