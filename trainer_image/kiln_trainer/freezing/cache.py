"""Cache of frozen-prefix outputs (fp16, RAM or a memory-mapped file), and a prefetching reader.

Egeria (Wang et al., EuroSys'23, section 4) caches frozen-layer outputs: with deterministic
inputs a frozen prefix maps a sample to the same activation every epoch. The caller decides
when caching is valid (e.g. off with augmentation). Shapes: B batch, N dataset samples.
"""

from __future__ import annotations

import itertools
import math
import pathlib
import queue
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Self

import numpy as np
import torch
from torch import nn

#: Bytes per stored element (fp16).
ELEMENT_BYTES = 2


class ActivationCache:
    """fp16 table of per-sample activations, keyed by dataset index, in RAM or a memmap file.

    The table Tensor[N, ...] is allocated on the first `put`, once the per-sample shape is
    known: in RAM if N x per-sample bytes <= `memory_limit_bytes`, else as a memmap file in
    `directory` (a fresh temporary directory when None), deleted by `close` (or when the cache
    is garbage collected). A bool mask records which samples are present. Thread-safe: the
    `Prefetcher` reads while the training thread writes.

    Values are stored as fp16: relative error about 5e-4, and magnitudes beyond 65504 become
    inf (activations of normalised networks stay far below).

    Args:
        num_samples: N, the dataset size (indices are 0 .. N-1).
        memory_limit_bytes: the most host RAM the table may take.
        directory: where the memmap file goes when the table exceeds the limit.

    Raises:
        ValueError: `num_samples` < 1 or `memory_limit_bytes` < 0.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        memory_limit_bytes: int,
        directory: pathlib.Path | None = None,
    ) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1 (got {num_samples})")
        if memory_limit_bytes < 0:
            raise ValueError(f"memory_limit_bytes must be >= 0 (got {memory_limit_bytes})")
        self.num_samples = num_samples
        self.memory_limit_bytes = memory_limit_bytes
        self.directory = directory
        self._lock = threading.Lock()
        self._present = torch.zeros(num_samples, dtype=torch.bool)
        self._shape: tuple[int, ...] | None = None
        self._memory: torch.Tensor | None = None
        self._disk: np.memmap[Any, np.dtype[np.float16]] | None = None
        self._cleanup: weakref.finalize[Any, Any] | None = None
        self._generation = 0
        self._closed = False

    @property
    def bytes(self) -> int:
        """Bytes of the allocated table (RAM or file); 0 before the first `put`."""
        if self._shape is None:
            return 0
        return self.num_samples * math.prod(self._shape) * ELEMENT_BYTES

    @property
    def location(self) -> str:
        """Where the table lives: "disk" (memmap file) or "memory" (also before the first put)."""
        return "disk" if self._disk is not None else "memory"

    @property
    def path(self) -> pathlib.Path | None:
        """The memmap file, or None when the table is in RAM or not allocated."""
        if self._disk is None or self._disk.filename is None:
            return None
        return pathlib.Path(self._disk.filename)

    @property
    def generation(self) -> int:
        """Counts `invalidate` and `advance` calls: activations read under an older generation
        are stale."""
        return self._generation

    def put(self, indices: torch.Tensor, outputs: torch.Tensor) -> None:
        """Store `outputs[i]` for dataset index `indices[i]`, as fp16.

        After `invalidate` (nothing present) the per-sample shape may change: the table is
        reallocated for the new boundary.

        Args:
            indices: LongTensor[B], dataset indices in [0, N).
            outputs: Tensor[B, ...], any float dtype and device (detached, copied to the host).

        Raises:
            ValueError: B differs between the arguments, an index is out of range, or the
                per-sample shape differs from the stored one while samples are present.
            RuntimeError: the cache is closed.
        """
        index = self._indices(indices)
        if outputs.shape[0] != index.shape[0]:
            raise ValueError(
                f"put got {index.shape[0]} indices and {outputs.shape[0]} outputs; they must match"
            )
        values = outputs.detach().to(device="cpu", dtype=torch.float16)
        shape = tuple(values.shape[1:])
        with self._lock:
            self._check_open()
            if shape != self._shape:
                if bool(self._present.any()):
                    raise ValueError(
                        f"put got per-sample shape {list(shape)} but the cache holds "
                        f"{list(self._shape or ())}; invalidate() it first"
                    )
                self._allocate(shape)
            if self._disk is not None:
                self._disk[index.numpy()] = values.numpy()
            else:
                assert self._memory is not None
                self._memory[index] = values
            self._present[index] = True

    def get(self, indices: torch.Tensor, *,
            dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """The stored activations for `indices`, or None unless every one is present.

        Args:
            indices: LongTensor[B], dataset indices in [0, N).
            dtype: of the result; torch.float16 returns the stored values without a cast (half
                the host memory and copy bytes, for a cast on the device instead).

        Returns:
            Tensor[B, ...] in `dtype` on the CPU, or None.

        Raises:
            ValueError: an index is out of range.
            RuntimeError: the cache is closed.
        """
        index = self._indices(indices)
        with self._lock:
            self._check_open()
            if self._shape is None or not bool(self._present[index].all()):
                return None
            if self._disk is not None:
                return torch.from_numpy(self._disk[index.numpy()]).to(dtype)
            assert self._memory is not None
            return self._memory[index].to(dtype)

    def invalidate(self) -> None:
        """Forget every entry (the prefix was unfrozen, or `advance` cannot apply); keeps the
        table."""
        with self._lock:
            self._present.zero_()
            self._generation += 1

    def advance(self, transform: Callable[[torch.Tensor], torch.Tensor], *,
                batch_size: int = 256) -> int:
        """Move every entry one boundary deeper: replace it by `transform` of it, in one pass.

        When more blocks freeze, the entries cached at the old boundary need only the newly
        frozen blocks (`partition.Partition.bridge`) to become the new boundary's outputs,
        instead of the whole prefix on the next read. The generation moves on at once (batches
        read ahead meanwhile are served with their inputs); the old table is freed afterwards.
        Run by the thread that owns the model; other threads' reads wait or miss meanwhile.

        Args:
            transform: Tensor[b, ...] float32 on the CPU -> Tensor[b, ...'] (any device and
                float dtype): the new boundary's outputs of the same samples.
            batch_size: entries per `transform` call.

        Returns:
            Entries moved.

        Raises:
            ValueError: batch_size < 1, or `transform` changes the batch size.
            RuntimeError: the cache is closed.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (got {batch_size})")
        with self._lock:
            self._check_open()
            present = self._present.nonzero().flatten()
            old_memory, old_disk, old_cleanup = self._memory, self._disk, self._cleanup
            self._memory, self._disk, self._shape, self._cleanup = None, None, None, None
            self._present = torch.zeros(self.num_samples, dtype=torch.bool)
            self._generation += 1
        try:
            for chunk in torch.split(present, batch_size):
                if old_disk is not None:
                    values = torch.from_numpy(old_disk[chunk.numpy()]).float()
                else:
                    assert old_memory is not None
                    values = old_memory[chunk].float()
                self.put(chunk, transform(values))
        finally:
            del old_memory, old_disk
            if old_cleanup is not None:
                old_cleanup()
        return int(present.numel())

    def close(self) -> None:
        """Free the table and delete the memmap file. Idempotent."""
        with self._lock:
            self._closed = True
            self._release()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _allocate(self, shape: tuple[int, ...]) -> None:
        self._release()
        self._shape = shape
        if self.bytes <= self.memory_limit_bytes:
            self._memory = torch.empty((self.num_samples, *shape), dtype=torch.float16)
            return
        if self.directory is None:
            folder = tempfile.mkdtemp(prefix="kiln-activations-")
        else:
            self.directory.mkdir(parents=True, exist_ok=True)
            folder = tempfile.mkdtemp(prefix="kiln-activations-", dir=self.directory)
        path = pathlib.Path(folder) / "activations.f16"
        self._disk = np.memmap(path, dtype=np.float16, mode="w+", shape=(self.num_samples, *shape))
        self._cleanup = weakref.finalize(self, _remove, path)

    def _release(self) -> None:
        self._memory, self._disk, self._shape = None, None, None
        self._present.zero_()
        if self._cleanup is not None:
            self._cleanup()  # runs once: deletes the file and its folder
            self._cleanup = None

    def _indices(self, indices: torch.Tensor) -> torch.Tensor:
        index = torch.as_tensor(indices, dtype=torch.long).reshape(-1).cpu()
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.num_samples):
            raise ValueError(
                f"dataset indices must lie in [0, {self.num_samples}) "
                f"(got {int(index.min())} .. {int(index.max())})"
            )
        return index

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the activation cache is closed")


