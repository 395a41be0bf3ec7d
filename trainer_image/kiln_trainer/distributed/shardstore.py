"""torch.distributed.checkpoint (DCP) storage over Kiln's object store, without pickle.

Each rank's items go in one safetensors object, DCP's metadata in one JSON object; non-tensor
items (optimizer settings) travel as torch.save bytes inside the safetensors object and are
read only with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import pickle
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import safetensors
import safetensors.torch
import torch
from torch import distributed as dist
from torch.distributed.checkpoint import (
    _traverse,
    default_planner,
    state_dict_loader,
    state_dict_saver,
)
from torch.distributed.checkpoint import api as dcp_api
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint import storage as dcp_storage
from torch.futures import Future

from kiln.zoo import store as zoo_store

FORMAT = "kiln-dcp-safetensors-1"  # the JSON metadata's "format"
_BYTES_DTYPE = torch.uint8


class ShardsUnreadable(ValueError):
    """A shard or metadata object is missing or damaged; the message names the object."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one sharded save lives in a store.

    Attributes:
        store: the object store.
        shard_key: rank -> key of that rank's safetensors object.
        metadata_key: key of the JSON metadata.
        save_id: names one save; every object of it carries the id, so a reader refuses
            objects left by another (interrupted) save in the same keys.
    """

    store: zoo_store.ObjectStore
    shard_key: Callable[[int], str]
    metadata_key: str
    save_id: str

    def describe(self, key: str) -> str:
        return f"{key} in {self.store.describe()}"


@dataclasses.dataclass(frozen=True)
class _Stored:
    """Where one item lies: the writing rank's object, and the tensor's name inside it."""

    rank: int
    name: str


def save(state_dict: dict[str, Any], layout: Layout) -> int:
    """`dcp.save` of `state_dict` (collective when a process group exists) into `layout`.

    Returns:
        The bytes of this rank's object.

    Raises:
        zoo_store.StoreUnavailable: a write failed (on any rank: every rank raises).
    """
    writer = StoreWriter(layout)
    try:
        with _one_process_quietly():
            state_dict_saver.save(state_dict, storage_writer=writer,
                                  no_dist=not dist.is_initialized())
    except dcp_api.CheckpointException as exc:  # a BaseException carrying each rank's error
        raise _first_failure(exc) from None
    return writer.written


def load(state_dict: dict[str, Any], layout: Layout) -> None:
    """`dcp.load` into `state_dict` in place, resharding to its tensors' layout.

    Raises:
        ShardsUnreadable: the metadata or a shard object is missing or damaged.
        zoo_store.StoreUnavailable: a read failed.
    """
    reader = StoreReader(layout)
    reader.read_metadata()  # its errors first, as themselves (DCP rewords them)
    try:
        with _one_process_quietly():
            state_dict_loader.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(),
                                   no_dist=not dist.is_initialized())
    except dcp_api.CheckpointException as exc:
        raise _first_failure(exc) from None


@contextlib.contextmanager
def _one_process_quietly() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _first_failure(exc: dcp_api.CheckpointException) -> BaseException:
    """The first rank's own exception (ShardsUnreadable, StoreUnavailable, ...)."""
    failures = sorted(exc.failures.items())
    if not failures:
        return RuntimeError(str(exc))
    first: BaseException = failures[0][1][0]
    return first


