"""The operator's sweep reconcile against crafted sweeps and trial jobs, in memory: a sweep
whose parameters changed after it began, or whose status or trial jobs say what the operator
never granted, fails or is ignored by name, and never makes the reconcile raise again and
again."""

from __future__ import annotations

import asyncio
import copy
import json
import types
from typing import Any, cast

import yaml

from kiln import api
from kiln.controller import cache, jobs, kube, lifecycle, metrics, sweeps, trials

S = api.sweep
NS, NAME, UID = "team-a", "search", "uid-sweep"
SWEEP = f"""\
apiVersion: kiln.dev/v1alpha1
kind: TrainingSweep
metadata: {{name: {NAME}, namespace: {NS}, uid: {UID}}}
spec:
  template:
    model: {{architecture: small_cnn, args: {{num_classes: 10}}, inputShape: [1, 8, 8]}}
    training: {{epochs: 4, batchSize: 32}}
  parameters:
    - path: model.args.depth
      int: {{min: 1, max: 3}}
  maxTrials: 4
  parallelTrials: 2
"""


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class FakeApi:
    """The API calls a sweep's reconcile makes, on objects kept by path."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.created: list[str] = []
        self.uids = 0

    async def get(self, path: str) -> dict[str, Any] | None:
        found = self.objects.get(path)
        return copy.deepcopy(found) if found is not None else None

    async def list(self, path: str, *, label_selector: str = "") -> list[dict[str, Any]]:
        key, _, value = label_selector.partition("=")
        return [copy.deepcopy(o) for p, o in self.objects.items() if p.startswith(path + "/")
                and (o.get("metadata") or {}).get("labels", {}).get(key) == value]

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        at = f"{path}/{body['metadata']['name']}"
        if at in self.objects:
            return None
        self.uids += 1
        made = copy.deepcopy(body)
        made["metadata"]["uid"] = f"uid-job-{self.uids}"
        self.objects[at] = made
        self.created.append(body["metadata"]["name"])
        return copy.deepcopy(made)

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        target = self.objects.get(path.removesuffix("/status"))
        if target is None:
            return None
        _merge(target, patch)
        return copy.deepcopy(target)


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str]] = []

    async def post(self, body: Any, type_: str, reason: str, message: str) -> None:
        self.posted.append((type_, reason, message))


def _deps(fake: FakeApi, events: Events) -> lifecycle.Deps:
    return cast(lifecycle.Deps, types.SimpleNamespace(
        client=fake, jobs=events, caches=cache.Caches(), metrics=metrics.OperatorMetrics(),
        parents=types.SimpleNamespace(records=list), clock=lambda: 1_700_000_000.0))


def _sweep_path() -> str:
    return kube.Paths.sweep(NS, NAME)


def _setup(text: str = SWEEP) -> tuple[FakeApi, Events, lifecycle.Deps]:
    fake, events = FakeApi(), Events()
    fake.objects[_sweep_path()] = yaml.safe_load(text)
    return fake, events, _deps(fake, events)


def _reconcile(deps: lifecycle.Deps) -> None:
    asyncio.run(sweeps.reconcile(deps, jobs.JobRef(NS, NAME)))


def _status(fake: FakeApi) -> dict[str, Any]:
    return cast(dict[str, Any], fake.objects[_sweep_path()].get("status") or {})


def _errors(deps: lifecycle.Deps) -> float:
    return float(deps.metrics.reconcile_errors.labels(handler=sweeps.HANDLER)._value.get())


def test_a_sweep_starts_its_first_trials() -> None:
    fake, _, deps = _setup()
    _reconcile(deps)
    st = _status(fake)
    assert st["phase"] == "Running" and fake.created == ["search-t0", "search-t1"]
    assert _errors(deps) == 0


def test_parameters_edited_after_the_start_fail_the_sweep_naming_the_trial_once() -> None:
    fake, events, deps = _setup()
    _reconcile(deps)
    fake.objects[_sweep_path()]["spec"]["parameters"] = [
        {"path": "model.args.depth", "int": {"min": 5, "max": 6}}]
    deps.caches.sweep_searches.clear()  # as after an operator restart
    for _ in range(2):
        _reconcile(deps)
    st = _status(fake)
    assert _errors(deps) == 0
    assert st["phase"] == "Failed"
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == "HistoryConflict"
    assert "search-t0" in failed["message"] and "model.args.depth" in failed["message"]
    assert [e[1] for e in events.posted].count("HistoryConflict") == 1
    # Its trials were stopped, as at any end.
    assert all(fake.objects[kube.Paths.job(NS, f"search-t{i}")]["spec"]["runPolicy"]["suspend"]
               for i in (0, 1))
    assert st["trials"] == {"total": 2, "running": 0, "succeeded": 0, "pruned": 2, "failed": 0}


def _copy_trial(fake: FakeApi, index: int, params: dict[str, Any]) -> None:
    """A user's copy of trial 0's job (ownerReference and labels kept) as trial `index`."""
    job = copy.deepcopy(fake.objects[kube.Paths.job(NS, "search-t0")])
    job["metadata"].update(name=f"search-t{index}", uid=f"uid-copy-{index}")
    job["metadata"]["labels"][S.TRIAL_LABEL] = str(index)
    job["metadata"]["annotations"][S.PARAMS_ANNOTATION] = json.dumps(params)
    fake.objects[kube.Paths.job(NS, f"search-t{index}")] = job


def test_a_copied_trial_job_with_values_outside_the_search_is_left_alone() -> None:
    fake, _, deps = _setup()
    _reconcile(deps)
    _copy_trial(fake, 2, {"model.args.depth": 99})
    _copy_trial(fake, 3, {"model.args.depth": 3})
    deps.caches.sweep_searches.clear()
    _reconcile(deps)
    st = _status(fake)
    assert _errors(deps) == 0 and st["phase"] == "Running"
    # The copy with the search's values is adopted; the other is not a trial, and its index
    # is not given to a new one.
    assert [(t["index"], t["params"]) for t in st["history"]] == [
        (0, st["history"][0]["params"]), (1, st["history"][1]["params"]),
        (3, {"model.args.depth": 3})]
    for i in (0, 1, 3):  # trials end, so new ones may start
        job = fake.objects[kube.Paths.job(NS, f"search-t{i}")]
        job["status"] = {"conditions": [{"type": "Succeeded", "status": "True"}],
                         "result": {"validation_accuracy": 0.5}}
    _reconcile(deps)
    st = _status(fake)
    assert [t["index"] for t in st["history"]] == [0, 1, 3, 4]
    assert "search-t2" not in fake.created and "search-t4" in fake.created


def test_a_failed_trials_long_message_is_kept_short_in_the_history() -> None:
    fake, _, deps = _setup()
    _reconcile(deps)
    job = fake.objects[kube.Paths.job(NS, "search-t0")]
    job["status"] = {"conditions": [{"type": "Failed", "status": "True", "reason": "X",
                                     "message": "boom " * 6000}]}
    _reconcile(deps)
    (trial, *_) = _status(fake)["history"]
    assert trial["state"] == "Failed" and trial["message"].startswith("boom boom")
    assert len(trial["message"].encode()) <= S.TRIAL_MESSAGE_MAX_BYTES


def test_a_trials_stop_at_the_sweeps_end_keeps_its_reason_short() -> None:
    long = "x" * 5000
    stopped = trials.stopped(S.Trial(index=0, name="search-t0", state=S.TrialState.RUNNING,
                                     evaluations=[[1.0, 0.5, 3.0]]), long)
    assert stopped.pruned_at is not None
    assert len(stopped.message.encode()) + len(stopped.pruned_at.against.encode()) \
        <= S.TRIAL_MESSAGE_MAX_BYTES + 64


def test_a_trial_job_whose_labels_were_edited_gets_them_back_and_is_read() -> None:
    fake, _, deps = _setup()
    _reconcile(deps)
    job = fake.objects[kube.Paths.job(NS, "search-t0")]
    del job["metadata"]["labels"][S.SWEEP_LABEL]
    job["metadata"]["labels"][S.TRIAL_LABEL] = "1"
    job["status"] = {"conditions": [{"type": "Succeeded", "status": "True"}],
                     "result": {"validation_accuracy": 0.75}}
    _reconcile(deps)
    assert job["metadata"]["labels"] == {S.SWEEP_LABEL: NAME, S.TRIAL_LABEL: "0"}
    _reconcile(deps)  # the event of that patch
    (trial, *_) = _status(fake)["history"]
    assert (trial["state"], trial["metric"]) == ("Succeeded", 0.75)
    assert fake.created == ["search-t0", "search-t1", "search-t2"] and _errors(deps) == 0


def test_a_provisional_best_that_fails_is_dropped_from_the_status() -> None:
    fake, events, deps = _setup()
    _reconcile(deps)
    job = fake.objects[kube.Paths.job(NS, "search-t0")]
    job["status"] = {"progress": {"epoch": 3, "validationAccuracy": 0.6}}  # epoch 2's value
    _reconcile(deps)
    assert _status(fake)["best"]["trial"] == "search-t0"
    assert [e[1] for e in events.posted].count("NewBestTrial") == 1
    job["status"]["conditions"] = [{"type": "Failed", "status": "True", "reason": "X",
                                    "message": "store unavailable"}]
    _reconcile(deps)
    st = _status(fake)
    assert st["history"][0]["state"] == "Failed" and st["history"][0]["evaluations"]
    assert "best" not in st and _errors(deps) == 0  # as `kiln sweep run` keeps it
