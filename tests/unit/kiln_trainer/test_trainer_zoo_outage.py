"""The zoo is needed only when used: a cold-starting trainer trains through a zoo outage.

The unreachable zoo is an s3:// URI whose endpoint is a closed local port, retried briefly.
"""

from __future__ import annotations

import io
import json
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from kiln import api, contract
from kiln.zoo import records, store
from kiln_trainer import checkpoint, cli, events, loop

JOB_NAME = "digits-outage"



@pytest.fixture
def zoo_down(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """An s3:// zoo URI nobody answers; the trainer runs in `tmp_path` (its local default)."""
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv(contract.Env.ZOO_ENDPOINT, f"127.0.0.1:{port}")
    # open_store builds S3Stores with the default policy (seconds of backoff): keep it short.
    monkeypatch.setitem(store.S3Store.__init__.__kwdefaults__, "retry",
                        store.RetryPolicy(attempts=2, first_backoff_seconds=0.01))
    monkeypatch.chdir(tmp_path)
    for name in (contract.Env.ZOO, contract.Env.CHECKPOINTS, contract.Env.WARM_START,
                 contract.Env.JOB):
        monkeypatch.delenv(name, raising=False)
    return "s3://zoo"


def _job_doc(*, warm_start: bool) -> dict[str, Any]:
    return {
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": JOB_NAME},
        "spec": {
            "model": {"architecture": "small_cnn", "args": {"depth": 2, "width": 8},
                      "inputShape": [1, 8, 8]},
            "dataset": {"name": "digits", "maxSamples": 300},
            "training": {"epochs": 2, "batchSize": 64,
                         "optimizer": {"name": "adam", "lr": 0.01, "weightDecay": 0.0}},
            "warmStart": {"enabled": warm_start},
        },
    }


def _events(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_a_cold_job_trains_through_a_zoo_outage_keeps_its_model_and_a_rerun_registers_it(
    zoo_down: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_job_doc(warm_start=False)), encoding="utf-8")
    termination_log = tmp_path / "termination-log"
    termination_log.touch()
    monkeypatch.setattr(events, "TERMINATION_LOG", termination_log)
    kept = tmp_path / checkpoint.DEFAULT_DIR / "default" / JOB_NAME / checkpoint.FILE_NAME

    assert cli.main(["--job", str(job), "--zoo", zoo_down]) == contract.EXIT_STORE_UNAVAILABLE
    first = capsys.readouterr()
    trained = [e for e in _events(first.out) if e["event"] == "progress"]
    assert trained and trained[-1]["epoch"] == 2  # it trained to the end, then registration
    assert not any(e["event"] == "result" for e in _events(first.out))
    failure = contract.read_termination_message(termination_log.read_text())
    assert isinstance(failure, contract.Failure)
    assert "registration failed: zoo unavailable; the model is kept at " in failure.message
    local = (tmp_path / checkpoint.DEFAULT_DIR).resolve()
    assert f"default/{JOB_NAME}/checkpoint.pt in directory {local}" in failure.message
    assert kept.is_file()

    zoo_dir = tmp_path / "zoo"
    assert cli.main(["--job", str(job), "--zoo", str(zoo_dir)]) == contract.EXIT_OK
    second = _events(capsys.readouterr().out)
    result = second[-1]
    assert result["event"] == "result" and result["zoo_model"]
    assert result["resumed_from_epoch"] == 2 and result["steps"] == trained[-1]["step"]
    (record,) = records.list_records(store.DirStore(zoo_dir))
    assert record.id == result["zoo_model"]
    assert not kept.exists()  # registered: a later run of the job trains afresh


def test_a_job_that_warm_starts_from_the_zoo_fails_fast_while_it_is_unreachable(
    zoo_down: str, tmp_path: Path,
) -> None:
    out = io.StringIO()
    with pytest.raises(store.StoreUnavailable, match="is unavailable"):
        loop.main(api.parse_job(_job_doc(warm_start=True)), zoo_uri=zoo_down, out=out,
                  termination_log=None)
    assert not any(e["event"] == "progress" for e in _events(out.getvalue()))
    assert not (tmp_path / checkpoint.DEFAULT_DIR).exists()


def test_with_a_checkpoint_directory_only_registration_meets_the_outage(
    zoo_down: str, tmp_path: Path,
) -> None:
    kept = tmp_path / "checkpoints"
    with pytest.raises(store.StoreUnavailable, match="registration failed") as failed:
        loop.main(api.parse_job(_job_doc(warm_start=False)), zoo_uri=zoo_down,
                  checkpoint_dir=kept, out=io.StringIO(), termination_log=None)
    assert f"in directory {kept}" in str(failed.value)
    assert (kept / "default" / JOB_NAME / checkpoint.FILE_NAME).is_file()
