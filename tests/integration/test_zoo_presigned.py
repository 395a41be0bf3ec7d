"""Presigned zoo access against a real S3 server (moto): the operator signs, a pod's
`PresignedStore` reads and writes exactly the granted objects, and nothing else.

moto does not check presigned signatures or expiry, so the refused-URL case answers from a
small local HTTP server with the error S3 gives an expired URL.
"""

from __future__ import annotations

import datetime
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import minio.credentials
import minio.credentials.providers
import pytest

from kiln import contract
from kiln.zoo import access, eviction, presigned, records, store

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
PARENT = "small_cnn-0000aaaa"
PRIVATE = "small_cnn-0000bbbb"
OWN = "small_cnn-0000cccc"
UID = "7d1c5e0a-0000-4000-8000-000000000001"  # the job's, as the API server sets it


@pytest.fixture
def operator_zoo(s3_server: Any, s3_bucket: str) -> store.S3Store:
    """The zoo as the operator opens it: with its credential."""
    return store.S3Store(s3_server.endpoint, s3_bucket, access_key=s3_server.access_key,
                         secret_key=s3_server.secret_key, prefix="team-zoo",
                         retry=store.RetryPolicy(attempts=1))


def _signed(zoo: store.S3Store, grants: presigned.Grants, path: Path) -> store.ObjectStore:
    """Mint `grants` into a manifest file at `path`; the pod's store over it."""
    manifest = presigned.mint(zoo, grants, lifetime=datetime.timedelta(hours=1),
                              now=datetime.datetime.now(datetime.UTC))
    path.write_text(manifest.to_json())
    return presigned.open_zoo(f"{contract.ZOO_ACCESS_SCHEME}:{path}", env={})


def test_a_pod_uses_its_own_objects_and_reads_only_granted_parents(
    operator_zoo: store.S3Store, tmp_path: Path,
) -> None:
    for record_id in (PARENT, PRIVATE):
        for name in (records.META_NAME, records.GRAPH_NAME, records.WEIGHTS_NAME):
            operator_zoo.put_bytes(records.record_prefix(record_id) + name, record_id.encode())
    grants = access.job_grants("team-b", "digits", uid=UID, record=OWN, parents=[PARENT],
                               now=NOW)
    pod = _signed(operator_zoo, grants, tmp_path / "manifest.json")
    assert isinstance(pod, presigned.PresignedStore) and pod.reserved_record == OWN

    # Its checkpoint: written, read, sized, deleted.
    checkpoint = records.checkpoint_key("team-b", "digits", UID)
    assert not pod.exists(checkpoint)
    pod.put_bytes(checkpoint, b"state")
    assert pod.get_bytes(checkpoint) == b"state" and pod.size_bytes(checkpoint) == 5
    assert operator_zoo.get_bytes(checkpoint) == b"state"  # the same bucket and prefix
    pod.delete(checkpoint)
    assert not operator_zoo.exists(checkpoint)
    with pytest.raises(store.ObjectNotFound, match="checkpoint"):
        pod.get_bytes(checkpoint)

    # The granted parent is readable, and its hit countable; never writable.
    meta = records.record_prefix(PARENT) + records.META_NAME
    assert pod.get_bytes(meta) == PARENT.encode()
    eviction.record_hit(pod, PARENT, now=NOW)
    assert list(eviction.hit_times(operator_zoo)) == [PARENT]
    with pytest.raises(presigned.NotGranted, match="may not put"):
        pod.put_bytes(meta, b"tampered")

    # Another namespace's private record: no URL at all, and listing does not reveal it.
    private_meta = records.record_prefix(PRIVATE) + records.META_NAME
    with pytest.raises(presigned.NotGranted, match=r"only its job's objects") as refused:
        pod.get_bytes(private_meta)
    assert private_meta in str(refused.value)
    assert PRIVATE not in str(pod.list_keys(records.MODELS_PREFIX))
    assert PRIVATE not in (tmp_path / "manifest.json").read_text()

    # Its own record: written under the reserved id, then deleted as a whole.
    own = records.record_prefix(OWN)
    for name in (records.WEIGHTS_NAME, records.GRAPH_NAME, records.META_NAME):
        pod.put_bytes(own + name, b"x")
    records.delete_record(pod, OWN)
    assert operator_zoo.list_keys(own) == []


