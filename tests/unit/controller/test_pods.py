"""The trainer pod built by kiln.controller.pods, and reading a pod back."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kiln import api, contract
from kiln.controller import pods, profiling
from kiln.controller import settings as operator_settings
from kiln.warmstart import select

WARM = api.WarmStartDecision(
    parent="small_cnn-1234abcd", similarity=0.8, parent_metric=0.9, matched_tensors=4,
    total_tensors=5, reason="warm start from it", candidates_considered=1,
    outcome=api.WarmStartOutcome.WARM)
COLD = select.cold_start(api.WarmStartOutcome.COLD_EMPTY, "cold start: the model zoo is empty")

SETTINGS = operator_settings.pod_settings(operator_settings.Options(
    default_image="kiln/trainer:test", zoo_uri="s3://zoo", zoo_endpoint="minio:9000",
    zoo_secret="zoo-creds", zoo_pod_access="credentials"))


def _job(**spec: Any) -> tuple[dict[str, Any], api.TrainingJob]:
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
           "metadata": {"name": "digits", "namespace": "team-a", "uid": "u-1",
                        "labels": {"kueue.x-k8s.io/queue-name": "gpu", "team": "a"}},
           "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]}, **spec}}
    return doc, api.parse_job(doc)


def _launch(**changes: Any) -> pods.Launch:
    values = {"node": "gpu-1", "devices": 2, "parallelism": "ddp", "device": "gpu",
              "warm_start": WARM, "estimated_seconds": 60.0, "started": 1.0}
    return pods.Launch(**{**values, **changes})


def test_a_gpu_pod_is_pinned_owned_labelled_and_runs_torchrun() -> None:
    owner, job = _job()
    pod = pods.build_pod(owner, job, attempt=1, launch=_launch(), settings=SETTINGS)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "digits-trainer-1" and meta["namespace"] == "team-a"
    assert meta["ownerReferences"][0] | {"uid": "u-1", "controller": True} == \
        meta["ownerReferences"][0]
    assert meta["labels"]["kiln.dev/job-name"] == "digits"
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "gpu"
    assert meta["annotations"]["prometheus.io/scrape"] == "true"
    container = spec["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert container["command"][:4] == ["python", "-m", "torch.distributed.run", "--standalone"]
    assert container["command"][-2:] == ["--parallelism", "ddp"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["gpu-1"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_zoo_credentials_come_from_a_secret_reference_never_a_value() -> None:
    owner, job = _job()
    pod = pods.build_pod(owner, job, attempt=0, launch=_launch(), settings=SETTINGS)
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    for name in ("KILN_ZOO_ACCESS_KEY", "KILN_ZOO_SECRET_KEY"):
        assert "value" not in env[name]
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "zoo-creds"
    assert json.loads(env["KILN_WARM_START"]["value"]) == WARM.model_dump(mode="json")
    assert env["KILN_ZOO_ENDPOINT"]["value"] == "minio:9000"
    token = env["KILN_ZOO_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"]  # temporary keys only
    assert token == {"name": "zoo-creds", "key": "sessionToken", "optional": True}


def test_presigned_zoo_access_mounts_the_jobs_secret_and_gives_no_zoo_credential() -> None:
    owner, job = _job()
    settings = dataclasses.replace(SETTINGS, zoo_pod_access="presigned")
    pod = pods.build_pod(owner, job, attempt=0, launch=_launch(), settings=settings)
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["KILN_ZOO"]["value"] == "presigned:/var/run/kiln/zoo-access/manifest.json"
    assert not {"KILN_ZOO_ACCESS_KEY", "KILN_ZOO_SECRET_KEY", "KILN_ZOO_SESSION_TOKEN",
                "KILN_ZOO_CREDENTIALS"} & set(env)
    assert env["KILN_ZOO_ENDPOINT"]["value"] == "minio:9000"  # for s3:// datasets: no secret
    assert "zoo-creds" not in json.dumps(pod)
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == pods.ZOO_ACCESS_VOLUME)
    assert volume["secret"]["secretName"] == "digits-zoo-access"
    mount = next(m for m in container["volumeMounts"] if m["name"] == pods.ZOO_ACCESS_VOLUME)
    assert mount == {"name": pods.ZOO_ACCESS_VOLUME, "readOnly": True,
                     "mountPath": "/var/run/kiln/zoo-access"}
    # A directory zoo has no URLs to sign: presigned access leaves it as it is.
    local = dataclasses.replace(settings, zoo_uri="/data/zoo")
    pod = pods.build_pod(owner, job, attempt=0, launch=_launch(), settings=local)
    assert {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}[
        "KILN_ZOO"] == "/data/zoo"
    assert pods.ZOO_ACCESS_VOLUME not in json.dumps(pod)


def test_the_pod_tells_the_trainer_its_image_and_the_operators_share_default() -> None:
    owner, job = _job(template={"image": "team-a/trainer:7"})
    shared = dataclasses.replace(SETTINGS, zoo_share="shared")
    pod = pods.build_pod(owner, job, attempt=0, launch=_launch(), settings=shared)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert (env["KILN_TRAINER_IMAGE"], env["KILN_ZOO_SHARE"]) == ("team-a/trainer:7", "shared")


def test_the_pod_is_told_the_one_record_id_its_model_may_have_with_either_zoo_access() -> None:
    owner, job = _job()
    owner["metadata"]["uid"] = "1f2e3d4c-0000-0000-0000-000000000000"
    for access in ("credentials", "presigned"):
        settings = dataclasses.replace(SETTINGS, zoo_pod_access=access)
        for attempt in (0, 3):
            pod = pods.build_pod(owner, job, attempt=attempt, launch=_launch(),
                                 settings=settings)
            env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
            assert env["KILN_ZOO_RECORD"] == "small_cnn-1f2e3d4c"


def test_a_cpu_pod_asks_for_no_gpu_and_runs_one_process() -> None:
    owner, job = _job()
    pod = pods.build_pod(owner, job, attempt=0, settings=SETTINGS,
                         launch=_launch(devices=1, parallelism="single", device="cpu",
                                        warm_start=COLD))
    container = pod["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert container["command"] == ["python", "-m", "kiln_trainer"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert api.WarmStartDecision.model_validate(json.loads(env["KILN_WARM_START"])) == COLD


def test_the_template_overrides_image_and_env_and_adds_scheduling() -> None:
    owner, job = _job(template={
        "image": "me/trainer:1", "env": [{"name": "OMP_NUM_THREADS", "value": "4"},
                                         {"name": "PYTHONUNBUFFERED", "value": "0"}],
        "tolerations": [{"key": "gpu", "operator": "Exists"}],
        "nodeSelector": {"pool": "a"}})
    pod = pods.build_pod(owner, job, attempt=0, launch=_launch(), settings=SETTINGS)
    container = pod["spec"]["containers"][0]
    assert container["image"] == "me/trainer:1"
    names = [e["name"] for e in container["env"]]
    assert names.count("PYTHONUNBUFFERED") == 1 and "KILN_METRICS_PORT" in names
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PYTHONUNBUFFERED"] == "0" and env["OMP_NUM_THREADS"] == "4"
    assert pod["spec"]["nodeSelector"] == {"pool": "a"}
    assert pod["spec"]["tolerations"][0]["key"] == "gpu"


def test_an_own_command_runs_with_kilns_env_volumes_and_init_containers() -> None:
    owner, job = _job(template={
        "image": "me/loop:2", "command": ["python", "train.py"], "args": ["--fast"],
        "envFrom": [{"secretRef": {"name": "s3-creds"}}],
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "pets"}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
        "initContainers": [{"name": "fetch", "image": "busybox:1.36",
                            "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
        "securityContext": {"runAsUser": 2000, "privileged": True}})
    pod = pods.build_pod(owner, job, attempt=0, launch=_launch(), settings=SETTINGS)
    spec = pod["spec"]
    container = spec["containers"][0]
    assert container["name"] == "trainer"
    assert container["command"] == ["python", "train.py"] and container["args"] == ["--fast"]
    assert container["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    env = {e["name"] for e in container["env"]}
    assert {"KILN_JOB", "KILN_ZOO", "KILN_METRICS_PORT", "KILN_WARM_START"} <= env
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"  # Kiln's, not the user's
    assert [v["name"] for v in spec["volumes"]] == ["dshm", "data"]
    assert [m["mountPath"] for m in container["volumeMounts"]] == ["/dev/shm", "/data"]
    assert spec["initContainers"][0]["name"] == "fetch"
    assert container["securityContext"]["runAsUser"] == 2000
    assert container["securityContext"]["privileged"] is True  # the user's word wins
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["gpu-1"]


def test_without_a_command_the_pod_runs_kilns_trainer() -> None:
    owner, job = _job(template={"image": "me/trainer:1"})
    pod = pods.build_pod(owner, job, attempt=0, launch=_launch(devices=1, parallelism="single"),
                         settings=SETTINGS)
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "kiln_trainer"] and "args" not in container
    assert "initContainers" not in pod["spec"]


def test_pod_state_reads_the_terminated_trainer() -> None:
    owner, job = _job()
    pod = pods.build_pod(owner, job, attempt=2, launch=_launch(), settings=SETTINGS)
    pod["status"] = {"phase": "Failed", "podIP": "10.0.0.7", "containerStatuses": [
        {"name": "trainer", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled",
                                                     "message": "killed"}}}]}
    state = pods.pod_state(pod)
    assert (state.job, state.attempt, state.exit_code, state.container_reason) == (
        "digits", 2, 137, "OOMKilled")
    assert state.finished and not state.active and state.node == "gpu-1"
    assert state.metrics_port == SETTINGS.metrics_port


def test_pod_state_reads_readiness_and_a_disruption() -> None:
    owner, job = _job()
    pod = pods.build_pod(owner, job, attempt=0, launch=_launch(), settings=SETTINGS)
    pod["status"] = {"phase": "Running", "conditions": [
        {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}]}
    state = pods.pod_state(pod)
    assert state.ready and state.disruption is None

    pod["status"] = {"phase": "Failed", "conditions": [
        {"type": "Ready", "status": "False", "reason": "PodCompleted"},
        {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler",
         "message": "Preempted in order to admit critical pod"}]}
    state = pods.pod_state(pod)
    assert not state.ready
    assert state.disruption == (
        "PreemptionByScheduler: Preempted in order to admit critical pod")

    pod["status"]["conditions"][1]["status"] = "False"  # the disruption was called off
    assert pods.pod_state(pod).disruption is None


def test_pod_state_reads_waiting_containers_init_first_and_the_scheduler() -> None:
    owner, job = _job(template={"image": "reg.example/own:1", "initContainers": [
        {"name": "fetch", "image": "reg.example/fetch:2"}]})
    pod = pods.build_pod(owner, job, attempt=0, launch=_launch(), settings=SETTINGS)
    pod["status"] = {"phase": "Pending", "initContainerStatuses": [
        {"name": "fetch", "state": {"waiting": {"reason": "ErrImagePull", "message": "nope"}}}],
        "containerStatuses": [
            {"name": "trainer", "state": {"waiting": {"reason": "PodInitializing"}}}]}
    state = pods.pod_state(pod)
    assert state.waiting == pods.Waiting("fetch", "ErrImagePull", "nope", "reg.example/fetch:2",
                                         init=True)
    assert state.starting is not None and state.starting.reason == "PodInitializing"
    assert state.starting.image == "reg.example/own:1" and state.unschedulable is None

    pod["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}
    state = pods.pod_state(pod)
    assert state.waiting is None and state.starting is None
    assert state.unschedulable == "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."


def test_the_stop_patch_sets_a_short_active_deadline() -> None:
    assert pods.stop_patch() == {"spec": {"activeDeadlineSeconds": pods.STOP_DEADLINE_SECONDS}}


def test_the_pod_asks_for_the_gpu_resource_its_node_offers_and_keeps_the_constraints() -> None:
    toleration = {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}
    owner, job = _job(template={
        "nodeSelector": {"pool": "ml"}, "tolerations": [toleration],
        "resources": {"requests": {"cpu": "2", "memory": "4Gi"}}})
    pod = pods.build_pod(owner, job, attempt=0, settings=SETTINGS,
                         launch=_launch(gpu_resource="nvidia.com/mig-1g.10gb"))
    resources = pod["spec"]["containers"][0]["resources"]
    assert resources == {"requests": {"cpu": "2", "memory": "4Gi"},
                         "limits": {"nvidia.com/mig-1g.10gb": "2"}}
    assert pod["spec"]["nodeSelector"] == {"pool": "ml"}
    assert pod["spec"]["tolerations"] == [toleration]


def test_trainer_pods_run_as_non_root_without_a_fixed_uid_by_default() -> None:
    owner, job = _job()
    pod = pods.build_pod(owner, job, attempt=0, launch=_launch(), settings=SETTINGS)
    pod_context, container = pod["spec"]["securityContext"], pod["spec"]["containers"][0]
    # OpenShift's restricted-v2 SCC assigns the uid; Pod Security "restricted" needs these.
    assert pod_context == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert "runAsUser" not in container["securityContext"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_security_contexts_come_from_the_operator_then_the_job() -> None:
    settings = operator_settings.pod_settings(operator_settings.Options(
        default_image="kiln/trainer:test", zoo_uri="s3://zoo", zoo_pod_access="credentials",
        pod_security_context=json.dumps(
            {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000}),
        container_security_context=json.dumps({"readOnlyRootFilesystem": True})))
    owner, job = _job()
    pod = pods.build_pod(owner, job, attempt=0, launch=_launch(), settings=settings)
    assert pod["spec"]["securityContext"]["fsGroup"] == 1000
    assert pod["spec"]["containers"][0]["securityContext"] == {"readOnlyRootFilesystem": True}
    owner, job = _job(template={"podSecurityContext": {"runAsUser": 4242},
                                "securityContext": {"readOnlyRootFilesystem": False}})
    pod = pods.build_pod(owner, job, attempt=0, launch=_launch(), settings=settings)
    assert pod["spec"]["securityContext"] == {"runAsUser": 4242}
    assert pod["spec"]["containers"][0]["securityContext"] == {"readOnlyRootFilesystem": False}


def test_kiln_labels_added_to_a_job_after_admission_never_reach_its_pods() -> None:
    owner, job = _job()
    # Admission refuses these; labels and the template's scheduling keys can change later.
    owner["metadata"]["labels"]["kiln.dev/role"] = "profile"
    job = job.model_copy(update={"metadata": job.metadata.model_copy(update={
        "labels": {**job.metadata.labels, "kiln.dev/role": "profile"}})})
    job.spec.template.update(labels={"kiln.dev/job-name": "other", "app": "x"},
                             annotations={"kiln.dev/node": "elsewhere", "note": "y"})
    pod = pods.build_pod(owner, job, attempt=0, launch=_launch(), settings=SETTINGS)
    labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
    assert {k: v for k, v in labels.items() if k.startswith("kiln.dev/")} == {
        "kiln.dev/job-name": "digits", "kiln.dev/attempt": "0"}
    assert labels["app"] == "x" and labels["team"] == "a"
    assert annotations["kiln.dev/node"] == "gpu-1" and annotations["note"] == "y"
    assert not profiling.is_profiling_pod(pod)


def test_a_job_with_s3_sources_gets_the_initializer_and_only_it_the_secret() -> None:
    ref = {"name": "team-s3"}
    owner, job = _job(
        model={"architecture": "char_transformer", "inputShape": [16],
               "pretrained": {"uri": "s3://weights/lm", "secretRef": ref}},
        dataset={"name": "text", "uri": "s3://data/corpus"},
        initializer={"cacheClaim": "kiln-cache"})
    pod = pods.build_pod(owner, job, attempt=0, launch=_launch(), settings=SETTINGS)
    spec = pod["spec"]
    trainer, (init,) = spec["containers"][0], spec["initContainers"]
    assert init["name"] == contract.INITIALIZER_CONTAINER and init["image"] == trainer["image"]
    assert init["command"] == ["python", "-m", contract.INITIALIZER_MODULE]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["kiln-sources"] == {"name": "kiln-sources", "emptyDir": {}}
    assert volumes["kiln-source-cache"]["persistentVolumeClaim"] == {"claimName": "kiln-cache"}
    assert volumes["kiln-secret-0"]["secret"]["secretName"] == "team-s3"
    init_env = {e["name"]: e for e in init["env"]}
    assert init_env["KILN_DATA_CACHE"]["value"] == contract.SOURCE_CACHE_DIR
    assert init_env["KILN_SECRETS_DIR"]["value"] == contract.SECRETS_DIR
    assert init_env["KILN_ZOO_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "zoo-creds"
    assert {m["mountPath"] for m in init["volumeMounts"]} == {
        contract.SOURCES_DIR, contract.SOURCE_CACHE_DIR, f"{contract.SECRETS_DIR}/team-s3"}
    trainer_env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert trainer_env["KILN_SOURCES"] == init_env["KILN_SOURCES"]["value"]
    assert trainer_env["KILN_DATA_CACHE"] == contract.SOURCE_CACHE_DIR
    mounts = {m["name"]: m for m in trainer["volumeMounts"]}
    assert "kiln-secret-0" not in mounts and mounts["kiln-source-cache"]["readOnly"] is True


def test_a_job_reading_only_paths_gets_no_initializer() -> None:
    owner, job = _job(dataset={"name": "imagefolder", "uri": "/data/pets"})
    pod = pods.build_pod(owner, job, attempt=0, launch=_launch(), settings=SETTINGS)
    assert "initContainers" not in pod["spec"]
    assert "KILN_SOURCES" not in {e["name"] for e in pod["spec"]["containers"][0]["env"]}


def test_pod_state_reads_a_failed_init_container_as_the_pods_failure() -> None:
    failure = '{"kind": "error", "message": "spec.dataset.uri: nothing under s3://data/x"}'
    state = pods.pod_state({"metadata": {"name": "p"}, "status": {
        "phase": "Failed",
        "initContainerStatuses": [{"name": contract.INITIALIZER_CONTAINER, "state": {
            "terminated": {"exitCode": 2, "reason": "Error", "message": failure}}}],
        "containerStatuses": [{"name": "trainer", "state": {
            "waiting": {"reason": "PodInitializing"}}}]}})
    assert (state.exit_code, state.container_reason, state.message) == (2, "Error", failure)
