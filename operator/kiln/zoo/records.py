"""Zoo records: how trained models lie in an `ObjectStore`.

Layout (one folder per model; ids look like ``small_resnet-7f3c2a1b``)::

    models/<id>/weights.safetensors   the state dict, safetensors format (never pickle)
    models/<id>/graph.json            the warm-start graph (kiln.warmstart's JSON form)
    models/<id>/meta.json             the `ZooRecord` as JSON, written LAST
    checkpoints/<namespace>/<job>/checkpoint.pt   trainer checkpoints share the store

A record exists once its ``meta.json`` does: `write_record` writes it last and `delete_record`
removes it first, so readers never see half a record. `list_records` skips (and warns about)
folders without ``meta.json``, with an unreadable ``meta.json``, or with a missing weights or
graph file. The weights' SHA-256 is in ``meta.json`` and checked by `load_weights` (lazily, as
it means reading the whole file) and by `verify_record`.

The meta.json format itself (`ZooRecord`, its checked JSON form, ids) lives in
`kiln.zoo.metajson`; its names are re-exported here, so callers write `records.ZooRecord` as
the contract says.

Callers: the trainer (`write_record`, `load_weights`), the warm-start matcher and the operator
(`list_records`, `load_graph`), the CLI (listing, `verify_record`, `delete_record`).

Non-goals: no choosing between records (kiln.warmstart), no graph format (kiln.warmstart), no
index or cache: a listing reads every ``meta.json``. torch is imported only to (de)serialize
weights, so listing records does not import it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.zoo import metajson, store

if TYPE_CHECKING:
    import torch

# Re-exports: the record type and its format, under the names the contract gives them.
ZooModelId = metajson.ZooModelId
ZooRecord = metajson.ZooRecord
CorruptRecord = metajson.CorruptRecord
new_id = metajson.new_id
check_id = metajson.check_id
SCHEMA_VERSION = metajson.SCHEMA_VERSION
META_NAME = metajson.META_NAME

MODELS_PREFIX = "models/"
WEIGHTS_NAME = "weights.safetensors"
GRAPH_NAME = "graph.json"
CHECKPOINTS_PREFIX = "checkpoints/"
CHECKPOINT_NAME = "checkpoint.pt"

_log = logging.getLogger(__name__)


class SkippedRecordWarning(UserWarning):
    """`list_records` left out a record it could not use; the message names it and says why."""


def record_prefix(record_id: str) -> str:
    """``models/<id>/``: the key prefix of every object of a record."""
    return f"{MODELS_PREFIX}{check_id(record_id)}/"


def checkpoint_key(namespace: str, job_name: str) -> str:
    """``checkpoints/<namespace>/<job-name>/checkpoint.pt``: where a job's checkpoint lives.

    Raises:
        ValueError: a name that is not a single safe key component.
    """
    key = f"{CHECKPOINTS_PREFIX}{namespace}/{job_name}/{CHECKPOINT_NAME}"
    if "/" in namespace or "/" in job_name:
        raise ValueError(f"checkpoint key {key!r}: namespace and job name may not contain '/'")
    return store.check_key(key)


def write_record(
    zoo: store.ObjectStore,
    record: ZooRecord,
    weights: Mapping[str, torch.Tensor],
    graph: Mapping[str, Any],
) -> ZooRecord:
    """Add a model to the zoo: weights, then graph, then meta.json last.

    Args:
        zoo: the store.
        record: the metadata; `weights_sha256` may be empty (filled in here).
        weights: the state dict, name -> tensor (any device; copied to CPU).
        graph: the warm-start graph as a JSON-serializable dict.

    Returns:
        The record as stored, with `weights_sha256` set.

    Raises:
        ValueError: invalid id or fields, a record with this id already exists, weights that
            safetensors cannot hold, a graph that is not JSON, or a `weights_sha256` that does
            not match the weights.
        StoreUnavailable: the store failed; the record may be half-written (no meta.json), which
            readers skip.
    """
    prefix = record_prefix(record.id)
    data = _serialize_weights(record.id, weights)
    digest = hashlib.sha256(data).hexdigest()
    if record.weights_sha256 and record.weights_sha256 != digest:
        raise ValueError(
            f"zoo record {record.id}: weights_sha256 {record.weights_sha256} does not match the "
            f"weights given (sha256 {digest}); leave it empty to have it computed"
        )
    record = dataclasses.replace(record, weights_sha256=digest)
    meta = record.to_json()
    try:
        ZooRecord.from_json(meta, record_id=record.id)  # never write what we could not read
        graph_text = json.dumps(graph, indent=1)
    except CorruptRecord as exc:
        raise ValueError(f"refusing to write zoo record {record.id}: {exc.problem}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"zoo record {record.id}: graph is not JSON-serializable: {exc}") from exc
    if zoo.exists(prefix + META_NAME):
        raise ValueError(f"zoo record {record.id} already exists in {zoo.describe()}")
    zoo.put_bytes(prefix + WEIGHTS_NAME, data)
    zoo.put_bytes(prefix + GRAPH_NAME, graph_text.encode())
    zoo.put_bytes(prefix + META_NAME, meta.encode())
    return record


def read_record(zoo: store.ObjectStore, record_id: str) -> ZooRecord:
    """Read and check one record's meta.json (the weights are not read).

    Raises:
        ValueError: an invalid id.
        ObjectNotFound: no such record (no meta.json).
        CorruptRecord: meta.json is unreadable or names another id.
        StoreUnavailable: the store failed.
    """
    text = zoo.get_bytes(record_prefix(record_id) + META_NAME)
    record = ZooRecord.from_json(text, record_id=record_id)
    if record.id != record_id:
        raise CorruptRecord(
            record_id, f"{META_NAME} says id {record.id!r}, but it lies in models/{record_id}/",
            field="id",
        )
    return record


def load_weights(zoo: store.ObjectStore, record: ZooRecord) -> dict[str, torch.Tensor]:
    """The record's state dict on the CPU, after checking its SHA-256.

    Raises:
        CorruptRecord: the weights file is missing, fails its checksum, or is not safetensors.
        StoreUnavailable: the store failed.
    """
    import safetensors
    import safetensors.torch

    try:
        data = zoo.get_bytes(record_prefix(record.id) + WEIGHTS_NAME)
    except store.ObjectNotFound:
        raise CorruptRecord(record.id, f"{WEIGHTS_NAME} is missing; delete the record") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != record.weights_sha256:
        raise CorruptRecord(
            record.id, f"{WEIGHTS_NAME} ({len(data)} bytes) has sha256 {digest}, but "
            f"{META_NAME} expects {record.weights_sha256}: the file is damaged or was replaced; "
            "delete the record", field="weights_sha256",
        )
    try:
        return safetensors.torch.load(data)
    except (safetensors.SafetensorError, ValueError, RuntimeError) as exc:
        raise CorruptRecord(record.id, f"{WEIGHTS_NAME} is not valid safetensors: {exc}") from exc


def load_graph(zoo: store.ObjectStore, record: ZooRecord) -> dict[str, Any]:
    """The record's warm-start graph (graph.json) as a dict.

    Raises:
        CorruptRecord: graph.json is missing, not JSON (or nested too deeply to read), or not
            an object.
        StoreUnavailable: the store failed.
    """
    try:
        text = zoo.get_bytes(record_prefix(record.id) + GRAPH_NAME)
    except store.ObjectNotFound:
        raise CorruptRecord(record.id, f"{GRAPH_NAME} is missing; delete the record") from None
    graph = metajson.parse_json(text, record.id, GRAPH_NAME)
    if not isinstance(graph, dict):
        raise CorruptRecord(record.id, f"{GRAPH_NAME} holds {type(graph).__name__}, not an object")
    return graph


def verify_record(zoo: store.ObjectStore, record_id: str) -> ZooRecord:
    """Check a whole record: meta.json, the weights' checksum and format, graph.json.

    Returns:
        The record, when everything checks out.

    Raises:
        ValueError: an invalid id.
        ObjectNotFound: no such record.
        CorruptRecord: anything damaged (the message says what).
        StoreUnavailable: the store failed.
    """
    record = read_record(zoo, record_id)
    load_weights(zoo, record)
    load_graph(zoo, record)
    return record


def list_records(zoo: store.ObjectStore) -> list[ZooRecord]:
    """Every usable record, sorted by id; unusable ones are skipped with a warning.

    A record is skipped, with a `SkippedRecordWarning` naming it and saying why, when it has no
    meta.json (half-written or being deleted), an unreadable meta.json, or no weights or graph
    file. Checksums are not verified here (see `load_weights`, `verify_record`).

    Raises:
        StoreUnavailable: the store failed.
    """
    names_by_id: dict[str, set[str]] = {}
    for key in zoo.list_keys(MODELS_PREFIX):
        parts = key.split("/")
        if len(parts) == 3:  # models/<id>/<file>; anything deeper is not ours
            names_by_id.setdefault(parts[1], set()).add(parts[2])
    records = []
    for record_id, names in sorted(names_by_id.items()):
        missing = [n for n in (META_NAME, WEIGHTS_NAME, GRAPH_NAME) if n not in names]
        if META_NAME in missing:
            _skip(record_id, f"has no {META_NAME} (half-written, or being deleted)", zoo)
            continue
        if missing:
            _skip(record_id, f"{' and '.join(missing)} missing", zoo)
            continue
        try:
            records.append(read_record(zoo, record_id))
        except ValueError as exc:  # CorruptRecord, or a folder name that is no id
            _skip(record_id, f"unreadable: {exc}", zoo)
        except store.ObjectNotFound:
            _log.debug("zoo record %s was deleted while listing %s", record_id, zoo.describe())
    return records


def delete_record(zoo: store.ObjectStore, record_id: str) -> None:
    """Remove a record: meta.json first (so it vanishes at once), then its other files.

    Deleting a missing record is not an error.

    Raises:
        ValueError: an invalid id.
        StoreUnavailable: the store failed; the record may be half-deleted, which readers skip.
    """
    prefix = record_prefix(record_id)
    zoo.delete(prefix + META_NAME)
    for key in zoo.list_keys(prefix):
        zoo.delete(key)


# ----------------------------------------------------------------------------------------------
# helpers


def _skip(record_id: str, why: str, zoo: store.ObjectStore) -> None:
    warnings.warn(
        f"zoo record {record_id} in {zoo.describe()} skipped: {why}",
        SkippedRecordWarning,
        stacklevel=3,
    )


def _serialize_weights(record_id: str, weights: Mapping[str, torch.Tensor]) -> bytes:
    """safetensors bytes of a state dict, copied to CPU; tied tensors are stored twice."""
    import safetensors.torch

    tensors = {}
    storages: set[int] = set()
    for name, tensor in weights.items():
        cpu = tensor.detach().to("cpu").contiguous()
        pointer = cpu.untyped_storage().data_ptr()
        if pointer in storages:  # tied weights share storage, which safetensors refuses
            cpu = cpu.clone()
        elif pointer:
            storages.add(pointer)
        tensors[name] = cpu
    try:
        return safetensors.torch.save(tensors)
    except (ValueError, RuntimeError, TypeError) as exc:
        raise ValueError(f"zoo record {record_id}: cannot serialize the weights: {exc}") from exc