def test_a_searching_pod_lists_visible_records_and_writes_none(
    operator_zoo: store.S3Store, tmp_path: Path,
) -> None:
    operator_zoo.put_bytes(records.record_prefix(PARENT) + records.GRAPH_NAME, b"{}")
    grants = access.job_grants("team-b", "entry", uid=UID, record=OWN, visible=[PARENT], now=NOW)
    pod = _signed(operator_zoo, grants, tmp_path / "manifest.json")
    prefix = records.record_prefix(PARENT)
    assert [k for k in pod.list_keys(prefix)] == [
        prefix + records.GRAPH_NAME, prefix + records.META_NAME, prefix + records.WEIGHTS_NAME]
    assert pod.get_bytes(prefix + records.GRAPH_NAME) == b"{}"
    with pytest.raises(presigned.NotGranted):
        pod.put_bytes(prefix + records.GRAPH_NAME, b"{}")
    with pytest.raises(presigned.NotGranted, match="no hit"):  # a profiling pod counts none
        eviction.record_hit(pod, PARENT, now=NOW)


def test_the_store_reads_the_manifest_again_when_the_operator_replaces_it(
    operator_zoo: store.S3Store, tmp_path: Path,
) -> None:
    path = tmp_path / "manifest.json"
    pod = _signed(operator_zoo, access.job_grants("team-b", "a", uid=UID, record=OWN, now=NOW),
                  path)
    profile = records.profile_key("team-b", "b")
    with pytest.raises(presigned.NotGranted):
        pod.put_bytes(profile, b"{}")
    # A Secret volume swaps the file for a new one; the same store sees the new grants.
    fresh = presigned.mint(operator_zoo,
                           access.job_grants("team-b", "b", uid=UID, record=OWN, now=NOW),
                           lifetime=datetime.timedelta(hours=1),
                           now=datetime.datetime.now(datetime.UTC))
    (tmp_path / "new.json").write_text(fresh.to_json())
    (tmp_path / "new.json").replace(path)
    pod.put_bytes(profile, b"{}")
    assert operator_zoo.get_bytes(profile) == b"{}"


class _Expired(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = (b"<?xml version='1.0'?><Error><Code>AccessDenied</Code>"
                b"<Message>Request has expired</Message></Error>")
        self.send_response(403)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def expired_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Expired)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/bucket/key?X-Amz-Expires=60"
    finally:
        server.shutdown()
        server.server_close()


def test_a_refused_url_is_a_misconfiguration_naming_the_manifest(
    tmp_path: Path, expired_url: str,
) -> None:
    path = tmp_path / "manifest.json"
    path.write_text(presigned.Manifest(expires=NOW, record=None,
                                       objects={"profiles/a/b.json": {"get": expired_url}}
                                       ).to_json())
    pod = presigned.PresignedStore(path, retry=store.RetryPolicy(attempts=3),
                                   sleep=lambda _: None)
    with pytest.raises(store.StoreMisconfigured, match="expired") as refused:
        pod.get_bytes("profiles/a/b.json")
    assert str(path) in str(refused.value) and "2026-01-02T03:04:05Z" in str(refused.value)


@pytest.mark.parametrize("text", ["", "{}", '{"expires": "soon", "objects": {}}',
                                  ('{"expires": "2026-01-02T03:04:05Z", "objects": '
                                   '{"../x": {"get": "http://h/x"}}}'),
                                  ('{"expires": "2026-01-02T03:04:05Z", "record": "../../x", '
                                   '"objects": {}}'),
                                  "[" * 100_000])
def test_a_damaged_or_missing_manifest_is_a_misconfiguration(tmp_path: Path, text: str) -> None:
    path = tmp_path / "manifest.json"
    if text:
        path.write_text(text)
    with pytest.raises(store.StoreMisconfigured, match="manifest") as refused:
        presigned.PresignedStore(path).list_keys("")
    assert str(path) in str(refused.value)


