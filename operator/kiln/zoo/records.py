"""Zoo records: how trained models lie in an `ObjectStore`, and their meta.json format.

A record exists once its ``meta.json`` does: `write_record` writes it last and `delete_record`
removes it first, so readers never see half a record. No choosing between records, no graph
format, no index or cache; torch is imported only to (de)serialize weights.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import math
import re
import secrets
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NewType

from kiln.zoo import store

ZooModelId = NewType("ZooModelId", str)

SCHEMA_VERSION = 2
"""Version of the meta.json format; readers reject records from a newer version.

Version 2 added ``entrypoint`` (a record may have no ``architecture``), ``source`` and
``license``. A record with an architecture is written as version 1, which older readers load.
"""

META_NAME = "meta.json"
"""The file holding a record's `ZooRecord` (in its folder ``models/<id>/``)."""

# Ids become one key component: keep them to letters, digits, '_', '.', '-' (no '/', no '..').
_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")
# "package.module:callable": dotted identifiers, a colon, a dotted attribute path.
_ENTRYPOINT_PATTERN = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")

MAX_COUNT = 10**13
"""Largest believable count in meta.json (num_params): ten times today's largest models."""


class CorruptRecord(ValueError):
    """A zoo record is damaged: bad meta.json, weights that fail their checksum, missing files.

    Attributes:
        record_id: the record's id (its folder name).
        problem: what is wrong, one sentence.
        field: the meta.json field at fault, or None.
    """

    def __init__(self, record_id: str, problem: str, *, field: str | None = None) -> None:
        super().__init__(f"zoo record {record_id}: {problem}")
        self.record_id = record_id
        self.problem = problem
        self.field = field


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZooRecord:
    """Everything the zoo knows about one trained model (stored as meta.json).

    Attributes:
        id: the record id, e.g. ``small_resnet-7f3c2a1b`` (see `new_id`).
        architecture: model registry name (`kiln.models`), or None for an entrypoint model.
        entrypoint: the user's builder, ``package.module:callable``, or None for a registry
            model. Exactly one of `architecture` and `entrypoint` is set.
        args: the builder's keyword arguments (JSON values).
        input_shape: one sample's shape without the batch: (C, H, W) or (T,).
        modality: ``image`` or ``text`` (`kiln.models.Modality` values).
        task: ``classification`` or ``language_modeling`` (`kiln.models.Task` values).
        dataset: dataset name the model was trained on (`kiln.api.DatasetName` values).
        metric_name: the job's target metric, ``validation_accuracy`` or ``validation_loss``.
        metric_value: its final value.
        validation_accuracy: final validation accuracy in [0, 1], or None.
        validation_loss: final validation loss, or None.
        samples_per_second: training throughput (samples/s), or None.
        num_params: number of parameters.
        parent: the zoo id it was warm-started from, or None (cold start).
        similarity: architectural similarity to the parent in [0, 1], or None.
        created_time: when it was registered, RFC 3339 (``2024-05-01T12:00:00Z``).
        weights_sha256: hex SHA-256 of weights.safetensors; `write_record` fills it in.
        job_name: name of the TrainingJob that produced it.
        job_spec: that job as its wire dict (`kiln.api.to_wire`); for imported weights only
            ``{"spec": {"model": ...}}``.
        source: where imported weights came from (a file path or URL), or None for a model
            trained by Kiln.
        license: the imported weights' license (free text), or None.
    """

    id: ZooModelId
    architecture: str | None = None
    entrypoint: str | None = None
    args: dict[str, Any]
    input_shape: tuple[int, ...]
    modality: str
    task: str
    dataset: str
    metric_name: str
    metric_value: float
    validation_accuracy: float | None = None
    validation_loss: float | None = None
    samples_per_second: float | None = None
    num_params: int
    parent: ZooModelId | None = None
    similarity: float | None = None
    created_time: str
    weights_sha256: str = ""
    job_name: str
    job_spec: dict[str, Any]
    source: str | None = None
    license: str | None = None

    def __post_init__(self) -> None:
        problem = _builder_problem(self.architecture, self.entrypoint)
        if problem:
            raise ValueError(f"zoo record {self.id}: {problem}")

    @property
    def builder(self) -> str:
        """What builds the model: the registry name, or the entrypoint."""
        return self.architecture or self.entrypoint or ""

    def to_json(self) -> str:
        """meta.json text: the fields plus ``schema_version``, with a trailing newline.

        The version is the oldest that can read the record: 1 unless it has an entrypoint.
        """
        doc: dict[str, Any] = {"schema_version": 1 if self.entrypoint is None else SCHEMA_VERSION}
        doc.update(dataclasses.asdict(self))
        doc["input_shape"] = list(self.input_shape)
        return json.dumps(doc, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, record_id: str = "<unknown>") -> ZooRecord:
        """Parse and type-check meta.json; unknown fields are ignored (forward compatibility).

        Args:
            text: the meta.json contents.
            record_id: the id to name in errors (the record's folder).

        Raises:
            CorruptRecord: not JSON, not an object, a newer or missing ``schema_version``, a
                missing field, or a field of the wrong type or format (named in the message).
        """
        doc = parse_json(text, record_id, META_NAME)
        if not isinstance(doc, dict):
            raise CorruptRecord(record_id, f"{META_NAME} holds {type(doc).__name__}, not an object")
        if record_id == "<unknown>" and isinstance(doc.get("id"), str):
            record_id = doc["id"]
        version = doc.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise CorruptRecord(
                record_id, f"{META_NAME} field 'schema_version': expected a positive integer, "
                f"got {version!r}", field="schema_version",
            )
        if version > SCHEMA_VERSION:
            raise CorruptRecord(
                record_id, f"{META_NAME} has schema_version {version} > {SCHEMA_VERSION}: written "
                "by a newer Kiln; upgrade Kiln to read it", field="schema_version",
            )
        values: dict[str, Any] = {}
        for name, (kind, nullable) in _FIELD_KINDS.items():
            if name not in doc and name in _ADDED_IN_VERSION_2:
                values[name] = None  # a record written before the field existed
                continue
            if name not in doc:
                raise CorruptRecord(
                    record_id, f"{META_NAME} field {name!r} is missing", field=name
                )
            value = doc[name]
            if value is None and nullable:
                values[name] = None
                continue
            try:
                values[name] = _CONVERTERS[kind](value)
            except (TypeError, ValueError) as exc:
                raise CorruptRecord(
                    record_id, f"{META_NAME} field {name!r}: expected {exc}, got "
                    f"{type(value).__name__} {_short(value)}", field=name,
                ) from None
        problem = _builder_problem(values["architecture"], values["entrypoint"])
        if problem:
            raise CorruptRecord(record_id, f"{META_NAME}: {problem}", field="entrypoint")
        return cls(**values)


