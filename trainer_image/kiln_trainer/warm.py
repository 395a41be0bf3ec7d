"""Warm start inside the trainer: apply the warm-start decision to the freshly built model.

The decision comes from upstream (the operator, as JSON) or, when none was passed, from the
same `kiln.warmstart.decision.decide` run here. The probe guard then keeps, of the parents (the
decided one and its alternatives) whose warm weights clearly beat a cold start at step 0, the
first, unless a later one starts clearly lower; if none does, the first that beats it after a
few training steps taken side by side on the same batches; otherwise it starts cold.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pydantic
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils import data as torch_data

from kiln import api, contract
from kiln.models import lora
from kiln.warmstart import decision, pretrained, select, transform
from kiln.zoo import records, sources, store
from kiln_trainer import fingerprint, optim, registration

_log = logging.getLogger(__name__)

PROBE_SAMPLES = 256
"""Training samples in the probe batch: the first ones of the training split (all if fewer)."""
PROBE_CHUNK = 64
"""Samples per forward pass of the probe (bounds its memory)."""
MAX_TRAINING_SAMPLES = 2048
"""At most this many training samples feed the guard's probe steps (their batches cycle)."""
MAX_LOSS_RATIO = 0.95
"""At step 0 the guard keeps warm weights at once if their probe loss is at most this times the
cold one's (and, for classification, their probe accuracy at least the cold one's): clearly
better, not better by noise; it costs two forward passes per parent tried. The same margin lets
a later parent that passes displace an earlier one."""
LAST_STEPS_FRACTION = 0.25
"""Otherwise warm and cold train ``spec.warmStart.probeSteps`` steps side by side, and the
guard compares their mean training loss over this last fraction of the steps (at least one).

Why training loss, on the very batches both arms took: the two differ only in their initial
weights (same batches, optimizer, learning rate and random draws), so the paired difference is
the transfer's alone; averaging a few steps smooths one batch's noise, costs no extra forward
pass, and in train mode is free of the lag of batch-norm running statistics that an evaluation
after so few steps would show. A new stage starts random, so a parent whose features help
looks no better than cold at step 0 yet is clearly ahead a few steps in."""

LossFn = Callable[[Tensor, Tensor], Tensor]


def cross_entropy(outputs: Tensor, targets: Tensor) -> Tensor:
    """Kiln's training loss: mean cross-entropy over the flattened leading dimensions (per
    token for language models), in fp32."""
    return F.cross_entropy(outputs.flatten(0, -2).float(), targets.flatten())


@dataclasses.dataclass(frozen=True)
class Probe:
    """A fixed batch of training data, and how the guard scores a model on it.

    Attributes:
        inputs: Tensor[n, ...] the probe's inputs, scored at step 0.
        targets: Tensor[n, ...] their targets.
        loss: (outputs, targets) -> mean loss, the training loop's own.
        accuracy: also compare accuracies (argmax of the last output dimension; classification).
        device: where to evaluate (the model is moved there and back); None: where it is.
        train_inputs: Tensor[m, ...] the samples the probe steps train on, in batches of the
            job's batch size that cycle; None: `inputs`.
        train_targets: Tensor[m, ...] their targets.
    """

    inputs: Tensor
    targets: Tensor
    loss: LossFn = cross_entropy
    accuracy: bool = False
    device: torch.device | None = None
    train_inputs: Tensor | None = None
    train_targets: Tensor | None = None

    @property
    def samples(self) -> int:
        return len(self.inputs)

    def batch(self, step: int, size: int) -> tuple[Tensor, Tensor]:
        """The training batch of probe step `step` (0-based): `size` consecutive samples,
        wrapping around; the same for every model trained on this probe.

        A `size` above the probe's training samples is cut to them, as the training loop
        cuts a batch to its split: repeating the same samples would change the gradient
        little and multiply the guard's time and memory (a batchSize of 65536 on the
        digits made it train 20 steps of 65536 samples, minutes beside a 1-second epoch).
        """
        inputs = self.inputs if self.train_inputs is None else self.train_inputs
        targets = self.targets if self.train_targets is None else self.train_targets
        size = min(size, len(inputs))
        index = (torch.arange(size) + step * size) % len(inputs)
        return inputs[index], targets[index]


@dataclasses.dataclass(frozen=True)
class Score:
    """A model's mean loss and accuracy (None: not compared) on a probe."""

    loss: float
    accuracy: float | None = None


