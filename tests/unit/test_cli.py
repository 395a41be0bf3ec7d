"""`kiln validate`, `kiln zoo` and `kiln run` argument checks: every bad input is one clear
message naming the field or file, a non-zero exit, and no traceback."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kiln import cli
from kiln.local import machine, runner

VALID = """\
apiVersion: kiln.dev/v1alpha1
kind: TrainingJob
metadata: {name: digits-small}
spec:
  model: {architecture: small_cnn, args: {num_classes: 10}, inputShape: [1, 8, 8]}
  training: {epochs: 2, batchSize: 32}
"""


def _write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_validate_accepts_every_example(capsys: pytest.CaptureFixture[str]) -> None:
    examples = sorted(Path(__file__).resolve().parents[2].glob("examples/**/*.yaml"))
    assert examples, "examples/ must hold job files"
    assert cli.main(["validate", *map(str, examples)]) == cli.EXIT_OK
    assert capsys.readouterr().out.count("valid") == len(examples)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        pytest.param(("epochs: 2", "epoch: 2"), "spec.training.epoch: unknown field; did you mean "
                     "'epochs'", id="unknown-field-did-you-mean"),
        pytest.param(("kiln.dev/v1alpha1", "kiln.dev/v1"), "apiVersion: must be kiln.dev/v1alpha1",
                     id="wrong-api-version"),
        pytest.param(("kind: TrainingJob", "kind: PyTorchJob"), "kind: must be TrainingJob",
                     id="wrong-kind"),
        pytest.param(("name: digits-small", "name: Digits_Small"), "metadata.name: must be a "
                     "DNS-1123 label", id="invalid-name"),
        pytest.param(("small_cnn", "resnet181"), "spec.model.architecture: unknown architecture "
                     "'resnet181'", id="unknown-architecture"),
        pytest.param(("batchSize: 32", "batchSize: 32, optimizer: {name: sgdm}"),
                     "spec.training.optimizer.name", id="unknown-optimizer"),
        pytest.param(("batchSize: 32", "batchSize: 0"), "spec.training.batchSize", id="zero-batch"),
        pytest.param(("epochs: 2", "epochs: -1"), "spec.training.epochs", id="negative-epochs"),
        pytest.param(("batchSize: 32", "batchSize: 32, optimizer: {lr: 0}"),
                     "spec.training.optimizer.lr", id="zero-lr"),
        pytest.param(("epochs: 2", "epochs: two"), "spec.training.epochs", id="wrong-type"),
        pytest.param(("inputShape: [1, 8, 8]", "inputShape: [64]"), "spec.model.inputShape",
                     id="shape-does-not-fit-dataset"),
        pytest.param(("training:", "dataset: {name: mnist}\n  training:"), "spec.dataset.name",
                     id="unknown-dataset"),
        pytest.param(("training:", ("template: {volumes: [{name: data, emptyDir: {}}], "
                                    "volumeMounts: [{name: dataset, mountPath: /data}]}\n"
                                    "  training:")),
                     "spec.template.volumeMounts[0].name: 'dataset' names no volume in "
                     "spec.template.volumes (volumes: data)", id="mount-of-no-volume"),
        pytest.param(("training:", "template: {env: [{name: KILN_ZOO, value: /z}]}\n  training:"),
                     "spec.template.env[0].name: KILN_ZOO is reserved", id="reserved-env"),
        pytest.param(("training:", ("dataset: {name: digits, entrypoint: 'my.data:load'}\n"
                                    "  training:")),
                     "spec.dataset: set name (a built-in loader) or entrypoint",
                     id="dataset-name-and-entrypoint"),
    ],
)
def test_validate_rejects_bad_input_with_a_message_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: tuple[str, str], expected: str
) -> None:
    path = _write(tmp_path, VALID.replace(*edit))
    assert cli.main(["validate", str(path)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert expected in " ".join(err.split()), err
    assert "Traceback" not in err


def test_validate_reports_unreadable_yaml_with_line(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "apiVersion: kiln.dev/v1alpha1\nkind: [TrainingJob\n")
    assert cli.main(["validate", str(path)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "not valid YAML" in err and "line" in err and str(path) in " ".join(err.split())


def test_validate_reports_a_missing_file(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["validate", str(tmp_path / "nope.yaml")]) == cli.EXIT_USAGE
    assert "cannot read the file" in capsys.readouterr().err


def test_validate_rejects_two_jobs_with_one_name(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, VALID + "---\n" + VALID)
    assert cli.main(["validate", str(path)]) == cli.EXIT_USAGE
    assert "repeated" in capsys.readouterr().err


def test_validate_names_unknown_keys_and_a_bad_toleration_at_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, VALID + """\
  traning: {epochs: 3}
  template:
    nodeAfinity: {}
    affinity: {nodeAfinity: {}}
    tolerations: [{key: gpu, operator: Exists, effect: NoSchedle, efect: NoSchedule}]
