"""Layer freezing (Egeria): time to target of full training, Kiln's freezing and a fixed schedule.

Writes bench/results/freezing.json and .png (`--quick`, a CI smoke: freezing_quick.*); a spawned
reference process imports this file, hence the main guard. 10-20 minutes on 2 loaded cores.
    OMP_NUM_THREADS=1 python bench/freezing.py [--quick] [--seeds 0,1,2] [--cases cnn,resnet]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one steady thread per process

import dataclasses
import hashlib
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

from kiln import api, models
from kiln_trainer import data, events, loop, optim, runtime
from kiln_trainer.distributed import batching
from kiln_trainer.freezing import controller
from kiln_trainer.freezing import setup as freezing_setup

NAME = "freezing"
ARMS = ("full", "kiln", "fixed")
FREEZING_ARMS = ("kiln", "fixed")
# The target of a case: this share of the full arm's final accuracy (median over seeds), as
# Egeria measures time to the baseline's accuracy less a tolerance; decided before the run.
TARGET_FRACTION = 0.98
FIXED_SPAN = (0.3, 0.8)  # the fixed schedule's first and last freeze, as budget fractions
SPARSE_CHECK_EVERY_STEPS = 8  # the second idle measurement's probe cadence
IDLE_REPEATS = 2  # fresh full/idle pairs per case: this machine's load moves between minutes
IDLE_TOLERANCE = 1e-9  # the idle arm's tolerance and peakFraction: no block ever converges
CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Case:
    """One workload: a registered model, its data and recipe, the target and the budget."""

    label: str
    architecture: str
    args: dict[str, Any]
    input_shape: list[int]
    dataset: dict[str, Any]
    optimizer: dict[str, Any]
    schedule: dict[str, Any]
    epochs: int
    eval_every: int  # steps per lockstep chunk: the time-to-target resolution
    batch_size: int = 64


STEP_HALFWAY = {"name": "step", "gamma": 0.1}
CASES = [
    Case("cnn", "small_cnn", {"depth": 6, "width": 32, "num_classes": 10}, [1, 16, 16],
         {"name": "digits"}, {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weightDecay": 5e-4},
         {**STEP_HALFWAY, "stepEpochs": 4}, epochs=8, eval_every=8),
    Case("resnet", "small_resnet", {"blocks": [2, 2, 2], "width": 16, "num_classes": 10},
         [1, 16, 16], {"name": "digits"},
         {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weightDecay": 5e-4},
         {**STEP_HALFWAY, "stepEpochs": 4}, epochs=8, eval_every=8),
    Case("transformer", "char_transformer", {"depth": 4, "width": 64, "heads": 4}, [32],
         {"name": "text", "maxSamples": 3000, "validationFraction": 0.1},
         {"name": "adamw", "lr": 3e-3, "weightDecay": 0.01}, {**STEP_HALFWAY, "stepEpochs": 2},
         epochs=4, eval_every=6),
]
QUICK_CASES = [
    Case("cnn-quick", "small_cnn", {"depth": 4, "width": 8, "num_classes": 10}, [1, 8, 8],
         {"name": "digits", "maxSamples": 800}, {"name": "adam", "lr": 3e-3},
         {"name": "constant"}, epochs=4, eval_every=4),
]


def make_job(case: Case, *, seed: int, corpus: Path | None,
             freezing: dict[str, Any] | None = None) -> api.TrainingJob:
    """The TrainingJob every arm of `case` runs (freezing knobs: the spec's defaults)."""
    dataset = dict(case.dataset)
    if dataset["name"] == "text":
        dataset["path"] = str(corpus)
    return api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": f"bench-{case.label}-s{seed}"},
        "spec": {
            "model": {"architecture": case.architecture, "args": case.args,
                      "inputShape": case.input_shape},
            "dataset": dataset,
            "training": {"epochs": case.epochs, "batchSize": case.batch_size,
                         "optimizer": case.optimizer, "lrSchedule": case.schedule,
                         "seed": seed, "device": "cpu"},
            "freezing": freezing or {},
        }})


