"""The `kiln` command's tables: results, a run's plan, a profile, the zoo, warm-start candidates.

Every cell is plain text (`add_row`): job names, zoo records and trainer values are never read
as rich markup. Pure formatting of data the caller already has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from kiln import api
from kiln.warmstart import select

# Annotations only. The torch-backed modules (models, runplan, estimate) are imported by the
# tables that call them, so `kiln zoo ls` starts without torch.
if TYPE_CHECKING:
    from kiln.local import machine, runner
    from kiln.placement import profilecache, types
    from kiln.warmstart import index
    from kiln.zoo import records

SHORT = {"validation_accuracy": "val acc", "validation_loss": "val loss"}
"""Short names of the target metrics for table cells."""


def add_row(table: Table, *cells: str) -> None:
    """A table row of plain text: record and trainer values are never read as markup."""
    table.add_row(*(Text(cell) for cell in cells))


def fmt(value: Any, name: str | None = None, digits: int = 3) -> str:
    """`value` with `digits` decimals when a float ("-" for None), after `name` if given."""
    if value is None:
        return "-"
    text = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    return f"{name} {text}" if name else text


def results(outcomes: Sequence[runner.JobOutcome]) -> Table:
    """One row per job; planned runs add config and planned vs. actual "start+duration" (s)."""
    table = Table(title="Kiln results")
    planned = any(o.placement for o in outcomes)
    for column in ("job", "architecture", "warm start (similarity)", "final metric",
                   "time-to-target s", "wall s", "samples/s", "frozen (saved s)", "zoo model",
                   *(("config", "planned s", "actual s") if planned else ())):
        table.add_column(column, overflow="fold")
    for o in outcomes:
        r = o.result
        parent = (f"{r['parent']} ({r['similarity']:.2f})" if r.get("parent")
                  else _cold(r.get("warm_start_decision")))
        metric = f"{SHORT.get(r.get('metric_name', ''), '')} {fmt(r.get('metric'))}"
        reached = fmt(r.get("time_to_target_seconds"), digits=1) if r.get("target_reached") \
            else "not reached" if o.has_target else "no target"
        add_row(table, o.name, o.architecture, parent, metric, reached,
                fmt(r.get("wall_seconds"), digits=1),
                fmt(r.get("samples_per_second"), digits=0), _frozen(r.get("freezing")),
                str(r.get("zoo_model") or "-"), *(_placement(o.placement) if planned else ()))
    return table


def _cold(decided: dict[str, Any] | None) -> str:
    """How a run without a parent started: "cold (guard)" when the trainer's guard refused
    every candidate, "cold (no match)" when the zoo offered no usable one, "cold (disabled)", or
    "pretrained weights" for a job that starts from spec.model.pretrained."""
    outcome = (decided or {}).get("outcome")
    if (decided or {}).get("reason") == select.PRETRAINED_REASON:
        return "pretrained weights"
    return _COLD.get(str(outcome), "cold (no match)" if outcome else "cold")


_COLD = {api.WarmStartOutcome.COLD_GUARD.value: "cold (guard)",
         api.WarmStartOutcome.DISABLED.value: "cold (disabled)",
         api.WarmStartOutcome.INIT_STATE.value: "caller's weights"}


def _placement(p: runner.Placement | None) -> tuple[str, ...]:
    """('ddp×2 (flops)', '0+35', '2+41'): config, planned and actual start+duration."""
    if p is None:
        return ("-", "-", "-")
    return (f"{p.parallelism}×{p.gpus} ({p.source})",
            f"{p.planned_start_seconds:.0f}+{p.planned_seconds:.0f}",
            f"{p.start_seconds:.0f}+{p.seconds:.0f}")


def _frozen(summary: dict[str, Any] | None) -> str:
    """'2 modules (4.1 s)': the most modules frozen at once and the estimated time saved."""
    if not summary:
        return "off"
    most = max((e["boundary"] for e in summary.get("events", [])), default=0)
    return f"{most} modules ({fmt(summary.get('saved_seconds'), digits=1)})" if most else "none"


def plan(the_plan: types.Plan, configs: Mapping[str, tuple[types.Config, ...]],
         devices: machine.Devices) -> Table:
    """The plan: job -> device(s), config, planned start, estimated duration, source."""
    from kiln.local import runplan

    slots = runplan.planned_devices(the_plan, devices.count)
    table = Table(title=f"Plan: {len(the_plan.assignments)} jobs on {devices.count} "
                        f"{devices.noun} ({the_plan.solver}; makespan {the_plan.makespan:.0f} s)")
    for column in ("job", devices.noun[:-1].lower() + "(s)", "config", "start s", "est. s",
                   "source"):
        table.add_column(column)
    for a in sorted(the_plan.assignments, key=lambda a: (a.start, a.job)):
        add_row(table, a.job, ",".join(map(str, slots[a.job])), f"{a.parallelism}×{a.gpus}",
                f"{a.start:.0f}", f"{a.seconds:.0f}",
                runplan.source_of(configs.get(a.job, ()), a))
    return table


def profile_table(job: api.TrainingJob, measured: Sequence[profilecache.Measurement], *,
                  kind: str, cache: Path | None) -> Table:
    """A job's profile: per config, step seconds, samples/s, estimated job seconds, status."""
    from kiln.placement import estimate

    work, device = estimate.workload(job), estimate.device_model(kind)
    table = Table(title=f"Profile of {job.name} ({job.spec.model.label}, batch "
                        f"{work.batch_size}) on {kind}; cache {cache or 'none'}")
    for column in ("config", "step s", "samples/s", "est. job s", "status"):
        table.add_column(column)
    for m in measured:
        step = m.step_seconds
        status = ("cached " if m.cached else "") + m.status + (f": {m.detail}" if m.detail
                                                               else "")
        add_row(table, f"{m.parallelism}×{m.gpus}", fmt(step, digits=4),
                fmt(work.batch_size / step if step else None, digits=0),
                fmt(estimate.job_seconds(work, step, device) if step else None, digits=1),
                status)
    return table


