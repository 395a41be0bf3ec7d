"""What `kiln ls`, `kiln get` and `kiln.Client` report about a job: plain dicts from its object.

Pure functions of a TrainingJob or TrainingSweep as the API server returns it (camelCase JSON)
and of its events; the same shapes for a cluster job and a `Client(local=True)` run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table
from rich.text import Text

from kiln import api

Object = Mapping[str, Any]

TERMINAL_PHASES = (api.Phase.SUCCEEDED.value, api.Phase.FAILED.value)
WARM_OUTCOMES = (api.WarmStartOutcome.WARM.value, api.WarmStartOutcome.PINNED.value)


def summary(obj: Object) -> dict[str, Any]:
    """One `kiln ls` row: kind, name, namespace, phase, epoch of epochs, ETA, warm start,
    placement and accuracy (None where the status does not tell yet)."""
    meta, spec, status = _parts(obj)
    row: dict[str, Any] = {"kind": obj.get("kind"), "name": meta.get("name"),
                           "namespace": meta.get("namespace"), "phase": status.get("phase")}
    if obj.get("kind") == api.sweep.SWEEP_KIND:
        trials, best = status.get("trials") or {}, status.get("best") or {}
        return row | {"epoch": None, "epochs": None, "etaSeconds": None, "warmStart": None,
                      "placement": f"{trials.get('total', 0)} trials" if trials else None,
                      "accuracy": best.get("metric")}
    progress, result = status.get("progress") or {}, status.get("result") or {}
    done = status.get("phase") == api.Phase.SUCCEEDED.value
    return row | {
        "epoch": progress.get("epoch"),
        "epochs": (spec.get("training") or {}).get("epochs"),
        "etaSeconds": None if status.get("phase") in TERMINAL_PHASES
        else progress.get("etaSeconds"),
        "warmStart": warm_start_short(status.get("warmStart")),
        "placement": placement_short(status.get("placement")),
        "accuracy": result.get("validationAccuracy") if done or result
        else progress.get("validationAccuracy"),
    }


def detail(obj: Object, events: Sequence[Object] = ()) -> dict[str, Any]:
    """`kiln get`: the summary, the progress, conditions, recent events (oldest first), the
    result and the job's story in words."""
    _meta, _spec, status = _parts(obj)
    return summary(obj) | {
        "progress": dict(status.get("progress") or {}),
        "result": dict(status.get("result") or {}),
        "conditions": [{key: c.get(key) for key in
                        ("type", "status", "reason", "message", "lastTransitionTime")}
                       for c in status.get("conditions") or []],
        "events": [event_row(e) for e in events],
        "story": story(obj),
    }


def event_row(event: Object) -> dict[str, Any]:
    """An event as `kubectl events` shows it: when, type, reason, message, count."""
    return {"time": event.get("lastTimestamp") or event.get("eventTime")
            or (event.get("metadata") or {}).get("creationTimestamp"),
            "type": event.get("type"), "reason": event.get("reason"),
            "message": event.get("message"), "count": event.get("count")}


def story(obj: Object) -> list[str]:
    """The job in sentences: warm start, placement, progress, freezing, and how it ended."""
    _meta, spec, status = _parts(obj)
    if obj.get("kind") == api.sweep.SWEEP_KIND:
        return _sweep_story(status)
    lines = [_warm_story(status.get("warmStart"))]
    placement = status.get("placement") or {}
    if placement.get("node") or placement.get("nodes"):
        lines.append(f"Placed on {placement_short(placement)}"
                     + (f"; estimated {_seconds(placement['estimatedSeconds'])} of training."
                        if placement.get("estimatedSeconds") else "."))
    progress = status.get("progress") or {}
    if progress.get("epoch"):
        epochs = (spec.get("training") or {}).get("epochs")
        said = f"Epoch {progress['epoch']}" + (f" of {epochs}" if epochs else "")
        if progress.get("step"):
            said += f", step {progress['step']}"
        if progress.get("validationAccuracy") is not None:
            said += f", validation accuracy {progress['validationAccuracy']:.3f}"
        if progress.get("etaSeconds") and status.get("phase") not in TERMINAL_PHASES:
            said += f", about {_seconds(progress['etaSeconds'])} left"
        lines.append(said + ".")
    lines.append(_freezing_story(spec.get("freezing") or {}, progress))
    lines += _ending(status)
    return lines


def warm_start_short(decision: Object | None) -> str | None:
    """'warm: PARENT (0.93)', 'pinned: PARENT', 'cold (cold_empty)', or None before deciding."""
    if not decision:
        return None
    outcome = str(decision.get("outcome") or "")
    if outcome in WARM_OUTCOMES and decision.get("parent"):
        similarity = decision.get("similarity")
        return f"{outcome}: {decision['parent']}" + (
            f" ({similarity:.2f})" if isinstance(similarity, float) else "")
    if outcome == api.WarmStartOutcome.IN_TRAINER.value:
        return "in trainer"
    return f"cold ({outcome})" if outcome else "cold"


def placement_short(placement: Object | None) -> str | None:
    """'NODE, 2 GPUs, ddp' (the nodes of a multi-node job joined by '+'), or None."""
    if not placement or not (placement.get("node") or placement.get("nodes")):
        return None
    nodes = "+".join(placement.get("nodes") or [placement["node"]])
    gpus = placement.get("gpus")
    parts = [nodes, "CPU" if not gpus else f"{gpus} GPU" + ("s" if gpus > 1 else "")]
    if placement.get("parallelism"):
        parts.append(str(placement["parallelism"]))
    return ", ".join(parts)