def write_corpus(directory: Path) -> tuple[Path, dict[str, Any]]:
    """Kiln's own Python sources (operator/kiln, sorted) as one text file: the corpus of the
    character model, fixed for the run (its size and sha256 go in the results)."""
    sources = sorted((REPO / "operator" / "kiln").rglob("*.py"))
    text = b"\n".join(p.read_bytes() for p in sources if "__pycache__" not in p.parts)
    path = directory / "kiln-sources.txt"
    path.write_bytes(text)
    return path, {"files": len(sources), "bytes": len(text),
                  "sha256": hashlib.sha256(text).hexdigest()[:16]}


class Arm:
    """One training run of a job, advanced a chunk at a time through the trainer's own step.

    For each case (a CNN and a ResNet on scikit-learn digits, a character transformer on Kiln's
    own Python sources) and seed, three arms train the same job from the same initial weights
    on the same batches: ``full`` (no freezing); ``kiln`` (the job's default policy, set up by
    `freezing.setup.start`, with its int8 reference process); ``fixed`` (FreezeOut-like, Brock
    et al. 2017: block k of the prefix Kiln may freeze goes at step t_k, linearly spaced from
    30% to 80% of the budget, the head never; a `Freezer(main=False)` with no reference
    process and no learning-rate rule, moved by `Freezer.set_boundary`). All run through the
    trainer's own pieces (`loop.train_one_epoch`, `loop.evaluate`, `kiln_trainer.data`,
    `kiln_trainer.optim`), one process, one torch thread, on Egeria's own recipe: a step
    schedule whose tenfold drop halfway is also Kiln's unfreeze event.

    Args:
        name: "full", "kiln", "fixed" or "idle".
        job: the job (the idle arm's carries its thresholds).
        splits: the loaded data; `spe`: steps per epoch.
    """

    def __init__(self, name: str, job: api.TrainingJob, splits: data.Splits, spe: int) -> None:
        spec = job.spec
        self.name, self.spec, self.splits, self.spe = name, spec, splits, spe
        self.total_steps = spec.training.epochs * spe
        runtime.seed_everything(spec.training.seed)  # same initial weights in every arm
        self.model = models.build(spec.model)
        self.optimizer = optim.build_optimizer(self.model.parameters(), spec.training.optimizer)
        self.scheduler = optim.build_schedule(self.optimizer, spec.training, steps_per_epoch=spe)
        self.freezer: controller.Freezer | None = None
        self.schedule: list[tuple[int, int]] = []  # the fixed arm's (step, boundary)
        self.info = io.StringIO()
        began = time.perf_counter()
        if name in ("kiln", "idle"):
            self.freezer = freezing_setup.start(
                job, self.model, splits, self.optimizer, spe,
                events.EventWriter(self.info, termination_log=None))
        elif name == "fixed":
            settings = controller.Settings.from_job(spec, steps_per_epoch=spe)
            validation, train = splits.validation, splits.train
            probe = controller.probe_batch(validation, settings.probe_batch_size)  # type: ignore
            # no optimizer: FreezeOut never unfreezes, so no learning-rate rule applies
            self.freezer = controller.Freezer(self.model, spec.model, probe, settings,
                                              num_samples=len(train), main=False)  # type: ignore
            k_max, (first, last) = self.freezer.max_frozen, FIXED_SPAN
            self.schedule = [(round(self.total_steps * (
                first + (last - first) * (k - 1) / max(1, k_max - 1))), k)
                for k in range(1, k_max + 1)]
        self.setup_seconds = time.perf_counter() - began
        self.trainable = self.freezer.trainable_module() if self.freezer else self.model
        self.step, self.epoch_batch, self.epoch, self.seconds = 0, spe, -1, 0.0
        self.batches: Any = None
        self.curve: list[dict[str, float]] = []

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps

    def wait_for_reference(self, timeout_seconds: float = 300.0) -> float:
        """Block until the reference process has made its first snapshot; seconds waited."""
        began = time.perf_counter()
        worker = self.freezer.worker if self.freezer is not None else None
        while worker is not None and worker.kind is None and worker.alive \
                and time.perf_counter() - began < timeout_seconds:
            worker.wait(1.0)
            worker.poll()  # drains the worker's messages; no probe was sent yet
        return time.perf_counter() - began

    def train(self, steps: int) -> None:
        """Advance `steps` optimizer steps (fewer at the end of the budget)."""
        until = min(self.total_steps, self.step + steps)
        while self.step < until:
            if self.epoch_batch >= self.spe:
                self.epoch, self.epoch_batch = self.epoch + 1, 0
                self.batches = iter(batching.train_batches(
                    self.splits.train, batch_size=self.spec.training.batch_size,
                    seed=self.spec.training.seed, epoch=self.epoch,
                    with_indices=self.freezer is not None))
            limit = min(until - self.step, self.spe - self.epoch_batch,
                        *(s - self.step for s, _ in self.schedule if s > self.step))
            stats = loop.train_one_epoch(
                self.trainable, self.batches, optimizer=self.optimizer, scheduler=self.scheduler,
                device=CPU, grad_clip_norm=self.spec.training.grad_clip_norm, max_steps=limit,
                freezer=self.freezer, first_step=self.step)
            self.step, self.epoch_batch = self.step + stats.steps, self.epoch_batch + stats.steps
            self.seconds += stats.seconds
            if stats.boundary_event is not None:  # the policy moved the boundary
                self.trainable = self.freezer.trainable_module()  # type: ignore[union-attr]
            due = [k for s, k in self.schedule if s == self.step]
            if due and self.freezer is not None:
                began = time.perf_counter()
                self.freezer.set_boundary(max(due), self.step, "fixed schedule")
                self.trainable = self.freezer.trainable_module()
                self.seconds += time.perf_counter() - began

    def evaluate(self) -> None:
        """Record (step, training seconds, accuracy, loss, skipped backward share so far)."""
        result = loop.evaluate(self.model, self.splits, batch_size=self.spec.training.batch_size,
                               device=CPU)
        self.curve.append({
            "step": self.step, "seconds": round(self.seconds, 3),
            "accuracy": round(result.accuracy, 5), "loss": round(result.loss, 5),
            "skipped": round(self.freezer.backward_flops_skipped, 4) if self.freezer else 0.0,
            "frozen": self.freezer.boundary if self.freezer else 0})

    def close(self) -> dict[str, Any]:
        """Stop the reference process; the arm's record."""
        record: dict[str, Any] = {"steps": self.step, "train_seconds": round(self.seconds, 3),
                                  "setup_seconds": round(self.setup_seconds, 2),
                                  "curve": self.curve, "info": self.info.getvalue().splitlines(),
                                  # a run too short to decide has no Freezer: it froze nothing
                                  "events": [], "reference_process_cpu_seconds": 0.0,
                                  "freezing": {"backward_flops_skipped": 0.0, "saved_seconds": 0.0,
                                               "reference_cpu_seconds": 0.0}}
        if self.freezer is not None:
            worker = self.freezer.worker
            record["reference_process_cpu_seconds"] = _process_cpu_seconds(
                worker.pid if worker is not None else None)
            record["reference_alive"] = worker.alive if worker is not None else None
            record["freezing"] = self.freezer.summary()
            record["events"] = [e.to_json() for e in self.freezer.events]
            record["blocks"] = list(self.freezer.partition.blocks)
            record["backward_fraction"] = [
                round(self.freezer.partition.backward_flops_fraction(k), 4)
                for k in range(len(self.freezer.partition.blocks))]
            self.freezer.close()
        return record


