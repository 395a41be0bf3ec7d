"""The warm-start probe guard: of the decided parent and its alternatives, those whose warm
weights clearly beat a cold start at step 0 compete, and a later one displaces the one kept
only by starting clearly lower; if none does,
the first that beats it after a few training steps side by side on the same batches; else the
run starts cold."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln import api, contract, models
from kiln.controller import jobs, lifecycle
from kiln.warmstart import decision, graph, select, transform
from kiln.zoo import records, store
from kiln_trainer import data, jobcontext, loop, optim, warm

CNN = {"depth": 3, "width": 16}



def _job(name: str, architecture: str = "small_cnn", args: dict[str, Any] | None = None,
         **sections: Any) -> api.TrainingJob:
    doc: dict[str, Any] = {
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {
            "model": {"architecture": architecture, "args": args or CNN, "inputShape": [1, 8, 8]},
            "dataset": {"name": "digits", "maxSamples": 600},
            "training": {"epochs": 2, "batchSize": 64,
                         "optimizer": {"name": "adam", "lr": 0.01, "weightDecay": 0.0}},
        },
    }
    for section, values in sections.items():
        doc["spec"][section] = {**doc["spec"].get(section, {}), **values}
    return api.parse_job(doc)


def _run(job: api.TrainingJob, tmp_path: Path, zoo: Path, **kwargs: Any) -> dict[str, Any]:
    return loop.main(job, out=io.StringIO(), termination_log=None, zoo_uri=str(zoo),
                     checkpoint_dir=tmp_path / f"ckpt-{job.name}", **kwargs)


def _register_scaled(zoo: store.ObjectStore, job: api.TrainingJob, metric: float) -> str:
    """A bad parent: random weights scaled by 10, with a metric that makes the policy pick it."""
    torch.manual_seed(123)
    model = models.build(job.spec.model)
    state = {k: v * 10 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    return _register(zoo, job, state, metric)


def _register(zoo: store.ObjectStore, job: api.TrainingJob, state: dict[str, torch.Tensor],
              metric: float) -> str:
    """A zoo record of `job`'s model holding `state`, claiming `metric`."""
    model = models.build(job.spec.model)
    architecture = str(job.spec.model.architecture)
    record = records.ZooRecord(
        id=records.new_id(architecture), architecture=architecture,
        args=dict(job.spec.model.args), input_shape=(1, 8, 8), modality="image",
        task="classification", dataset="digits", metric_name="validation_accuracy",
        metric_value=metric, validation_accuracy=metric, validation_loss=0.1,
        samples_per_second=100.0, num_params=sum(p.numel() for p in model.parameters()),
        created_time="2026-11-30T00:00:00Z", job_name="bad-parent",
        job_spec=api.to_wire(job.spec), parent=None, similarity=None, weights_sha256="",
        # the same data as the good parents, so that only the metric orders them
        dataset_fingerprint=records.dataset_fingerprint(job.spec.dataset))
    return records.write_record(zoo, record, state,
                                graph.to_json(decision.model_graph(job.spec.model))).id


