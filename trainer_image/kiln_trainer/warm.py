"""Warm start inside the trainer: apply the warm-start decision to the freshly built model.

The decision comes from upstream (the operator, as JSON) or, when none was passed, from the
same `kiln.warmstart.decision.decide` run here; the trainer never chooses again nor overturns it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from torch import nn

from kiln import api, contract
from kiln.warmstart import decision, select, transform
from kiln.zoo import store

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """What warm start did for this run (JSON-ready; kept in checkpoints and the result).

    A resumed run neither decides again nor reloads the parent: its weights come from the
    checkpoint, and this record with them.

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
        values: dict[str, Any] = {f.name: data.get(f.name) for f in dataclasses.fields(cls)}
        return cls(**values)

    def lr_damping(self, epoch: int) -> float:
        """Learning-rate multiplier for 0-based `epoch` (`transform.lr_damping`; 1.0 if cold)."""
        if self.parent is None:
            return 1.0
        return transform.lr_damping(self.untransferred_fraction, epoch)

    def message(self) -> str:
        """The console line: the reason, which names the parent and similarity or says why cold."""
        return self.reason[:1].upper() + self.reason[1:]


def parse_decision(text: str | None) -> select.Decision | None:
    """The warm-start decision passed upstream as JSON text (``--warm-start``), or None (no
    decision, or one deferred to the trainer: an entrypoint model's).

    Raises:
        api.InvalidSpec: the text is not a decision, naming the flag and what is wrong.
    """
    if not text:
        return None
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise TypeError(f"expected a JSON object, got {type(doc).__name__}")
        decided = select.Decision.from_json(doc)
    except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        raise api.InvalidSpec([(f"{contract.Flag.WARM_START} (env {contract.Env.WARM_START}): "
                                f"not a warm-start decision ({exc})")]) from None
    # An entrypoint model's decision is left to the trainer, which can import the user's code.
    return None if decided.outcome is select.Outcome.IN_TRAINER else decided


def warm_start(
    job: api.TrainingJob,
    raw_model: nn.Module,
    zoo: store.ObjectStore | None,
    *,
    decided: select.Decision | None = None,
) -> WarmStart:
    """Apply the warm-start decision: load the parent's transformed weights into `raw_model`.

    Args:
        job: the job; `spec.warmStart` controls it.
        raw_model: the freshly initialised, unwrapped model; updated in place when warm.
        zoo: the model zoo, or None (then: cold start, unless a decision names a parent).
        decided: the decision made upstream, final; None: decide here (`decision.decide`).

    Returns:
        What happened, for the result, the checkpoint and the console.

    Raises:
        api.InvalidSpec: a pinned parent is not in the zoo.
        decision.ApplyError: the decided parent cannot be loaded or transformed any more.
        store.StoreUnavailable: the zoo could not be read.
    """
    if decided is None:
        decided = (decision.decide(job, zoo) if zoo is not None else select.cold_start(
            select.Outcome.COLD_EMPTY, "cold start: no model zoo configured (--zoo)"))
    applied = decision.apply(decided, zoo, raw_model, job.spec.model.input_shape,
                             seed=job.spec.training.seed)
    for note in applied.notes:
        _log.info("warm start: %s", note)
    if applied.state_dict is not None:
        raw_model.load_state_dict(applied.state_dict)
    return WarmStart(
        parent=decided.parent_id, similarity=decided.similarity,
        parent_metric=decided.parent_metric, matched_tensors=decided.matched_tensors,
        total_tensors=decided.total_tensors,
        untransferred_fraction=applied.untransferred_fraction,
        outcome=str(decided.outcome), reason=decided.reason)
