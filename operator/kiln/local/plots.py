"""`kiln plot`: training curves from runs' metric histories (a `kiln run` history file, or the
one a zoo record keeps), and a placement plan as a Gantt chart.

Figures are drawn off screen (matplotlib's Agg backend) and returned, so callers can save them
or inspect their axes; this module never shows a window.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display on CI machines or in pods

from matplotlib import pyplot
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from kiln import api
from kiln.local import runner
from kiln.zoo import records, store

# (history key, axis label) of each curve panel, left to right.
CURVES = (("train_loss", "train loss"), ("validation_loss", "validation loss (nats)"),
          ("validation_accuracy", "validation accuracy"))
FROZEN = ("frozen_modules", "frozen modules")
X_LABEL = "training time (s)"


class PlotError(ValueError):
    """A history or plan file that cannot be plotted; the message names the file and the fix."""


def load_runs(paths: Sequence[Path], *,
              zoo: store.ObjectStore | None = None) -> dict[str, list[dict[str, Any]]]:
    """Read runs for `runs_figure`, each named by its file (`digits-a.metrics.jsonl`: digits-a).

    A path that is a job name or a job's log resolves to its history beside it, so
    `kiln plot .kiln/runs/digits-a.log` and `.kiln/runs/digits-a` both work; a bare job name
    (`digits-a`) with no history in the working directory is looked up in `.kiln/runs/`, then,
    given a `zoo`, as a zoo model id or the job name of a zoo record (`zoo_history`): a
    cluster job's curves are those its trainer stored with its record.

    Raises:
        PlotError: a file is missing, unreadable, or holds no evaluations; or no zoo record
            matches, or the one that does keeps no history.
        store.StoreUnavailable: the zoo could not be read.
    """
    runs: dict[str, list[dict[str, Any]]] = {}
    for given in paths:
        path = history_file(given)
        if zoo is not None and (name := zoo_name(given)) is not None:
            history = zoo_history(zoo, name)
        else:
            name, history = path.name.removesuffix(".metrics.jsonl"), _file_history(given, path)
        runs[name if name not in runs else str(path)] = history
    return runs


def _file_history(given: Path, path: Path) -> list[dict[str, Any]]:
    try:
        history = runner.read_history(path)
    except OSError as exc:
        plan = (f"; to draw the plan {given} as a Gantt chart, give --plan {given}"
                if given.name.endswith(".json") else "")
        raise PlotError(f"{given}: cannot read {path} ({exc.strerror or exc}); give a "
                        "`kiln run` history, e.g. .kiln/runs/JOB.metrics.jsonl, a job name or "
                        f"a zoo model id{plan}") from None
    if not history:
        raise PlotError(f"{path}: holds no evaluations yet; a run writes one line per "
                        "evaluation (each epoch, and every spec.training.evalEverySteps)")
    return history


def zoo_name(given: Path) -> str | None:
    """`given` as a zoo model id or job name to look up, or None: a path with a folder, a file
    name (a history, log or job file), or a name whose history is here, is read as a file."""
    if (given.parent != Path() or given.name.endswith((".metrics.jsonl", ".log", ".json"))
            or history_file(given).exists()):
        return None
    return given.name


def zoo_history(zoo: store.ObjectStore, name: str) -> list[dict[str, Any]]:
    """The evaluations stored with the zoo record `name` (a model id), else with the newest
    record of the job called `name`.

    Raises:
        PlotError: no record matches; the job has records in several namespaces; the record
            keeps no history, or an empty one.
        store.StoreUnavailable: the zoo could not be read.
    """
    record = _find_record(zoo, name)
    try:
        history = records.read_history(zoo, record)
    except store.ObjectNotFound:
        raise PlotError(f"{name}: zoo model {record.id} keeps no training history (registered "
                        "by an older trainer, or imported); plot the history its run left "
                        "(`kiln run` writes .kiln/runs/JOB.metrics.jsonl), or train the job "
                        "again with this Kiln") from None
    if not history:
        raise PlotError(f"{name}: zoo model {record.id} keeps a history without evaluations")
    return history


def _find_record(zoo: store.ObjectStore, name: str) -> records.ZooRecord:
    try:
        return records.read_record(zoo, name)
    except (ValueError, store.ObjectNotFound):  # not an id, or no record of that id
        pass
    mine = [r for r in records.list_records(zoo) if r.job_name == name]
    if not mine:
        raise PlotError(f"{name}: no `kiln run` history here ({history_file(Path(name))}) and "
                        f"no zoo model with this id or job name in {zoo.describe()}; give a "
                        "history file, or a model id or job name from `kiln zoo ls` with the "
                        "--zoo that holds it")
    if len({r.namespace for r in mine}) > 1:
        raise PlotError(f"{name}: jobs of this name in several namespaces registered models "
                        f"({', '.join(f'{r.id} ({r.namespace})' for r in mine)}); give the "
                        "model id instead")
    return max(mine, key=lambda r: r.created_time)


def history_file(path: Path) -> Path:
    """The history file a user meant: the path itself, or `<job>.metrics.jsonl` beside a job's
    log, job file, or job name; a bare name's in `runner.RUNS` unless the working directory has it."""
    if path.name.endswith(".metrics.jsonl"):
        found = path
    else:
        stem = path.name.removesuffix(".log").removesuffix(".json")
        found = path.with_name(f"{stem}.metrics.jsonl")
    if found.parent == Path() and not found.exists():
        return runner.RUNS / found
    return found


