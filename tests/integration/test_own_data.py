"""Bring your own data to `kiln run`: a dataset entrypoint, imagefolder and text from an S3
server (moto over HTTP) cached on local disk, and a job's own command run with Kiln's
environment. Bad data fails the job permanently with the user's file and line.

Subprocesses get OMP_NUM_THREADS=1: tiny models train fastest on one thread on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import clirun
import minio
import pytest
import yaml

from kiln import api, contract
from kiln.zoo import records, store
from kiln_trainer import data

REPO = Path(__file__).resolve().parents[2]
SHAPES = REPO / "tests" / "data" / "shapes"
CORPUS = REPO / "tests" / "data" / "corpus"
OWN_MODEL = REPO / "examples" / "own-model"
DEADLINE_SECONDS = 240.0


def _kiln(*args: str, cwd: Path, **env: str) -> clirun.Done:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    environ.pop("KILN_ZOO", None)
    return clirun.kiln(*args, cwd=cwd, env=environ)


def _job_file(path: Path, name: str, spec: dict[str, Any]) -> Path:
    doc = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name},
           "spec": spec}
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def _upload(s3: Any, bucket: str, prefix: str, folder: Path) -> minio.Minio:
    client = minio.Minio(s3.endpoint, access_key=s3.access_key, secret_key=s3.secret_key,
                         secure=False)
    if not client.bucket_exists(bucket):
        client.make_bucket(bucket)
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        client.fput_object(bucket, f"{prefix}/{file.relative_to(folder).as_posix()}", str(file))
    return client


def _s3_env(s3: Any, cache: Path) -> dict[str, str]:
    return {contract.Env.ZOO_ENDPOINT: s3.endpoint, contract.Env.ZOO_ACCESS_KEY: s3.access_key,
            contract.Env.ZOO_SECRET_KEY: s3.secret_key, contract.Env.DATA_CACHE: str(cache)}


# ----------------------------------------------------------------------------------------------
# s3:// data


def test_imagefolder_from_s3_is_fetched_once_and_read_like_a_folder(
    s3_server: Any, s3_bucket: str, tmp_path: Path
) -> None:
    _upload(s3_server, s3_bucket, "shapes", SHAPES)
    env = _s3_env(s3_server, tmp_path / "cache")
    spec = api.DatasetSpec(name=api.DatasetName.IMAGEFOLDER, path=f"s3://{s3_bucket}/shapes/train",
                           validation_path=f"s3://{s3_bucket}/shapes/validation")
    splits = data.load(spec, input_shape=[1, 12, 12], seed=0, environ=env)
    assert (len(splits.train), len(splits.validation)) == (15, 6)  # type: ignore[arg-type]
    assert splits.num_classes == 3
    entries = sorted((tmp_path / "cache").iterdir())
    assert len(entries) == 2 and not [e for e in entries if e.name.startswith(".")]
    train = Path(data.fetch(str(spec.path), field="spec.dataset.path", environ=env).path)
    assert sorted(p.name for p in train.iterdir()) == ["circle", "cross", "square"]
    inode = train.stat().st_ino
    again = data.load(spec, input_shape=[1, 12, 12], seed=0, environ=env)  # from the cache
    assert train.stat().st_ino == inode and len(list((tmp_path / "cache").iterdir())) == 2
    # Fingerprinted by the listing's ETags and sizes: the same objects under another prefix
    # are the same data.
    assert again.fingerprint == splits.fingerprint and str(splits.fingerprint).startswith(
        "content:sha256:")
    _upload(s3_server, s3_bucket, "copy", SHAPES)
    copy = spec.model_copy(update={"path": f"s3://{s3_bucket}/copy/train",
                                   "validation_path": f"s3://{s3_bucket}/copy/validation"})
    assert data.load(copy, input_shape=[1, 12, 12], seed=0,
                     environ=env).fingerprint == splits.fingerprint


def test_a_changed_object_is_fetched_again(s3_server: Any, s3_bucket: str, tmp_path: Path
                                           ) -> None:
    client = _upload(s3_server, s3_bucket, "corpus", CORPUS)
    env = _s3_env(s3_server, tmp_path / "cache")
    uri = f"s3://{s3_bucket}/corpus/kilns.txt"  # one object: the local path is a file
    before = data.fetch(uri, field="spec.dataset.path", environ=env)
    first = Path(before.path)
    assert first.is_file() and first.read_bytes() == (CORPUS / "kilns.txt").read_bytes()
    client.fput_object(s3_bucket, "corpus/kilns.txt", str(CORPUS / "firing.txt"))
    after = data.fetch(uri, field="spec.dataset.path", environ=env)
    second = Path(after.path)
    assert second != first and second.read_bytes() == (CORPUS / "firing.txt").read_bytes()
    assert after.fingerprint != before.fingerprint  # changed in place: other data
    spec = api.DatasetSpec(name=api.DatasetName.TEXT, path=f"s3://{s3_bucket}/corpus")
    splits = data.load(spec, input_shape=[31], seed=0, environ=env)
    assert len(splits.train) + len(splits.validation) == (852 + 1 + 852) // 32  # type: ignore[arg-type]


def test_a_failed_download_leaves_no_partial_dataset(
    s3_server: Any, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _upload(s3_server, s3_bucket, "shapes", SHAPES)
    env = _s3_env(s3_server, tmp_path / "cache")
    real = minio.Minio.fget_object
    calls: list[str] = []

    def fail_on_the_third(self: minio.Minio, bucket: str, name: str, path: str,
                          *args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        if len(calls) == 3:
            raise ConnectionResetError("connection reset by peer")
        return real(self, bucket, name, path, *args, **kwargs)

    monkeypatch.setattr(minio.Minio, "fget_object", fail_on_the_third)
    with pytest.raises(store.StoreUnavailable, match="connection reset"):
        data.fetch(f"s3://{s3_bucket}/shapes/train", field="spec.dataset.path", environ=env)
    assert list((tmp_path / "cache").iterdir()) == []  # neither an entry nor a .partial folder
    monkeypatch.setattr(minio.Minio, "fget_object", real)
    done = Path(data.fetch(f"s3://{s3_bucket}/shapes/train", field="spec.dataset.path",
                           environ=env).path)
    assert sum(1 for p in done.rglob("*.png")) == 15


@pytest.mark.parametrize(("uri", "env_changes", "expected"), [
    pytest.param("s3://{bucket}/nothing-here", {}, "spec.dataset.path: nothing under "
                 "s3://{bucket}/nothing-here", id="empty-prefix"),
    pytest.param("s3://no-such-bucket-{bucket}/x", {}, "spec.dataset.path: cannot read "
                 "s3://no-such-bucket-{bucket}/x (NoSuchBucket", id="no-bucket"),
    pytest.param("s3://{bucket}/shapes", {contract.Env.ZOO_ENDPOINT: ""}, "needs the S3 "
                 "server address; set KILN_ZOO_ENDPOINT", id="no-endpoint"),
    pytest.param("s3://{bucket}/shapes", {contract.Env.ZOO_SECRET_KEY: ""},
                 "KILN_ZOO_SECRET_KEY is not set", id="half-credentials"),
])
def test_s3_problems_name_the_field_and_the_fix(
    s3_server: Any, s3_bucket: str, tmp_path: Path, uri: str, env_changes: dict[str, str],
    expected: str,
) -> None:
    _upload(s3_server, s3_bucket, "shapes", SHAPES / "validation")
    env = {**_s3_env(s3_server, tmp_path / "cache"), **env_changes}
    with pytest.raises(data.DatasetError) as caught:
        data.fetch(uri.format(bucket=s3_bucket), field="spec.dataset.path", environ=env)
    assert expected.format(bucket=s3_bucket) in str(caught.value)


def test_kiln_run_trains_on_images_from_s3(s3_server: Any, s3_bucket: str, tmp_path: Path
                                          ) -> None:
    _upload(s3_server, s3_bucket, "shapes", SHAPES)
    job = _job_file(tmp_path / "job.yaml", "shapes-s3", {
        "model": {"architecture": "small_cnn", "args": {"depth": 2, "width": 8,
                                                        "num_classes": 3},
                  "inputShape": [1, 12, 12]},
        "dataset": {"name": "imagefolder", "path": f"s3://{s3_bucket}/shapes/train",
                    "validationPath": f"s3://{s3_bucket}/shapes/validation"},
        "training": {"epochs": 2, "batchSize": 5}, "freezing": {"enabled": False}})
    done = _kiln("run", str(job), "--zoo", "zoo", cwd=tmp_path,
                 **_s3_env(s3_server, tmp_path / "cache"))
    assert done.returncode == 0, done.stderr
    (record,) = records.list_records(store.DirStore(tmp_path / "zoo"))
    assert record.dataset == "imagefolder" and record.job_name == "shapes-s3"
    assert len(list((tmp_path / "cache").iterdir())) == 2


# ----------------------------------------------------------------------------------------------
# a dataset entrypoint


def test_kiln_run_trains_the_example_on_its_own_dataset_entrypoint(tmp_path: Path) -> None:
    doc = yaml.safe_load((OWN_MODEL / "shapes-mixer.yaml").read_text(encoding="utf-8"))
    assert doc["spec"]["dataset"]["entrypoint"] == "data_shapes:shapes"
    doc["spec"]["training"]["epochs"] = 1
    doc["spec"]["dataset"]["args"] |= {"samples": 200, "validation": 50}
    job = tmp_path / "shapes-mixer.yaml"  # outside the example folder: PYTHONPATH finds it
    job.write_text(yaml.safe_dump(doc), encoding="utf-8")
    done = _kiln("run", str(job), "--zoo", "zoo", cwd=tmp_path, PYTHONPATH=str(OWN_MODEL))
    assert done.returncode == 0, done.stderr
    assert "on data_shapes:shapes" in done.stdout
    (record,) = records.list_records(store.DirStore(tmp_path / "zoo"))
    assert record.dataset == "data_shapes:shapes"


BAD_DATA = '''\
import torch
from torch.utils.data import TensorDataset


def shifted_labels():
    x = torch.randn(40, 1, 8, 8)
    y = torch.arange(40) % 3 + 8  # classes 8, 9 and 10: one too many for 10 outputs
    return TensorDataset(x[:30], y[:30]), TensorDataset(x[30:], y[30:])


def from_disk(root):
    with open(root + "/index.json") as index:  # the user's bug: the file is not there
        return index
'''


def test_kiln_run_fails_bad_data_at_once_with_the_users_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "bad_data.py").write_text(BAD_DATA, encoding="utf-8")
    model = {"architecture": "small_cnn", "args": {"depth": 2, "width": 8},
             "inputShape": [1, 8, 8]}
    labels = _job_file(tmp_path / "labels.yaml", "bad-labels", {
        "model": model, "dataset": {"entrypoint": "bad_data:shifted_labels"},
        "training": {"epochs": 1, "batchSize": 10}})
    done = _kiln("run", str(labels), "--zoo", "zoo", cwd=tmp_path)
    err = " ".join(done.stderr.split())
    assert done.returncode == 1, err
    assert "bad-labels: trainer exited with code 2" in err
    assert ("spec.dataset.entrypoint: a target among the first samples is 10, out of range for "
            "the model's 10 outputs") in err
    assert "Traceback" not in err

    disk = _job_file(tmp_path / "disk.yaml", "bad-disk", {
        "model": model, "dataset": {"entrypoint": "bad_data:from_disk",
                                    "args": {"root": str(tmp_path / "nowhere")}},
        "training": {"epochs": 1, "batchSize": 10}})
    (tmp_path / "termination-log").write_bytes(b"")  # as the kubelet makes it
    environ = {**os.environ, "PYTHONPATH": str(tmp_path), contract.Env.TERMINATION_LOG:
               str(tmp_path / "termination-log"), "OMP_NUM_THREADS": "1"}
    trainer = subprocess.run(  # the trainer as a pod runs it: exit code and termination log
        contract.trainer_command(1, contract.TrainerArgs(job_file=str(disk)).to_argv()),
        cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=DEADLINE_SECONDS,
        check=False)
    assert trainer.returncode == contract.EXIT_INVALID, trainer.stderr
    failure = contract.read_termination_message(
        (tmp_path / "termination-log").read_text(encoding="utf-8"))
    assert isinstance(failure, contract.Failure)
    assert failure.message.startswith("spec.dataset.entrypoint: bad_data:from_disk(root=")
    assert "raised FileNotFoundError" in failure.message
    assert "bad_data.py, line 12, in from_disk" in failure.message, failure.message


CLAIMING_DATA = '''\
import torch
from torch.utils.data import Dataset


class Claims(Dataset):
    """Serves any index, and says it holds `n` samples."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return torch.zeros(1, 8, 8), int(index) % 10