""")
    assert cli.main(["validate", str(path)]) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    expected = [
        "spec.traning: unknown field; did you mean 'training'?",
        ("spec.template.nodeAfinity: not a pod setting Kiln passes through; did you mean "
         "'affinity'?"),
        ("spec.template.affinity.nodeAfinity: unknown field of a Kubernetes Affinity; did you "
         "mean 'nodeAffinity'?"),
        ("spec.template.tolerations[0].effect: must be one of NoSchedule, PreferNoSchedule, "
         "NoExecute"),
        ("spec.template.tolerations[0].efect: unknown field of a Kubernetes Toleration; did you "
         "mean 'effect'?"),
    ]
    assert [e for e in expected if e not in err] == [], err


def test_run_rejects_a_missing_data_path_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = VALID.replace("training:", f"dataset: {{name: imagefolder, path: {tmp_path}/none}}\n"
                         "  training:")
    path = _write(tmp_path, text)
    assert cli.main(["run", str(path), "--zoo", str(tmp_path / "zoo")]) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert "spec.dataset.path" in err and "does not exist" in err


def test_zoo_show_names_an_unknown_model(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["zoo", "show", "nope-123", "--zoo", str(tmp_path)]) == cli.EXIT_USAGE
    assert "no zoo model 'nope-123'" in capsys.readouterr().err


def test_zoo_rm_names_an_unknown_model(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["zoo", "rm", "nope-123", "--zoo", str(tmp_path)]) == cli.EXIT_USAGE
    assert "nope-123" in capsys.readouterr().err


def test_unknown_flag_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "--epochs", "3"])
    assert exc.value.code == 2


def test_run_refuses_zero_slots(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "a.yaml", "b.yaml", "--slots", "0"])
    assert exc.value.code == cli.EXIT_USAGE
    assert "must be >= 1" in capsys.readouterr().err


def test_run_refuses_jobs_that_fit_no_plan_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fits = _write(tmp_path, VALID, "a.yaml")
    too_big = _write(tmp_path, VALID.replace("digits-small", "big") + "  resources: {gpus: 4}\n",
                     "b.yaml")
    args = ["run", str(fits), str(too_big), "--slots", "2", "--zoo", str(tmp_path / "zoo")]
    assert cli.main(args) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert "job big" in err and "(--slots)" in err and "Traceback" not in err


# ----------------------------------------------------------------------------------------------
# text from users and records is never read as rich markup


def _record(zoo_dir: Path, record_id: str = "small_cnn-0badc0de", **changes: object) -> None:
    """Write a small valid record into the directory zoo at `zoo_dir`."""
    import torch

    from kiln.zoo import records, store

    fields: dict[str, object] = {
        "id": record_id, "architecture": "small_cnn", "args": {}, "input_shape": (1, 8, 8),
        "modality": "image", "task": "classification", "dataset": "digits",
        "metric_name": "validation_accuracy", "metric_value": 0.9, "num_params": 10,
        "created_time": "2025-01-01T00:00:00Z", "job_name": "j", "job_spec": {}}
    fields.update(changes)
    record = records.ZooRecord(**fields)  # type: ignore[arg-type]
    records.write_record(store.DirStore(zoo_dir), record, {"w": torch.zeros(2)}, {})


def test_a_bad_zoo_uri_message_with_brackets_is_printed_as_text(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["zoo", "ls", "--zoo", "http://x"]) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert "--zoo http://x:" in err and "s3://bucket[/prefix]" in err
    assert "Traceback" not in err


def test_zoo_ls_prints_record_text_with_markup_characters_verbatim(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _record(tmp_path, dataset="[/]")
    _record(tmp_path, "small_cnn-00000bad", dataset="[red]x")
    assert cli.main(["zoo", "ls", "--zoo", str(tmp_path)]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "[/]" in out and "[red]x" in out


def test_zoo_ls_marks_a_provisional_record(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    _record(tmp_path, provisional=True, metric_value=0.212)
    _record(tmp_path, "small_cnn-00000f1e", metric_value=0.9)
    assert cli.main(["zoo", "ls", "--zoo", str(tmp_path)]) == cli.EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert any("0.212" in ln and "(provisional)" in ln for ln in lines), lines
    assert not any("0.9" in ln and "(provisional)" in ln for ln in lines), lines


def test_a_skipped_record_warning_with_markup_characters_is_printed_verbatim(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    _record(tmp_path)
    meta = tmp_path / "models" / "small_cnn-0badc0de" / "meta.json"
    meta.write_text(json.dumps(json.loads(meta.read_text()) | {"created_time": "[/]"}))
    assert cli.main(["zoo", "ls", "--zoo", str(tmp_path)]) == cli.EXIT_OK
    err = " ".join(capsys.readouterr().err.split())
    assert "warning: zoo record small_cnn-0badc0de" in err and "('[/]')" in err


# ----------------------------------------------------------------------------------------------
# zoo ids, partial records, a zoo that is a file


@pytest.mark.parametrize("action", ["show", "rm"])
@pytest.mark.parametrize("bad", ["../../x", "", "ok-1/../../x", "a b"])
def test_zoo_show_and_rm_refuse_an_invalid_id_with_one_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], action: str, bad: str
) -> None:
    assert cli.main(["zoo", action, bad, "--zoo", str(tmp_path)]) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert f"invalid zoo model id {bad!r}" in err and "kiln zoo ls" in err
    assert "Traceback" not in err


def test_zoo_rm_removes_a_half_written_record_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _record(tmp_path)
    (tmp_path / "models" / "small_cnn-0badc0de" / "meta.json").unlink()
    assert cli.main(["zoo", "rm", "small_cnn-0badc0de", "--zoo", str(tmp_path)]) == cli.EXIT_OK
    assert "removed partial record small_cnn-0badc0de" in capsys.readouterr().out
    assert not list((tmp_path / "models").rglob("*.*"))
    assert cli.main(["zoo", "ls", "--zoo", str(tmp_path)]) == cli.EXIT_OK
    assert "warning" not in capsys.readouterr().err


def test_zoo_rm_refuses_a_base_that_kept_adapters_use_and_names_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = "small_cnn-0badc0de"
    _record(tmp_path, base)
    lora = {"method": "lora", "rank": 2}
    for adapter in ("small_cnn-0000ada1", "small_cnn-0000ada2"):
        _record(tmp_path, adapter, base=base, adapter=lora, parent=base)
    _record(tmp_path, "small_cnn-00000123")  # another model: a typo's neighbour
    metas = sorted((tmp_path / "models").rglob("meta.json"))
    assert cli.main(["zoo", "rm", "small_cnn-00000123", base, "--zoo", str(tmp_path)]) \
        == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert (f"{base} by small_cnn-0000ada1, small_cnn-0000ada2" in err
            and f"kiln zoo rm small_cnn-0000ada1 small_cnn-0000ada2 {base}" in err
            and "--force" in err), err
    assert sorted((tmp_path / "models").rglob("meta.json")) == metas  # nothing deleted
    # deleting one adapter with the base is still refused: the other one needs it
    assert cli.main(["zoo", "rm", "small_cnn-0000ada1", base, "--zoo", str(tmp_path)]) \
        == cli.EXIT_USAGE
    assert "by small_cnn-0000ada2;" in " ".join(capsys.readouterr().err.split())
    # the adapters with their base, as the message says: all three go
    assert cli.main(["zoo", "rm", "small_cnn-0000ada1", "small_cnn-0000ada2", base,
                     "--zoo", str(tmp_path)]) == cli.EXIT_OK
    assert sorted(p.parent.name for p in (tmp_path / "models").rglob("meta.json")) == [
        "small_cnn-00000123"]


def test_zoo_rm_force_deletes_a_base_and_keeps_its_adapters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = "small_cnn-0badc0de"
    _record(tmp_path, base)
    _record(tmp_path, "small_cnn-0000ada1", base=base, adapter={"method": "lora"}, parent=base)
    assert cli.main(["zoo", "rm", base, "--force", "--zoo", str(tmp_path)]) == cli.EXIT_OK
    assert f"deleted {base}" in capsys.readouterr().out
    assert [p.parent.name for p in (tmp_path / "models").rglob("meta.json")] == [
        "small_cnn-0000ada1"]


@pytest.mark.parametrize("command", [["zoo", "ls"], ["run", "JOB"]], ids=["zoo-ls", "run"])
@pytest.mark.parametrize("below", ["", "/zoo"], ids=["file", "under-file"])
def test_a_zoo_that_is_a_file_fails_fast_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    command: list[str], below: str,
) -> None:
    monkeypatch.setattr(runner, "run_jobs", _no_training)
    (tmp_path / "afile").write_text("x", encoding="utf-8")
    job = _write(tmp_path, VALID)
    argv = [str(job) if a == "JOB" else a for a in command]
    assert cli.main([*argv, "--zoo", str(tmp_path / "afile") + below]) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert f"--zoo {tmp_path / 'afile'}{below}: " in err
    assert "afile is a file, not a directory" in err


def _no_training(*_: object, **__: object) -> None:
    raise AssertionError("training must not start")


# ----------------------------------------------------------------------------------------------
# kiln run checks before training


def test_run_refuses_a_pinned_parent_missing_from_the_zoo_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "run_jobs", _no_training)
    path = _write(tmp_path, VALID + "  warmStart: {parent: small_cnn-12345678}\n")
    assert cli.main(["run", str(path), "--zoo", str(tmp_path / "zoo")]) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert "digits-small: spec.warmStart.parent: no usable zoo model 'small_cnn-12345678'" in err
    assert "kiln zoo ls" in err


def test_run_accepts_a_pinned_parent_that_is_in_the_zoo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "run_jobs", lambda *_, **__: [])
    _record(tmp_path / "zoo")
    path = _write(tmp_path, VALID + "  warmStart: {parent: small_cnn-0badc0de}\n")
    assert cli.main(["run", str(path), "--zoo", str(tmp_path / "zoo")]) == cli.EXIT_OK


def test_run_refuses_a_job_another_run_in_this_directory_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner, "_run_one", _no_training)
    path = _write(tmp_path, VALID)
    runs = tmp_path / ".kiln" / "runs"
    runs.mkdir(parents=True)
    with runner.lock(runs / "digits-small.lock", "digits-small"):
        assert cli.main(["run", str(path), "--zoo", "zoo"]) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert f"job digits-small is already running (pid {os.getpid()})" in err


def test_run_refuses_more_cpu_slots_than_cores_even_for_one_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(machine.profile, "device_type", lambda device="auto": "cpu")
    monkeypatch.setattr(cli.runner, "run_jobs", _no_training)
    job = _write(tmp_path, VALID)
    args = ["run", str(job), "--slots", "3", "--zoo", str(tmp_path / "zoo")]
    assert cli.main(args) == cli.EXIT_USAGE
    assert "--slots 3: this machine has 2 CPU cores" in " ".join(capsys.readouterr().err.split())


def test_validate_says_which_files_are_valid_when_another_is_not(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(tmp_path, VALID, "good.yaml")
    bad = _write(tmp_path, VALID.replace("digits-small", "Bad_Name"), "bad.yaml")
    assert cli.main(["validate", str(bad), str(good)]) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert "valid: digits-small" in out
    assert "bad.yaml" in err and "metadata.name" in err


def test_validate_names_schema_cross_field_and_registry_problems_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (VALID.replace("small_cnn", "resnet181")
            .replace("batchSize: 32", "batchSize: 32, optimizer: {lr: -1}")
            .replace("training:", "dataset: {name: digits, path: /data}\n  training:"))
    path = _write(tmp_path, text)
    assert cli.main(["validate", str(path)]) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert "spec.training.optimizer.lr:" in err  # the schema's
    assert "spec.dataset.path: digits is bundled with scikit-learn" in err  # a cross-field rule
    assert "spec.model.architecture: unknown architecture 'resnet181'" in err  # the registry's


def test_validate_skips_only_the_checks_that_read_a_rejected_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # inputShape is rejected, so the model is not judged against the digits images on a
    # stand-in shape; `epoch` (meant as epochs) leaves epochs defaulted, so the warmup rule,
    # which reads epochs, is left out; the resources rule reads neither and is reported.
    text = (VALID.replace("inputShape: [1, 8, 8]", "inputShape: [1, 0, 8]")
            .replace("epochs: 2", "epoch: 2, lrSchedule: {warmupEpochs: 50}")
            .replace("training:", "resources: {gpus: 3, parallelism: single}\n  training:"))
    path = _write(tmp_path, text)
    assert cli.main(["validate", str(path)]) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert "spec.model.inputShape[1]" in err and "spec.training.epoch: unknown field" in err
    assert "spec.resources.parallelism: single trains one process" in err
    assert "warmupEpochs" not in err
    assert err.count("spec.model.inputShape") == 1, err


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_namespace_that_is_not_an_rfc_1123_label_is_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    path = _write(tmp_path, VALID.replace("{name: digits-small}",
                                          "{name: digits-small, namespace: ../../etc}"))
    extra = ["--zoo", str(tmp_path / "zoo")] if command == "run" else []
    assert cli.main([command, str(path), *extra]) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert "metadata.namespace: must be an RFC 1123 label" in err and "Traceback" not in err
    assert not (tmp_path / "zoo").exists() or not any((tmp_path / "zoo").rglob("*etc*"))


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        pytest.param(("name: digits-small", "name: r\u0435snet"),
                     "metadata.name: 'r\u0435snet' has a non-ASCII character '\u0435' (U+0435) "
                     "at position 2", id="name"),
        pytest.param(("small_cnn", "small_\u0441nn"),
                     "spec.model.architecture: 'small_\u0441nn' has a non-ASCII character "
                     "'\u0441' (U+0441) at position 7", id="architecture"),
    ],
)
def test_a_non_ascii_look_alike_is_named_with_its_code_point_and_position(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: tuple[str, str], expected: str
) -> None:
    path = _write(tmp_path, VALID.replace(*edit))
    assert cli.main(["validate", str(path)]) == cli.EXIT_USAGE
    assert expected in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("labels", [
    "template: {labels: {kiln.dev/role: profile}}",
    "template: {annotations: {kiln.dev/node: other-node}}",
])
def test_validate_refuses_kiln_labels_in_the_template_that_would_make_the_trainer_a_profiler(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], labels: str
) -> None:
    path = _write(tmp_path, VALID.replace("training:", f"{labels}\n  training:"))
    assert cli.main(["validate", str(path)]) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    key = "labels.kiln.dev/role" if "labels" in labels else "annotations.kiln.dev/node"
    assert f"spec.template.{key}: kiln.dev/* " in err and "remove it" in err


@pytest.mark.parametrize("resource", [
    "nvidia.com/mig-1g.10gb", "nvidia.com/gpu.shared", "gpu.intel.com/i915", "amd.com/gpu",
    "habana.ai/gaudi", "aws.amazon.com/neuroncore", "google.com/tpu", "example.com/gpu"])
@pytest.mark.parametrize("where", ["limits", "requests", "init"])
def test_validate_refuses_accelerators_under_any_name_outside_the_planners_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], resource: str, where: str
) -> None:
    amounts = f"{{{where if where != 'init' else 'limits'}: {{cpu: '1', {resource}: 1}}}}"
    template = (f"{{resources: {amounts}}}" if where != "init" else
                f"{{initContainers: [{{name: fetch, image: busybox, resources: {amounts}}}]}}")
    path = _write(tmp_path, VALID.replace("training:", f"template: {template}\n  training:"))
    assert cli.main(["validate", str(path)]) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    field = ("spec.template.initContainers[0].resources.limits" if where == "init"
             else f"spec.template.resources.{where}")
    assert f"{field}: {resource} is an accelerator" in err
    assert "set spec.resources.gpus" in err