def zoo_models(where: str, found: Sequence[records.ZooRecord]) -> Table:
    """`kiln zoo ls`: the zoo's models, in the order given (`--sort`)."""
    table = Table(title=Text(f"Model zoo: {where}", style="table.title"))
    for column in ("id", "architecture", "dataset", "metric", "params", "parent", "created"):
        table.add_column(column)
    for rec in found:
        # A provisional record is a job's best weights so far (still training, or stopped
        # early, e.g. a pruned trial): its metric is not a finished model's.
        metric = fmt(rec.metric_value, rec.metric_name) + (" (provisional)"
                                                             if rec.provisional else "")
        add_row(table, rec.id, rec.builder, rec.dataset, metric, f"{rec.num_params:,}",
                rec.parent or "-", rec.created_time)
    return table


def warm_start_candidates(job: api.TrainingJob, found: index.QueryResult, zoo_size: int,
                          chosen: str | None, *, top: int) -> Table:
    """`kiln zoo query`: the `top` ranked parents of a query result (`ZooIndex.query`)."""
    table = Table(title=f"Warm-start candidates for {job.name} ({job.spec.model.label}) "
                        f"among {zoo_size} zoo models, {found.mode} search")
    for column in ("rank", "zoo model", "architecture", "similarity", "bucket", "metric",
                   "candidate"):
        table.add_column(column)
    for rank, cand in enumerate(found.candidates[:top], start=1):
        bucket = select.bucket_of(cand.similarity)
        add_row(table, str(rank), cand.id, cand.record.builder, f"{cand.similarity:.3f}",
                f"{bucket / 10:.1f}-{(bucket + 1) / 10:.1f}",
                f"{SHORT.get(cand.record.metric_name, '')} {cand.record.metric_value:.4f}",
                "yes" if cand.id == chosen else "")
    return table


def architecture_rows() -> list[dict[str, str]]:
    """`kiln models`: the registered architectures, one plain dict each."""
    from kiln import models

    return [{"name": name, "family": info.family, "modality": str(info.modality),
             "task": str(info.task)}
            for name, info in ((name, models.get_info(name)) for name in models.list_models())]


def leaderboard(sweep: api.sweep.TrainingSweep, *, ranked: bool = True,
                compact: bool = False) -> Table:
    """A sweep's trials: values, state, last evaluated epoch, objective, warm or cold, pruned
    at; best first (`ranked`), else in trial order (the live view: rows stay put). `compact`
    (a narrow terminal): trials by index, warm or cold without the parent, no zoo model or why
    pruned, so each trial keeps to one line."""
    spec, status = sweep.spec, sweep.status or api.sweep.TrainingSweepStatus()
    metric = spec.objective.metric.value
    paths = [p.path for p in spec.parameters]
    leaves = [path.rsplit(".", 1)[-1] for path in paths]
    heads = [leaf if leaves.count(leaf) == 1 else path for leaf, path in zip(leaves, paths,
                                                                             strict=True)]
    phase = status.phase.value if status.phase else "Pending"
    c = status.trials
    table = Table(title=f"Sweep {sweep.name}: {phase}, {c.total} trials ({c.running} running, "
                        f"{c.pruned} pruned, {c.failed} failed)")
    detail = () if compact else ("zoo model", "pruned at / why")
    for column in ("trial", *heads, "state", "epoch", SHORT.get(metric, metric), "start",
                   *detail):
        table.add_column(column, overflow="fold")
    trials = list(status.history)
    if ranked:
        sign = -1.0 if spec.objective.maximize else 1.0
        trials.sort(key=lambda t: (t.metric is None, sign * (t.metric or 0.0), t.index))
    best = status.best.index if status.best is not None else None
    for t in trials:
        epochs = t.params.get("training.epochs", spec.template.training.epochs)
        epoch = f"{int(t.evaluations[-1][0])}/{epochs}" if t.evaluations else f"-/{epochs}"
        value = t.metric if t.metric is not None else (
            t.evaluations[-1][1] if t.evaluations else None)
        pruned = (f"epoch {t.pruned_at.epoch} ({t.pruned_at.value:.4f}): {t.pruned_at.against}"
                  if t.pruned_at is not None else t.message or "-")
        start = _start_of(sweep, t)
        name = t.name.removeprefix(f"{sweep.name}-") if compact else t.name  # the title has it
        add_row(table, name + (" *" if t.index == best else ""),
                *(_value(t.params.get(path)) for path in paths), t.state.value, epoch,
                fmt(value, digits=4), start.split(":")[0] if compact else start,
                *(() if compact else (t.zoo_model or "-", pruned)))
    return table


def _value(value: Any) -> str:
    """A parameter's value in a cell: 4 significant digits for a float."""
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _start_of(sweep: api.sweep.TrainingSweep, trial: api.sweep.Trial) -> str:
    """"warm: <parent>", "cold", or "-" while unknown: a trial's parent is known from its
    result, or from its zoo record (a running trial's first provisional one)."""
    if trial.parent:
        return f"warm: {trial.parent}"
    independent = sweep.spec.warm_start is api.sweep.SweepWarmStart.INDEPENDENT
    known = trial.state is api.sweep.TrialState.SUCCEEDED or (
        trial.zoo_model is not None and trial.state is not api.sweep.TrialState.RUNNING)
    return "cold" if independent or known else "-"
