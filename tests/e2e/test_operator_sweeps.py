"""TrainingSweeps on the operator: a sweep keeps two trials at a time, prunes one that is behind,
survives an operator restart without losing or repeating a trial, reports its best, and lets a
plain job in; a job that only carries its label is not its trial; bad sweeps fail naming the
field."""

# The order in which the pruner sees the first evaluations is fixed by the test, never by speed:
# the learning rate is categorical with a useless value (1e-7, still at chance after an epoch),
# the seed is the first whose trials 0 and 1 draw the good and the useless value (asked of the
# same `kiln.sweep.Search` the operator runs), trial 1's pod stays unschedulable until trial 0's
# first evaluation is in the sweep's history, and trials 0 to 2 are held (`kubelet.Hold`) at
# their first evaluation so the operator reads each one before the trial trains on (at an
# epoch below the budget, whatever the machine's speed: see EPOCHS).

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubesim import client, emulator, kubelet, operator_process, scenario
from prometheus_client.parser import text_string_to_metric_families

from kiln import api, sweep

pytestmark = pytest.mark.xdist_group(__name__)  # one worker: both tests share its operator

GOOD, USELESS = 0.02, 1e-7
LR = "training.optimizer.lr"
TRIALS = 6
# A trial's status dates an evaluation only below its last epoch: a held trainer stops a few
# epochs late on a fast machine (the kubelet checks every 0.1 s), far from the end.
EPOCHS = 20
SWEEP_SECONDS = 600.0
CRD = Path(__file__).resolve().parents[2] / "crds" / "trainingsweep.yaml"


def _path(namespace: str, name: str = "") -> str:
    base = f"/apis/{api.API_VERSION}/namespaces/{namespace}/{api.sweep.SWEEP_PLURAL}"
    return f"{base}/{name}" if name else base


def _doc(name: str, seed: int, namespace: str = "any") -> dict[str, Any]:
    template = scenario.tiny_job(name, epochs=EPOCHS)["spec"]
    template["zoo"] = {"register": False}  # later tests of the session expect an empty zoo
    return {
        "apiVersion": api.API_VERSION, "kind": api.sweep.SWEEP_KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"template": template,
                 "parameters": [{"path": LR, "categorical": [GOOD, USELESS]}],
                 "algorithm": {"name": "random", "seed": seed},
                 "earlyStopping": {"name": "asha", "minEpochs": 1, "reductionFactor": 2},
                 "maxTrials": TRIALS, "parallelTrials": 2, "warmStart": "independent"},
    }


def _seed(name: str) -> int:
    """The first seed whose trials 0 and 1 get the good and the useless learning rate."""
    for seed in range(64):
        parsed = api.sweep.parse_sweep(_doc(name, seed))
        search = sweep.Search(parsed.spec)
        if [search.ask(), search.ask()] == [{LR: GOOD}, {LR: USELESS}]:
            return seed
    raise AssertionError("no seed in 0..63 draws the good then the useless value")


def _status(cluster: emulator.Emulator, namespace: str, name: str) -> dict[str, Any]:
    found = cluster.client.get(_path(namespace, name)) or {}
    return dict(found.get("status") or {})


def _wait_sweep(cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
                namespace: str, name: str, predicate: Callable[[dict[str, Any]], bool], *,
                what: str, timeout_seconds: float = scenario.JOB_SECONDS) -> dict[str, Any]:
    """Poll the sweep's status until `predicate` holds; returns the status then."""
    return client.wait_until(
        lambda: (st := _status(cluster, namespace, name)) and predicate(st) and st,
        timeout_seconds=timeout_seconds, what=f"sweep {namespace}/{name}: {what}",
        details=lambda: json.dumps(_status(cluster, namespace, name), indent=1)[-4000:]
        + "\n" + operator.log_tail())


def _trial(st: dict[str, Any], index: int) -> dict[str, Any]:
    return next((t for t in st.get("history") or [] if t["index"] == index), {})


def _evaluated(pod: kubelet.RunningPod) -> bool:
    """The trainer has evaluated its first epoch (and trains its second)."""
    progress = scenario.trainer_progress(pod)
    return progress.get("validationAccuracy") is not None and progress.get("epoch", 0) >= 2


def _jobs_created(cluster: emulator.Emulator, namespace: str) -> list[str]:
    """Names of the TrainingJobs the operator created (the request log)."""
    return [r.body["metadata"]["name"] for r in cluster.requests
            if r.resource == api.PLURAL and r.action == "CREATE" and r.namespace == namespace
            and r.user_agent != client.TEST_USER_AGENT and isinstance(r.body, dict)]