class SafeLoadPlanner(default_planner.DefaultLoadPlanner):
    """DCP's load planner, but non-tensor items unpickle with ``weights_only=True``."""

    def load_bytes(self, read_item: dcp_planner.ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
            raise ShardsUnreadable(f"item {read_item.dest_index.fqn} does not load "
                                   f"({type(exc).__name__})") from exc
        if self.flatten_state_dict:
            _traverse.set_element(self.original_state_dict,
                                  self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class StoreWriter(dcp_storage.StorageWriter):
    """Writes each rank's items as one safetensors object; the coordinator the JSON metadata."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.written = 0

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: dcp_planner.SavePlan) -> dcp_planner.SavePlan:
        return plan

    def prepare_global_plan(
        self, plans: list[dcp_planner.SavePlan]
    ) -> list[dcp_planner.SavePlan]:
        # the plan's position is its rank: it names the object the rank writes
        return [dataclasses.replace(plan, storage_data=rank) for rank, plan in enumerate(plans)]

    def write_data(
        self, plan: dcp_planner.SavePlan, planner: dcp_planner.SavePlanner
    ) -> Future[list[dcp_storage.WriteResult]]:
        rank = int(plan.storage_data or 0)
        tensors: dict[str, torch.Tensor] = {}
        results = []
        for number, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            if item.type == dcp_planner.WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                tensor = torch.frombuffer(bytearray(data.getvalue()) or bytearray(1),
                                          dtype=_BYTES_DTYPE)[: len(data.getvalue())]
            else:
                assert isinstance(data, torch.Tensor)
                tensor = data.detach().to("cpu").contiguous()
            if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                tensor = tensor.clone()  # safetensors refuses views into a larger storage
            name = str(number)
            tensors[name] = tensor
            results.append(dcp_storage.WriteResult(
                index=item.index, size_in_bytes=tensor.numel() * tensor.element_size(),
                storage_data=_Stored(rank, name)))
        blob = safetensors.torch.save(tensors, metadata={"save": self.layout.save_id,
                                                         "rank": str(rank)})
        self.layout.store.put_bytes(self.layout.shard_key(rank), blob)
        self.written = len(blob)
        future: Future[list[dcp_storage.WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: dcp_metadata.Metadata,
               results: list[list[dcp_storage.WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        data = {**metadata_to_json(metadata), "save": self.layout.save_id}
        self.layout.store.put_bytes(self.layout.metadata_key, json.dumps(data).encode())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # never picked by a path: given explicitly


class StoreReader(dcp_storage.StorageReader):
    """Reads what `StoreWriter` wrote, fetching only the rank objects this rank needs."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.storage: dict[dcp_metadata.MetadataIndex, _Stored] = {}
        self._metadata: dcp_metadata.Metadata | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if self._metadata is None:
            self._metadata = self._read_metadata()
        return self._metadata

    def _read_metadata(self) -> dcp_metadata.Metadata:
        key = self.layout.metadata_key
        try:
            data = self.layout.store.get_bytes(key)
        except zoo_store.ObjectNotFound:
            raise ShardsUnreadable(f"{self.layout.describe(key)} is missing") from None
        try:
            fields = json.loads(data)
            metadata = metadata_from_json(fields)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError,
                RuntimeError) as exc:  # RuntimeError: JSON nested too deep
            raise ShardsUnreadable(f"{self.layout.describe(key)} is not shard metadata "
                                   f"({type(exc).__name__}: {exc})") from exc
        self._check_save(key, fields.get("save"))
        return metadata

    def _check_save(self, key: str, found: object) -> None:
        if found != self.layout.save_id:
            raise ShardsUnreadable(f"{self.layout.describe(key)} belongs to save {found!r}, not "
                                   f"{self.layout.save_id!r} (a save was interrupted)")

    def set_up_storage_reader(self, metadata: dcp_metadata.Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        self.storage = metadata.storage_data

    def prepare_local_plan(self, plan: dcp_planner.LoadPlan) -> dcp_planner.LoadPlan:
        return plan

    def prepare_global_plan(
        self, plans: list[dcp_planner.LoadPlan]
    ) -> list[dcp_planner.LoadPlan]:
        return plans

    def read_data(self, plan: dcp_planner.LoadPlan,
                  planner: dcp_planner.LoadPlanner) -> Future[None]:
        by_rank: dict[int, list[dcp_planner.ReadItem]] = {}
        for item in plan.items:
            by_rank.setdefault(self.storage[item.storage_index].rank, []).append(item)
        for rank, items in sorted(by_rank.items()):
            key = self.layout.shard_key(rank)
            tensors = self._read_object(key, rank)
            for item in items:
                name = self.storage[item.storage_index].name
                if name not in tensors:
                    raise ShardsUnreadable(f"{self.layout.describe(key)} lacks tensor {name} "
                                           f"({item.storage_index.fqn})")
                tensor = tensors[name]
                if item.type == dcp_planner.LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(tensor.numpy().tobytes()))
                    continue
                part = _narrow(tensor, item.storage_offsets, item.lengths)
                if part is None:
                    raise ShardsUnreadable(
                        f"{self.layout.describe(key)}: tensor {name} has shape "
                        f"{tuple(tensor.size())}, too small for its part of "
                        f"{item.storage_index.fqn} (the metadata names another tensor)")
                target = planner.resolve_tensor(item).detach()
                if target.size() != part.size():
                    raise ShardsUnreadable(
                        f"{self.layout.describe(key)}: {item.storage_index.fqn} has shape "
                        f"{tuple(part.size())}, expected {tuple(target.size())}")
                target.copy_(part)
                planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_object(self, key: str, rank: int) -> dict[str, torch.Tensor]:
        try:
            data = self.layout.store.get_bytes(key)
        except zoo_store.ObjectNotFound:
            raise ShardsUnreadable(f"{self.layout.describe(key)} is missing") from None
        try:
            tensors = safetensors.torch.load(data)
            size = int.from_bytes(data[:8], "little")  # safetensors: u64 header size, JSON
            header = json.loads(data[8:8 + size])
        except (safetensors.SafetensorError, ValueError, RuntimeError) as exc:
            raise ShardsUnreadable(f"{self.layout.describe(key)} is not a safetensors shard "
                                   f"({type(exc).__name__}: {exc})") from exc
        written = header.get("__metadata__") or {}
        self._check_save(key, written.get("save"))
        if written.get("rank", str(rank)) != str(rank):  # absent: written before ranks were kept
            raise ShardsUnreadable(f"{self.layout.describe(key)} holds rank "
                                   f"{written.get('rank')}'s shard, not rank {rank}'s (objects "
                                   "were moved or copied between ranks)")
        return tensors

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]
            ) -> torch.Tensor | None:
    """The part of a stored chunk one read item asks for; None when the chunk lacks it."""
    if tensor.dim() != len(offsets) or any(
            offset < 0 or offset + length > size
            for offset, length, size in zip(offsets, lengths, tensor.size(), strict=True)):
        return None
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