@pytest.fixture(scope="module")
def trained_zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A zoo holding one small_cnn and one small_resnet trained on digits (good parents)."""
    tmp = tmp_path_factory.mktemp("trained")
    zoo = tmp / "zoo"
    for job in (_job("good-cnn", warmStart={"enabled": False}),
                _job("good-resnet", "small_resnet", {"blocks": [1, 1, 1], "width": 8},
                     warmStart={"enabled": False})):
        _run(job, tmp, zoo)
    return zoo


def _probe(job: api.TrainingJob) -> warm.Probe:
    """The guard's probe batch from `job`'s training split, as the trainer builds it."""
    splits = data.load(job.spec.dataset, input_shape=job.spec.model.input_shape, seed=0,
                       model=job.spec.model)
    return warm.training_probe(splits.train, accuracy=True)


def _same_parameters(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> bool:
    """Every parameter of `model` is the tensor in `state` (buffers are not compared)."""
    return all(torch.equal(p, state[k]) for k, p in model.named_parameters())


def _copy_zoo(source: Path, target: Path, *, keep: str | None = None) -> Path:
    """A copy of the trained zoo, with only records of architecture `keep` (all if None)."""
    src, dst = store.DirStore(source), store.DirStore(target)
    for record in records.list_records(src):
        if keep is None or record.architecture == keep:
            records.write_record(dst, record, records.load_weights(src, record),
                                 records.load_graph(src, record))
    return target


# ----------------------------------------------------------------------------------------------
# the verdict and the damping


@pytest.mark.parametrize(("warm_score", "cold_score", "kept"), [
    pytest.param(warm.Score(0.4, 0.8), warm.Score(2.3, 0.1), True, id="clearly-better"),
    pytest.param(warm.Score(0.95 * 2.0), warm.Score(2.0), True, id="at-the-ratio"),
    pytest.param(warm.Score(0.96 * 2.0), warm.Score(2.0), False, id="within-noise"),
    pytest.param(warm.Score(2.41, 0.12), warm.Score(2.30, 0.10), False, id="worse"),
    pytest.param(warm.Score(1.0, 0.05), warm.Score(2.3, 0.10), False, id="lower-loss-worse-acc"),
    pytest.param(warm.Score(float("nan")), warm.Score(2.3), False, id="nan"),
    pytest.param(warm.Score(float("inf")), warm.Score(float("inf")), False, id="both-infinite"),
])
def test_the_guard_keeps_only_a_clearly_better_warm_start(
        warm_score: warm.Score, cold_score: warm.Score, kept: bool) -> None:
    assert warm.passes(warm_score, cold_score) is kept


@pytest.mark.parametrize(("warm_loss", "cold_loss", "kept"), [
    pytest.param(1.10, 1.30, True, id="ahead"),
    pytest.param(1.30, 1.30, False, id="level"),
    pytest.param(1.92, 1.85, False, id="behind"),
    pytest.param(float("inf"), float("inf"), False, id="both-diverged"),
    pytest.param(1.0, float("inf"), True, id="cold-diverged"),
    pytest.param(float("nan"), 1.0, False, id="nan"),
])
def test_after_the_probe_steps_the_guard_keeps_a_warm_start_only_if_it_is_ahead(
        warm_loss: float, cold_loss: float, kept: bool) -> None:
    assert warm.trained_passes(warm_loss, cold_loss) is kept
    said = warm.trained_comparison(warm_loss, cold_loss, 30)
    assert said.startswith(f"after 30 steps warm loss {warm_loss:.3f} {'<' if kept else '≥'} "
                           f"cold {cold_loss:.3f} (mean of the last 8 on the same batches)")


def test_probe_steps_give_every_model_the_same_batches_and_draws_and_change_nothing() -> None:
    job = _job("p")
    torch.manual_seed(0)
    inputs, targets = torch.randn(100, 1, 8, 8), torch.randint(0, 10, (100,))
    probe = warm.Probe(inputs[:40], targets[:40], train_inputs=inputs, train_targets=targets)
    assert torch.equal(probe.batch(1, 64)[0], inputs[torch.arange(64, 128) % 100])  # cycles
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Dropout(0.5), torch.nn.Linear(64, 10))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    state = torch.get_rng_state()
    first = warm.trained_loss(net, probe, job.spec.training, 12)
    assert warm.trained_loss(net, probe, job.spec.training, 12) == first  # same batches, masks
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert torch.equal(torch.get_rng_state(), state)
    other = {k: v + 1 for k, v in before.items()}
    assert warm.trained_loss(net, probe, job.spec.training, 12, start=other) != first
    assert torch.equal(net.state_dict()["2.weight"], before["2.weight"])


def test_calibration_sets_batch_norm_statistics_from_the_probe_and_draws_nothing() -> None:
    torch.manual_seed(0)
    inputs = torch.randn(130, 3, 4, 4) * 3 + 1
    probe = warm.Probe(inputs, torch.zeros(130, dtype=torch.long))
    norm = torch.nn.BatchNorm2d(3)
    net = torch.nn.Sequential(norm, torch.nn.Dropout(0.5), torch.nn.Flatten(),
                              torch.nn.Linear(48, 2)).eval()
    norm.running_mean.fill_(7.0)  # a parent's statistics of other features
    state = torch.get_rng_state()
    assert warm.calibrate_norms(net, probe) == 130
    # three chunks of 44, 43 and 43 samples (none a lone sample), averaged with equal weight
    chunks = inputs.tensor_split(3)
    mean = torch.stack([c.mean((0, 2, 3)) for c in chunks]).mean(0)
    var = torch.stack([c.var((0, 2, 3)) for c in chunks]).mean(0)  # unbiased, as in training
    assert torch.allclose(norm.running_mean, mean, atol=1e-5)
    assert torch.allclose(norm.running_var, var, atol=1e-4)
    assert torch.equal(torch.get_rng_state(), state)  # dropout stayed in eval mode
    assert norm.momentum == 0.1 and not net.training and not norm.training
    plain = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 2))
    assert warm.calibrate_norms(plain, probe) == 0  # nothing to re-estimate


def test_learning_rate_damping_follows_the_measured_quality_not_the_tensor_count() -> None:
    assert transform.transfer_quality(0.5, 2.0) == pytest.approx(0.75)
    assert transform.transfer_quality(3.0, 2.0) == 0.0
    assert transform.transfer_quality(float("nan"), 2.0) == 0.0
    # all tensors transferred, but the probe says little of the function was kept: gentle damping
    record = api.WarmStartDecision(parent="p", similarity=0.9, matched_tensors=54,
                                   total_tensors=54, outcome=api.WarmStartOutcome.WARM,
                                   reason="r", probe_loss=1.8, cold_probe_loss=2.0)
    run = {"steps_per_epoch": 10, "total_steps": 300}
    assert warm.lr_damping(record, 0, **run) == pytest.approx(0.9)  # 1 - clip(1 - 1.8 / 2, 0, 1)
    assert warm.lr_damping(record, 20, **run) == 1.0  # after 2 epochs
    partial = record.model_copy(update={"matched_tensors": 30})
    kept = partial.model_copy(update={"probe_loss": 0.2})
    assert warm.lr_damping(kept, 0, **run) == pytest.approx(0.3)  # quality 0.9 -> the floor
    unprobed = partial.model_copy(update={"probe_loss": None, "cold_probe_loss": None})
    assert warm.lr_damping(unprobed, 0, **run) == pytest.approx(24 / 54)  # the untransferred share
    cold = select.cold_start(api.WarmStartOutcome.COLD_FEW_TENSORS, "cold start: 1 of 54")
    assert warm.lr_damping(cold.model_copy(update={"matched_tensors": 1, "total_tensors": 54}),
                           0, **run) == 1.0


# ----------------------------------------------------------------------------------------------
# the record travels: decision JSON, the trainer's report, status.warmStart, checkpoints


def test_alternatives_and_probe_results_travel_through_json_report_and_status() -> None:
    decided = api.WarmStartDecision(
        parent="a", similarity=0.6, parent_metric=0.9, matched_tensors=3, total_tensors=5,
        reason="r", candidates_considered=3, outcome=api.WarmStartOutcome.WARM,
        alternatives=("b", "c"), probe_loss=0.4, cold_probe_loss=2.3, probe_accuracy=0.8,
        cold_probe_accuracy=0.1)
    doc = json.loads(decided.model_dump_json())  # --warm-start, the report, the checkpoint
    assert doc["parent"] == "a" and doc["alternatives"] == ["b", "c"]
    assert warm.parse_decision(json.dumps(doc)) == select.from_report(doc) == decided
    status = api.to_wire(decided)
    assert status["alternatives"] == ["b", "c"]
    assert (status["probeLoss"], status["coldProbeLoss"]) == (0.4, 2.3)
    assert api.TrainingJobStatus.model_validate({"warmStart": status}).warm_start == decided
    with pytest.raises(ValueError, match=r"alternatives\[0\]: Input should be a valid string"):
        select.from_report({**doc, "alternatives": [1]})


def test_the_operator_records_the_guard_verdict_of_a_decision_it_made() -> None:
    admitted = api.WarmStartDecision(
        parent="bad", similarity=0.45, parent_metric=0.9, matched_tensors=54,
        total_tensors=54, reason="warm start from bad: similarity 0.45", candidates_considered=1,
        outcome=api.WarmStartOutcome.WARM)
    probed = admitted.model_copy(update={
        "parent": None, "parent_metric": None, "outcome": api.WarmStartOutcome.COLD_GUARD,
        "reason": "warm start from bad (similarity 0.45) rejected: probe loss 2.410 vs 2.300 "
                  "cold on 256 training samples; cold start",
        "probe_loss": 2.41, "cold_probe_loss": 2.3})
    edit = jobs.Edit(body={}, status={"warmStart": api.to_wire(admitted)},
                     jobs=None)  # type: ignore[arg-type]  # condition() does not write
    lifecycle.record_trainer_decision(edit, probed, now=0.0)
    recorded = edit.status["warmStart"]
    assert (recorded["outcome"], recorded["probeLoss"], recorded["coldProbeLoss"]) == (
        "cold_guard", 2.41, 2.3)
    assert "parent" not in recorded
    (condition,) = [c for c in edit.status["conditions"] if c["type"] == "WarmStarted"]
    assert condition["status"] == "False" and "probe loss 2.410 vs 2.300" in condition["message"]
    assert [e.reason for e in edit.events] == [api.Reason.WARM_START_GUARDED]


def test_an_old_record_without_probe_fields_still_reads() -> None:
    old = {"parent": None, "similarity": None, "parent_metric": None, "matched_tensors": None,
           "total_tensors": None, "untransferred_fraction": 1.0, "outcome": "cold_empty",
           "reason": "cold start"}
    record = api.WarmStartDecision.model_validate(old)  # an older trainer's checkpoint
    assert record.alternatives == [] and record.probe_loss is None
    assert record.outcome is api.WarmStartOutcome.COLD_EMPTY
    own = api.WarmStartDecision.model_validate({**old, "outcome": "init_state"})
    assert own.cold_start and select.from_report(own) is None  # no decision to record


# ----------------------------------------------------------------------------------------------
# the guard on real parents


def test_decide_records_the_next_parents_in_selection_order(trained_zoo: Path,
                                                            tmp_path: Path) -> None:
    zoo_dir = _copy_zoo(trained_zoo, tmp_path / "zoo", keep="small_cnn")
    zoo = store.DirStore(zoo_dir)
    (good,) = [r.id for r in records.list_records(zoo)]
    best = _register_scaled(zoo, _job("x"), metric=0.99)
    second = _register_scaled(zoo, _job("x"), metric=0.98)
    decided = decision.decide(_job("child"), zoo)
    assert decided.parent == best and decided.alternatives == [second, good]


def test_a_bad_parent_is_refused_and_the_run_starts_cold_with_both_losses(
        tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    bad = _register_scaled(zoo, _job("x"), metric=0.99)
    job = _job("child")
    result = _run(job, tmp_path, tmp_path / "zoo", register=False)
    decided = result["warm_start_decision"]
    assert result["parent"] is None and decided["outcome"] == api.WarmStartOutcome.COLD_GUARD
    assert decided["reason"].startswith(f"candidate {bad} (similarity 1.00) rejected by the "
                                        "guard: after 10 steps warm loss ")
    assert "; step-0 probe loss " in decided["reason"]
    assert " cold on 256 training samples" in decided["reason"]
    assert decided["reason"].endswith("; cold start (guard)")
    assert decided["guard_steps"] == 20  # the cold twin and the one parent, 10 steps each
    assert decided["trained_probe_loss"] >= decided["cold_trained_probe_loss"]
    assert decided["cold_probe_loss"] is not None and (
        decided["probe_loss"] is None or decided["probe_loss"] > decided["cold_probe_loss"])
    # the guard leaves the cold initialisation exactly as a cold start would
    cold = _run(job, tmp_path, tmp_path / "empty-zoo", register=False)
    assert result["validation_loss"] == pytest.approx(cold["validation_loss"])


def test_a_good_parent_passes_and_the_report_leads_with_the_probe(
        trained_zoo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spied: list[Any] = []
    build = optim.build_schedule

    def spy(*args: Any, damping: Any = None, **kwargs: Any) -> Any:
        spied.append(damping)
        return build(*args, damping=damping, **kwargs)

    monkeypatch.setattr(optim, "build_schedule", spy)
    zoo_dir = _copy_zoo(trained_zoo, tmp_path / "zoo", keep="small_cnn")
    (good,) = [r.id for r in records.list_records(store.DirStore(zoo_dir))]
    out = io.StringIO()
    result = loop.main(_job("child"), out=out, termination_log=None, zoo_uri=str(zoo_dir),
                       checkpoint_dir=tmp_path / "ckpt", register=False)
    decided = result["warm_start_decision"]
    assert result["parent"] == good and decided["outcome"] == api.WarmStartOutcome.WARM
    assert decided["probe_loss"] < warm.MAX_LOSS_RATIO * decided["cold_probe_loss"]
    assert decided["probe_accuracy"] >= decided["cold_probe_accuracy"]
    assert decided["guard_steps"] == 0  # clearly better at step 0: no probe steps
    lead = (f"Warm start from {good} (similarity 1.00): guard: step-0 probe loss "
            f"{decided['probe_loss']:.3f} vs {decided['cold_probe_loss']:.3f} cold on 256 "
            "training samples")
    infos = [json.loads(line)["message"] for line in out.getvalue().splitlines()
             if json.loads(line)["event"] == "info"]
    assert infos[0].startswith(lead) and "tensors transferred" in infos[0]
    # the loop damps the kept warm start's first fifth of this 2-epoch run, not both epochs
    (damping,) = spied  # one schedule built; its damping is by optimizer step
    damped = math.ceil(0.2 * result["steps"])
    assert damping(0) < 1.0 and damping(damped - 1) == damping(0)
    assert damping(damped) == 1.0 and damped < result["steps"] // 2


def test_an_alternative_that_wins_at_step_0_is_kept_before_training_the_first_parent(
        trained_zoo: Path, tmp_path: Path) -> None:
    # Training a step-0 loser beside a cold twin is a rescue for when no candidate wins at
    # once: a parent that may only catch up never displaces one already ahead.
    zoo_dir = _copy_zoo(trained_zoo, tmp_path / "zoo", keep="small_cnn")
    zoo = store.DirStore(zoo_dir)
    (good,) = [r.id for r in records.list_records(zoo)]
    bad = _register_scaled(zoo, _job("x"), metric=0.99)
    job = _job("child")
    decided = decision.decide(job, zoo)
    assert (decided.parent, decided.alternatives) == (bad, [good])
    model = models.build(job.spec.model)
    done = warm.warm_start(job, model, zoo, decided=decided, probe=_probe(job))
    assert done.parent == good and done.outcome == api.WarmStartOutcome.WARM
    assert done.reason.startswith(f"warm start from {good} (similarity 1.00): guard: step-0 "
                                  "probe loss")
    assert (f"; candidate {bad} (similarity 1.00) rejected by the guard: step-0 probe loss "
            ) in done.reason
    assert "after 10 steps" not in done.reason
    assert done.guard_steps == 0 and done.trained_probe_loss is None
    # the parent's own weights; batch-norm statistics re-estimated for each parent scored and
    # once more for the one kept
    assert done.calibration_samples == 3 * 256
    parent_state = records.load_weights(zoo, records.read_record(zoo, good))
    assert _same_parameters(model, parent_state)


def test_of_the_parents_that_pass_the_guard_a_clearly_lower_start_is_kept(
        trained_zoo: Path, tmp_path: Path) -> None:
    # The policy's pick (the higher metric) is the good parent blended with 30% of a fresh
    # init: it beats cold at step 0, but the good parent starts lower and is kept.
    zoo_dir = _copy_zoo(trained_zoo, tmp_path / "zoo", keep="small_cnn")
    zoo = store.DirStore(zoo_dir)
    (good,) = [r.id for r in records.list_records(zoo)]
    trained = records.load_weights(zoo, records.read_record(zoo, good))
    torch.manual_seed(5)
    fresh = models.build(_job("x").spec.model).state_dict()
    blended = {k: 0.7 * v + 0.3 * fresh[k] if v.is_floating_point() else v
               for k, v in trained.items()}
    weaker = _register(zoo, _job("x"), blended, metric=0.99)
    job = _job("child")
    decided = decision.decide(job, zoo)
    assert (decided.parent, decided.alternatives) == (weaker, [good])
    model = models.build(job.spec.model)
    probe = _probe(job)
    done = warm.warm_start(job, model, zoo, decided=decided, probe=probe)
    assert done.parent == good and done.outcome == api.WarmStartOutcome.WARM
    passed_over = f"; candidate {weaker} (similarity 1.00) passed the guard, not kept: "
    assert passed_over in done.reason
    # the weaker parent did pass: its own step-0 loss beat cold, and lost to the good one's
    alone = warm.warm_start(job, models.build(job.spec.model), zoo,
                            decided=decided.model_copy(update={"alternatives": []}), probe=probe)
    assert alone.parent == weaker and done.probe_loss is not None
    assert alone.probe_loss is not None and done.probe_loss < alone.probe_loss
    assert _same_parameters(model, trained)
    # a start only a little lower does not displace the policy's pick
    near = {k: 0.99 * v + 0.01 * fresh[k] if v.is_floating_point() else v
            for k, v in trained.items()}
    nearly = _register(zoo, _job("x"), near, metric=0.995)
    decided = decision.decide(job, zoo)
    assert decided.parent == nearly and good in decided.alternatives
    kept = warm.warm_start(job, models.build(job.spec.model), zoo, decided=decided, probe=probe)
    assert kept.parent == nearly and kept.probe_loss is not None
    assert done.probe_loss <= kept.probe_loss < done.probe_loss / warm.MAX_LOSS_RATIO


def test_the_best_preferred_model_joins_the_alternatives(trained_zoo: Path,
                                                          tmp_path: Path) -> None:
    # A sweep prefers its best trial: when the policy's picks and alternatives are more
    # similar models, the preferred one is still tried by the guard (first alternative).
    zoo_dir = _copy_zoo(trained_zoo, tmp_path / "zoo", keep="small_cnn")
    zoo = store.DirStore(zoo_dir)
    (good,) = [r.id for r in records.list_records(zoo)]
    same = [_register_scaled(zoo, _job("x"), metric=m) for m in (0.9, 0.8)]
    narrow_job = _job("x", args={"depth": 2, "width": 8})
    narrow = _register(zoo, narrow_job, models.build(narrow_job.spec.model).state_dict(),
                       metric=0.95)
    plain = decision.decide(_job("child"), zoo)
    assert (plain.parent, plain.alternatives) == (same[0], [same[1], good])
    decided = decision.decide(_job("child", warmStart={"preferred": [narrow]}), zoo)
    assert decided.parent == same[0] and decided.alternatives == [narrow, same[1], good]
    # a preferred model below minSimilarity is not tried
    shy = decision.decide(_job("child", warmStart={"preferred": [narrow],
                                                   "minSimilarity": 0.99}), zoo)
    assert shy.parent == same[0] and narrow not in shy.alternatives


def test_a_cross_family_parent_transfers_with_lower_loss_or_is_refused_with_the_reason(
        trained_zoo: Path, tmp_path: Path) -> None:
    zoo_dir = _copy_zoo(trained_zoo, tmp_path / "zoo", keep="small_resnet")
    (resnet,) = [r.id for r in records.list_records(store.DirStore(zoo_dir))]
    job = _job("cnn-child", warmStart={"parent": resnet})
    result = _run(job, tmp_path, zoo_dir, register=False)
    decided = result["warm_start_decision"]
    if decided["outcome"] == api.WarmStartOutcome.COLD_GUARD:
        assert f"candidate {resnet}" in decided["reason"]
        assert "rejected by the guard: " in decided["reason"]
    elif decided["guard_steps"]:
        assert decided["trained_probe_loss"] < decided["cold_trained_probe_loss"]
    else:
        assert decided["probe_loss"] < warm.MAX_LOSS_RATIO * decided["cold_probe_loss"]


def test_an_own_loop_passes_a_probe_batch_and_its_loss(tmp_path: Path) -> None:
    job = _job("own")
    zoo_dir = tmp_path / "zoo"
    bad = _register_scaled(store.DirStore(zoo_dir), job, metric=0.99)
    env = {contract.Env.JOB.value: json.dumps({
               "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
               "metadata": {"name": "own"}, "spec": api.to_wire(job.spec)}),
           contract.Env.ZOO.value: str(zoo_dir),
           contract.Env.CHECKPOINTS.value: str(tmp_path / "ckpt")}
    ctx = jobcontext.job_context(environ=env, out=io.StringIO(), handle_signals=False)
    splits = data.load(job.spec.dataset, input_shape=job.spec.model.input_shape, seed=0,
                       model=job.spec.model)
    inputs = torch.stack([splits.train[i][0] for i in range(128)])
    targets = torch.tensor([int(splits.train[i][1]) for i in range(128)])
    model = models.build(job.spec.model)
    done = ctx.warm_start(model, (inputs, targets), torch.nn.functional.cross_entropy)
    ctx.close()
    assert done.outcome == api.WarmStartOutcome.COLD_GUARD and done.parent is None
    assert done.reason.startswith(f"candidate {bad} (similarity 1.00) rejected by the guard: "
                                  "after 10 steps") and "on 128 training samples" in done.reason


def test_a_new_stage_passes_at_step_0_once_its_statistics_are_re_estimated_else_after_steps(
        trained_zoo: Path, tmp_path: Path) -> None:
    """A fourth stage on 8x8 images sees one pixel of the parent's last 2x2 map (its stride-2
    projection starts as an identity on every other pixel), so every batch norm after it reads
    other features than the parent's statistics describe. Re-estimated on the probe, the
    parent wins at step 0; with the parent's statistics the step-0 probe refuses it and the
    probe steps keep it. Either way the run starts from the transferred weights, not from a
    probe-trained copy."""
    zoo_dir = _copy_zoo(trained_zoo, tmp_path / "zoo", keep="small_resnet")
    zoo = store.DirStore(zoo_dir)
    (parent,) = [r.id for r in records.list_records(zoo)]
    child = {"blocks": [1, 1, 1, 1], "width": 8}

    def start(steps: int, calibrate: bool = True) -> api.WarmStartDecision:
        """The guard's decision on a fresh child, whose weights it checks."""
        job = _job("child", "small_resnet", child,
                   warmStart={"probeSteps": steps, "calibrateNorms": calibrate})
        splits = data.load(job.spec.dataset, input_shape=job.spec.model.input_shape, seed=0,
                           model=job.spec.model)
        probe = warm.training_probe(splits.train, accuracy=True, train_samples=steps * 64)
        torch.manual_seed(job.spec.training.seed)
        model = models.build(job.spec.model)
        decided = warm.warm_start(job, model, zoo, decided=decision.decide(job, zoo),
                                  probe=probe)
        # the expected start: the transferred weights, their statistics re-estimated (unless
        # calibrateNorms is off) on the same probe
        torch.manual_seed(job.spec.training.seed)  # the same cold initialisation
        expected = models.build(job.spec.model)
        if decided.parent is not None:  # else the cold initialisation, untouched
            transferred = decision.apply(decided, zoo, expected, job.spec.model.input_shape,
                                         seed=job.spec.training.seed)
            assert transferred.state_dict is not None
            expected.load_state_dict(transferred.state_dict)
            if calibrate:
                warm.calibrate_norms(expected, probe)
        assert all(torch.equal(v, expected.state_dict()[k])
                   for k, v in model.state_dict().items())
        return decided

    calibrated = start(0)
    assert calibrated.parent == parent and calibrated.outcome == api.WarmStartOutcome.WARM
    assert calibrated.guard_steps == 0 and calibrated.trained_probe_loss is None
    assert calibrated.calibration_samples == 2 * 256  # when scored, and once more when kept
    assert calibrated.reason.startswith(f"warm start from {parent} (similarity 0.72): guard: "
                                        "step-0 probe loss")
    assert "batch-norm statistics re-estimated on the probe" in calibrated.reason
    # with the parent's statistics (spec.warmStart.calibrateNorms false), step 0 cannot tell
    step_zero = start(0, calibrate=False)
    assert step_zero.outcome == api.WarmStartOutcome.COLD_GUARD and step_zero.guard_steps == 0
    assert step_zero.probe_loss > warm.MAX_LOSS_RATIO * step_zero.cold_probe_loss  # premise
    assert calibrated.probe_loss < step_zero.probe_loss  # type: ignore[operator]
    assert "rejected by the guard: step-0 probe loss" in step_zero.reason
    trained = start(10, calibrate=False)
    assert trained.parent == parent and trained.outcome == api.WarmStartOutcome.WARM
    assert trained.trained_probe_loss < trained.cold_trained_probe_loss  # type: ignore[operator]
    assert trained.guard_steps == 20 and trained.calibration_samples == 0
    assert trained.reason.startswith(f"warm start from {parent} (similarity 0.72): guard: after "
                                     "10 steps warm loss")
    assert "re-estimated" not in trained.reason


def test_probe_batches_are_cut_to_the_probe_samples_as_the_loop_cuts_them_to_the_split() -> None:
    """A batchSize far above the data (65536 on 100 samples) must not make the guard train
    on batches of 65536 repeated samples: minutes of probe steps beside a 1-second epoch."""
    torch.manual_seed(0)
    inputs, targets = torch.randn(100, 1, 8, 8), torch.randint(0, 10, (100,))
    probe = warm.Probe(inputs[:40], targets[:40], train_inputs=inputs, train_targets=targets)
    for step in (0, 1, 7):
        batch, labels = probe.batch(step, 65536)
        assert torch.equal(batch, inputs) and torch.equal(labels, targets)
    assert torch.equal(probe.batch(1, 64)[0], inputs[torch.arange(64, 128) % 100])  # unchanged
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    huge = _job("huge", training={"batchSize": 65536}).spec.training
    whole = _job("whole", training={"batchSize": 100}).spec.training
    assert warm.trained_loss(net, probe, huge, 5) == warm.trained_loss(net, probe, whole, 5)
