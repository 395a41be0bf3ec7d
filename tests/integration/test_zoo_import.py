"""`kiln zoo import`: weights saved here (safetensors, a Hugging Face directory, a torch state
dict) become zoo records that a fine-tuning `kiln run` warm-starts from; every bad input is one
message naming the file or option, exit 2, and nothing written to the zoo.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from kiln import cli, models
from kiln.api import jobfile
from kiln.zoo import records, store

JOB = """\
apiVersion: kiln.dev/v1alpha1
kind: TrainingJob
metadata: {{name: {name}}}
spec:
  model:
    architecture: small_cnn
    args: {{num_classes: 10, width: {width}}}
    inputShape: [1, 8, 8]
  training: {{epochs: 1, batchSize: 64, seed: 0}}
  target: {{metric: validation_accuracy, value: 0.99}}
"""
ARGS = ["--architecture", "small_cnn", "--args", '{"num_classes": 10, "width": 8}',
        "--input-shape", "1,8,8"]


def _job(tmp_path: Path, name: str = "finetune", width: int = 8) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(JOB.format(name=name, width=width), encoding="utf-8")
    return path


def _state(tmp_path: Path, width: int = 8) -> dict[str, torch.Tensor]:
    """A small_cnn's state dict, as a user would have after training it elsewhere (a plain
    torch loop on standardised digits: the warm-start guard refuses untrained weights)."""
    (job,) = jobfile.load_jobs(_job(tmp_path, "source", width))
    torch.manual_seed(7)
    model = models.build(job.spec.model)
    from sklearn import datasets as sk_datasets  # here: every pytest-xdist worker collects this

    digits = sk_datasets.load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = (images - images.mean()) / images.std()
    labels = torch.tensor(digits.target)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(60):
        batch = slice(64 * step % 1700, 64 * step % 1700 + 64)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(images[batch]), labels[batch]).backward()
        optimizer.step()
    return model.state_dict()


def _save(tmp_path: Path, kind: str, state: dict[str, torch.Tensor]) -> Path:
    if kind == "safetensors":
        path = tmp_path / "cnn.safetensors"
        safetensors.torch.save_file(state, str(path))
    elif kind == "torch":
        path = tmp_path / "cnn.pt"
        torch.save(state, path)
    else:  # a Hugging Face-format directory
        path = tmp_path / "cnn-hf"
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"model_type": "small_cnn"}))
        safetensors.torch.save_file(state, str(path / "model.safetensors"))
    return path


def _import(*argv: str) -> int:
    return cli.main(["zoo", "import", *argv])


@pytest.mark.parametrize("kind", ["safetensors", "torch", "hf-directory"])
def test_imported_weights_are_a_record_with_their_provenance_and_exact_values(
        tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    state = _state(tmp_path)
    path = _save(tmp_path, kind, state)
    assert _import(str(path), *ARGS, "--metric", "validation_accuracy=0.91", "--license", "MIT",
                   "--zoo", str(tmp_path / "zoo")) == cli.EXIT_OK
    zoo = store.DirStore(tmp_path / "zoo")
    (rec,) = records.list_records(zoo)
    assert capsys.readouterr().out.startswith(f"imported {rec.id}: small_cnn")
    assert (rec.architecture, rec.entrypoint, rec.license) == ("small_cnn", None, "MIT")
    assert rec.source == str(path.resolve()) and rec.args == {"num_classes": 10, "width": 8}
    assert (rec.metric_name, rec.metric_value, rec.validation_accuracy) == (
        "validation_accuracy", 0.91, 0.91)
    assert rec.modality == "image" and rec.task == "classification"
    statistics = ("running_mean", "running_var", "num_batches_tracked")  # buffers, not params
    assert rec.num_params == sum(v.numel() for k, v in state.items()
                                 if not k.endswith(statistics))
    stored = records.load_weights(zoo, records.verify_record(zoo, rec.id))
    assert stored.keys() == state.keys()
    assert all(torch.equal(stored[k], state[k]) for k in state)


def test_a_fine_tuning_run_warm_starts_from_the_imported_weights(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = _save(tmp_path, "safetensors", _state(tmp_path))
    assert _import(str(path), "--job", str(_job(tmp_path, "pretrained")), "--metric",
                   "validation_accuracy=0.97", "--source", "https://example.org/cnn",
                   "--zoo", "zoo") == cli.EXIT_OK
    (imported,) = records.list_records(store.DirStore(tmp_path / "zoo"))
    assert imported.source == "https://example.org/cnn" and imported.job_name == ""
    capsys.readouterr()
    assert cli.main(["run", str(_job(tmp_path)), "--zoo", "zoo"]) == cli.EXIT_OK
    out = " ".join(capsys.readouterr().out.split())
    tuned = next(r for r in records.list_records(store.DirStore(tmp_path / "zoo"))
                 if r.job_name == "finetune")
    assert tuned.parent == imported.id and tuned.similarity == 1.0
    assert f"Warm start from {imported.id} (similarity 1.00): guard: step-0 probe loss" in out, out


def test_import_adds_or_drops_a_wrapper_prefix_and_accepts_a_tied_key(tmp_path: Path) -> None:
    state = {f"net.{k}": v for k, v in _state(tmp_path).items()}  # saved from a wrapper
    path = _save(tmp_path, "safetensors", state)
    assert _import(str(path), *ARGS, "--metric", "validation_loss=0.3",
                   "--zoo", str(tmp_path / "zoo")) == cli.EXIT_OK
    (rec,) = records.list_records(store.DirStore(tmp_path / "zoo"))
    assert rec.validation_loss == 0.3 and rec.validation_accuracy is None


@pytest.mark.parametrize(
    ("make", "argv", "message"),
    [
        pytest.param(lambda t: t / "nope.safetensors", [], "nope.safetensors: no such file",
                     id="missing-file"),
        pytest.param(lambda t: _text(t / "weights.txt", "hello"), [],
                     "not a format Kiln imports; give a .safetensors file", id="wrong-format"),
        pytest.param(lambda t: _text(t / "bad.safetensors", "not really"), [],
                     "bad.safetensors: not a readable safetensors file", id="damaged"),
        pytest.param(lambda t: _pickled(t / "object.pt"), [],
                     "not a torch state dict that loads with weights_only=True", id="pickle"),
        pytest.param(lambda t: _hf_without_config(t), [],
                     "needs config.json and model.safetensors; config.json missing",
                     id="hf-no-config"),
        pytest.param(lambda t: _save(t, "safetensors", _state(t, width=4)), [],
                     "tensors have other shapes than the model's", id="wrong-width"),
        pytest.param(lambda t: _save(t, "safetensors", {"head.weight": torch.zeros(2)}), [],
                     "the weights do not fit the model: keys", id="keys"),
        pytest.param(lambda t: _save(t, "safetensors", _state(t)), ["--metric", "0.9"],
                     "--metric '0.9': expected NAME=VALUE", id="metric-without-equals"),
        pytest.param(lambda t: _save(t, "safetensors", _state(t)),
                     ["--metric", "accuracy=0.9"], "unknown metric 'accuracy'", id="metric-name"),
        pytest.param(lambda t: _save(t, "safetensors", _state(t)),
                     ["--metric", "validation_accuracy=91"], "write 0.91, not 91",
                     id="metric-percent"),
        pytest.param(lambda t: _save(t, "safetensors", {
            k: v.fill_(float("nan")) if k == "head.2.bias" else v for k, v in _state(t).items()}),
                     [], "1 tensors hold NaN or infinite values (head.2.bias)", id="nan-weights"),
        pytest.param(lambda t: _save(t, "safetensors", _state(t)),
                     ["--metric", "validation_loss=-2"], "a loss is a cross-entropy, at least 0",
                     id="metric-negative-loss"),
    ],
)
def test_bad_imports_say_what_is_wrong_and_write_nothing(
        tmp_path: Path, make: Callable[[Path], Path], argv: list[str], message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = make(tmp_path)
    metric = [] if argv else ["--metric", "validation_accuracy=0.9"]
    assert _import(str(path), *ARGS, *metric, *argv,
                   "--zoo", str(tmp_path / "zoo")) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert "error:" in err and message in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "zoo").exists() or not list((tmp_path / "zoo").rglob("*.json"))


def test_mismatched_keys_are_listed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = _state(tmp_path)
    state["extra.weight"] = torch.zeros(3)
    del state[next(iter(state))]
    path = _save(tmp_path, "safetensors", state)
    assert _import(str(path), *ARGS, "--metric", "validation_accuracy=0.9",
                   "--zoo", str(tmp_path / "zoo")) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert "1 missing (" in err and "1 unexpected (extra.weight)" in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--input-shape", "1,8,8"], "give the model: --entrypoint", id="no-model"),
        pytest.param(["--architecture", "small_cnn"], "--input-shape: required", id="no-shape"),
        pytest.param(["--architecture", "small_cnn", "--input-shape", "1,8,8", "--args", "[1]"],
                     "expected a JSON object", id="args-list"),
        pytest.param(["--entrypoint", "no_such_module_here:build", "--input-shape", "4"],
                     "spec.model.entrypoint: cannot import 'no_such_module_here'", id="module"),
    ],
)
def test_bad_model_options_name_the_option(tmp_path: Path, argv: list[str], message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = _save(tmp_path, "safetensors", _state(tmp_path))
    assert _import(str(path), *argv, "--metric", "validation_accuracy=0.9",
                   "--zoo", str(tmp_path / "zoo")) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert message in err, err


def _text(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def _pickled(path: Path) -> Path:
    torch.save({"model": object()}, path)  # an arbitrary object: weights_only refuses it
    return path


def _hf_without_config(tmp_path: Path) -> Path:
    path = _save(tmp_path, "hf-directory", _state(tmp_path))
    (path / "config.json").unlink()
    return path


@pytest.mark.parametrize("dataset", ["two\nlines", "", "bell\x07"])
def test_an_import_dataset_name_is_one_printable_line(
        tmp_path: Path, dataset: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`kiln zoo ls` prints it in a table column: a newline split the row in two."""
    path = _save(tmp_path, "safetensors", _state(tmp_path))
    with pytest.raises(SystemExit) as exited:
        _import(str(path), *ARGS, "--metric", "validation_accuracy=0.9", "--dataset", dataset,
                "--zoo", str(tmp_path / "zoo"))
    assert exited.value.code == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert "argument --dataset:" in err and "on one line, without control characters" in err
    assert not (tmp_path / "zoo").exists()