def test_urls_live_at_most_seven_days(operator_zoo: store.S3Store) -> None:
    with pytest.raises(ValueError, match="7 days"):
        presigned.mint(operator_zoo, presigned.Grants.of([]), lifetime=datetime.timedelta(
            days=8), now=NOW)
    with pytest.raises(ValueError, match="name the manifest file"):
        presigned.open_zoo(f"{contract.ZOO_ACCESS_SCHEME}:", env={})
    with pytest.raises(ValueError, match="only the trainer opens"):  # not the operator's zoo
        store.open_store(f"{contract.ZOO_ACCESS_SCHEME}:{contract.ZOO_ACCESS_DIR}", env={})


def test_urls_signed_with_a_temporary_credential_die_with_it(
        s3_server: Any, s3_bucket: str) -> None:
    """A URL works only while the credential that signed it does: the lifetime is cut to the
    session's, and a session about to end signs nothing."""
    def operator_with(expiry: datetime.datetime | None) -> store.S3Store:
        credentials = minio.credentials.Credentials(
            s3_server.access_key, s3_server.secret_key, session_token="session-token",
            expiration=expiry)
        provider = minio.credentials.providers.StaticProvider(
            s3_server.access_key, s3_server.secret_key, "session-token")
        provider.retrieve = lambda: credentials  # type: ignore[method-assign]
        return store.S3Store(s3_server.endpoint, s3_bucket, access_key=None, secret_key=None,
                             credentials=provider, retry=store.RetryPolicy(attempts=1))

    grants = presigned.Grants.of([("profiles/a/b.json", ["put"])])
    soon = operator_with(NOW + datetime.timedelta(minutes=50))
    manifest = presigned.mint(soon, grants, lifetime=datetime.timedelta(hours=24), now=NOW)
    assert manifest.expires == NOW + datetime.timedelta(minutes=50)
    unknown = operator_with(None)  # a token that does not say: an hour, STS's default
    manifest = presigned.mint(unknown, grants, lifetime=datetime.timedelta(hours=24), now=NOW)
    assert manifest.expires == NOW + store.UNKNOWN_TOKEN_LIFETIME
    ending = operator_with(NOW + datetime.timedelta(seconds=20))
    with pytest.raises(store.StoreUnavailable, match="expires at .* too soon"):
        presigned.mint(ending, grants, lifetime=datetime.timedelta(hours=24), now=NOW)


