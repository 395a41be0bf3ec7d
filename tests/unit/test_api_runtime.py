"""TrainingRuntime and ClusterTrainingRuntime: parsing, merging a job over one, locking, and
the job running on the runtime as admission recorded it."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kiln import api
from kiln.api import runtime

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