def endless():
    return Claims(10**15), Claims(20)
'''


def test_kiln_run_names_a_dataset_claiming_more_samples_than_any_run_can_shuffle(
        tmp_path: Path) -> None:
    (tmp_path / "claiming_data.py").write_text(CLAIMING_DATA, encoding="utf-8")
    job = _job_file(tmp_path / "claims.yaml", "claims", {
        "model": {"architecture": "small_cnn", "args": {"depth": 2, "width": 8},
                  "inputShape": [1, 8, 8]},
        "dataset": {"entrypoint": "claiming_data:endless"},
        "training": {"epochs": 1, "batchSize": 10}})
    done = _kiln("run", str(job), "--zoo", "zoo", cwd=tmp_path)
    err = " ".join(done.stderr.split())
    assert done.returncode == 1, err
    assert "claims: trainer exited with code 2" in err  # invalid, not out of memory
    assert ("spec.dataset.entrypoint: the train split of claiming_data:endless says it holds "
            "1,000,000,000,000,000 samples (its __len__ returned 1000000000000000)") in err
    assert "out of memory" not in err and "Traceback" not in err


# ----------------------------------------------------------------------------------------------
# a job's own command


OWN_LOOP = '''\
"""Stands in for a user's training loop: reads Kiln's environment, reports one result."""
import json
import os
import pathlib
import sys