def training_probe(dataset: torch_data.Dataset[Any], *, accuracy: bool,
                   device: torch.device | None = None, loss: LossFn = cross_entropy,
                   train_samples: int = 0) -> Probe:
    """The probe of Kiln's loop: the first `PROBE_SAMPLES` samples of the training split,
    scored at step 0; its probe steps train on the first `train_samples` (at most
    `MAX_TRAINING_SAMPLES`; at least the scored ones).

    Reading them leaves the random state as it was (augmentation may draw from it), so a run
    the guard turns cold trains exactly as a cold start would.
    """
    length = len(dataset)  # type: ignore[arg-type]
    scored = min(PROBE_SAMPLES, length)
    count = max(scored, min(train_samples, MAX_TRAINING_SAMPLES, length))
    with torch.random.fork_rng(devices=[]):
        samples = [dataset[i] for i in range(count)]
    inputs, targets = torch_data.default_collate([(s[0], s[1]) for s in samples])
    targets = torch.as_tensor(targets)
    return Probe(inputs[:scored], targets[:scored], loss=loss, accuracy=accuracy, device=device,
                 train_inputs=inputs, train_targets=targets)


@contextlib.contextmanager
def _on_probe(model: nn.Module, probe: Probe) -> Iterator[torch.device]:
    """`model` in eval mode without gradients, on the probe's device if it names one (else left
    where it is: it may span devices); yields the device to send inputs to. The model's mode
    and device are restored."""
    first = next(iter(model.parameters()), None)
    home = first.device if first is not None else torch.device("cpu")
    training = model.training
    if probe.device is not None:
        model.to(probe.device)
    model.eval()
    try:
        with torch.no_grad():
            yield probe.device or home
    finally:
        model.train(training)
        if probe.device is not None:
            model.to(home)