def _process_cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a live process so far (Linux /proc), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError, TypeError):
        return None
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)


def run_case(case: Case, seed: int, *, corpus: Path | None, order: int) -> dict[str, Any]:
    """The three arms of one (case, seed), in lockstep; their records.

    The arms advance `Case.eval_every` steps at a time, round robin (the order rotates every
    round), each chunk followed by that arm's evaluation, so load changes on this shared
    machine hit the arms alike. An arm's training clock sums its `train_one_epoch` seconds (and
    the fixed arm's `set_boundary` calls); evaluations and setup are off it. The reference
    process is started, and its first snapshot made, before training (its start-up, mostly
    imports, is reported apart: a one-off per job). Its later CPU work answers the kiln arm's
    own probes, so it mostly overlaps that arm's chunks and, on this CPU-only box, slows its
    clock; it is also reported as ``reference_cpu_ratio`` (reference CPU / training seconds).
    """
    job = make_job(case, seed=seed, corpus=corpus)
    splits = data.load(job.spec.dataset, input_shape=job.spec.model.input_shape,
                       seed=job.spec.dataset.split_seed)
    spe = batching.steps_per_epoch(splits.train, batch_size=case.batch_size)
    arms = {name: Arm(name, job, splits, spe) for name in ARMS}
    startup = arms["kiln"].wait_for_reference()
    names = list(ARMS)
    for name in names:
        arms[name].evaluate()  # step 0
    rounds = 0
    while not all(arm.done for arm in arms.values()):
        k = (order + rounds) % len(names)
        for name in names[k:] + names[:k]:
            arms[name].train(case.eval_every)
            arms[name].evaluate()
        rounds += 1
    records = {name: arm.close() for name, arm in arms.items()}
    records["kiln"]["reference_startup_seconds"] = round(startup, 2)
    return {"arms": records, "steps_per_epoch": spe, "total_steps": spe * case.epochs,
            "n_train": len(splits.train), "n_validation": len(splits.validation)}  # type: ignore[arg-type]


