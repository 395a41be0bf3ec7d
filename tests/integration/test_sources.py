"""Sources downloaded before training, through `kiln run`: pretrained weights (a Hugging Face
directory with its tokenizer.json) and a text corpus on a second S3 server (moto over HTTP,
not the zoo's), reached through a Secret's keys, cached by content, never used half-written.

Subprocesses get OMP_NUM_THREADS=1: tiny models train fastest on one thread on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import clirun
import minio
import pytest
import sourcedata
import tokenizers
import yaml
from tokenizers import models as tokenizer_models
from tokenizers import pre_tokenizers

from kiln import api, contract
from kiln.zoo import records, sources, store

CORPUS = sourcedata.CORPUS


def _secret(folder: Path, s3: Any) -> None:
    folder.mkdir(parents=True)
    for key, value in sourcedata.secret_data(s3).items():
        (folder / key).write_text(value + "\n", encoding="utf-8")


def _job(path: Path, name: str, bucket: str) -> Path:
    ref = {"name": "second-s3"}  # written twice, not as a YAML alias
    doc = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name},
           "spec": {"model": {**sourcedata.MODEL,
                              "pretrained": {"uri": f"s3://{bucket}/models/lm",
                                             "secretRef": dict(ref)}},
                    "dataset": {"name": "text", "uri": f"s3://{bucket}/corpus",
                                "secretRef": dict(ref), "validationFraction": 0.3},
                    "training": {"epochs": 1, "batchSize": 8},
                    "freezing": {"enabled": False}}}
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def test_kiln_run_fine_tunes_from_sources_on_a_second_s3_server(
    second_s3_server: Any, s3_bucket: str, tmp_path: Path
) -> None:
    sourcedata.upload_sources(second_s3_server, s3_bucket, tmp_path)
    _secret(tmp_path / "secrets" / "second-s3", second_s3_server)
    cache = tmp_path / "cache"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    environ |= {"OMP_NUM_THREADS": "1", contract.Env.SECRETS_DIR: str(tmp_path / "secrets"),
                contract.Env.DATA_CACHE: str(cache)}  # no zoo endpoint: only the Secret's
    first = clirun.kiln("run", str(_job(tmp_path / "a.yaml", "tuned-a", s3_bucket)),
                        "--zoo", "zoo", "-o", "json", cwd=tmp_path, env=environ)
    assert first.returncode == 0, first.stderr + first.stdout
    runs = tmp_path / ".kiln" / "runs"
    fetched = (runs / "tuned-a.initializer.log").read_text(encoding="utf-8")
    assert fetched.count("downloaded to") == 2, fetched
    log = (runs / "tuned-a.log").read_text(encoding="utf-8")
    assert f"started from the pretrained weights at s3://{s3_bucket}/models/lm" in log
    assert "tokenizer.json)" in log  # the text was tokenized by the model's tokenizer
    (result,) = json.loads(first.stdout)
    assert "the job starts from spec.model.pretrained.uri" in json.dumps(result), result
    entries = sorted(p.name for p in cache.iterdir())
    assert len(entries) == 2 and not [e for e in entries if e.startswith(".")]
    # A second job on the same content reuses the cache: nothing is downloaded again.
    second = clirun.kiln("run", str(_job(tmp_path / "b.yaml", "tuned-b", s3_bucket)),
                         "--zoo", "zoo", cwd=tmp_path, env=environ)
    assert second.returncode == 0, second.stderr + second.stdout
    again = (runs / "tuned-b.initializer.log").read_text(encoding="utf-8")
    assert again.count("found in the cache at") == 2 and "downloaded to" not in again, again
    assert sorted(p.name for p in cache.iterdir()) == entries


def test_a_missing_secret_stops_kiln_run_before_training(second_s3_server: Any, s3_bucket: str,
                                                         tmp_path: Path) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    environ |= {"OMP_NUM_THREADS": "1", contract.Env.SECRETS_DIR: str(tmp_path / "secrets")}
    done = clirun.kiln("run", str(_job(tmp_path / "a.yaml", "no-secret", s3_bucket)),
                       "--zoo", "zoo", cwd=tmp_path, env=environ)
    assert done.returncode != 0
    assert ("spec.model.pretrained.uri: its secretRef, Secret second-s3, is not there"
            in done.stderr), done.stderr
    assert not (tmp_path / ".kiln" / "runs" / "no-secret.log").exists()  # no trainer started


def test_a_download_that_differs_from_its_listing_is_never_used(
    second_s3_server: Any, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sourcedata.upload_sources(second_s3_server, s3_bucket, tmp_path)
    _secret(tmp_path / "secrets" / "second-s3", second_s3_server)
    env: dict[str, str] = {contract.Env.SECRETS_DIR: str(tmp_path / "secrets")}
    real = minio.Minio.fget_object

    def truncated(self: minio.Minio, bucket: str, name: str, path: str, *args: Any,
                  **kwargs: Any) -> Any:
        result = real(self, bucket, name, path, *args, **kwargs)
        with open(path, "r+b") as file:  # as a connection cut short would leave it
            file.truncate(10)
        return result

    monkeypatch.setattr(minio.Minio, "fget_object", truncated)
    uri = f"s3://{s3_bucket}/corpus"
    with pytest.raises(sources.SourceError, match=r"spec.dataset.uri: firing.txt: downloaded "
                       r"10 bytes, listed 852"):
        sources.fetch(uri, field="spec.dataset.uri", secret="second-s3", environ=env,
                      cache=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # neither an entry nor a .partial folder
    monkeypatch.setattr(minio.Minio, "fget_object", real)
    done = sources.fetch(uri, field="spec.dataset.uri", secret="second-s3", environ=env,
                         cache=tmp_path / "cache")
    assert done.downloaded and (Path(done.path) / "kilns.txt").read_bytes() == (
        CORPUS / "kilns.txt").read_bytes()


LORA = {"method": "lora", "rank": 2, "alpha": 4.0,
        "targetModules": ["layers.0.attention.query", "layers.0.attention.value", "head.1"]}


def _lora_job(path: Path, name: str, bucket: str, model: str) -> Path:
    _job(path, name, bucket)
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    doc["spec"]["model"]["pretrained"]["uri"] = f"s3://{bucket}/{model}"
    doc["spec"]["training"]["peft"] = LORA
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def test_lora_jobs_on_an_s3_base_import_it_once_and_continue_adapters_on_it(
    second_s3_server: Any, s3_bucket: str, tmp_path: Path
) -> None:
    client = sourcedata.upload_sources(second_s3_server, s3_bucket, tmp_path)
    other = sourcedata.pretrained(tmp_path / "other")  # the same model, other weights
    for file in sorted(other.iterdir()):
        client.fput_object(s3_bucket, f"models/other/{file.name}", str(file))
    _secret(tmp_path / "secrets" / "second-s3", second_s3_server)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    environ |= {"OMP_NUM_THREADS": "1", contract.Env.SECRETS_DIR: str(tmp_path / "secrets"),
                contract.Env.DATA_CACHE: str(tmp_path / "cache")}
    zoo = store.DirStore(tmp_path / "zoo")
    runs = tmp_path / ".kiln" / "runs"

    def run(name: str, model: str) -> tuple[records.ZooRecord, str]:
        job = _lora_job(tmp_path / f"{name}.yaml", name, s3_bucket, model)
        done = clirun.kiln("run", str(job), "--zoo", "zoo", cwd=tmp_path, env=environ)
        assert done.returncode == 0, done.stderr + done.stdout
        (record,) = [r for r in records.list_records(zoo) if r.job_name == name
                     and r.adapter is not None]
        return record, done.stdout + done.stderr + (runs / f"{name}.log").read_text()

    first, log = run("lora-a", "models/lm")
    (base,) = [r for r in records.list_records(zoo) if r.adapter is None]
    # the pretrained weights became a full-weight record, by content: the adapter's base
    assert base.source == f"s3://{s3_bucket}/models/lm" and base.dataset == "imported"
    assert base.validation_loss is not None and base.metric_name == "validation_accuracy"
    assert first.base == base.id and first.parent == base.id
    assert first.adapter == {**LORA, "dropout": 0.0}
    assert f"on base {base.id} (imported now from s3://{s3_bucket}/models/lm), a new adapter" \
        in log, log
    assert {k.rsplit(".", 2)[0] for k in records.load_weights(zoo, first) if "lora_" in k} \
        == set(LORA["targetModules"])

    # the same base again: no second import; the job continues the first adapter
    second, log = run("lora-b", "models/lm")
    assert [r.id for r in records.list_records(zoo) if r.adapter is None] == [base.id]
    assert second.base == base.id and second.parent == first.id
    assert f"the zoo record of s3://{s3_bucket}/models/lm), continuing adapter {first.id}" \
        in log, log

    # other weights are another base: imported too, and a new adapter starts on them
    third, log = run("lora-c", "models/other")
    (other_base,) = [r for r in records.list_records(zoo)
                     if r.adapter is None and r.id != base.id]
    assert other_base.weights_sha256 != base.weights_sha256
    assert third.base == other_base.id and third.parent == other_base.id
    assert "a new adapter" in log and first.id not in log and second.id not in log

    # the adapter exports merged into its imported base: a whole model
    exported = clirun.kiln("zoo", "export", second.id, "--out", str(tmp_path / "merged"),
                           "--zoo", "zoo", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert base.id in json.loads((tmp_path / "merged" / "meta.json").read_text())["source"]


def test_a_damaged_cache_entry_is_downloaded_again_not_used(
    second_s3_server: Any, s3_bucket: str, tmp_path: Path
) -> None:
    sourcedata.upload_sources(second_s3_server, s3_bucket, tmp_path)
    _secret(tmp_path / "secrets" / "second-s3", second_s3_server)
    env: dict[str, str] = {contract.Env.SECRETS_DIR: str(tmp_path / "secrets")}

    def fetch() -> sources.Fetched:
        return sources.fetch(f"s3://{s3_bucket}/corpus", field="spec.dataset.uri",
                             secret="second-s3", environ=env, cache=tmp_path / "cache")

    first = fetch()
    copy = Path(first.path) / "kilns.txt"
    copy.write_bytes(copy.read_bytes()[:10])  # as a node that crashed before a flush leaves it
    again = fetch()
    assert again.downloaded and again.path == first.path
    assert copy.read_bytes() == (CORPUS / "kilns.txt").read_bytes()
    (Path(first.path) / "firing.txt").unlink()  # a file gone: the same
    assert fetch().downloaded and (Path(first.path) / "firing.txt").is_file()
    assert not fetch().downloaded  # whole again: used as it is
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [Path(first.path).name]
    # A download killed mid-way leaves its scratch folder; an old one goes at the next fetch,
    # a recent one (another pod's download on a shared cache) stays.
    old, recent = (tmp_path / "cache" / f".{name}.partial" for name in ("old", "recent"))
    for scratch in (old, recent):
        (scratch / "part").mkdir(parents=True)
        (scratch / "part" / "x.txt").write_bytes(b"half")
    hours_ago = time.time() - 2 * 3600
    for path in (old, old / "part", old / "part" / "x.txt"):
        os.utime(path, (hours_ago, hours_ago))
    fetch()
    assert not old.exists() and (recent / "part" / "x.txt").is_file()


@pytest.mark.parametrize("odd", ["data//x.txt", "data///y/x.txt"])
def test_an_object_key_with_an_empty_part_is_refused_naming_it(
    second_s3_server: Any, s3_bucket: str, tmp_path: Path, odd: str
) -> None:
    client = sourcedata.upload_sources(second_s3_server, s3_bucket, tmp_path)
    for name, text in (("data/x.txt", b"the one at data/x.txt"), (odd, b"another text")):
        (tmp_path / "object").write_bytes(text)
        client.fput_object(s3_bucket, name, str(tmp_path / "object"))
    _secret(tmp_path / "secrets" / "second-s3", second_s3_server)
    env: dict[str, str] = {contract.Env.SECRETS_DIR: str(tmp_path / "secrets")}
    with pytest.raises(sources.SourceError, match=rf"spec.dataset.uri: object '{odd}' has an "
                       r"empty part in its key \('//' or a leading '/'\).*; rename it"):
        sources.fetch(f"s3://{s3_bucket}/data", field="spec.dataset.uri", secret="second-s3",
                      environ=env, cache=tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def _run_text_job(tmp_path: Path, name: str, weights: Path) -> subprocess.CompletedProcess[str]:
    """`kiln run` of a text job fine-tuning the pretrained weights in `weights`."""
    job = _job(tmp_path / f"{name}.yaml", name, "unused")
    doc = yaml.safe_load(job.read_text(encoding="utf-8"))
    doc["spec"]["model"]["pretrained"] = {"uri": str(weights)}
    doc["spec"]["dataset"] = {"name": "text", "uri": str(CORPUS), "validationFraction": 0.3}
    job.write_text(yaml.safe_dump(doc), encoding="utf-8")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    return clirun.kiln("run", str(job), "--zoo", "zoo", cwd=tmp_path,
                       env=environ | {"OMP_NUM_THREADS": "1"})


def test_a_tokenizer_larger_than_the_model_is_refused_naming_it(tmp_path: Path) -> None:
    weights = sourcedata.pretrained(tmp_path / "lm")
    # every corpus word is unknown, so the first sample holds id 1000: past the 256 rows
    vocab = {**{f"w{i}": i for i in range(1000)}, "[UNK]": 1000}
    tokenizer = tokenizers.Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(weights / "tokenizer.json"))
    done = _run_text_job(tmp_path, "big-vocab", weights)
    log = (tmp_path / ".kiln" / "runs" / "big-vocab.log").read_text(encoding="utf-8")
    assert done.returncode != 0
    assert ("spec.model.pretrained.uri: the model cannot read the ids of the tokenizer.json "
            "beside its weights" in done.stderr and "1001 tokens" in done.stderr), done.stderr
    assert "Traceback" not in log, log


def test_a_tokenizer_json_that_is_no_file_is_refused_naming_it(tmp_path: Path) -> None:
    weights = sourcedata.pretrained(tmp_path / "lm")
    (weights / "tokenizer.json").unlink(missing_ok=True)
    (weights / "tokenizer.json").mkdir()  # not silently byte-level: the user meant a tokenizer
    done = _run_text_job(tmp_path, "dir-tokenizer", weights)
    assert done.returncode != 0
    assert "tokenizer.json is no file" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
