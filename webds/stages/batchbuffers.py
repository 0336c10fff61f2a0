"""Reused shared-memory buffers for the batches DataLoader workers send a WebLoader.

PyTorch sends each tensor through a fresh shared-memory segment, its file descriptor over a new
socket connection, mapped and freed again in the one main process: per batch of images, most of
that process's CPU time. Here each worker (:class:`SlotPool`) copies all tensors of a batch into
one of a few reused buffers (slots) and sends a :class:`Packed`: the slot number and the tensors'
places. The main process (:class:`Unpacker`) receives a slot's memory once and keeps it mapped;
when the last tensor built over a slot (views included) is freed, the slot is marked free in a
small shared flag array the worker reads before reusing it. No one waits: a worker with no free
slot makes another (up to :data:`MAX_SLOTS`), then sends batches torch's way, as it does a batch
with anything but plain containers of plain CPU tensors, or with ``pin_memory=True``. A batch
never taken out of the DataLoader's queues keeps its slot busy. What users see:
docs/api/loading.md. This module imports torch: :mod:`webds.loader` uses it, and its workers.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from ..errors import WebdsError

__all__ = ["SlotPool", "Packed", "Unpacker", "MAX_SLOTS"]

#: Slots per worker: the DataLoader's prefetched batches, the one being pinned or trained on,
#: and a few the training loop keeps.
MAX_SLOTS = 8
_ALIGN = 64


class _Ref(NamedTuple):
    """A packed tensor: its offset in the slot, shape and dtype."""

    offset: int
    shape: Tuple[int, ...]
    dtype: torch.dtype


class Packed(NamedTuple):
    """A batch packed into a slot: which worker pool (``token``), which slot and which
    generation of its memory, the slot's memory and the pool's flags when the main process may
    not have them yet, and the batch with its tensors replaced by :class:`_Ref`."""

    token: int
    slot: int
    generation: int
    memory: Optional[torch.Tensor]
    flags: Optional[torch.Tensor]
    tree: Any


def _tensors(tree: Any, out: List[torch.Tensor]) -> bool:
    """Collect the tensors of a batch; False if it holds a tensor that cannot be packed."""
    if isinstance(tree, torch.Tensor):
        # A subclass (torchvision's tv_tensors, yours) keeps its type and attributes only
        # through torch's own pickling: its batch travels that way.
        if type(tree) is not torch.Tensor:
            return False
        if tree.device.type != "cpu" or tree.requires_grad or tree.is_sparse:
            return False
        out.append(tree)
        return True
    if type(tree) in (tuple, list):
        return _plain(tree) or all(_tensors(x, out) for x in tree)
    if type(tree) is dict:
        return _plain(tree.values()) or all(_tensors(x, out) for x in tree.values())
    return True


class _Branch(NamedTuple):
    """A container of a packed batch with a packed tensor somewhere below it: its type and its
    items (a dict's as (key, value) pairs). Any other container travels as it is, and is not
    looked into again where the batch is rebuilt (a batch's lists of keys or of bytes: a walk
    over each item had cost more than the tensors)."""

    kind: type
    items: Tuple[Any, ...]


def _plain(items: Any) -> bool:
    """Whether none of ``items`` is a tensor or a container to look into, told by their types
    at once."""
    kinds = set(map(type, items))
    return kinds.isdisjoint(_LOOKED_INTO) and not any(issubclass(k, torch.Tensor) for k in kinds)


_LOOKED_INTO = frozenset({tuple, list, dict})


def _replace(tree: Any, refs: Dict[int, _Ref]) -> Any:
    if isinstance(tree, torch.Tensor):
        return refs[id(tree)]
    if type(tree) in (tuple, list):
        if _plain(tree):
            return tree
        return _Branch(type(tree), tuple(_replace(x, refs) for x in tree))
    if type(tree) is dict:
        if _plain(tree.values()):
            return tree
        return _Branch(dict, tuple((k, _replace(v, refs)) for k, v in tree.items()))
    return tree


class SlotPool:
    """A worker's slots (see the module doc); :meth:`pack` a batch before sending it."""

    def __init__(self, max_slots: int = MAX_SLOTS) -> None:
        self.token = int.from_bytes(os.urandom(8), "little")
        # Shared with the main process: per slot whether it is busy (set here, cleared there),
        # then per slot which generation of its memory the main process holds, then whether
        # the main process holds this array (both set there): what it has not acknowledged is
        # sent again, so a batch the main process never received loses nothing.
        self.flags = torch.zeros(2 * max_slots + 1, dtype=torch.int32).share_memory_()
        self._shared = self.flags.numpy()  # the same memory, read without a torch call
        self.max_slots = max_slots
        self.slots: List[torch.Tensor] = []
        self.generation: List[int] = []
        self.can_grow = True  # False once shared memory ran short

    def pack(self, batch: Any) -> Any:
        """The batch as a :class:`Packed`, or as it is if it cannot be (nothing to pack, a
        tensor not on the CPU, every slot busy)."""
        tensors: List[torch.Tensor] = []
        if not _tensors(batch, tensors) or not tensors:
            return batch
        refs: Dict[int, _Ref] = {}
        offset = 0
        for t in tensors:
            if id(t) not in refs:
                refs[id(t)] = _Ref(offset, tuple(t.shape), t.dtype)
                offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        slot = self._free_slot(offset)
        if slot < 0:
            return batch
        memory = self.slots[slot]
        for t in tensors:
            r = refs[id(t)]
            n = t.numel() * t.element_size()
            if n:
                dst = memory[r.offset : r.offset + n].view(t.dtype).view(t.shape)
                dst.copy_(t)
        shared = self._shared
        shared[slot] = 1
        gen = self.generation[slot]
        send_memory = shared[self.max_slots + slot] != gen
        return Packed(
            self.token,
            slot,
            gen,
            memory if send_memory else None,
            None if shared[-1] else self.flags,
            _replace(batch, refs),
        )

    def _free_slot(self, nbytes: int) -> int:
        """A free slot of at least ``nbytes`` (made or grown if need be), or -1."""
        busy = self._shared
        spare = -1
        for s, memory in enumerate(self.slots):
            if busy[s] == 0:
                if memory.numel() >= nbytes:
                    return s
                spare = s
        if spare < 0 and (len(self.slots) == self.max_slots or not self.can_grow):
            return -1
        try:
            memory = torch.empty(max(nbytes, 1), dtype=torch.uint8).share_memory_()
        except (RuntimeError, OSError):
            # Shared memory is short (a container's small /dev/shm): make no more slots, and
            # send this batch torch's way, which frees its memory once the batch is used.
            self.can_grow = False
            return -1
        if spare >= 0:  # a free slot too small for this batch: grow it
            self.slots[spare] = memory
            self.generation[spare] += 1
            return spare
        self.slots.append(memory)
        self.generation.append(1)
        return len(self.slots) - 1


class Unpacker:
    """The main process's side: keeps each worker pool's slots mapped and rebuilds batches."""

    def __init__(self) -> None:
        # token -> (flags as a numpy array, {slot: the slot's memory as a uint8 numpy array})
        self.pools: Dict[int, Tuple[Any, Dict[int, Any]]] = {}
        self.tokens: Dict[int, int] = {}  # worker -> its pool's token

    def unpack(self, worker: int, packed: Packed) -> Any:
        """The batch, its tensors views of the slot; the slot is freed with the last of them."""
        old = self.tokens.get(worker)
        if old != packed.token:
            # A new worker process (a new epoch, restarted workers): forget the old one's slots.
            self.pools.pop(old, None)  # type: ignore[arg-type]
            self.tokens[worker] = packed.token
        pool = self.pools.get(packed.token)
        if pool is None:
            if packed.flags is None:  # another process acknowledged them: not ours to read
                raise WebdsError(
                    f"a batch from DataLoader worker {worker} came in a shared buffer this "
                    "WebLoader was never given; iterate each WebLoader from one process, or "
                    "pass WebLoader(..., batch_buffers=False)"
                )
            shared = packed.flags.numpy()
            pool = self.pools[packed.token] = (shared, {})
            shared[-1] = 1
        shared, slots = pool
        if packed.memory is not None:
            slots[packed.slot] = packed.memory.numpy()
            shared[(len(shared) - 1) // 2 + packed.slot] = packed.generation
        region = slots[packed.slot][:]  # a new array object: its finalizer frees the slot
        weakref.finalize(region, _free, shared, packed.slot)
        return _rebuild(packed.tree, region)


def _free(flags: Any, slot: int) -> None:
    flags[slot] = 0


def _rebuild(tree: Any, region: Any) -> Any:
    if type(tree) is _Ref:
        n = _numel(tree.shape) * _itemsize(tree.dtype)
        if n == 0:
            return torch.empty(tree.shape, dtype=tree.dtype)
        # Each tensor over a storage of its own size, which keeps the region (and so the slot)
        # busy: torch.save, pickle and deepcopy of one cost its own bytes, not the batch's.
        part = torch.frombuffer(region, dtype=torch.uint8, count=n, offset=tree.offset)
        return part.view(tree.dtype).view(tree.shape)
    if type(tree) is _Branch:
        if tree.kind is dict:
            return {k: _rebuild(v, region) for k, v in tree.items}
        return tree.kind(_rebuild(x, region) for x in tree.items)
    return tree


_ITEMSIZE: Dict[torch.dtype, int] = {}


def _itemsize(dtype: torch.dtype) -> int:
    n = _ITEMSIZE.get(dtype)
    if n is None:
        n = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return n


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