def measure_idle(case: Case, seed: int, *, corpus: Path | None, steps: int, repeats: int,
                 check_every_steps: int | None = None) -> dict[str, Any]:
    """Training clocks of `full` and `idle` (probes and reference running, nothing freezes),
    `repeats` times with fresh arms; `check_every_steps`: the probe cadence (None: the
    default, 8 probes per epoch). The ratio is the median over repeats of idle / full.

    The idle arm is the same job with ``freezing.tolerance`` and ``freezing.peakFraction``
    1e-9: the probes, refreshes and reference process all run, nothing converges.
    """
    job = make_job(case, seed=seed, corpus=corpus)
    knobs: dict[str, Any] = {"tolerance": IDLE_TOLERANCE, "peakFraction": IDLE_TOLERANCE}
    if check_every_steps:
        knobs["checkEverySteps"] = check_every_steps
    idle_job = make_job(case, seed=seed, corpus=corpus, freezing=knobs)
    splits = data.load(job.spec.dataset, input_shape=job.spec.model.input_shape,
                       seed=job.spec.dataset.split_seed)
    spe = batching.steps_per_epoch(splits.train, batch_size=case.batch_size)
    runs = []
    for _ in range(repeats):
        arms = {"full": Arm("full", job, splits, spe), "idle": Arm("idle", idle_job, splits, spe)}
        arms["idle"].wait_for_reference()
        for round_ in range(-(-steps // case.eval_every)):
            for name in (("full", "idle") if round_ % 2 == 0 else ("idle", "full")):
                arms[name].train(case.eval_every)
        full, idle = arms["full"].close(), arms["idle"].close()
        runs.append({"full_seconds": full["train_seconds"], "idle_seconds": idle["train_seconds"],
                     "reference_cpu_seconds": idle.get("freezing", {}).get(
                         "reference_cpu_seconds", 0.0),
                     "froze": [e for e in idle.get("events", []) if e["kind"] == "froze"],
                     "reference_alive": idle.get("reference_alive"), "info": idle["info"]})

    def total(key: str) -> float:
        return round(float(sum(r[key] for r in runs)), 3)

    return {"steps": steps, "repeats": runs, "check_every_steps": controller.Settings.from_job(
                idle_job.spec, steps_per_epoch=spe).check_every_steps,
            "ratio": _median([r["idle_seconds"] / max(r["full_seconds"], 1e-9) for r in runs]),
            "full_seconds": total("full_seconds"), "idle_seconds": total("idle_seconds"),
            "reference_cpu_seconds": total("reference_cpu_seconds")}


def to_target(record: dict[str, Any], *, target: float, total_steps: int) -> dict[str, Any]:
    """Seconds, steps and backward FLOPs (in full steps' backward passes) to the first
    evaluation at the target."""
    hit = next((p for p in record["curve"] if p["accuracy"] >= target), None)
    point = hit or record["curve"][-1]
    return {"reached": hit is not None, "seconds": point["seconds"], "steps": point["step"],
            "backward": point["step"] * (1 - point["skipped"]),
            "fraction_of_budget": round(point["step"] / total_steps, 3)}


def summarize(runs: dict[str, dict[int, Any]], cases: list[Case], idle: dict[str, Any]
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per-case medians over seeds of paired ratios and deltas; the summary over cases.

    A case's target is TARGET_FRACTION of the full arm's final accuracy (median over seeds), a
    rule fixed before the run. Time to target: the training clock at the first evaluation
    meeting it (an arm that never does counts its whole budget, flagged); also steps and
    backward FLOPs to target, final accuracy, and the Freezer's summary. Ratios are full / arm
    per seed, median over seeds, then over cases; deltas are arm - full, in accuracy points.
    The summary holds `median_tta_ratio`, `worst_final_metric_delta`,
    `median_backward_flops_skipped`, `idle_overhead_ratio`, `beats_fixed_schedule`, ...
    """
    per_case: dict[str, Any] = {}
    for case in cases:
        row: dict[str, Any] = {}
        by_seed = list(runs[case.label].values())
        target = round(TARGET_FRACTION * statistics.median(
            r["arms"]["full"]["curve"][-1]["accuracy"] for r in by_seed), 4)
        tta = [{arm: to_target(r["arms"][arm], target=target, total_steps=r["total_steps"])
                for arm in ARMS} for r in by_seed]
        final = [{arm: 100 * r["arms"][arm]["curve"][-1]["accuracy"] for arm in ARMS}
                 for r in by_seed]
        for arm in ARMS:
            row[f"{arm}_tta_seconds"] = _median([t[arm]["seconds"] for t in tta])
            row[f"{arm}_steps_to_target"] = _median([t[arm]["steps"] for t in tta])
            row[f"{arm}_final_accuracy"] = _median([f[arm] / 100 for f in final])
            row[f"{arm}_unreached"] = sum(not t[arm]["reached"] for t in tta)
        row["full_target_fraction_of_budget"] = _median(
            [t["full"]["fraction_of_budget"] for t in tta])
        for arm in FREEZING_ARMS:
            for key in ("seconds", "steps", "backward"):
                row[f"{arm}_{key}_ratio"] = _median(
                    [t["full"][key] / max(t[arm][key], 1e-9) for t in tta])
            row[f"{arm}_final_delta_points"] = _median([f[arm] - f["full"] for f in final])
            row[f"{arm}_worst_final_delta_points"] = round(min(f[arm] - f["full"]
                                                               for f in final), 4)
            row[f"{arm}_backward_flops_skipped"] = _median(
                [r["arms"][arm]["freezing"]["backward_flops_skipped"] for r in by_seed])
            row[f"{arm}_clock_ratio"] = _median(  # whole budget, same steps
                [r["arms"]["full"]["train_seconds"] / r["arms"][arm]["train_seconds"]
                 for r in by_seed])
            row[f"{arm}_frozen_steps_fraction"] = _median([
                frozen_steps_fraction(r["arms"][arm]["events"], r["total_steps"]) for r in by_seed])
        kiln = [r["arms"]["kiln"] for r in by_seed]
        row["reference_cpu_ratio"] = _median(
            [a["freezing"]["reference_cpu_seconds"] / a["train_seconds"] for a in kiln])
        row["reference_startup_seconds"] = _median([a["reference_startup_seconds"] for a in kiln])
        row["reference_process_cpu_seconds"] = _median(
            [a["reference_process_cpu_seconds"] or 0.0 for a in kiln])
        row["saved_seconds_estimate"] = _median([a["freezing"]["saved_seconds"] for a in kiln])
        row["kiln_first_freeze_fraction"] = _median([
            next((e["step"] / r["total_steps"] for e in r["arms"]["kiln"]["events"]
                  if e["kind"] == "froze"), 1.0) for r in by_seed])
        row["kiln_unfreezes"] = _median([sum(e["kind"] == "unfroze" for e in a["events"])
                                         for a in kiln])
        row["kiln_max_frozen"] = max(max([e["boundary"] for e in a["events"]], default=0)
                                     for a in kiln)
        row["target"] = target
        per_case[case.label] = row
    rows = list(per_case.values())

    def over(key: str) -> float:
        return _median([row[key] for row in rows])

    summary: dict[str, Any] = {
        "median_tta_ratio": over("kiln_seconds_ratio"),
        "median_steps_ratio": over("kiln_steps_ratio"),
        "median_backward_flops_ratio": over("kiln_backward_ratio"),
        "worst_final_metric_delta": min(row["kiln_final_delta_points"] for row in rows),
        "median_final_metric_delta": over("kiln_final_delta_points"),
        "median_backward_flops_skipped": over("kiln_backward_flops_skipped"),
        "median_reference_cpu_ratio": over("reference_cpu_ratio"),
        "idle_overhead_ratio": idle["ratio"],
        "fixed_schedule": {
            "median_tta_ratio": over("fixed_seconds_ratio"),
            "median_steps_ratio": over("fixed_steps_ratio"),
            "worst_final_metric_delta": min(row["fixed_final_delta_points"] for row in rows),
            "median_backward_flops_skipped": over("fixed_backward_flops_skipped"),
        },
        "unreached": {arm: sum(row[f"{arm}_unreached"] for row in rows) for arm in ARMS},
    }
    summary["beats_fixed_schedule"] = bool(
        summary["median_tta_ratio"] > summary["fixed_schedule"]["median_tta_ratio"]
        and summary["worst_final_metric_delta"]
        >= summary["fixed_schedule"]["worst_final_metric_delta"])
    summary["goal"] = {"median_tta_ratio_at_least": 1.3, "worst_final_metric_delta_at_least": -0.3,
                       "idle_overhead_ratio_at_most": 1.03, "beats_fixed_schedule": True}
    summary["goal_met"] = bool(summary["median_tta_ratio"] >= 1.3
                               and summary["worst_final_metric_delta"] >= -0.3
                               and summary["beats_fixed_schedule"])
    summary["idle_goal_met"] = bool(idle["ratio"] <= 1.03)
    return summary, per_case


def frozen_steps_fraction(events: list[dict[str, Any]], total_steps: int) -> float:
    """Share of the budget's steps taken with at least one block frozen."""
    frozen, since = 0, None
    for event in events:
        if event["boundary"] and since is None:
            since = event["step"]
        elif not event["boundary"] and since is not None:
            frozen, since = frozen + event["step"] - since, None
    if since is not None:
        frozen += total_steps - since
    return frozen / total_steps


def _median(values: list[float]) -> float:
    return round(float(statistics.median(values)), 4)


def print_table(per_case: dict[str, Any], summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Layer freezing: full vs Kiln (Egeria) vs fixed schedule, medians "
                  "over seeds")
    for column in ("case", "target", "TTA full s", "kiln s", "kiln ×", "steps ×",
                   "fixed ×", "acc full", "Δ kiln", "Δ fixed", "bwd skipped kiln/fixed",
                   "1st freeze", "unfreezes", "ref CPU"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for label, row in per_case.items():
        table.add_row(
            label, f"{row['target']:.3f}", f"{row['full_tta_seconds']:.1f}",
            f"{row['kiln_tta_seconds']:.1f}", f"{row['kiln_seconds_ratio']:.2f}",
            f"{row['kiln_steps_ratio']:.2f}", f"{row['fixed_seconds_ratio']:.2f}",
            f"{row['full_final_accuracy']:.4f}", f"{row['kiln_final_delta_points']:+.2f}",
            f"{row['fixed_final_delta_points']:+.2f}",
            f"{row['kiln_backward_flops_skipped']:.2f}/{row['fixed_backward_flops_skipped']:.2f}",
            f"{row['kiln_first_freeze_fraction']:.0%}" if row["kiln_first_freeze_fraction"] < 1
            else "never", f"{row['kiln_unfreezes']:.0f}",
            f"{row['reference_cpu_ratio']:.1%}")
    console = Console(width=160)
    console.print(table)
    console.print(
        f"median TTA ratio {summary['median_tta_ratio']:.2f} (steps "
        f"{summary['median_steps_ratio']:.2f}); fixed schedule "
        f"{summary['fixed_schedule']['median_tta_ratio']:.2f}; worst final delta "
        f"{summary['worst_final_metric_delta']:+.2f} points; backward skipped "
        f"{summary['median_backward_flops_skipped']:.2f}; idle overhead "
        f"{summary['idle_overhead_ratio']:.3f}; beats fixed: {summary['beats_fixed_schedule']}; "
        f"goal met: {summary['goal_met']}", highlight=False)


def plot(per_case: dict[str, Any], runs: dict[str, dict[int, Any]], path: Path,
         title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(per_case)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.38
    for k, (arm, colour) in enumerate((("kiln", "tab:green"), ("fixed", "tab:grey"))):
        xs = [i + (k - 0.5) * width for i in range(len(labels))]
        axes[0].bar(xs, [per_case[c][f"{arm}_seconds_ratio"] for c in labels], width,
                    label=arm, color=colour)
        axes[1].bar(xs, [per_case[c][f"{arm}_final_delta_points"] for c in labels], width,
                    label=arm, color=colour)
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    axes[0].axhline(1.3, color="tab:red", linewidth=0.8, linestyle="--")
    axes[0].set_ylabel("time to target, full / arm")
    axes[1].axhline(0.0, color="black", linewidth=0.8)
    axes[1].axhline(-0.3, color="tab:red", linewidth=0.8, linestyle="--")
    axes[1].set_ylabel("final accuracy, arm - full (points)")
    for ax in axes[:2]:
        ax.set_xticks(range(len(labels)), labels)
        ax.legend(fontsize=8)
    first = {c: next(iter(runs[c].values())) for c in labels}  # first seed's curves
    for i, (c, colour) in enumerate(zip(labels, ("tab:blue", "tab:orange", "tab:purple",
                                                  "tab:brown"), strict=False)):
        total, shift = first[c]["total_steps"], 0.06 * i  # shifted so equal lines stay visible
        for arm, style in (("kiln", "-"), ("fixed", "--")):
            curve = first[c]["arms"][arm]["curve"]
            axes[2].plot([p["step"] / total for p in curve], [p["frozen"] + shift for p in curve],
                         style, color=colour, label=f"{c} {arm}")
        hit = next((p["step"] for p in first[c]["arms"]["full"]["curve"]
                    if p["accuracy"] >= per_case[c]["target"]), total)
        axes[2].axvline(hit / total, color=colour, linewidth=0.8, linestyle=":")
    axes[2].set_xlabel("fraction of the step budget")
    axes[2].set_ylabel("frozen blocks, first seed (dotted: full at target)")
    axes[2].legend(fontsize=7)
    common.save_figure(fig, path, title=title)


def main() -> None:
    parser = common.arguments(__doc__, "tiny smoke run (CI)")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--cases", default=None, help="comma-separated case labels (default all)")
    parser.add_argument("--idle-steps", type=int, default=None,
                        help="steps per case of the idle-overhead measurement (default 120)")
    args = parser.parse_args()
    common.one_thread()
    name = NAME + ("_quick" if args.quick else "")
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",")]
    cases = QUICK_CASES if args.quick else CASES
    if args.cases:
        cases = [c for c in cases if c.label in args.cases.split(",")]
    idle_steps = args.idle_steps or (16 if args.quick else 120)
    load_before, began = os.getloadavg(), time.perf_counter()
    runs: dict[str, dict[int, Any]] = {c.label: {} for c in cases}
    with tempfile.TemporaryDirectory(prefix="kiln-freezing-") as tmp:
        corpus, corpus_info = write_corpus(Path(tmp))
        for si, seed in enumerate(seeds):
            for ci, case in enumerate(cases):
                run = run_case(case, seed, corpus=corpus, order=si + ci)
                runs[case.label][seed] = run
                a = run["arms"]
                print(f"  s{seed} {case.label:12s} " + "  ".join(
                    f"{arm} {a[arm]['train_seconds']:6.1f} s final "
                    f"{a[arm]['curve'][-1]['accuracy']:.4f}" for arm in ARMS)
                    + f"  kiln events {[(e['kind'][0], e['step']) for e in a['kiln']['events']]}",
                    flush=True)
        repeats = 1 if args.quick else IDLE_REPEATS
        idle_runs = {c.label: measure_idle(c, seeds[0], corpus=corpus, steps=idle_steps,
                                           repeats=repeats) for c in cases}
        # the same on the first case with a sparser probe cadence: how the overhead scales
        sparse = measure_idle(cases[0], seeds[0], corpus=corpus, steps=idle_steps,
                              repeats=repeats, check_every_steps=SPARSE_CHECK_EVERY_STEPS)
    idle = {"by_case": idle_runs, "sparse_cadence": sparse}
    report(name, cases, runs, idle, corpus_info, {
        "seeds": seeds, "quick": args.quick,
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "bench_seconds": round(time.perf_counter() - began, 1)})


def report(name: str, cases: list[Case], runs: dict[str, dict[int, Any]], idle: dict[str, Any],
           corpus_info: dict[str, Any], about: dict[str, Any]) -> None:
    """Summarize, print the table, write the JSON and the plot."""
    by_case = idle["by_case"]
    idle["ratio"] = _median([r["ratio"] for r in by_case.values()])  # median of case medians
    idle["with_reference_cpu_ratio"] = _median([
        (r["idle_seconds"] + r["reference_cpu_seconds"]) / max(r["full_seconds"], 1e-9)
        for r in by_case.values()])
    summary, per_case = summarize(runs, cases, idle)
    summary.update({
        "idle_overhead_ratio_with_reference_cpu": idle["with_reference_cpu_ratio"],
        "idle_overhead_ratio_sparse_cadence": idle["sparse_cadence"]["ratio"],
        "targets": {label: row["target"] for label, row in per_case.items()},
        "cases": [c.label for c in cases], "torch_threads": 1, **about})
    details = {"per_case": per_case, "idle": idle, "corpus": corpus_info,
               "cases": {c.label: dataclasses.asdict(c) for c in cases},
               "runs": {label: {str(s): r for s, r in by.items()} for label, by in runs.items()}}
    print_table(per_case, summary)
    print(f"wrote {common.write_results(name, summary, details)}")
    plot(per_case, runs, common.plot_path(name),
         f"Kiln layer freezing vs full training and a fixed schedule: {len(cases)} cases x "
         f"{len(about['seeds'])} seeds, 1 thread")


if __name__ == "__main__":
    main()