def _metric(operator: operator_process.OperatorProcess, sample: str, **labels: str
            ) -> float | None:
    for family in text_string_to_metric_families(operator.metrics()):
        for found in family.samples:
            if found.name == sample and all(found.labels.get(k) == v for k, v in labels.items()):
                return float(found.value)
    return None


def test_a_sweep_prunes_survives_a_restart_lets_a_plain_job_in_and_reports_its_best(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
    node_kubelet: kubelet.Kubelet, namespace: str,
) -> None:
    name = "digits-sweep"
    trials = [api.sweep.trial_name(name, i) for i in range(TRIALS)]
    holds = [node_kubelet.hold(kubelet.Hold(namespace, f"{t}-trainer-0", when=_evaluated))
             for t in trials[:3]]
    late = f"{namespace}/{trials[1]}-trainer-0"
    node_kubelet.unschedulable_pods.add(late)
    created = cluster.client.create(_path(namespace), _doc(name, _seed(name), namespace))
    uid = created["metadata"]["uid"]
    # Anyone may label a job with the sweep; only the sweep's own (its ownerReference) count.
    forged = scenario.tiny_job(f"{name}-t9", run_policy={"suspend": True})
    forged["metadata"]["labels"] = {api.sweep.SWEEP_LABEL: name, api.sweep.TRIAL_LABEL: "9"}
    forged["metadata"]["ownerReferences"] = [{
        "apiVersion": api.API_VERSION, "kind": api.sweep.SWEEP_KIND, "name": name,
        "uid": "00000000-0000-0000-0000-000000000000", "controller": True}]
    cluster.client.create_job(namespace, forged)

    try:
        _wait_sweep(cluster, operator, namespace, name,
                    lambda st: bool(_trial(st, 0).get("evaluations")),
                    what="trial 0's first evaluation in the history")
        node_kubelet.unschedulable_pods.discard(late)  # trial 1 is evaluated second
        pruned = _wait_sweep(cluster, operator, namespace, name,
                             lambda st: _trial(st, 1).get("state") == "Pruned",
                             what="trial 1 pruned")
        one = _trial(pruned, 1)
        assert one["params"] == {LR: USELESS}
        assert 1 <= one["prunedAt"]["epoch"] < EPOCHS and one["prunedAt"]["against"], one
        assert one["prunedAt"]["value"] < _trial(pruned, 0)["evaluations"][0][1]
        stopped = scenario.wait_phase(cluster, namespace, trials[1], "Suspended",
                                      details=operator.log_tail)
        assert stopped["spec"]["runPolicy"]["suspend"] is True
        # Two trials at a time: trial 2 takes trial 1's place while trial 0 is held.
        client.wait_until(lambda: holds[2].held.is_set(), timeout_seconds=scenario.JOB_SECONDS,
                          what="trial 2 to reach its first evaluation", details=operator.log_tail)
        assert holds[0].holding()
        cluster.client.create_job(namespace, scenario.tiny_job("digits-plain"))
        before = {t: cluster.client.job(namespace, t) for t in trials[:3]}

        operator.kill()  # mid-sweep: trial 0 and trial 2 are running
        operator.start()
        for hold in holds:
            hold.release()

        done = _wait_sweep(cluster, operator, namespace, name,
                           lambda st: st.get("phase") in ("Succeeded", "Failed"),
                           what="the end", timeout_seconds=SWEEP_SECONDS)
        assert done["phase"] == "Succeeded", done["conditions"]
        history = done["history"]
        assert [(t["index"], t["name"]) for t in history] == list(enumerate(trials))
        assert all(t["state"] in ("Succeeded", "Pruned") for t in history), history
        created_jobs = _jobs_created(cluster, namespace)
        assert sorted(created_jobs) == sorted(trials), created_jobs  # each once, none lost
        for trial, job in before.items():  # the restarted operator kept the jobs it found
            assert job is not None
            after = cluster.client.job(namespace, trial)
            assert after is not None and after["metadata"]["uid"] == job["metadata"]["uid"]
        counts = done["trials"]
        assert counts["total"] == TRIALS and counts["running"] == 0 and counts["pruned"] >= 1
        assert counts["succeeded"] + counts["pruned"] == TRIALS

        best = done["best"]
        finished = [t for t in history if t["state"] == "Succeeded"]
        assert best["trial"] in trials and best["params"] == {LR: GOOD}, best
        assert best["metric"] == max(t["metric"] for t in finished)
        crd = yaml.safe_load(CRD.read_text(encoding="utf-8"))
        columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
        for column in columns:  # what `kubectl get trainingsweeps` shows
            if column["jsonPath"].startswith(".status."):
                value: Any = done
                for key in column["jsonPath"].removeprefix(".status.").split("."):
                    value = value.get(key) if isinstance(value, dict) else None
                assert value is not None, column["name"]
        # events are posted after the status they explain: the last may follow the phase
        client.wait_until(lambda: {"NewBestTrial", "TrialPruned", "MaxTrialsReached"}
                          <= set(scenario.event_reasons(cluster, namespace, name)),
                          timeout_seconds=30.0, what="the sweep's events",
                          details=lambda: str(scenario.event_reasons(cluster, namespace, name)))
        best_events = [e["message"] for e in scenario.events(cluster, namespace, name)
                       if e["reason"] == "NewBestTrial"]
        assert any(best["trial"] in m and LR in m for m in best_events), best_events

        # The plain job, submitted while trials ran, started before the sweep ended.
        plain = scenario.wait_phase(cluster, namespace, "digits-plain", "Succeeded",
                                    details=operator.log_tail)
        placed = scenario.condition(plain, "Placed")
        assert placed is not None
        assert placed["lastTransitionTime"] <= done["completionTime"]
        # The forged job is no trial: not recorded, not created, never touched.
        assert "digits-sweep-t9" not in [t["name"] for t in history]
        still = cluster.client.job(namespace, f"{name}-t9")
        assert still is not None and still["spec"]["runPolicy"]["suspend"] is True
        assert still["metadata"]["ownerReferences"][0]["uid"] != uid

        assert _metric(operator, "kiln_sweep_trials", job_namespace=namespace, sweep=name,
                       state="Pruned") == counts["pruned"]
        assert _metric(operator, "kiln_sweep_best_metric", job_namespace=namespace,
                       sweep=name) == best["metric"]
        assert _metric(operator, "kiln_reconcile_errors_total", handler="sweeps") == 0
        assert node_kubelet.overlaps == []
    finally:
        node_kubelet.unschedulable_pods.discard(late)
        cluster.client.delete(_path(namespace, name))
        for job in [*trials, f"{name}-t9", "digits-plain"]:  # no garbage collector here
            cluster.client.delete(cluster.client.jobs_path(namespace, job))


