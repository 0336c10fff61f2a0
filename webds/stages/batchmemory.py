"""Reused memory for big batches: :class:`BatchMemory`, which :func:`~webds.stages.batching.batched`
stacks big columns into, and :func:`default_collate_into`, torch's ``default_collate`` doing the
same (a WebLoader's ``batch_size=``).

A block larger than the C allocator's mmap threshold (32 MB at most) comes fresh from the kernel
for each batch, a page fault per 4 KiB: stacking 64 float images of 224 pixels cost 0.27 ms an
image, two thirds of decoding and cropping it (docs/benchmarks.md, "Next to its peers"). Here a
stack goes into a block an earlier batch gave back, and a block is given back only when its batch
and every view of it are gone. This module imports torch.
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
import weakref
from typing import Any, Callable, List, Optional

import numpy as np
import torch

__all__ = ["BatchMemory", "stacked_into", "arrays_into", "default_collate_into"]

#: Stacks of at least this many bytes go into a :class:`BatchMemory` block; the C allocator's
#: heap reuses smaller ones itself.
REUSED_BYTES = 1 << 20

#: Blocks start on a huge page (2 MiB), so that the kernel can back them with huge pages:
#: stacking into 4 KiB pages measured 2-2.5x slower (TLB misses).
_HUGE_PAGE = 2 << 20


class BatchMemory:
    """Reused blocks for the big stacks of one pass.

    A block is given back only when its batch and every view of it are gone (a finalizer on the
    array the stack is made over, which every tensor or array over it keeps alive): no batch
    ever shares memory with one still held. At most ``keep`` free blocks are kept, none after
    :meth:`release` (the pass's end: a persistent worker holds no batch-sized block between
    epochs); ``made`` counts the blocks allocated. ``tensors``: whether tensor stacks go here
    too, or only numpy arrays (see ``webds.stages.batching._batch_memory``).
    """

    def __init__(self, tensors: bool = True, keep: int = 2) -> None:
        self.tensors = tensors
        self.keep = keep
        self.made = 0
        self._free: List[Any] = []
        self._released = False
        # A batch may be freed on another thread (a loader's pin thread, the training loop's).
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _locked(self) -> threading.Lock:
        """The lock, this process's: a forked process (a DataLoader worker) inherits the lock
        as it was, held where another thread held it at the fork, and would wait for ever."""
        if self._pid != os.getpid():
            self._lock, self._pid = threading.Lock(), os.getpid()
        return self._lock

    def take(self, nbytes: int) -> Any:
        """A ``uint8`` array of ``nbytes`` that no live batch uses, starting on a huge page."""
        with self._locked():
            fits = [i for i, b in enumerate(self._free) if b.size >= nbytes]
            best = min(fits, key=lambda i: self._free[i].size) if fits else None
            block = self._free.pop(best) if best is not None else None
        if block is None:
            block = _mapped(nbytes)
            self.made += 1
        lease = block[:nbytes]  # a new array: its end gives the block back
        weakref.finalize(lease, self._give_back, block)
        # Handed out behind a memoryview: numpy makes a view's base the array that owns the
        # memory (the block), so a view of the batch would not keep the lease alive.
        return np.frombuffer(memoryview(lease), np.uint8)

    def _give_back(self, block: Any) -> None:
        with self._locked():
            if not self._released and len(self._free) < self.keep:
                self._free.append(block)

    def release(self) -> None:
        """Free the blocks kept, and keep none given back from now on."""
        with self._locked():
            self._released = True
            self._free.clear()


def _mapped(nbytes: int) -> Any:
    """A block of ``nbytes`` in a private mapping of its own rather than on the C heap: freed,
    it goes back to the OS at once, leaving no hole in the heap for a persistent worker to
    keep between epochs."""
    mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages
            pass
    whole = np.frombuffer(mapping, np.uint8)
    start = -whole.ctypes.data % _HUGE_PAGE
    return whole[start : start + nbytes]


def stacked_into(values: List[Any], memory: BatchMemory) -> Optional[torch.Tensor]:
    """``torch.stack(values)`` into a block of ``memory``; None where the stack is small or
    is not plain: CPU tensors of one shape and dtype, not subclasses (whose type torch.stack
    keeps), nested, quantized or needing gradients."""
    first = values[0]
    nbytes = len(values) * first.numel() * first.element_size()
    if nbytes < REUSED_BYTES or not (
        first.device.type == "cpu"
        and first.layout == torch.strided
        and not first.is_nested
        and not first.is_quantized
        and all(
            type(v) is torch.Tensor and v.dtype == first.dtype and v.shape == first.shape
            for v in values
        )
        and not any(v.requires_grad for v in values)
    ):
        return None
    out = torch.from_numpy(memory.take(nbytes)).view(first.dtype).view(len(values), *first.shape)
    return torch.stack(values, 0, out=out)


def arrays_into(values: List[Any], memory: BatchMemory) -> Optional[np.ndarray]:
    """``np.stack(values)`` into a block of ``memory``; None where the stack is small, of
    objects, or of arrays of more than one dtype or shape."""
    first = values[0]
    nbytes = len(values) * first.nbytes
    if (
        nbytes < REUSED_BYTES
        or first.dtype.hasobject
        or any(v.dtype != first.dtype or v.shape != first.shape for v in values)
    ):
        return None
    out = memory.take(nbytes).view(first.dtype).reshape((len(values), *first.shape))
    return np.stack(values, out=out)


def default_collate_into(memory: BatchMemory) -> Optional[Callable[[Any], Any]]:
    """torch's ``default_collate`` with its big tensor stacks in ``memory`` (and its arrays,
    which it makes tensors first): the same batches otherwise. None where this torch has no
    ``collate_fn_map`` to say so."""
    try:
        from torch.utils.data._utils.collate import (
            collate,
            collate_tensor_fn,
            default_collate_fn_map,
        )
    except ImportError:  # torch before 1.13
        return None

    def tensors(batch: Any, *, collate_fn_map: Any = None) -> Any:
        stacked = stacked_into(list(batch), memory)
        if stacked is None:
            return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
        return stacked

    fn_map = {**default_collate_fn_map, torch.Tensor: tensors}
    return functools.partial(collate, collate_fn_map=fn_map)