def score(model: nn.Module, probe: Probe) -> Score:
    """`model`'s mean loss (and accuracy) on `probe`, in eval mode without gradients; the
    model's mode and device are restored."""
    loss_sum, correct, count = 0.0, 0, 0
    with _on_probe(model, probe) as device:
        for start in range(0, probe.samples, PROBE_CHUNK):
            inputs = probe.inputs[start:start + PROBE_CHUNK].to(device)
            targets = probe.targets[start:start + PROBE_CHUNK].to(device)
            outputs = model(inputs)
            loss_sum += float(probe.loss(outputs, targets)) * len(inputs)
            if probe.accuracy:
                predicted = outputs.flatten(0, -2).argmax(-1)
                correct += int((predicted == targets.flatten()).sum())
                count += targets.numel()
    return Score(loss_sum / max(1, probe.samples),
                 correct / count if probe.accuracy and count else None)


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def calibrate_norms(model: nn.Module, probe: Probe) -> int:
    """Re-estimate the running statistics of `model`'s batch norms on `probe`'s scored samples
    (a plain average over its chunks) and return how many samples that took: 0 when the model
    has none with running statistics.

    A transferred batch norm keeps the statistics of the parent's features; where the transform
    changed what feeds it (a dropped block, replicated units, other data) an evaluation in the
    first steps reads through stale ones, as running statistics move a tenth per step
    (measured on a ResNet child that lost a parent's block: step-0 validation accuracy 0.75,
    0.94 once re-estimated on 256 samples; 128 to 1,024 samples gave the same to a point).
    Only the batch norms run in training mode, so no dropout draws from the random state. A
    SyncBatchNorm is left alone: in training mode it would wait for ranks that are not here.
    """
    norms = [m for m in model.modules()
             if isinstance(m, _BATCH_NORMS) and not isinstance(m, nn.SyncBatchNorm)
             and m.track_running_stats and m.running_mean is not None]
    if not norms or probe.samples < 2:  # one sample has no variance
        return 0
    momenta = [m.momentum for m in norms]
    with _on_probe(model, probe) as device:
        try:
            for norm in norms:
                norm.reset_running_stats()
                norm.momentum = None  # a cumulative average: every chunk weighs the same
                norm.train()
            # chunks within one sample of each other in size: none is a lone sample
            for chunk in probe.inputs.tensor_split(-(-probe.samples // PROBE_CHUNK)):
                model(chunk.to(device))
        finally:
            for norm, momentum in zip(norms, momenta, strict=True):
                norm.momentum = momentum
    return probe.samples


def passes(warm: Score, cold: Score) -> bool:
    """The guard's verdict: the warm start is clearly better than the cold one (see
    `MAX_LOSS_RATIO`). A non-finite warm loss never passes."""
    if not (math.isfinite(warm.loss) and warm.loss <= MAX_LOSS_RATIO * cold.loss):
        return False
    return warm.accuracy is None or cold.accuracy is None or warm.accuracy >= cold.accuracy


def comparison(warm: Score, cold: Score, samples: int) -> str:
    """"step-0 probe loss 0.412 vs 2.303 cold on 256 training samples, accuracy 0.86 vs 0.09"."""
    text = (f"step-0 probe loss {warm.loss:.3f} vs {cold.loss:.3f} cold on {samples} training "
            "samples")
    if warm.accuracy is not None and cold.accuracy is not None:
        text += f", accuracy {warm.accuracy:.2f} vs {cold.accuracy:.2f}"
    return text


def rule(warm: Score, cold: Score) -> str:
    """What `passes` asks, in words: "needs loss ≤ 0.95 × cold and accuracy ≥ cold"."""
    text = f"needs loss ≤ {MAX_LOSS_RATIO:g} × cold"
    if warm.accuracy is not None and cold.accuracy is not None:
        text += " and accuracy ≥ cold"
    return text


def window(steps: int) -> int:
    """How many of `steps` probe steps the trained comparison averages: the last quarter."""
    return max(1, round(steps * LAST_STEPS_FRACTION))


def trained_loss(model: nn.Module, probe: Probe, training: api.TrainingSpec, steps: int, *,
                 start: Mapping[str, Tensor] | None = None) -> float:
    """Train a copy of `model` (with the weights `start`, if given) `steps` optimizer steps on
    `probe`'s batches and return its mean training loss over the last `window(steps)` of them
    (inf once one is not finite).

    Every model trained here takes the same batches, the job's optimizer at its base learning
    rate, its gradient clipping and the same random draws (seeded with the job's seed), so two
    such losses differ by the initial weights alone. `model` and the random state are left as
    they were.
    """
    twin = copy.deepcopy(model)
    if start is not None:
        twin.load_state_dict(start)
    first = next(iter(twin.parameters()), None)
    device = probe.device or (first.device if first is not None else torch.device("cpu"))
    if probe.device is not None:
        twin.to(device)
    twin.train()
    optimizer = optim.build_optimizer(twin.parameters(), training.optimizer)
    losses: list[float] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(training.seed)
        for step in range(steps):
            inputs, targets = probe.batch(step, training.batch_size)
            loss = probe.loss(twin(inputs.to(device)), targets.to(device))
            losses.append(float(loss.detach()))
            if not math.isfinite(losses[-1]):
                return math.inf
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            if training.grad_clip_norm:
                nn.utils.clip_grad_norm_(twin.parameters(), training.grad_clip_norm)
            optimizer.step()
    last = losses[-window(steps):]
    return sum(last) / len(last) if last else math.inf


def trained_passes(warm_loss: float, cold_loss: float) -> bool:
    """The verdict after the probe steps: the warm copy's loss is finite and below the cold
    twin's on the same batches."""
    return math.isfinite(warm_loss) and warm_loss < cold_loss


def trained_comparison(warm_loss: float, cold_loss: float, steps: int) -> str:
    """"after 10 steps warm loss 1.920 ≥ cold 1.850 (mean of the last 2 on the same
    batches)"."""
    sign = "<" if trained_passes(warm_loss, cold_loss) else "≥"
    return (f"after {steps} steps warm loss {warm_loss:.3f} {sign} cold {cold_loss:.3f} (mean "
            f"of the last {window(steps)} on the same batches)")


def untransferred_fraction(applied: api.WarmStartDecision) -> float:
    """Share of the child's weight tensors the warm start `applied` did not transfer, in
    [0, 1] (1.0 on a cold start)."""
    if applied.parent is None or not applied.total_tensors:
        return 1.0
    return 1.0 - (applied.matched_tensors or 0) / applied.total_tensors


def lr_damping(applied: api.WarmStartDecision, step: int, *, steps_per_epoch: int,
               total_steps: int) -> float:
    """Learning-rate multiplier for 0-based optimizer `step` after the warm start `applied`
    (`transform.lr_damping` of what the probe measured was not inherited, else of the
    untransferred tensors; 1.0 if cold)."""
    if applied.parent is None:
        return 1.0
    if applied.probe_loss is not None and applied.cold_probe_loss is not None:
        untransferred = 1.0 - transform.transfer_quality(applied.probe_loss,
                                                          applied.cold_probe_loss)
    else:
        untransferred = untransferred_fraction(applied)
    return transform.lr_damping(untransferred, step, steps_per_epoch=steps_per_epoch,
                                total_steps=total_steps)


def message(applied: api.WarmStartDecision) -> str:
    """The console line: the reason, which names the parent and similarity or says why cold."""
    return applied.reason[:1].upper() + applied.reason[1:]


def parse_decision(text: str | None) -> api.WarmStartDecision | None:
    """The warm-start decision passed upstream as JSON text (``--warm-start``), or None (no
    decision, or one deferred to the trainer: an entrypoint model's).

    Raises:
        api.InvalidSpec: the text is not a decision, naming the flag and what is wrong.
    """
    if not text:
        return None
    where = f"{contract.Flag.WARM_START} (env {contract.Env.WARM_START})"
    try:
        doc = json.loads(text)
    except ValueError as exc:  # json.JSONDecodeError
        raise api.InvalidSpec([f"{where}: not a warm-start decision ({exc})"]) from None
    if not isinstance(doc, dict) or doc.get("outcome") is None:
        what = "no outcome" if isinstance(doc, dict) else f"a JSON {type(doc).__name__}"
        raise api.InvalidSpec([f"{where}: not a warm-start decision ({what})"])
    try:
        decided = api.WarmStartDecision.model_validate(doc)
    except pydantic.ValidationError as exc:
        problems = "; ".join(api.problems_of(exc))
        raise api.InvalidSpec([f"{where}: not a warm-start decision ({problems})"]) from None
    # An entrypoint model's decision is left to the trainer, which can import the user's code.
    return None if decided.outcome is api.WarmStartOutcome.IN_TRAINER else decided


def warm_start(
    job: api.TrainingJob,
    raw_model: nn.Module,
    zoo: store.ObjectStore | None,
    *,
    decided: api.WarmStartDecision | None = None,
    probe: Probe | None = None,
    data_fingerprint: str | None = None,
    copied: set[str] | None = None,
) -> api.WarmStartDecision:
    """Apply the warm-start decision: load the parent's transformed weights into `raw_model`.

    With a `probe`, the guard scores the cold `raw_model` and each warm start on it at step 0
    (the decided parent, then its alternatives) and keeps, of those that `passes`, the first,
    unless a later one's probe loss is clearly lower (at most `MAX_LOSS_RATIO` times the kept
    one's); only when none passes, the first that, trained ``spec.warmStart.probeSteps`` steps
    beside a cold twin on the same batches (`trained_loss`), `trained_passes`; a kept parent's weights are the
    transferred ones, untrained (the copies are discarded). When none is kept, `raw_model`
    keeps its cold weights (outcome COLD_GUARD, the refusing test in the reason). A pinned
    parent is guarded too. With `data_fingerprint`, a warm start's reason also says whether
    the parent was trained on the same data (`data_note`).

    Args:
        job: the job; `spec.warmStart` controls it.
        raw_model: the freshly initialised, unwrapped model; updated in place when warm.
        zoo: the model zoo, or None (then: cold start, unless a decision names a parent).
        decided: the decision made upstream; None: decide here (`decision.decide`).
        probe: the guard's batch; None: no guard (the decision is applied as it is).
        data_fingerprint: what this job loaded (`data.Splits.fingerprint`), or None.
        copied: if given, filled with the child's state_dict keys the kept warm start copied
            unchanged from its parent (`decision.Applied.unchanged`; layer freezing starts
            from them); left empty on a cold start.

    Returns:
        The decision as applied (its tensor counts those transferred), for the result, the
        checkpoint and the console.

    Raises:
        api.InvalidSpec: a pinned parent is not in the zoo.
        decision.ApplyError: the decided parent cannot be loaded or transformed any more (an
            alternative that cannot is skipped).
        store.StoreUnavailable: the zoo could not be read.
    """
    if decided is None:
        decided = decide(job, zoo)
    if probe is None or decided.parent is None:
        applied = _apply(job, decided, zoo, raw_model)
        if copied is not None:
            copied.update(applied.unchanged)
        return _as_applied(decided, applied, data_fingerprint, "no probe guard")
    cold_state = {k: v.detach().clone() for k, v in raw_model.state_dict().items()}
    try:
        cold = score(raw_model, probe)
    except (RuntimeError, ValueError, IndexError) as exc:  # the model's own checks say why
        _log.warning("warm-start guard skipped: the cold model cannot score the probe (%s)", exc)
        applied = _apply(job, decided, zoo, raw_model)
        if copied is not None:
            copied.update(applied.unchanged)
        return _as_applied(decided, applied, data_fingerprint,
                           "guard skipped: the cold model cannot score the probe")
    _log.info("warm start: %s", decided.reason)
    steps, training = job.spec.warm_start.probe_steps, job.spec.training
    rejected: list[str] = []
    first: tuple[api.WarmStartDecision, Score] | None = None
    waiting: list[tuple[api.WarmStartDecision, Score, str]] = []  # failed at step 0
    passing: list[tuple[api.WarmStartDecision, Score, str]] = []  # passed at step 0
    calibrated = 0  # samples the batch norms' re-estimation took, every parent tried

    def calibrate() -> int:
        return calibrate_norms(raw_model, probe) if job.spec.warm_start.calibrate_norms else 0

    for parent in (decided.parent, *decided.alternatives):
        trial = decided if parent == decided.parent else decided.model_copy(update={
            "parent": parent, "outcome": api.WarmStartOutcome.WARM, "alternatives": [],
            "matched_tensors": None, "total_tensors": None})  # counted by apply
        try:
            applied = _apply(job, trial, zoo, raw_model)
        except decision.ApplyError as exc:
            if parent == decided.parent:
                raise
            rejected.append(f"alternative {parent} unusable ({exc})")
            continue
        calibrated += calibrate()
        warm = score(raw_model, probe)
        trial = _measured(trial.model_copy(update={
            "similarity": applied.similarity, "parent_metric": applied.parent_metric,
            "metric_name": applied.metric_name, "matched_tensors": applied.matched_tensors,
            "total_tensors": applied.total_tensors}), warm, cold)
        trial = trial.model_copy(update={"guard_steps": 0})
        first = first or (trial, warm)
        verdict = comparison(warm, cold, probe.samples)
        if passes(warm, cold):
            passing.append((trial, warm, verdict))
        else:
            waiting.append((trial, warm, verdict))
        raw_model.load_state_dict(cold_state)
    if passing:
        # The policy ranks by similarity first, and a less similar parent that learned more (a
        # sweep's best trial) can start far lower (measured on a deeper transformer: 2.25 nats
        # against 2.78 from the more similar parent, 2.18 against 2.66 after 100 steps). A later
        # parent displaces the one kept so far only when it starts clearly lower, by the margin
        # a warm start needs over cold: a few hundredths apart (0.73 against 0.76 on a ResNet
        # child) the policy's order is kept (the lower start there ended 2.4 points lower).
        kept = passing[0]
        for candidate in passing[1:]:
            if candidate[1].loss <= MAX_LOSS_RATIO * kept[1].loss:
                kept = candidate
        trial, _, verdict = kept
        applied = _apply(job, trial, zoo, raw_model)
        calibrated += calibrate()
        passed_over = [f"candidate {t.parent} (similarity {_fmt(t.similarity)}) passed the "
                       f"guard, not kept: {v}" for t, _, v in passing if t is not trial]
        failed = [f"candidate {t.parent} (similarity {_fmt(t.similarity)}) rejected by "
                  f"the guard: {v} ({rule(w, cold)})" for t, w, v in waiting]
        return _kept(trial.model_copy(update={"calibration_samples": calibrated}), applied,
                     verdict, [*rejected, *passed_over, *failed], data_fingerprint, copied)
    # No candidate beat cold at step 0. A new stage or head starts random, so step 0 cannot
    # tell a useful parent from a useless one: train each beside one cold twin, in order.
    # Only now, so a candidate that wins at once is never passed over for one rescued later.
    cold_trained: float | None = None
    spent = 0  # the guard's training steps
    for trial, warm, verdict in waiting:
        if steps and math.isfinite(warm.loss):
            if cold_trained is None:  # one cold twin for every parent tried
                cold_trained = trained_loss(raw_model, probe, training, steps, start=cold_state)
                spent += steps
            applied = _apply(job, trial, zoo, raw_model)
            calibrated += calibrate()
            warm_trained = trained_loss(raw_model, probe, training, steps)
            spent += steps
            trial = trial.model_copy(update={
                "trained_probe_loss": _finite(warm_trained),
                "cold_trained_probe_loss": _finite(cold_trained), "guard_steps": spent,
                "calibration_samples": calibrated})
            if first is not None and first[0].parent == trial.parent:
                first = (trial, warm)  # a cold start reports the first candidate's losses
            verdict = f"{trained_comparison(warm_trained, cold_trained, steps)}; {verdict}"
            if trained_passes(warm_trained, cold_trained):
                return _kept(trial, applied, verdict, rejected, data_fingerprint, copied)
            raw_model.load_state_dict(cold_state)
        else:
            verdict += f" ({rule(warm, cold)})"
        rejected.append(f"candidate {trial.parent} (similarity {_fmt(trial.similarity)}) "
                        f"rejected by the guard: {verdict}")
    assert first is not None  # the decided parent was applied or raised
    reason = "; ".join(rejected) + "; cold start (guard)"
    return first[0].model_copy(update={"parent": None, "parent_metric": None,
                                       "outcome": api.WarmStartOutcome.COLD_GUARD,
                                       "reason": reason, "guard_steps": spent,
                                       "calibration_samples": calibrated})


def _kept(trial: api.WarmStartDecision, applied: decision.Applied, verdict: str,
          rejected: list[str], data_fingerprint: str | None,
          copied: set[str] | None) -> api.WarmStartDecision:
    """The decision for a parent the guard kept: its reason leads with the test it passed."""
    lead = (f"warm start from {trial.parent} (similarity {_fmt(trial.similarity)}): guard: "
            f"{verdict}; {applied.matched_tensors} of {applied.total_tensors} tensors "
            "transferred")
    if trial.calibration_samples:
        lead += "; batch-norm statistics re-estimated on the probe"
    if applied.parent_provisional:
        lead += (f"; {trial.parent} is a provisional record (its job's best weights so far: "
                 "that job still trains, or was stopped early, e.g. pruned)")
    note = data_note(applied.parent_data, data_fingerprint)
    if copied is not None:
        copied.update(applied.unchanged)
    return trial.model_copy(update={
        "reason": "; ".join([lead, *([note] if note else []), *rejected])})


def data_note(parent: str | None, child: str | None) -> str:
    """What the parent's data fingerprint says about the child's, for the reason: "same data
    as the parent (content:sha256:1a2b…)", "other data than the parent's (…)", "the parent's
    data is unknown" or "not comparable" (kinds differ, e.g. a content hash and a spec hash);
    "" when the child's fingerprint is unknown.

    Admission prefers parents by the spec's fingerprint (the data is not read then); this is
    what the trainer, which loaded the data, can add.
    """
    if child is None:
        return ""
    if parent is None:
        return f"the parent's data is unknown (this job {fingerprint.short(child)})"
    same = fingerprint.same_data(parent, child)
    if same:
        return f"same data as the parent ({fingerprint.short(child)})"
    if same is False:
        return (f"other data than the parent's (parent {fingerprint.short(parent)}, this job "
                f"{fingerprint.short(child)})")
    return (f"data not comparable with the parent's (parent {fingerprint.short(parent)}, this "
            f"job {fingerprint.short(child)})")


def _as_applied(decided: api.WarmStartDecision, applied: decision.Applied,
                data_fingerprint: str | None, unguarded: str) -> api.WarmStartDecision:
    """`decided` once applied without the guard (`unguarded` says why): when a parent was
    loaded, its reason leads with the warm start and ends with `data_note`, and the tensor
    counts are those transferred."""
    if decided.parent is None:
        return decided
    note = data_note(applied.parent_data, data_fingerprint)
    reason = f"warm start from {decided.parent} ({unguarded}): {decided.reason}"
    return decided.model_copy(update={
        "matched_tensors": applied.matched_tensors, "total_tensors": applied.total_tensors,
        "reason": f"{reason}; {note}" if note else reason})


def _apply(job: api.TrainingJob, decided: api.WarmStartDecision, zoo: store.ObjectStore | None,
           raw_model: nn.Module) -> decision.Applied:
    """`decision.apply`, its weights loaded into `raw_model`."""
    applied = decision.apply(decided, zoo, raw_model, job.spec.model.input_shape,
                             seed=job.spec.training.seed)
    for note in applied.notes:
        _log.info("warm start: %s", note)
    if applied.state_dict is not None:
        raw_model.load_state_dict(applied.state_dict)
    return applied


def _measured(trial: api.WarmStartDecision, warm: Score,
              cold: Score) -> api.WarmStartDecision:
    """`trial` with the step-0 probe's scores."""
    return trial.model_copy(update={
        "probe_loss": _finite(warm.loss), "cold_probe_loss": _finite(cold.loss),
        "probe_accuracy": warm.accuracy, "cold_probe_accuracy": cold.accuracy})


def _finite(value: float) -> float | None:
    """`value`, or None when not finite (JSON has no NaN)."""
    return value if math.isfinite(value) else None


def _fmt(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f}"


def needs_zoo(job: api.TrainingJob, decided: api.WarmStartDecision | None) -> bool:
    """Whether `warm_start` reads the zoo: for a decision naming a parent, or to decide here
    (no decision from upstream) for a job with spec.warmStart.enabled."""
    if decided is not None:
        return decided.parent is not None
    return job.spec.warm_start.enabled


def decide(job: api.TrainingJob, zoo: store.ObjectStore | None) -> api.WarmStartDecision:
    """The decision the trainer makes when none came from upstream: `decision.decide` on the
    zoo, or a cold start without one.

    Raises:
        api.InvalidSpec: a pinned parent is not in the zoo.
        store.StoreUnavailable: the zoo could not be read.
    """
    if zoo is None:
        return select.cold_start(api.WarmStartOutcome.COLD_EMPTY,
                                 "cold start: no model zoo configured (--zoo)")
    return decision.decide(job, zoo)


Measure = Callable[[nn.Module], tuple[float, float]]
"""(model) -> (validation accuracy, validation loss) on the job's validation split."""


def lora_start(job: api.TrainingJob, model: nn.Module, zoo: store.ObjectStore | None, *,
               load: bool, main: bool = True, measure: Measure | None = None,
               ) -> tuple[api.WarmStartDecision, records.ZooModelId | None]:
    """A LoRA job's start (``spec.training.peft``): its base's exact weights in `model`, then
    the adapters attached (`lora.attach`); from a parent adapter on that base, its adapter too.

    The pinned parent (``spec.warmStart.parent``) is the base itself, or an adapter whose
    ``base`` record holds the weights. A job on ``spec.model.pretrained.uri`` (`model` holds
    those weights already) finds its base and parent itself (`pretrained_lora_parent`). No
    probe guard: a LoRA job never starts cold.

    Args:
        job: the LoRA job.
        model: the freshly built model (wrapped in place).
        zoo: the zoo holding the parent.
        load: load the weights (rank 0 of a fresh start); False only attaches, for the other
            ranks (weights broadcast later) and for a resumed run (weights in the checkpoint).
        main: rank 0, which alone finds (and imports) a pretrained job's base; the others
            only attach, and get the decision from it.
        measure: the job's validation metrics of a model, for a pretrained base imported now.

    Returns:
        The decision (the parent, similarity 1) and the base record's id (None on the ranks
        that only attached).

    Raises:
        api.InvalidSpec: no zoo, a parent missing or private, a base of another model, an
            adapter parent with other LoRA settings, or target modules that fit nothing.
    """
    peft = job.spec.training.peft
    assert peft is not None
    if zoo is None:
        raise api.InvalidSpec([("spec.training.peft: LoRA needs the model zoo holding its "
                               "base (spec.warmStart.parent, or the record of "
                               "spec.model.pretrained.uri); pass --zoo")],
                              source=f"job {job.name}")
    outcome = api.WarmStartOutcome.PINNED
    if job.spec.model.pretrained is not None:
        if not main:
            _attach(job, model, peft)
            return select.cold_start(api.WarmStartOutcome.IN_TRAINER, "decided on rank 0"), None
        parent, base, imported = pretrained_lora_parent(job, model, zoo, measure=measure)
        outcome = api.WarmStartOutcome.WARM
    else:
        parent = decision.pinned_record(zoo, job.spec.warm_start.parent, namespace=job.namespace)
        base = decision.pinned_record(zoo, parent.base, namespace=job.namespace) \
            if parent.base is not None else parent
        imported = False
        decision.require_lora_shape(job, base)
    if parent.adapter is not None and not same_adapter(parent.adapter, peft):
        raise api.InvalidSpec([(
            f"spec.training.peft: the parent adapter {parent.id} has {parent.adapter}; a LoRA "
            "job continues an adapter with the same method, rank, alpha and targetModules "
            f"(or pin its base {base.id} to train a new one)")], source=f"job {job.name}")
    if load and job.spec.model.pretrained is None:
        try:
            pretrained.load_strict(
                model, records.load_weights(zoo, base), f"spec.warmStart.parent: base {base.id}",
                advice=(f"LoRA trains on its base's exact weights, so spec.model must be the "
                        f"base's: {base.builder} with args {json.dumps(base.args)} and "
                        f"inputShape {list(base.input_shape)} (`kiln zoo show {base.id}`), or "
                        "pin a base of spec.model's architecture and args"))
        except pretrained.WeightsError as exc:
            raise api.InvalidSpec([str(exc)], source=f"job {job.name}") from None
    _attach(job, model, peft)
    if load and parent.base is not None:
        try:
            lora.load_adapter(model, records.load_weights(zoo, parent))
        except ValueError as exc:
            raise api.InvalidSpec([str(exc)], source=f"job {job.name}") from None
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    start = (f"continuing adapter {parent.id}" if parent.base is not None
             else "a new adapter")
    source = job.spec.model.pretrained
    on = (f" ({'imported now from' if imported else 'the zoo record of'} {source.uri})"
          if source is not None else "")
    reason = (f"LoRA rank {peft.rank} on base {base.id}{on}, {start}: {trained:,} of {total:,} "
              "parameters train; the base is frozen, so layer freezing is off")
    return api.WarmStartDecision(
        outcome=outcome, parent=parent.id, similarity=1.0,
        parent_metric=parent.metric_value, metric_name=parent.metric_name,
        reason=reason), base.id


def same_adapter(settings: Mapping[str, Any], peft: api.PeftSpec) -> bool:
    """Whether an adapter record's settings (``ZooRecord.adapter``) are `peft`'s, but for
    dropout (which only training uses): a job can continue it."""
    def kept(doc: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in doc.items() if k != "dropout"}
    return kept(settings) == kept(api.to_wire(peft))


def pretrained_lora_parent(job: api.TrainingJob, model: nn.Module, zoo: store.ObjectStore, *,
                           measure: Measure | None
                           ) -> tuple[records.ZooRecord, records.ZooRecord, bool]:
    """A LoRA job's parent and base when its base is ``spec.model.pretrained.uri`` (its
    weights in `model`, no adapters yet).

    The base is the zoo record holding exactly those weights, found by content (its
    ``weights_sha256`` is the SHA-256 of `model`'s weights as a record stores them, and it
    has the job's architecture and args), whatever URI, server or format they came from;
    without one the job imports them now (`registration.import_base`). The parent is the
    best finished adapter on such a record with the job's LoRA settings (same dataset
    first, then the better metric, then the newer) when ``spec.warmStart.enabled``, else the
    base: a new adapter. Only records the job's namespace may see count.

    Returns:
        (parent, base, whether the base was imported now).

    Raises:
        api.InvalidSpec: the base must be imported and `measure` is None, or its validation
            metric is not finite.
        store.StoreUnavailable: the zoo could not be read or written.
    """
    peft = job.spec.training.peft
    assert peft is not None
    spec = job.spec.model
    digest = hashlib.sha256(records.serialize_weights("pretrained", model.state_dict())
                            ).hexdigest()
    seen = [r for r in records.list_records(zoo)
            if r.visible_to(job.namespace) and not r.provisional]
    bases = sorted((r for r in seen if r.adapter is None and r.weights_sha256 == digest
                    and (r.architecture, r.entrypoint, r.args, tuple(r.input_shape))
                    == (spec.architecture, spec.entrypoint, dict(spec.args),
                        tuple(spec.input_shape))),
                   key=lambda r: (r.created_time, r.id))
    by_id = {r.id: r for r in bases}
    adapters = [r for r in seen if r.base in by_id and r.adapter is not None
                and same_adapter(r.adapter, peft)]
    if adapters and job.spec.warm_start.enabled:
        data = records.dataset_fingerprint(job.spec.dataset)
        metric = registration.metric_name(job.spec)
        higher = metric == api.TargetMetric.VALIDATION_ACCURACY
        best = max(adapters, key=lambda r: (
            r.dataset_fingerprint == data, r.metric_name == metric,
            (r.metric_value if higher else -r.metric_value) if r.metric_name == metric else 0.0,
            r.created_time))
        assert best.base is not None
        return best, by_id[best.base], False
    if bases:
        return bases[0], bases[0], False
    if measure is None:
        raise api.InvalidSpec([(
            "spec.model.pretrained.uri: a LoRA job imports these weights into the zoo as its "
            "base, with their validation metric; pass the measure to warm_start (Kiln's loop "
            "does), or import them once with `kiln zoo import`")], source=f"job {job.name}")
    base = registration.import_base(zoo, job, model, measure(model), weights_sha256=digest)
    return base, base, True


def _attach(job: api.TrainingJob, model: nn.Module, peft: api.PeftSpec) -> None:
    try:
        lora.attach(model, peft)
    except ValueError as exc:
        raise api.InvalidSpec([str(exc)], source=f"job {job.name}") from None


def load_pretrained(job: api.TrainingJob, model: nn.Module, environ: Mapping[str, str]) -> None:
    """Load ``spec.model.pretrained``'s weights into `model` (every key and shape matching:
    `pretrained.load_strict`), from the initializer's local copy (`sources.local_copy`).

    Raises:
        api.InvalidSpec: the weights cannot be made local, read, or do not fit the model;
            naming spec.model.pretrained.uri and the fix.
        store.StoreUnavailable: an S3 server did not answer.
    """
    source = job.spec.model.pretrained
    if source is None:
        return
    field = "spec.model.pretrained.uri"
    try:
        local = sources.local_copy(source.uri, field=field, environ=environ,
                                   secret=source.secret_ref.name if source.secret_ref else "")
        pretrained.load_strict(model, pretrained.read_weights(Path(local.path)),
                               f"{field} {source.uri}",
                               advice="check spec.model (architecture or entrypoint, args) "
                               "against the model the weights were saved from")
    except (sources.SourceError, pretrained.WeightsError) as exc:
        raise api.InvalidSpec([str(exc) if str(exc).startswith(field) else f"{field}: {exc}"]
                              ) from None
    _log.info("started from the pretrained weights at %s", source.uri)