def summary_table(rows: Sequence[Object]) -> Table:
    """`kiln ls` for people: one row per job, numbers rounded, '-' for unknown."""
    table = Table(title="Kiln jobs")
    for column in ("namespace", "name", "kind", "phase", "epoch", "eta", "warm start",
                   "placement", "accuracy"):
        table.add_column(column, overflow="fold")
    for row in rows:
        epoch = row.get("epoch")
        shown_epoch = "-" if epoch is None else (
            f"{epoch}/{row['epochs']}" if row.get("epochs") else str(epoch))
        eta = row.get("etaSeconds")
        accuracy = row.get("accuracy")
        table.add_row(*(Text(str(cell)) for cell in (
            row.get("namespace") or "-", row.get("name") or "-", row.get("kind") or "-",
            row.get("phase") or "-", shown_epoch, "-" if eta is None else _seconds(eta),
            row.get("warmStart") or "-", row.get("placement") or "-",
            "-" if accuracy is None else f"{accuracy:.4g}")))
    return table


def detail_lines(view: Object) -> list[str]:
    """`kiln get` for people: the story, then conditions and events, one line each."""
    lines = [(f"{view.get('kind')} {view.get('namespace') or '-'}/{view.get('name')}: "
             f"{view.get('phase') or 'no phase yet'}"), *(f"  {s}" for s in view["story"])]
    lines.append("Conditions:")
    lines += [f"  {c['type']}={c['status']} {c.get('reason') or ''}: {c.get('message') or ''}"
              .rstrip(": ") for c in view["conditions"]] or ["  (none yet)"]
    lines.append("Events:")
    lines += [f"  {e.get('time') or '-'} {e.get('type') or '-'} {e.get('reason') or '-'}: "
              f"{e.get('message') or ''}" for e in view["events"]] or ["  (none)"]
    return lines


def _parts(obj: Object) -> tuple[Object, Object, Object]:
    return obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}


def _warm_story(decision: Object | None) -> str:
    if not decision:
        return "No warm-start decision yet."
    outcome, reason = str(decision.get("outcome") or ""), str(decision.get("reason") or "")
    why = f": {reason}" if reason else ""
    if outcome in WARM_OUTCOMES and decision.get("parent"):
        said = ("Warm-started from the pinned parent " if outcome == "pinned"
                else "Warm-started from ") + str(decision["parent"])
        facts = []
        if isinstance(decision.get("similarity"), float):
            facts.append(f"similarity {decision['similarity']:.2f}")
        if decision.get("matchedTensors") is not None and decision.get("totalTensors"):
            facts.append(f"{decision['matchedTensors']} of {decision['totalTensors']} tensors "
                         "transferred")
        return said + (f" ({', '.join(facts)})" if facts else "") + why.rstrip(".") + "."
    if outcome == api.WarmStartOutcome.IN_TRAINER.value:
        return "The trainer picks the warm-start parent before its first step" + why + "."
    return f"Started cold ({outcome or 'no parent'})" + why.rstrip(".") + "."


def _freezing_story(freezing: Object, progress: Object) -> str:
    if freezing.get("enabled") is False:
        return "Layer freezing is off (spec.freezing.enabled: false)."
    frozen = progress.get("frozenModules")
    if not frozen:
        return "Layer freezing is on; no module is frozen yet."
    fraction = progress.get("computeFraction")
    cost = (f"; a step costs {fraction:.0%} of a full one" if isinstance(fraction, float)
            else "")
    return f"{frozen} leading module{'s' if frozen > 1 else ''} frozen{cost}."


def _ending(status: Object) -> list[str]:
    phase, result = status.get("phase"), status.get("result") or {}
    if phase == api.Phase.SUCCEEDED.value:
        said = "Succeeded"
        if result.get("validationAccuracy") is not None:
            said += f" with validation accuracy {result['validationAccuracy']:.3f}"
        if result.get("wallSeconds") is not None:
            said += f" after {_seconds(result['wallSeconds'])} of training"
        return [said + (f"; registered as zoo model {result['zooModel']}."
                        if result.get("zooModel") else ".")]
    if phase == api.Phase.FAILED.value:
        failed: Object = next((c for c in status.get("conditions") or []
                       if c.get("type") == "Failed" and c.get("status") == "True"), {})
        return [(f"Failed ({failed.get('reason') or 'no reason given'}): "
                f"{failed.get('message') or 'see the events and kiln logs'}")]
    return []


def _sweep_story(status: Object) -> list[str]:
    trials, best = status.get("trials") or {}, status.get("best") or {}
    lines = [(f"{trials.get('total', 0)} trials: {trials.get('running', 0)} running, "
             f"{trials.get('succeeded', 0)} succeeded, {trials.get('pruned', 0)} pruned, "
             f"{trials.get('failed', 0)} failed.")]
    if best:
        lines.append(f"Best so far: {best.get('trial')} with {best.get('metric')}.")
    return lines


def _seconds(value: float) -> str:
    """'42 s', '7 min', '2.5 h'."""
    if value < 120:
        return f"{value:.0f} s"
    if value < 7200:
        return f"{value / 60:.0f} min"
    return f"{value / 3600:.1f} h"