def runs_figure(runs: Mapping[str, Sequence[Mapping[str, Any]]], *,
                x_key: str = "elapsed_seconds") -> Figure:
    """Loss and accuracy curves of several runs side by side (one line per run, one panel per
    quantity), so a warm-started run reads against its cold twin at a glance.

    A frozen-modules panel (integer ticks) is added when any run froze a module. Missing values
    (an evaluation before the first training loss) are gaps, not zeros. A run with a single
    evaluation is drawn as a dot, on an x axis from 0.

    Args:
        runs: run name -> its evaluations (`runner.read_history` lines).
        x_key: the x axis: "elapsed_seconds" (training time, the default: warm start and
            freezing pay off in time, not steps) or "step".

    Returns:
        The figure; its axes are titled by quantity and share the x axis.
    """
    panels = list(CURVES)
    if any(line.get(FROZEN[0]) for history in runs.values() for line in history):  # 0: none
        panels.append(FROZEN)
    figure = pyplot.figure(figsize=(4.5 * len(panels), 4.0), layout="constrained")
    axes = figure.subplots(1, len(panels), sharex=True, squeeze=False)[0]
    for ax, (key, label) in zip(axes, panels, strict=True):
        for name, history in runs.items():
            xs = [_number(line.get(x_key) or 0.0) for line in history]
            ys = [_number(line.get(key)) for line in history]
            marker = "o" if len(xs) == 1 else "."  # a lone evaluation is no line
            if key == FROZEN[0]:
                ax.step(xs, ys, where="post", label=name, marker=marker if len(xs) == 1 else "")
                ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # whole modules
            else:
                ax.plot(xs, ys, marker=marker, label=name)
        ax.set_title(label)
        ax.set_xlabel(X_LABEL if x_key == "elapsed_seconds" else x_key.replace("_", " "))
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    at = {x for history in runs.values() for line in history
          if math.isfinite(x := _number(line.get(x_key) or 0.0))}
    if len(at) == 1:  # matplotlib would span a sliver around the one x; show it from 0
        (x,) = at
        axes[0].set_xlim(min(0.0, x), 2 * x if x > 0 else 1.0)
    axes[0].legend(loc="best", fontsize="small")
    figure.suptitle(", ".join(runs) if len(runs) <= 3 else f"{len(runs)} runs")
    return figure


def load_plan(path: Path) -> dict[str, Any]:
    """A plan document: `kiln run --slots` writes one as `.kiln/runs/run.json` (the plan and
    how each job ran); a bare plan (``{"assignments": [...]}``) works too.

    Raises:
        PlotError: the file is missing, not JSON, or has no assignments.
    """
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PlotError(f"--plan {path}: cannot read it ({exc.strerror or exc}); `kiln run "
                        "--slots N` writes .kiln/runs/run.json") from None
    except json.JSONDecodeError as exc:
        raise PlotError(f"--plan {path}: not JSON ({exc.msg}, line {exc.lineno})") from None
    plan = doc.get("plan", doc) if isinstance(doc, dict) else None
    assignments = plan.get("assignments") if isinstance(plan, dict) else None
    if not isinstance(assignments, list) or not all(
            isinstance(a, dict) and {"job", "start", "seconds"} <= a.keys() for a in assignments):
        raise PlotError(f"--plan {path}: expected run.json from `kiln run --slots` or a plan "
                        "with assignments [{job, start, seconds, gpus, parallelism}, ...]")
    return dict(doc)