def new_id(architecture: str) -> ZooModelId:
    """A fresh record id: the architecture name, a dash, 8 random hex digits.

    Example: ``new_id("small_resnet")`` gives e.g. ``small_resnet-7f3c2a1b``; an entrypoint
    gives its callable's name: ``new_id("mynets.mixer:build_mixer")``, ``build_mixer-0c1d2e3f``.
    """
    name = architecture.rpartition(":")[2]
    slug = re.sub(r"[^a-z0-9_]+", "_", name.lower()).strip("_")[:100] or "model"
    return ZooModelId(f"{slug}-{secrets.token_hex(4)}")


def check_id(record_id: str) -> ZooModelId:
    """Return `record_id` as a `ZooModelId` if it can name a record folder.

    Raises:
        ValueError: not 1-128 of letters, digits, '_', '.', '-' starting with a letter or digit.
    """
    if not _ID_PATTERN.fullmatch(record_id):
        raise ValueError(
            f"invalid zoo model id {record_id!r}: use letters, digits, '_', '.', '-' (at most "
            "128), starting with a letter or digit, e.g. small_resnet-7f3c2a1b"
        )
    return ZooModelId(record_id)


def parse_json(text: str | bytes, record_id: str, name: str) -> Any:
    """`text` decoded as JSON; anything unreadable is a `CorruptRecord` naming the file.

    Besides syntax errors this covers nesting too deep for the decoder (RecursionError: a
    hostile ``[[[[...]]]]``) and integers longer than Python's 4,300-digit limit (ValueError).
    """
    try:
        return json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptRecord(record_id, f"{name} is not valid JSON ({exc})") from None
    except RecursionError:
        raise CorruptRecord(record_id, f"{name} is nested too deeply to read") from None
    except ValueError as exc:  # e.g. an integer over sys.get_int_max_str_digits() digits
        raise CorruptRecord(record_id, f"{name} is not usable JSON ({exc})") from None


def _builder_problem(architecture: str | None, entrypoint: str | None) -> str:
    """Why this pair cannot build a model (exactly one must be set), or ``""``."""
    if architecture is None and entrypoint is None:
        return "neither 'architecture' nor 'entrypoint' is set; a record needs exactly one"
    if architecture is not None and entrypoint is not None:
        return (f"both 'architecture' ({architecture!r}) and 'entrypoint' ({entrypoint!r}) are "
                "set; a record needs exactly one")
    return ""


def _short(value: Any) -> str:
    text = repr(value)
    return f"({text[:60]}...)" if len(text) > 60 else f"({text})"


def _as_str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("a string")
    return value


