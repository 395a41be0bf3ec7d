"""`kiln validate`, `kiln zoo` and `kiln run` argument checks: every bad input is one clear
message naming the field or file, a non-zero exit, and no traceback."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kiln import cli

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
    examples = sorted(Path(__file__).resolve().parents[2].glob("examples/*.yaml"))
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
