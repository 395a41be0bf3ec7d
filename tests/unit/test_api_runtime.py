"""TrainingRuntime and ClusterTrainingRuntime: parsing, merging a job over one, locking, and
the job running on the runtime as admission recorded it."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest
import yaml

from kiln import api, crd
from kiln.api import jobfile, runtime

TOLERATION = {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}


def _runtime(kind: str = "ClusterTrainingRuntime", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": api.API_VERSION, "kind": kind, "metadata": {"name": "team"},
            "spec": spec}


def _job(template: dict[str, Any] | None = None, **ref: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"runtimeRef": {"name": "team", **ref},
                            "model": {"architecture": "small_resnet", "inputShape": [1, 8, 8]}}
    if template is not None:
        spec["template"] = template
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "j"},
            "spec": spec}


RUNTIME = _runtime(
    template={"image": "registry.example/trainer:2", "env": [{"name": "TEAM", "value": "a"},
                                                             {"name": "MODE", "value": "x"}],
              "tolerations": [TOLERATION], "nodeSelector": {"pool": "gpu"},
              "podSecurityContext": {"runAsNonRoot": True}},
    locked=["image", "podSecurityContext"])


def test_a_runtime_parses_and_its_record_keeps_template_and_locks() -> None:
    parsed = runtime.parse_runtime(RUNTIME)
    assert isinstance(parsed, runtime.ClusterTrainingRuntime)
    recorded = runtime.record(parsed)
    assert recorded == {"kind": "ClusterTrainingRuntime", "name": "team",
                        "template": RUNTIME["spec"]["template"],
                        "locked": ["image", "podSecurityContext"]}
    assert isinstance(runtime.parse_runtime(_runtime("TrainingRuntime")),
                      runtime.TrainingRuntime)


def test_an_invalid_runtime_names_every_field() -> None:
    bad = _runtime(template={"tolerations": [{"key": "gpu", "efect": "NoSchedule"}],
                             "imagee": "x"}, locked=["image", "nodeSelectr"])
    with pytest.raises(api.InvalidSpec) as caught:
        runtime.parse_runtime(bad)
    text = "\n".join(caught.value.problems)
    assert "ClusterTrainingRuntime team: spec.template.imagee:" in text
    assert "spec.template.tolerations[0].efect" in text
    assert "ClusterTrainingRuntime team: spec.locked[1]: 'nodeSelectr' is not" in text
    with pytest.raises(api.InvalidSpec, match="spec.lockd"):
        runtime.parse_runtime(_runtime(lockd=[]))


def test_the_job_template_merges_over_the_runtime_and_locked_keys_stay_the_runtimes() -> None:
    recorded = runtime.record(runtime.parse_runtime(RUNTIME))
    mine = {"image": "mine:1", "env": [{"name": "MODE", "value": "y"}, {"name": "OWN",
                                                                          "value": "1"}],
            "tolerations": [{"key": "spot", "operator": "Exists"}],
            "nodeSelector": {"zone": "b"}, "command": ["python", "-m", "mine"]}
    merged = runtime.merge(recorded["template"], recorded["locked"], mine)
    assert merged["image"] == "registry.example/trainer:2"  # locked
    assert merged["env"] == [{"name": "TEAM", "value": "a"}, {"name": "MODE", "value": "y"},
                             {"name": "OWN", "value": "1"}]  # by name, the job's wins
    assert merged["tolerations"] == [TOLERATION, {"key": "spot", "operator": "Exists"}]
    assert merged["nodeSelector"] == {"pool": "gpu", "zone": "b"}
    assert merged["command"] == ["python", "-m", "mine"]
    assert merged["podSecurityContext"] == {"runAsNonRoot": True}
    # Merging the merged template again changes nothing (a running job is merged each read).
    assert runtime.merge(recorded["template"], recorded["locked"], merged) == merged


def test_a_job_setting_a_locked_key_is_refused_naming_the_field() -> None:
    recorded = runtime.record(runtime.parse_runtime(RUNTIME))
    with pytest.raises(api.InvalidSpec) as caught:
        runtime.parse_job_on(_job({"image": "mine:1", "env": []}), recorded)
    assert caught.value.problems == [
        ("spec.template.image: locked by ClusterTrainingRuntime team; remove it from the job "
        "(the runtime sets it)")]
    job = runtime.parse_job_on(_job({"env": [{"name": "OWN", "value": "1"}]}), recorded)
    assert job.spec.template == {"env": [{"name": "OWN", "value": "1"}]}  # as written


def test_a_merged_template_is_checked_as_a_whole() -> None:
    # The job mounts a volume only the runtime declares: valid together, not alone.
    recorded = runtime.record(runtime.parse_runtime(_runtime(
        template={"volumes": [{"name": "cache", "emptyDir": {}}]})))
    ok = _job({"volumeMounts": [{"name": "cache", "mountPath": "/cache"}]})
    runtime.parse_job_on(ok, recorded)
    with pytest.raises(api.InvalidSpec, match="spec.template.volumeMounts"):
        api.parse_job(ok)
    missing = _job({"volumeMounts": [{"name": "other", "mountPath": "/x"}]})
    with pytest.raises(api.InvalidSpec, match="spec.template.volumeMounts"):
        runtime.parse_job_on(missing, recorded)


def test_ref_of_reads_a_documents_runtime_ref() -> None:
    assert runtime.ref_of(_job()) == api.RuntimeRef(kind="ClusterTrainingRuntime", name="team")
    assert runtime.ref_of(_job(kind="Nope")) is None
    assert runtime.ref_of({"spec": {}}) is None


def test_find_matches_kind_and_name() -> None:
    found = [runtime.parse_runtime(_runtime("TrainingRuntime")), runtime.parse_runtime(RUNTIME)]
    assert runtime.find(api.RuntimeRef(name="team"), found) is found[1]
    assert runtime.find(api.RuntimeRef(kind="TrainingRuntime", name="team"), found) is found[0]
    assert runtime.find(api.RuntimeRef(name="other"), found) is None
    assert runtime.find(None, found) is None


def test_an_admitted_job_runs_on_the_runtime_recorded_whatever_the_runtime_says_later() -> None:
    recorded = runtime.record(runtime.parse_runtime(RUNTIME))
    body = _job({"env": [{"name": "OWN", "value": "1"}]})
    body["status"] = {runtime.RUNTIME_STATUS: recorded}
    job = api.parse_running(body)  # before admission: merged over the record
    assert job.spec.template["image"] == "registry.example/trainer:2"
    body["status"][api.ADMITTED_SPEC_STATUS] = api.admitted_spec(job)
    # Later edits: the job's tolerations (a scheduling directive, taken live) add to the
    # runtime's; nothing the runtime changes reaches the job, whose status keeps the record.
    edited = copy.deepcopy(body)
    edited["spec"]["template"]["tolerations"] = [{"key": "spot", "operator": "Exists"}]
    running = api.parse_running(edited)
    assert running.spec.template["tolerations"] == [TOLERATION,
                                                    {"key": "spot", "operator": "Exists"}]
    assert running.spec.template["env"] == [{"name": "TEAM", "value": "a"},
                                            {"name": "MODE", "value": "x"},
                                            {"name": "OWN", "value": "1"}]
    assert api.ignored_edits(body) == []  # the recorded runtime's keys are no edit
    edited["spec"]["template"]["env"] = []
    assert api.ignored_edits(edited) == ["spec.template.env"]


def test_a_job_without_a_runtime_is_untouched() -> None:
    doc = _job({"env": [{"name": "OWN", "value": "1"}]})
    del doc["spec"]["runtimeRef"]
    assert api.running_doc(doc) == doc
    assert runtime.resolve(doc, None) is doc


def test_a_job_mounting_a_runtime_volume_elsewhere_adds_a_mount() -> None:
    # Kubernetes keys a mount by its path: the runtime's /cache stays, the job's path adds.
    cache = {"name": "cache", "mountPath": "/cache"}
    recorded = runtime.record(runtime.parse_runtime(_runtime(template={
        "volumes": [{"name": "cache", "emptyDir": {}}], "volumeMounts": [cache]})))
    also = {"name": "cache", "mountPath": "/also", "subPath": "x"}
    job = runtime.on(runtime.parse_job_on(_job({"volumeMounts": [also]}), recorded), recorded)
    assert job.spec.template["volumeMounts"] == [cache, also]
    read_only = {**cache, "readOnly": True}  # the same path: the job's mount wins
    assert runtime.merge(recorded["template"], [], {"volumeMounts": [read_only]})[
        "volumeMounts"] == [read_only]


def test_a_runtime_above_a_jobs_bounds_is_refused_as_a_runtime() -> None:
    # Every job on it carries its template: refused once, by the runtime's name, not per job.
    big = _runtime(template={"annotations": {f"a{i}": "x" * 1000 for i in range(200)}})
    with pytest.raises(api.InvalidSpec) as caught:
        runtime.parse_runtime(big, source="big.yaml")
    assert caught.value.kind == "ClusterTrainingRuntime"
    (problem,) = caught.value.problems
    assert problem.startswith("ClusterTrainingRuntime team: spec.template: the spec is 197 KiB "
                              "as JSON, above the 100 KiB")
    assert str(caught.value).startswith("big.yaml: invalid ClusterTrainingRuntime:")


def test_a_sweep_template_naming_a_runtime_is_checked_on_it() -> None:
    # Each trial is a job on the runtime: a locked key in the template fails every trial.
    text = yaml.safe_dump(RUNTIME) + "---\n" + yaml.safe_dump({
        "apiVersion": api.API_VERSION, "kind": "TrainingSweep", "metadata": {"name": "sw"},
        "spec": {"template": {**_job({"image": "mine:1"})["spec"],
                              "dataset": {"name": "digits"}},
                 "parameters": [{"path": "training.epochs", "categorical": [2, 3]}]}})
    with pytest.raises(api.InvalidSpec) as caught:
        jobfile.parse_all(text, source="s.yaml")
    assert caught.value.kind == "TrainingSweep"
    assert caught.value.problems == [
        ("spec.template.template.image: locked by ClusterTrainingRuntime team; remove it from "
         "the job (the runtime sets it)")]
    fine = text.replace("image: mine:1", "env: [{name: OWN, value: '1'}]")
    assert [d.kind for d in jobfile.parse_all(fine, source="s.yaml")] == [
        "ClusterTrainingRuntime", "TrainingSweep"]


@pytest.mark.parametrize("resource", [crd.RUNTIME, crd.CLUSTER_RUNTIME], ids=lambda r: r.kind)
def test_the_crd_refuses_a_runtime_locking_no_template_key(resource: crd.Resource) -> None:
    # Refused at kubectl apply, not later by failing every job on the runtime.
    locked = crd.openapi_schema(resource)["properties"]["spec"]["properties"]["locked"]
    assert locked["items"]["enum"] == list(api.TEMPLATE_KEYS)
    validator = jsonschema.Draft202012Validator(locked)
    assert [e.message for e in validator.iter_errors(["image", "nodeAfinity"])] == [
        f"'nodeAfinity' is not one of {list(api.TEMPLATE_KEYS)}"]
    assert list(validator.iter_errors(list(api.TEMPLATE_KEYS))) == []


def test_a_training_runtime_of_another_namespace_is_not_the_jobs() -> None:
    # The operator looks a TrainingRuntime up in the job's namespace: so does kiln validate.
    other = _runtime("TrainingRuntime", locked=["image"])
    other["metadata"]["namespace"] = "team-b"
    found = [runtime.parse_runtime(other)]
    ref = api.RuntimeRef(kind="TrainingRuntime", name="team")
    assert runtime.find(ref, found, "team-a") is None
    assert runtime.find(ref, found, "team-b") is found[0]
    assert runtime.find(ref, found) is found[0]  # the job's namespace is kubectl's to pick
    job = _job({"image": "mine:1"}, kind="TrainingRuntime")
    job["metadata"]["namespace"] = "team-a"
    text = yaml.safe_dump(other) + "---\n" + yaml.safe_dump(job)
    (_, parsed) = jobfile.parse_all(text, source="f.yaml")  # not checked on team-b's
    assert parsed.kind == api.KIND


def test_an_unknown_runtime_field_is_named_as_a_jobs_is() -> None:
    # A Kubeflow Trainer runtime's mlPolicy, or a misspelt locked: named with what is known.
    with pytest.raises(api.InvalidSpec) as caught:
        runtime.parse_runtime(_runtime(mlPolicy={"numNodes": 1}, lockd=["image"]))
    assert caught.value.problems == [
        "ClusterTrainingRuntime team: spec.mlPolicy: unknown field; known: template, locked",
        "ClusterTrainingRuntime team: spec.lockd: unknown field; did you mean 'locked'?"]
