"""The sources a job downloads: the cache key names content, a copy that does not match its
listing is refused, the manifest reads back, Secrets come from folders, and hf:// without the
Hub fails naming the field."""

from __future__ import annotations

import hashlib
import http.server
import socket
import threading
from pathlib import Path

import pytest

from kiln import api, contract
from kiln.zoo import sources, store

A = sources.Listed("a.txt", 3, hashlib.md5(b"abc", usedforsecurity=False).hexdigest())
B = sources.Listed("sub/b.txt", 2, "0" * 32 + "-2")  # a multipart ETag: no MD5 to check


def test_the_cache_key_names_the_content_not_its_order_or_place() -> None:
    key = sources.content_key([A, B], single=False)
    assert sources.content_key([B, A], single=False) == key
    assert len(key) == 32
    for other in ([A], [A, sources.Listed("sub/b.txt", 3, B.etag)],
                  [A, sources.Listed("sub/b.txt", 2, "1" * 32 + "-2")],
                  [A, sources.Listed("sub/c.txt", 2, B.etag)]):
        assert sources.content_key(other, single=False) != key
    assert sources.content_key([A], single=True) != sources.content_key([A], single=False)


def _copy(folder: Path, files: dict[str, bytes]) -> Path:
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)
    return folder


def test_verify_accepts_a_copy_that_matches_its_listing(tmp_path: Path) -> None:
    sources.verify(_copy(tmp_path, {"a.txt": b"abc", "sub/b.txt": b"xy"}), [A, B])


@pytest.mark.parametrize(("files", "expected"), [
    pytest.param({"sub/b.txt": b"xy"}, "a.txt: downloaded 0 bytes, listed 3", id="missing"),
    pytest.param({"a.txt": b"ab", "sub/b.txt": b"xy"}, "a.txt: downloaded 2 bytes, listed 3",
                 id="short"),
    pytest.param({"a.txt": b"abd", "sub/b.txt": b"xy"}, "a.txt: its MD5 is not its ETag",
                 id="changed"),
])
def test_verify_refuses_a_copy_that_differs_from_its_listing(
    tmp_path: Path, files: dict[str, bytes], expected: str
) -> None:
    with pytest.raises(sources.SourceError, match=expected):
        sources.verify(_copy(tmp_path, files), [A, B])


def test_the_manifest_reads_back_and_finds_only_copies_still_there(tmp_path: Path) -> None:
    entry = _copy(tmp_path / "cache" / "k", {"a.txt": b"abc"})
    fetched = sources.Fetched("s3://data/x", "s3-data", str(entry), (A,), False, True)
    gone = sources.Fetched("s3://data/y", "", str(tmp_path / "gone"), (A,))
    path = tmp_path / "sources.json"
    sources.Manifest((fetched, gone)).write(path)
    read = sources.Manifest.read(path)
    assert read.sources == (fetched, gone)
    assert read.find("s3://data/x", "s3-data") == fetched
    assert read.find("s3://data/x", "") is None  # another Secret: another server, maybe
    assert read.find("s3://data/y", "") is None
    assert sources.Manifest.read(tmp_path / "none.json").sources == ()
    path.write_text("{}", encoding="utf-8")
    with pytest.raises(sources.SourceError, match="not a sources manifest"):
        sources.Manifest.read(path)


def test_a_secret_folder_gives_the_endpoint_and_credentials(tmp_path: Path) -> None:
    _copy(tmp_path / "s3-data", {"endpoint": b"minio:9000\n", "accessKey": b"ak",
                                 "secretKey": b"sk"})
    env: dict[str, str] = {contract.Env.SECRETS_DIR: str(tmp_path),
                           contract.Env.ZOO_ENDPOINT: "zoo:9000"}
    assert sources.s3_settings("s3-data", field="spec.dataset.uri", environ=env) == {
        contract.Env.ZOO_ENDPOINT: "minio:9000", contract.Env.ZOO_ACCESS_KEY: "ak",
        contract.Env.ZOO_SECRET_KEY: "sk"}
    assert sources.s3_settings("", field="spec.dataset.uri", environ=env) == env  # the zoo's


@pytest.mark.parametrize(("files", "expected"), [
    pytest.param(None, "spec.dataset.uri: its secretRef, Secret s3-data, is not there", id="none"),
    pytest.param({"accessKey": b"ak"}, "spec.dataset.uri: its secretRef, Secret s3-data, has no "
                 "key endpoint", id="no-endpoint"),
    pytest.param({"endpoint": b"minio:9000", "accessKey": b"", "secretKey": b"sk"},
                 "spec.dataset.uri: its secretRef, Secret s3-data, has an empty or no key "
                 "accessKey; give accessKey and secretKey both", id="empty-access-key"),
    pytest.param({"endpoint": b"minio:9000", "accessKey": b"ak"},
                 "spec.dataset.uri: its secretRef, Secret s3-data, has an empty or no key "
                 "secretKey", id="no-secret-key"),
])
def test_a_missing_secret_or_key_names_the_field_and_the_fix(
    tmp_path: Path, files: dict[str, bytes] | None, expected: str
) -> None:
    if files is not None:
        _copy(tmp_path / "s3-data", files)
    env: dict[str, str] = {contract.Env.SECRETS_DIR: str(tmp_path)}
    with pytest.raises(sources.SourceError) as caught:
        sources.fetch("s3://data/pets", field="spec.dataset.uri", secret="s3-data", environ=env,
                      cache=tmp_path / "cache")
    assert str(caught.value).startswith(expected)
    assert "kubectl create secret generic s3-data --from-literal=endpoint=" in str(caught.value)


