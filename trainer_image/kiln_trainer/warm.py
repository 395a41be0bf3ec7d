"""Warm start inside the trainer: pick or receive the parent, load its transformed weights.

The trainer's side of ModelKeeper (NSDI '23; DESIGN.md section 4): `warm_start` runs
`kiln.warmstart.plan.plan` (unless the operator already decided and passed `--parent`), then
`plan.apply`, and loads the warm state_dict into the freshly built model. The outcome is a
`WarmStart` record that travels in checkpoints (a resumed run neither re-plans nor reloads the
parent: its weights come from the checkpoint) and in the result.

The learning rate of the first epochs is damped by how much transferred (`lr_damping`).

Callers: `kiln_trainer.loop`. Non-goals: no parent search of its own (that is `kiln.warmstart`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch import nn

from kiln import api
from kiln.warmstart import plan, select, transform
from kiln.zoo import store

_log = logging.getLogger(__name__)

PARENT_NONE = "none"  # --parent none: the caller decided on a cold start


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """What warm start did for this run (JSON-ready; kept in checkpoints and the result).

    Attributes:
        parent: the zoo id the weights came from, or None (cold start).
        similarity: architectural similarity to the parent (or the best match) in [0, 1].
        parent_metric: the parent's final metric.
        matched_tensors: child weight tensors that received parent values.
        total_tensors: the child's weight tensors.
        untransferred_fraction: share of tensors not transferred, in [0, 1] (1.0 if cold).
        outcome: `select.Outcome` value.
        reason: one sentence with numbers.
    """

    parent: str | None
    similarity: float | None
    parent_metric: float | None
    matched_tensors: int | None
    total_tensors: int | None
    untransferred_fraction: float
    outcome: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WarmStart:
        return cls(**{f.name: data.get(f.name) for f in dataclasses.fields(cls)})

    def lr_damping(self, epoch: int) -> float:
        """Learning-rate multiplier for 0-based `epoch` (`transform.lr_damping`; 1.0 if cold)."""
        if self.parent is None:
            return 1.0
        return transform.lr_damping(self.untransferred_fraction, epoch)

    def message(self) -> str:
        """The console line: the reason, which names the parent and similarity or says why cold."""
        return self.reason[:1].upper() + self.reason[1:]


def warm_start(
    job: api.TrainingJob,
    raw_model: nn.Module,
    zoo: store.ObjectStore | None,
    *,
    parent: str | None = None,
) -> WarmStart:
    """Choose (or take) the parent and load its transformed weights into `raw_model`.

    Args:
        job: the job; `spec.warmStart` controls it.
        raw_model: the freshly initialised, unwrapped model; updated in place when warm.
        zoo: the model zoo, or None (then: cold start).
        parent: a decision made upstream: a zoo id, or "none" for a cold start; None: decide
            here with `plan.plan`.

    Returns:
        What happened, for the result, the checkpoint and the console.

    Raises:
        api.InvalidSpec: a pinned parent is not in the zoo.
        store.StoreUnavailable: the zoo could not be read.
    """
    if parent == PARENT_NONE:
        decision = plan.cold_start(select.Outcome.COLD_EMPTY,
                                   "cold start decided by the operator")
    elif not job.spec.warm_start.enabled:
        decision = plan.cold_start(select.Outcome.DISABLED,
                                   "warm start disabled by spec.warmStart.enabled")
    elif zoo is None:
        decision = plan.cold_start(select.Outcome.COLD_EMPTY,
                                   "cold start: no model zoo configured (--zoo)")
    elif parent is not None:
        decision = plan.plan(job.model_copy(update={"spec": _pin(job.spec, parent)}), zoo)
    else:
        decision = plan.plan(job, zoo)
    applied = plan.apply(decision, zoo, raw_model, job.spec.model.input_shape,
                         seed=job.spec.training.seed) if zoo is not None else None
    if applied is not None:
        decision = applied.decision
        for note in applied.notes:
            _log.info("warm start: %s", note)
    if applied is not None and applied.state_dict is not None:
        raw_model.load_state_dict(applied.state_dict)
    return WarmStart(
        parent=decision.parent_id, similarity=decision.similarity,
        parent_metric=decision.parent_metric, matched_tensors=decision.matched_tensors,
        total_tensors=decision.total_tensors,
        untransferred_fraction=applied.untransferred_fraction if applied else 1.0,
        outcome=str(decision.outcome), reason=decision.reason)


def _pin(spec: api.TrainingJobSpec, parent: str) -> api.TrainingJobSpec:
    pinned = spec.warm_start.model_copy(update={"parent": parent, "enabled": True})
    return spec.model_copy(update={"warm_start": pinned})