# ----------------------------------------------------------------------------------------------
# DCP's Metadata as JSON: dtypes by name, sizes as lists, object paths as lists of str | int


def metadata_to_json(metadata: dcp_metadata.Metadata) -> dict[str, Any]:
    """`metadata` (storage data of `StoreWriter`) as plain JSON values."""
    tensors, byte_items = {}, []
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, dcp_metadata.BytesStorageMetadata):
            byte_items.append(fqn)
            continue
        tensors[fqn] = {
            "dtype": str(item.properties.dtype).removeprefix("torch."),
            "size": list(item.size),
            "chunks": [[list(c.offsets), list(c.sizes)] for c in item.chunks],
        }
    planner_data = metadata.planner_data or {}
    return {
        "format": FORMAT,
        "version": metadata.version,
        "tensors": tensors,
        "bytes": byte_items,
        "paths": {fqn: list(path) for fqn, path in planner_data.items()},
        "storage": [[index.fqn, None if index.offset is None else list(index.offset),
                     index.index, stored.rank, stored.name]
                    for index, stored in metadata.storage_data.items()],
    }


def metadata_from_json(data: dict[str, Any]) -> dcp_metadata.Metadata:
    """The inverse of `metadata_to_json`, checking what DCP does not: every tensor's chunks lie
    inside it and fill it, and every chunk and non-tensor item has an object (a rank >= 0)
    and a name there; otherwise DCP would leave parts of the model silently unloaded.

    Raises:
        ValueError, KeyError, TypeError: not what `metadata_to_json` writes.
    """
    if data.get("format") != FORMAT:
        raise ValueError(f"format {data.get('format')!r}, expected {FORMAT!r}")
    storage: dict[dcp_metadata.MetadataIndex, _Stored] = {}
    for fqn, offset, index, rank, name in data["storage"]:
        if not isinstance(name, str) or _whole(rank) < 0:
            raise ValueError(f"item {fqn!r}: rank {rank!r} and name {name!r}")
        storage[dcp_metadata.MetadataIndex(str(fqn), None if offset is None else _sizes(offset),
                                           index)] = _Stored(rank, name)
    items: dict[str, dcp_metadata.STORAGE_TYPES] = {}
    for fqn, item in data["tensors"].items():
        size = _sizes(item["size"])
        chunks = [dcp_metadata.ChunkStorageMetadata(_sizes(offsets), _sizes(sizes))
                  for offsets, sizes in item["chunks"]]
        _check_chunks(fqn, size, chunks, storage)
        items[fqn] = dcp_metadata.TensorStorageMetadata(
            properties=dcp_metadata.TensorProperties(dtype=_dtype(item["dtype"])),
            size=size, chunks=chunks)
    for fqn in data["bytes"]:
        if dcp_metadata.MetadataIndex(str(fqn)) not in storage:
            raise ValueError(f"item {fqn!r} is stored nowhere")
        items[str(fqn)] = dcp_metadata.BytesStorageMetadata()
    return dcp_metadata.Metadata(
        state_dict_metadata=items,
        planner_data={fqn: tuple(path) for fqn, path in data["paths"].items()},
        storage_data=storage, version=data.get("version"))


def _whole(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not a whole number")
    return value


def _sizes(values: Sequence[object]) -> torch.Size:
    """Offsets or sizes: whole numbers >= 0 that torch can hold."""
    if not isinstance(values, list) or any(_whole(v) < 0 or v >= 2**62 for v in values):
        raise ValueError(f"{values!r} is not a list of sizes")
    return torch.Size(values)


def _check_chunks(fqn: str, size: torch.Size, chunks: list[dcp_metadata.ChunkStorageMetadata],
                  storage: dict[dcp_metadata.MetadataIndex, _Stored]) -> None:
    """The chunks of a tensor of `size` lie inside it, are stored, and add up to all of it."""
    covered = 0
    for chunk in chunks:
        if len(chunk.offsets) != len(size) or len(chunk.sizes) != len(size) or any(
                o + n > s for o, n, s in zip(chunk.offsets, chunk.sizes, size, strict=True)):
            raise ValueError(f"tensor {fqn!r} of size {list(size)}: chunk at "
                             f"{list(chunk.offsets)} of {list(chunk.sizes)} lies outside it")
        if dcp_metadata.MetadataIndex(fqn, chunk.offsets) not in storage:
            raise ValueError(f"tensor {fqn!r}: chunk at {list(chunk.offsets)} is stored nowhere")
        covered += chunk.sizes.numel()
    if covered != size.numel():
        raise ValueError(f"tensor {fqn!r}: its chunks hold {covered} of its {size.numel()} "
                         "elements")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")  # noqa: TRY004  # bad data, not a type
    return dtype