def follow(cache: ActivationCache, bridge: nn.Module | None) -> int:
    """Keep `cache` valid after the frozen boundary moved; returns the entries kept.

    With `bridge` (the newly frozen blocks, `partition.Partition.bridge`) every entry is
    advanced through it in eval mode without gradients, on the bridge's device; without one
    (unfrozen, or a boundary the model does not split at) the entries are forgotten.
    """
    if bridge is None:
        cache.invalidate()
        return 0
    anchor = next(itertools.chain(bridge.parameters(), bridge.buffers()), None)
    device = anchor.device if anchor is not None else torch.device("cpu")
    saved = [(module, module.training) for module in bridge.modules()]
    bridge.eval()  # frozen blocks: BatchNorm statistics fixed, dropout off, as `prefix` runs
    try:
        with torch.no_grad():
            return cache.advance(lambda values: bridge(values.to(device)))
    finally:
        for module, training in saved:
            module.train(training)


def _remove(path: pathlib.Path) -> None:
    path.unlink(missing_ok=True)
    try:
        path.parent.rmdir()
    except OSError:  # not empty (someone else's file): leave the folder
        pass


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Served = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]
# a batch read ahead: its cached activations (if any), the cache generation then, and the
# event that marks their copy to the device done (CUDA only)
_Item = tuple[Batch, torch.Tensor | None, int, "torch.cuda.Event | None"]