from kiln import api, contract
from kiln.api import jobfile

job = jobfile.load_jobs(pathlib.Path(os.environ[contract.Env.JOB_FILE]))[0]
pathlib.Path(sys.argv[1]).write_text(json.dumps({
    "job": job.name, "zoo": os.environ.get(contract.Env.ZOO), "greeting": os.environ["GREETING"],
    "python": sys.executable, "args": sys.argv[2:]}))
result = contract.Result(
    metric_name="validation_accuracy", metric=0.75, validation_accuracy=0.75,
    validation_loss=0.5, wall_seconds=1.0, time_to_target_seconds=None, target_reached=False,
    epochs_run=1, steps=10, samples_per_second=100.0, zoo_model=None, resumed_from_epoch=0)
print(contract.to_line(result), flush=True)
'''


def test_kiln_run_runs_a_jobs_own_command_with_kilns_environment(tmp_path: Path) -> None:
    (tmp_path / "my_loop.py").write_text(OWN_LOOP, encoding="utf-8")
    seen = tmp_path / f"seen-{uuid.uuid4().hex[:6]}.json"
    job = _job_file(tmp_path / "own.yaml", "own-loop", {
        "model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
        "template": {"command": ["python", "-m", "my_loop", str(seen)], "args": ["--fast"],
                     "env": [{"name": "GREETING", "value": "hello"}]}})
    done = _kiln("run", str(job), "--zoo", "zoo", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    told = json.loads(seen.read_text(encoding="utf-8"))
    assert told["job"] == "own-loop" and told["greeting"] == "hello" and told["args"] == ["--fast"]
    assert told["zoo"] == "zoo" and Path(told["python"]).parent == Path(sys.executable).parent
    assert "0.750" in done.stdout  # the result table shows what the own loop reported


def test_several_jobs_under_a_plan_run_their_own_commands(tmp_path: Path) -> None:
    (tmp_path / "my_loop.py").write_text(OWN_LOOP, encoding="utf-8")
    jobs = []
    for name in ("own-a", "own-b"):
        jobs.append(str(_job_file(tmp_path / f"{name}.yaml", name, {
            "model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
            "template": {"command": ["python", "-m", "my_loop", str(tmp_path / f"{name}.json")],
                         "env": [{"name": "GREETING", "value": name}]}})))
    done = _kiln("run", *jobs, "--slots", "2", "--zoo", "zoo", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for name in ("own-a", "own-b"):
        told = json.loads((tmp_path / f"{name}.json").read_text(encoding="utf-8"))
        assert (told["job"], told["greeting"], told["zoo"]) == (name, name, "zoo")


def test_kiln_run_fails_a_job_whose_own_command_is_not_on_path(tmp_path: Path) -> None:
    job = _job_file(tmp_path / "missing.yaml", "missing", {
        "model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
        "template": {"command": ["no-such-command-xyz"]}})
    done = _kiln("run", str(job), "--zoo", "zoo", cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr  # not a crash
    assert ("job missing: spec.template.command: cannot run 'no-such-command-xyz': not found on "
            "PATH") in " ".join(done.stderr.split())


def test_an_own_commands_printed_output_shows_in_its_failure_and_log(tmp_path: Path) -> None:
    job = _job_file(tmp_path / "prints.yaml", "prints", {
        "model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
        "template": {"command": ["python", "-c", "print('my loop broke here'); exit(3)"]}})
    done = _kiln("run", str(job), "--zoo", "zoo", cwd=tmp_path)
    assert done.returncode != 0 and "exited with code 3" in done.stderr
    assert "my loop broke here" in done.stderr and "(no output)" not in done.stderr
    assert "my loop broke here" in (tmp_path / ".kiln" / "runs" / "prints.log").read_text(
        encoding="utf-8")