@pytest.mark.parametrize(("change", "field"), [
    ({"parameters": [{"path": "training.lrr", "categorical": [0.1]}]},
     "spec.parameters[0].path: 'training.lrr' is not a TrainingJob field"),
    ({"parameters": [{"path": "model.args.depth", "int": {"min": 5, "max": 1}}]},
     "spec.parameters[0].int: empty range"),
    ({"objective": {"metric": "train_loss"}}, "spec.objective.metric"),
])
def test_a_bad_sweep_fails_as_invalid_spec_naming_the_field_and_makes_no_trial(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
    change: dict[str, Any], field: str,
) -> None:
    name = "digits-bad-sweep"
    doc = _doc(name, 0, namespace)
    doc["spec"].update(change)
    cluster.client.create(_path(namespace), doc)
    failed = _wait_sweep(cluster, operator, namespace, name,
                         lambda st: st.get("phase") == "Failed", what="phase Failed")
    condition = next(c for c in failed["conditions"] if c["type"] == "Failed")
    assert condition["reason"] == "InvalidSpec" and field in condition["message"], condition
    scenario.wait_event(cluster, namespace, name, "InvalidSpec")
    assert _jobs_created(cluster, namespace) == []
    cluster.client.delete(_path(namespace, name))


def test_a_trial_job_the_api_server_refuses_fails_the_trial_with_its_words(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
) -> None:
    """A rule of the API server's own (a CRD validation rule the sweep's checks lack) refuses
    every trial job: each trial fails with the server's message, a TrialRejected event says it,
    and the sweep ends at maxFailedTrials instead of creating the jobs forever."""
    name = "digits-refused-sweep"
    doc = _doc(name, 0, namespace)
    doc["spec"].update(maxTrials=3, maxFailedTrials=2)
    words = "spec.training: Invalid value: the cluster's own rule"
    refusal = cluster.refuse_creates(emulator.CreateRefusal(
        plural=api.PLURAL, message=words,
        when=lambda body: ((body.get("metadata") or {}).get("labels") or {}).get(
            api.sweep.SWEEP_LABEL) == name))
    cluster.client.create(_path(namespace), doc)
    failed = _wait_sweep(cluster, operator, namespace, name,
                         lambda st: st.get("phase") == "Failed", what="phase Failed")
    history = failed["history"]
    assert history and all(t["state"] == "Failed" and words in t["message"] for t in history), (
        history)
    assert failed["trials"]["failed"] >= 2, failed["trials"]
    assert len(refusal.refused) >= 2, refusal.refused
    assert not [j for j in cluster.objects(emulator.TRAININGJOBS)
                if j["metadata"].get("labels", {}).get(api.sweep.SWEEP_LABEL) == name]
    scenario.wait_event(cluster, namespace, name, "TrialRejected")
    cluster.client.delete(_path(namespace, name))