def _as_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError("a number")
    if not math.isfinite(value):  # json.loads accepts NaN and Infinity; no metric may be one
        raise TypeError("a finite number")
    return float(value)


def _as_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError("a non-negative integer")
    if value > MAX_COUNT:
        raise TypeError(f"a count up to {MAX_COUNT:,}")
    return value


def _as_object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError("an object")
    return value


def _as_shape(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value
    ):
        raise TypeError("a non-empty list of positive integers")
    return tuple(value)


def _as_id(value: Any) -> ZooModelId:
    if not isinstance(value, str) or not _ID_PATTERN.fullmatch(value):
        raise TypeError("a zoo model id such as small_resnet-7f3c2a1b")
    return ZooModelId(value)


def _as_entrypoint(value: Any) -> str:
    if not isinstance(value, str) or not _ENTRYPOINT_PATTERN.fullmatch(value):
        raise TypeError("an entrypoint such as mypackage.models:build_net")
    return value


def _as_time(value: Any) -> str:
    try:
        datetime.datetime.fromisoformat(_as_str(value))
    except (TypeError, ValueError):
        raise TypeError("an RFC 3339 time such as 2024-05-01T12:00:00Z") from None
    return str(value)


def _as_sha256(value: Any) -> str:
    if not isinstance(value, str) or not _SHA256_PATTERN.fullmatch(value):
        raise TypeError("64 lowercase hex digits (SHA-256)")
    return value


_CONVERTERS: dict[str, Any] = {
    "str": _as_str, "number": _as_number, "count": _as_count, "object": _as_object,
    "shape": _as_shape, "id": _as_id, "time": _as_time, "sha256": _as_sha256,
    "entrypoint": _as_entrypoint,
}

# meta.json fields: name -> (converter kind, may be null). A unit test keeps this in step with
# ZooRecord's fields.
_FIELD_KINDS: dict[str, tuple[str, bool]] = {
    "id": ("id", False),
    "architecture": ("str", True),
    "entrypoint": ("entrypoint", True),
    "args": ("object", False),
    "input_shape": ("shape", False),
    "modality": ("str", False),
    "task": ("str", False),
    "dataset": ("str", False),
    "metric_name": ("str", False),
    "metric_value": ("number", False),
    "validation_accuracy": ("number", True),
    "validation_loss": ("number", True),
    "samples_per_second": ("number", True),
    "num_params": ("count", False),
    "parent": ("id", True),
    "similarity": ("number", True),
    "created_time": ("time", False),
    "weights_sha256": ("sha256", False),
    "job_name": ("str", False),
    "job_spec": ("object", False),
    "source": ("str", True),
    "license": ("str", True),
}

# Fields that version-1 records lack: absent means None.
_ADDED_IN_VERSION_2 = frozenset({"entrypoint", "source", "license"})

if TYPE_CHECKING:
    import torch

# Layout, one folder per model (ids look like ``small_resnet-7f3c2a1b``):
#     models/<id>/weights.safetensors   the state dict, safetensors format (never pickle)
#     models/<id>/graph.json            the model's architecture graph, as JSON
#     models/<id>/meta.json             the `ZooRecord` as JSON, written LAST
#     checkpoints/<namespace>/<job>/checkpoint.pt   trainer checkpoints share the store
#     profiles/<namespace>/<job>.json   what the trainer's profiling step measured, graph included
# The weights' SHA-256 is in meta.json, checked by `load_weights` (lazily: it means reading the
# whole file) and by `verify_record`.
MODELS_PREFIX = "models/"
WEIGHTS_NAME = "weights.safetensors"
GRAPH_NAME = "graph.json"
CHECKPOINTS_PREFIX = "checkpoints/"
CHECKPOINT_NAME = "checkpoint.pt"
PROFILES_PREFIX = "profiles/"

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
    return _job_key("checkpoint", f"{CHECKPOINTS_PREFIX}{namespace}/{job_name}/{CHECKPOINT_NAME}",
                    namespace, job_name)


def profile_key(namespace: str, job_name: str) -> str:
    """``profiles/<namespace>/<job-name>.json``: where the profiling step leaves a job's profile.

    Raises:
        ValueError: a name that is not a single safe key component.
    """
    return _job_key("profile", f"{PROFILES_PREFIX}{namespace}/{job_name}.json", namespace,
                    job_name)


def _job_key(what: str, key: str, namespace: str, job_name: str) -> str:
    """`key`, checked: a job's namespace and name are each one key component."""
    if "/" in namespace or "/" in job_name:
        raise ValueError(f"{what} key {key!r}: namespace and job name may not contain '/'")
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
    graph = parse_json(text, record.id, GRAPH_NAME)
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
