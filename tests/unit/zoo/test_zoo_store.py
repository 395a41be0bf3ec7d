"""Unit tests of kiln.zoo.store that need no S3 server: keys, DirStore, retries, open_store.

The behaviour both stores share is tested against both in tests/integration/test_zoo_stores.py.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import minio.credentials.providers
import minio.error
import pytest

from kiln import contract
from kiln.zoo import store


@pytest.mark.parametrize(
    "key",
    [
        pytest.param("", id="empty"),
        pytest.param("/etc/passwd", id="absolute"),
        pytest.param("../outside", id="dot-dot-first"),
        pytest.param("models/../../outside", id="dot-dot-inside"),
        pytest.param("models/./x", id="dot"),
        pytest.param("models//x", id="empty-component"),
        pytest.param("models/x/", id="trailing-slash"),
        pytest.param("models\\x", id="backslash"),
        pytest.param("models/.kiln-tmp-abc", id="temp-file-name"),
    ],
)
def test_unsafe_keys_are_rejected_by_the_directory_store(tmp_path: Path, key: str) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    with pytest.raises(ValueError, match="key"):
        zoo.put_bytes(key, b"x")
    with pytest.raises(ValueError, match="key"):
        zoo.get_bytes(key)
    assert not (tmp_path / "outside").exists()


@pytest.mark.parametrize("prefix", ["", "models", "models/", "models/abc", "a/b/c/"])
def test_key_prefixes_may_end_anywhere(prefix: str) -> None:
    assert store.check_prefix(prefix) == prefix


@pytest.mark.parametrize("prefix", ["/models", "../", "models/../x"])
def test_key_prefixes_may_not_leave_the_store(prefix: str) -> None:
    with pytest.raises(ValueError):
        store.check_prefix(prefix)


def test_directory_store_maps_slashes_to_subdirectories(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    zoo.put_bytes("models/abc/meta.json", b"{}")
    assert (tmp_path / "models" / "abc" / "meta.json").read_bytes() == b"{}"


def test_directory_store_leaves_no_temporary_files_after_writing(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    zoo.put_bytes("a/b", b"first")
    zoo.put_bytes("a/b", b"second")
    assert sorted(os.listdir(tmp_path / "a")) == ["b"]
    assert zoo.get_bytes("a/b") == b"second"


def test_directory_store_hides_temporary_files_of_unfinished_writes(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    zoo.put_bytes("models/x/meta.json", b"{}")
    (tmp_path / "models" / "x" / ".kiln-tmp-123abc").write_bytes(b"partial")
    assert zoo.list_keys("") == ["models/x/meta.json"]


def test_directory_store_files_are_readable_by_others(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    zoo.put_bytes("k", b"v")
    assert (tmp_path / "k").stat().st_mode & 0o044 == 0o044


def test_directory_store_refuses_a_key_that_clashes_with_a_directory(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    zoo.put_bytes("a/b", b"x")
    with pytest.raises(ValueError, match="clashes"):
        zoo.put_bytes("a", b"y")
    with pytest.raises(ValueError, match="clashes"):
        zoo.put_bytes("a/b/c", b"z")


def test_directory_store_treats_a_directory_as_no_object(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    zoo.put_bytes("a/b", b"x")
    assert not zoo.exists("a")
    with pytest.raises(store.ObjectNotFound):
        zoo.get_bytes("a")
    zoo.delete("a")
    assert zoo.get_bytes("a/b") == b"x"


def test_directory_store_lists_nothing_before_the_root_exists(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path / "not-yet")
    assert zoo.list_keys("") == []
    assert zoo.list_keys("models/") == []
    assert not zoo.exists("models/x")


def test_directory_store_lists_nothing_under_a_file(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    zoo.put_bytes("models", b"x")
    assert zoo.list_keys("models/") == []


@pytest.mark.parametrize("below", ["", "sub/zoo"], ids=["the-file", "under-the-file"])
def test_directory_store_refuses_a_root_that_is_or_lies_under_a_file(
    tmp_path: Path, below: str
) -> None:
    (tmp_path / "afile").write_text("x", encoding="utf-8")
    with pytest.raises(ValueError, match=r"afile is a file, not a directory"):
        store.DirStore(tmp_path / "afile" / below if below else tmp_path / "afile")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        store.open_store(str(tmp_path / "afile"))


def test_directory_store_reports_a_full_disk_as_unavailable_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(src: str, dst: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(store.StoreUnavailable, match="disk has space"):
        store.DirStore(tmp_path).put_bytes("models/x/meta.json", b"{}")
    assert os.listdir(tmp_path / "models" / "x") == []


def test_directory_store_resolves_a_relative_root_when_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    zoo = store.DirStore(".kiln/zoo")
    assert zoo.root == tmp_path / ".kiln" / "zoo"
    assert zoo.describe() == f"directory {tmp_path / '.kiln' / 'zoo'}"


def test_object_not_found_is_a_key_error_naming_key_and_store(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    with pytest.raises(KeyError) as caught:
        zoo.get_bytes("models/none/meta.json")
    assert isinstance(caught.value, store.ObjectNotFound)
    assert str(caught.value) == f"no object 'models/none/meta.json' in directory {tmp_path}"


# ----------------------------------------------------------------------------------------------
# retries


def test_retry_backoff_doubles_up_to_its_cap() -> None:
    policy = store.RetryPolicy(
        attempts=6, first_backoff_seconds=0.5, max_backoff_seconds=3.0, multiplier=2.0
    )
    assert policy.backoffs_seconds() == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert store.RetryPolicy(attempts=1).backoffs_seconds() == []


def test_retry_policy_needs_at_least_one_attempt() -> None:
    with pytest.raises(ValueError, match="attempts"):
        store.RetryPolicy(attempts=0)


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # closed again: connections are refused


def test_s3_store_on_a_closed_port_is_unavailable_after_bounded_retries() -> None:
    port = _closed_port()
    waits: list[float] = []
    zoo = store.S3Store(
        f"127.0.0.1:{port}", "zoo", access_key="a", secret_key="b",
        retry=store.RetryPolicy(attempts=3, first_backoff_seconds=0.25, multiplier=2.0),
        connect_timeout_seconds=2.0, sleep=waits.append,
    )
    with pytest.raises(store.StoreUnavailable) as caught:
        zoo.list_keys("models/")
    assert waits == [0.25, 0.5]
    message = str(caught.value)
    assert f"http://127.0.0.1:{port}" in message
    assert "3 times" in message
    assert contract.Env.ZOO_ENDPOINT in message


def _s3_error(code: str) -> minio.error.S3Error:
    return minio.error.S3Error(
        response=None,  # type: ignore[arg-type]  # not read by the store
        code=code, message="test", resource="/zoo", request_id="r", host_id="h",
    )


def _store_with_waits(waits: list[float]) -> store.S3Store:
    return store.S3Store(
        "127.0.0.1:9", "zoo", access_key="a", secret_key="b",
        retry=store.RetryPolicy(attempts=4, first_backoff_seconds=1.0), sleep=waits.append,
    )


def test_s3_store_does_not_retry_refused_credentials() -> None:
    waits: list[float] = []
    zoo = _store_with_waits(waits)

    def refused() -> None:
        raise _s3_error("InvalidAccessKeyId")

    with pytest.raises(store.StoreMisconfigured, match=contract.Env.ZOO_ACCESS_KEY) as caught:
        zoo._with_retries("list", None, refused)
    assert not isinstance(caught.value, store.StoreUnavailable)
    assert waits == []


def test_s3_store_retries_a_busy_server_until_it_answers() -> None:
    waits: list[float] = []
    zoo = _store_with_waits(waits)
    answers: Iterator[Exception | bytes] = iter(
        [_s3_error("SlowDown"), _s3_error("ServiceUnavailable"), b"data"]
    )

    def busy_then_fine() -> bytes:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert zoo._with_retries("get", "k", busy_then_fine) == b"data"
    assert waits == [1.0, 2.0]


def test_s3_store_turns_no_such_key_into_object_not_found() -> None:
    zoo = _store_with_waits([])

    def missing() -> None:
        raise _s3_error("NoSuchKey")

    with pytest.raises(store.ObjectNotFound, match="'models/x'"):
        zoo._with_retries("get", "models/x", missing)


# ----------------------------------------------------------------------------------------------
# endpoints and open_store


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        pytest.param("minio:9000", ("minio:9000", False), id="host-port"),
        pytest.param("http://minio:9000", ("minio:9000", False), id="http"),
        pytest.param("https://minio.example.com/", ("minio.example.com", True), id="https"),
    ],
)
def test_endpoints_are_host_port_with_an_optional_scheme(
    endpoint: str, expected: tuple[str, bool]
) -> None:
    assert store.parse_endpoint(endpoint) == expected


@pytest.mark.parametrize("endpoint", ["", "ftp://x:1", "http://x:1/bucket", "x:1/bucket"])
def test_endpoints_with_paths_or_other_schemes_are_rejected(endpoint: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        store.parse_endpoint(endpoint)


def test_a_plain_path_opens_a_directory_store(tmp_path: Path) -> None:
    opened = store.open_store(str(tmp_path / "zoo"), env={})
    assert isinstance(opened, store.DirStore)
    assert opened.root == tmp_path / "zoo"


def test_a_file_uri_opens_a_directory_store(tmp_path: Path) -> None:
    opened = store.open_store(f"file://{tmp_path}/my%20zoo", env={})
    assert isinstance(opened, store.DirStore)
    assert opened.root == tmp_path / "my zoo"


def test_the_default_zoo_is_a_local_directory() -> None:
    opened = store.open_store(store.DEFAULT_ZOO_URI, env={})
    assert isinstance(opened, store.DirStore)
    assert opened.root == Path.cwd() / ".kiln" / "zoo"


def test_an_s3_uri_opens_an_s3_store_at_the_endpoint_from_the_environment() -> None:
    env = {"KILN_ZOO_ENDPOINT": "https://minio.kiln:9000", "KILN_ZOO_ACCESS_KEY": "a",
           "KILN_ZOO_SECRET_KEY": "b"}
    opened = store.open_store("s3://models/team-a/zoo/", env=env)
    assert isinstance(opened, store.S3Store)
    assert opened.describe() == "s3://models/team-a/zoo/ at https://minio.kiln:9000"


def test_an_s3_uri_without_a_prefix_uses_the_bucket_root() -> None:
    opened = store.open_store("s3://zoo", env={"KILN_ZOO_ENDPOINT": "minio:9000"})
    assert opened.describe() == "s3://zoo/ at http://minio:9000"


@pytest.mark.parametrize(
    ("uri", "env", "match"),
    [
        pytest.param("", {}, "empty", id="empty"),
        pytest.param("s3://zoo", {}, "KILN_ZOO_ENDPOINT", id="no-endpoint"),
        pytest.param("s3:///prefix", {"KILN_ZOO_ENDPOINT": "m:1"}, "bucket", id="no-bucket"),
        pytest.param("gs://zoo", {}, "unsupported scheme", id="other-scheme"),
        pytest.param("file://host/zoo", {}, "file:///", id="file-with-host"),
        pytest.param("s3://Bad_Bucket", {"KILN_ZOO_ENDPOINT": "m:1"}, "bucket", id="bad-bucket"),
        pytest.param(
            "s3://zoo", {"KILN_ZOO_ENDPOINT": "m:1", "KILN_ZOO_ACCESS_KEY": "a"},
            "KILN_ZOO_SECRET_KEY", id="half-a-credential",
        ),
    ],
)
def test_open_store_explains_unusable_uris(uri: str, env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        store.open_store(uri, env=env)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param({}, (None, None), id="anonymous"),
        pytest.param(
            {"KILN_ZOO_ACCESS_KEY": "k", "KILN_ZOO_SECRET_KEY": "s",
             "AWS_ACCESS_KEY_ID": "ak", "AWS_SECRET_ACCESS_KEY": "as"},
            ("k", "s"), id="kiln-first",
        ),
        pytest.param(
            {"AWS_ACCESS_KEY_ID": "ak", "AWS_SECRET_ACCESS_KEY": "as"}, ("ak", "as"),
            id="aws-fallback",
        ),
    ],
)
def test_credentials_come_from_kiln_variables_then_aws_ones(
    env: dict[str, str], expected: tuple[str | None, str | None]
) -> None:
    assert store.credentials_from_env(env) == expected


def test_half_an_aws_credential_is_an_error() -> None:
    with pytest.raises(ValueError, match="AWS_SECRET_ACCESS_KEY"):
        store.credentials_from_env({"AWS_ACCESS_KEY_ID": "ak"})


# ----------------------------------------------------------------------------------------------
# credential providers: session tokens and cloud identities instead of static keys


def test_temporary_credentials_carry_their_session_token() -> None:
    env = {contract.Env.ZOO_ACCESS_KEY: "k", contract.Env.ZOO_SECRET_KEY: "s",
           "AWS_SESSION_TOKEN": "token"}
    provider = store.credentials_provider(env)
    assert provider is not None
    found = provider.retrieve()
    assert (found.access_key, found.secret_key, found.session_token) == ("k", "s", "token")
    kiln_first = store.credentials_provider({**env, contract.Env.ZOO_SESSION_TOKEN: "mine"})
    assert kiln_first is not None and kiln_first.retrieve().session_token == "mine"


def test_no_keys_mean_anonymous_requests_and_a_lone_token_is_an_error() -> None:
    assert store.credentials_provider({}) is None
    with pytest.raises(ValueError, match="session token is set, but no KILN_ZOO_ACCESS_KEY"):
        store.credentials_provider({contract.Env.ZOO_SESSION_TOKEN: "t"})


def test_iam_credentials_come_from_minios_iam_provider() -> None:
    provider = store.credentials_provider({contract.Env.ZOO_CREDENTIALS: "iam"})
    assert isinstance(provider, minio.credentials.providers.IamAwsProvider)
    zoo = store.open_store("s3://zoo", env={contract.Env.ZOO_ENDPOINT: "127.0.0.1:9",
                                           contract.Env.ZOO_CREDENTIALS: "iam"})
    assert isinstance(zoo, store.S3Store)  # nothing is contacted before the first request


def test_a_pods_web_identity_is_used_when_no_keys_are_set() -> None:
    token = {"AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/token", "AWS_ROLE_ARN": "arn:aws:iam::1:r"}
    assert isinstance(store.credentials_provider(token),
                      minio.credentials.providers.IamAwsProvider)
    keys = {**token, contract.Env.ZOO_ACCESS_KEY: "k", contract.Env.ZOO_SECRET_KEY: "s"}
    assert isinstance(store.credentials_provider(keys),
                      minio.credentials.providers.StaticProvider)


def test_an_unknown_credential_source_names_the_variable_and_the_choices() -> None:
    with pytest.raises(ValueError, match="KILN_ZOO_CREDENTIALS='vault': use keys .* or iam"):
        store.credentials_provider({contract.Env.ZOO_CREDENTIALS: "vault"})


def test_a_store_takes_keys_or_a_provider_not_both() -> None:
    provider = minio.credentials.providers.StaticProvider("k", "s")
    with pytest.raises(ValueError, match="keys or a credential provider, not both"):
        store.S3Store("127.0.0.1:9", "zoo", access_key="k", secret_key="s", credentials=provider)