class _End:
    """Marks the end of the source iterator in the queue."""


class _Failure:
    """Carries an exception of the source iterator or the cache to the consumer."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher:
    """Iterates `batches` `depth` batches ahead in a background thread, with cache look-ups.

    Yields `(inputs, None, targets, indices)` for a batch the cache lacks (run the prefix),
    and `(None, cached, targets, indices)` with cached Tensor[B, ...] on `device` in `dtype`
    when every sample is cached (skip the prefix; Egeria section 4). Cached values stay fp16
    on the host until they reach the device, and are cast there. On CUDA the thread copies
    them (from pinned memory) on a side stream, which the consuming stream waits for; on the
    CPU the thread only reads ahead. A batch read ahead before `cache.invalidate()` or
    `cache.advance` is served with its inputs (never stale activations). An exception raised
    by `batches` is re-raised in the consuming thread, at the batch where it occurred.

    Args:
        batches: an iterator of (inputs Tensor[B, ...], targets Tensor[B, ...],
            indices LongTensor[B]), e.g. a DataLoader iterator yielding dataset indices.
        cache: looked up for every batch; None serves every batch with its inputs.
        depth: batches read ahead (>= 1).
        pin_memory: copy cached activations to pinned memory (fast asynchronous host-to-device
            copies on CUDA); ignored without CUDA.
        device: where cached activations are served (default: the CPU).
        dtype: what they are cast to there (the compute dtype; default float32).

    Raises:
        ValueError: depth < 1.
    """

    def __init__(
        self,
        batches: Iterator[Batch],
        cache: ActivationCache | None,
        depth: int = 2,
        *,
        pin_memory: bool = False,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1 (got {depth})")
        self._batches, self._cache = batches, cache
        self._device, self._dtype = device or torch.device("cpu"), dtype
        self._stream = (torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
                        if self._device.type == "cuda" else None)
        # pinning needs a CUDA runtime; the side stream's copies want it
        self._pin = (pin_memory or self._stream is not None) and torch.cuda.is_available()
        self._queue: queue.Queue[_Item | _End | _Failure]
        self._queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, name="kiln-prefetch", daemon=True)
        self._thread.start()

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Served:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if isinstance(item, _End | _Failure):
            self._done = True
            self._thread.join()
            if isinstance(item, _Failure):
                raise item.error
            raise StopIteration
        (inputs, targets, indices), cached, generation, ready = item
        if cached is None or self._cache is None or generation != self._cache.generation:
            return inputs, None, targets, indices
        if ready is not None:  # the side stream's copy: the consuming stream waits for it
            current = torch.cuda.current_stream(self._device)
            current.wait_event(ready)
            cached.record_stream(current)  # its memory is reused only after this stream's use
        return None, cached.to(self._device, non_blocking=True).to(self._dtype), targets, indices

    def close(self) -> None:
        """Stop the thread and drop batches read ahead. Idempotent."""
        self._stop.set()
        self._done = True
        while self._thread.is_alive():
            try:  # unblock a producer waiting on a full queue
                self._queue.get_nowait()
            except queue.Empty:
                self._thread.join(timeout=0.05)
        while not self._queue.empty():  # what was read ahead, for a caller that keeps `self`
            self._queue.get_nowait()
        self._batches = iter(())  # a DataLoader iterator holds its worker processes

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _run(self) -> None:
        try:
            for inputs, targets, indices in self._batches:
                if self._stop.is_set():
                    return
                cached, generation, ready = None, 0, None
                if self._cache is not None:
                    generation = self._cache.generation  # read before get: stale-safe
                    cached = self._cache.get(indices, dtype=torch.float16)
                    if cached is not None and self._pin:
                        cached = cached.pin_memory()
                    if cached is not None and self._stream is not None:
                        with torch.cuda.stream(self._stream):
                            cached = cached.to(self._device, non_blocking=True)
                            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
                            ready.record(self._stream)
                if not self._offer(((inputs, targets, indices), cached, generation, ready)):
                    return
        # Any error of the loader or the cache is handed to the consumer, which re-raises it.
        except Exception as error:  # noqa: BLE001
            self._offer(_Failure(error))
            return
        self._offer(_End())

    def _offer(self, item: _Item | _End | _Failure) -> bool:
        """Queue `item`, waiting while the queue is full; False once `close` was called."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False