def test_a_trainer_warm_starts_and_registers_through_its_presigned_access_alone(
    operator_zoo: store.S3Store, s3_server: Any, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The parent is trained with the zoo credential, as any job before; the child sees
    only its manifest: no endpoint, no keys in its environment."""
    import io

    from kiln import api
    from kiln.zoo import access as zoo_access
    from kiln_trainer import loop, warm

    def job(name: str, epochs: int) -> api.TrainingJob:
        return api.parse_job({
            "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": name, "namespace": "team-b", "uid": UID},
            "spec": {"model": {"architecture": "small_cnn", "args": {"depth": 2, "width": 8},
                               "inputShape": [1, 8, 8]},
                     "dataset": {"name": "digits", "maxSamples": 400},
                     "training": {"epochs": epochs, "batchSize": 32, "optimizer": {
                         "name": "adam", "lr": 0.01, "weightDecay": 0.0}},
                     "zoo": {"provisionalEveryEvaluations": 1}}})

    for name, value in ((contract.Env.ZOO_ENDPOINT, s3_server.endpoint),
                        (contract.Env.ZOO_ACCESS_KEY, s3_server.access_key),
                        (contract.Env.ZOO_SECRET_KEY, s3_server.secret_key)):
        monkeypatch.setenv(name, value)
    uri = f"s3://{operator_zoo.describe().split('/')[2]}/team-zoo"
    loop.main(job("parent", 6), zoo_uri=uri, out=io.StringIO(), termination_log=None)
    parent = records.list_records(operator_zoo)[0]

    child = job("child", 1)
    decided = warm.decide(child, operator_zoo)  # the operator's decision
    assert decided.parent == parent.id
    # A profiling pod decides the same from the visible records' graphs, without weights.
    searching = _signed(operator_zoo, zoo_access.job_grants(
        "team-b", "child", uid=UID, record=OWN, visible=[parent.id], now=NOW),
        tmp_path / "search.json")
    assert warm.decide(child, searching).parent == parent.id
    grants = zoo_access.job_grants("team-b", "child", uid=UID, record=OWN, now=NOW,
                                   parents=[decided.parent, *decided.alternatives])
    pod = _signed(operator_zoo, grants, tmp_path / "manifest.json")
    for name in (contract.Env.ZOO_ENDPOINT, contract.Env.ZOO_ACCESS_KEY,
                 contract.Env.ZOO_SECRET_KEY):
        monkeypatch.delenv(name)
    result = loop.main(child, zoo_uri=f"presigned:{pod.describe().rpartition(' ')[2]}",
                       warm_decision=decided, out=io.StringIO(), termination_log=None)
    assert (result["parent"], result["zoo_model"]) == (parent.id, OWN), result["warm_start"]
    registered = records.read_record(operator_zoo, OWN)
    assert (registered.parent, registered.provisional) == (parent.id, False)
    [evaluation] = records.read_history(operator_zoo, registered)  # `kiln plot`'s curve
    assert evaluation["validation_accuracy"] == result["validation_accuracy"]
    assert list(eviction.hit_times(operator_zoo)) == [parent.id]
    assert operator_zoo.list_keys(records.CHECKPOINTS_PREFIX) == []


def test_under_an_older_operators_grants_a_record_is_registered_without_its_history(
    operator_zoo: store.S3Store, tmp_path: Path,
) -> None:
    from kiln import api, models
    from kiln_trainer import registration, tracking

    grants = access.job_grants("team-b", "digits", uid=UID, record=OWN, now=NOW)
    older = presigned.Grants.of([(key, verbs) for key, verbs in grants.objects.items()
                                 if not key.endswith(records.HISTORY_NAME)], record=OWN)
    pod = _signed(operator_zoo, older, tmp_path / "manifest.json")
    job = api.parse_job({"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
                         "metadata": {"name": "digits", "namespace": "team-b", "uid": UID},
                         "spec": {"model": {"architecture": "small_cnn",
                                            "inputShape": [1, 8, 8]}}})
    state = tracking.RunState(history=[{"step": 5, "validation_accuracy": 0.5,
                                        "validation_loss": 1.0}])
    cold = api.WarmStartDecision(outcome=api.WarmStartOutcome.COLD_EMPTY, reason="empty zoo")
    assert registration.register_model(pod, job, models.build(job.spec.model), state,
                                       state.history[-1], cold) == OWN
    registered = records.verify_record(operator_zoo, OWN)
    with pytest.raises(store.ObjectNotFound):
        records.read_history(operator_zoo, registered)


def test_a_searching_pods_manifest_keeps_the_newest_records_that_fit_a_secret(
        operator_zoo: store.S3Store, monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.controller import zoo_access

    monkeypatch.setattr(zoo_access, "MAX_MANIFEST_BYTES", 40_000)
    visible = [f"small_cnn-{i:08x}" for i in range(64)]  # newest first

    def grants(seen: list[str]) -> presigned.Grants:
        return access.job_grants("team-b", "digits", uid=UID, record=OWN, visible=seen,
                                 now=NOW)

    manifest = zoo_access.sign_within_budget(operator_zoo, grants, visible,
                                             lifetime=datetime.timedelta(hours=1), now=NOW)
    assert len(manifest.to_json()) <= 40_000
    kept = {key.split("/")[1] for key in manifest.objects if key.startswith("models/")} - {OWN}
    assert kept and kept == set(visible[: len(kept)])  # a newest prefix, halved to fit
    assert len(kept) < len(visible)