def plan_figure(doc: Mapping[str, Any]) -> Figure:
    """The plan as a Gantt chart: one row per job, its planned span as an outlined bar labelled
    with its config (``ddp×2``), and, for run.json, the span it actually ran filled inside.

    Args:
        doc: `load_plan`'s document.

    Returns:
        The figure (one axes: x in seconds from the run's start, y the jobs in planned order).
    """
    plan = doc.get("plan", doc)
    assignments = sorted(plan["assignments"], key=lambda a: (float(a["start"]), str(a["job"])))
    ran = {str(j["name"]): j for j in doc.get("jobs", [])
           if isinstance(j, dict) and "start_seconds" in j and "end_seconds" in j}
    figure = pyplot.figure(figsize=(9.0, 1.2 + 0.5 * len(assignments)), layout="constrained")
    ax = figure.add_subplot()
    legend = {"planned", "actual"}  # each label once
    for row, a in enumerate(assignments):
        start, seconds = float(a["start"]), float(a["seconds"])
        ax.barh(row, seconds, left=start, height=0.7, fill=False, hatch="//",
                edgecolor="tab:blue", label=_once(legend, "planned"))
        ax.text(start + seconds / 2, row, f"{a.get('parallelism', '?')}×{a.get('gpus', '?')}",
                ha="center", va="center", fontsize="small")
        actual = ran.get(str(a["job"]))
        if actual is not None:
            began = float(actual["start_seconds"])
            ax.barh(row, float(actual["end_seconds"]) - began, left=began, height=0.35,
                    color="tab:orange", alpha=0.8, label=_once(legend, "actual"))
    ax.set_yticks(range(len(assignments)), [str(a["job"]) for a in assignments])
    ax.invert_yaxis()  # first start on top, as a schedule reads
    ax.set_xlabel("seconds from the start of the run")
    devices = doc.get("devices") or {}
    where = f" on {_devices(devices)}" if devices else ""
    makespan = _number(plan.get("makespan_seconds", plan.get("makespan")))
    spans = [] if math.isnan(makespan) else [f"makespan {makespan:.0f} s planned"]
    if ran:  # spans are seconds from the run's start
        spans.append(f"{max(float(j['end_seconds']) for j in ran.values()):.0f} s actual")
    ax.set_title(f"plan ({plan.get('solver', '?')}){where}" +
                 "".join(f", {span}" for span in spans))
    ax.grid(axis="x", alpha=0.3)
    # below the axes: inside, the legend would hide the bars of whichever rows it sat on
    figure.legend(loc="outside lower center", ncols=2, fontsize="small")
    return figure


def _devices(devices: Mapping[str, Any]) -> str:
    """A run's devices in words: "2 CPU slots", "1 GPU", "4 GPUs (NVIDIA H200)"."""
    count, kind = devices.get("count", "?"), str(devices.get("kind", "?"))
    if kind == "cpu":
        return f"{count} CPU slot{'' if count == 1 else 's'}"
    model = kind.removeprefix("cuda").lstrip(":")
    return f"{count} GPU{'' if count == 1 else 's'}" + (f" ({model})" if model else "")


def save(figure: Figure, out: Path) -> None:
    """Write `figure` to `out` (format from its suffix, e.g. .png, .svg, .pdf) and free it.

    Raises:
        PlotError: the folder does not exist or the format is unknown.
    """
    try:
        figure.savefig(out, dpi=100)
    except (OSError, ValueError) as exc:
        raise PlotError(f"--out {out}: cannot write it ({exc}); give a path in an existing "
                        "folder ending in .png, .svg or .pdf") from None
    finally:
        pyplot.close(figure)


def _once(unused: set[str], label: str) -> str | None:
    """`label` the first time it is asked for, then None (one legend entry per kind of bar)."""
    if label in unused:
        unused.discard(label)
        return label
    return None


def _number(value: Any) -> float:
    """A plotted value: a number, or NaN (a gap in the line) for None."""
    return float(value) if isinstance(value, int | float) else math.nan


def sweep_figure(sweep: api.sweep.TrainingSweep) -> Figure:
    """Every trial of a sweep: its objective at each evaluated epoch, one line per trial,
    pruned trials dashed and ending in an x, the best one thicker. Drawn from the sweep's
    status, so a cluster's sweep (`kubectl get tsw NAME -o yaml`) plots as a local one does.

    Raises:
        PlotError: no trial has evaluated yet.
    """
    status = sweep.status or api.sweep.TrainingSweepStatus()
    trials = [t for t in status.history if t.evaluations]
    if not trials:
        raise PlotError(f"sweep {sweep.name}: no trial has evaluated yet; a trial adds a point "
                        "at each epoch's evaluation")
    metric = sweep.spec.objective.metric.value
    best = status.best.index if status.best is not None else None
    figure = pyplot.figure(figsize=(8.0, 5.0), layout="constrained")
    ax = figure.add_subplot()
    for t in trials:
        epochs = [e[0] for e in t.evaluations]
        values = [e[1] for e in t.evaluations]
        pruned = t.state is api.sweep.TrialState.PRUNED
        (line,) = ax.plot(epochs, values, linestyle="--" if pruned else "-",
                          marker="o" if len(epochs) == 1 else ".",
                          linewidth=3.0 if t.index == best else 1.5,
                          label=f"{t.name} ({t.state.value.lower()})")
        if pruned:
            ax.plot(epochs[-1:], values[-1:], marker="x", markersize=9, color=line.get_color())
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel(metric.replace("_", " "))
    ax.grid(alpha=0.3)
    ax.set_title(f"sweep {sweep.name}: {len(status.history)} trials, "
                 f"{status.trials.pruned} pruned (dashed)")
    ax.legend(loc="best", fontsize="small", ncols=2 if len(trials) > 8 else 1)
    return figure