def test_hf_without_the_hub_names_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may download: no network here anyway
    with pytest.raises(sources.SourceError) as caught:
        sources.fetch("hf://kiln-test/tiny-bert", field="spec.model.pretrained.uri",
                      environ={}, cache=tmp_path)
    assert str(caught.value).startswith(
        "spec.model.pretrained.uri: hf://kiln-test/tiny-bert needs network access to the "
        "Hugging Face Hub")
    assert not any(tmp_path.rglob("*.safetensors"))


def test_a_path_is_used_where_it_is_and_jobs_list_what_they_download() -> None:
    assert sources.fetch("/data/pets", field="spec.dataset.uri", environ={},
                         cache=Path("/nonexistent")).path == "/data/pets"
    job = api.parse_job({
        "apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "x"},
        "spec": {"model": {"architecture": "char_transformer", "inputShape": [16],
                           "pretrained": {"uri": "s3://weights/lm", "secretRef": {"name": "w"}}},
                 "dataset": {"name": "text", "uri": "/data/corpus"}}})
    assert sources.job_sources(job.spec) == [("spec.model.pretrained.uri", "s3://weights/lm", "w")]


@pytest.mark.parametrize(("dataset", "expected"), [
    pytest.param({"name": "text", "uri": "gs://b/corpus"},
                 "spec.dataset.uri: unsupported scheme 'gs'", id="unknown-scheme"),
    pytest.param({"name": "text", "uri": "s3://B/corpus"},
                 "spec.dataset.uri: 'B' is not an S3 bucket name", id="bad-bucket"),
    pytest.param({"name": "text", "uri": "s3:/b/corpus"},
                 "spec.dataset.uri: write s3:// with two slashes (got 's3:/b/corpus')",
                 id="s3-one-slash"),
    pytest.param({"name": "text", "uri": "HF:org/name"},
                 "spec.dataset.uri: write hf:// with two slashes", id="hf-no-slash"),
    pytest.param({"name": "text", "uri": "hf://just-a-name"},
                 "spec.dataset.uri: write hf://org/name", id="hf-not-org-name"),
    pytest.param({"name": "text", "uri": "/data/corpus", "secretRef": {"name": "s"}},
                 "spec.dataset.secretRef: only an s3:// uri reads a Secret", id="secret-for-path"),
])
def test_bad_source_uris_are_refused_naming_the_field(dataset: dict[str, object], expected: str
                                                      ) -> None:
    doc = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "x"},
           "spec": {"model": {"architecture": "char_transformer", "inputShape": [16]},
                    "dataset": dataset}}
    with pytest.raises(api.InvalidSpec) as caught:
        api.parse_job(doc)
    assert [p for p in caught.value.problems if p.startswith(expected)], caught.value.problems


@pytest.mark.timeout(120)  # before bounded timeouts this waited 5 minutes per attempt
def test_an_s3_server_that_never_answers_fails_instead_of_holding_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sources, "READ_TIMEOUT_SECONDS", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as server:  # accepts, then says nothing
        environ = {contract.Env.ZOO_ENDPOINT: f"127.0.0.1:{server.getsockname()[1]}",
                   contract.Env.ZOO_ACCESS_KEY: "a", contract.Env.ZOO_SECRET_KEY: "b"}
        with pytest.raises(store.StoreUnavailable, match=r"spec.dataset.uri s3://data/x: .*"
                           r"Read timed out"):
            sources.fetch("s3://data/x", field="spec.dataset.uri", environ=environ,
                          cache=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


class _Refuses(http.server.BaseHTTPRequestHandler):
    """An S3 server that refuses anonymous requests, as a private bucket's does."""

    def do_GET(self) -> None:
        body = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code>"
                b"<Message>Access Denied</Message><Resource>/data</Resource></Error>")
        self.send_response(403)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_an_s3_source_without_a_secret_or_credentials_refused_says_to_give_a_secret(
    tmp_path: Path
) -> None:
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refuses) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        # a pod of the operator's default presigned zoo access: the zoo's endpoint, no keys
        environ = {contract.Env.ZOO_ENDPOINT: f"127.0.0.1:{server.server_address[1]}"}
        try:
            with pytest.raises(sources.SourceError) as caught:
                sources.fetch("s3://data/pets", field="spec.dataset.uri", environ=environ,
                              cache=tmp_path / "cache")
        finally:
            server.shutdown()
    said = str(caught.value)
    assert said.startswith("spec.dataset.uri: cannot read s3://data/pets (AccessDenied"), said
    assert "give the source a secretRef" in said, said
