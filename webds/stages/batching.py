"""Batching: group samples into batches (:func:`batched`) and split them back (:func:`unbatched`).

:func:`batched` cuts the stream into lists of ``batchsize`` items and hands each list to its
``collation_fn``, :func:`default_collation_fn` unless you pass another (or ``None`` for plain
lists); :func:`listed` / :func:`unlisted` group and flatten lists without any collation.

:func:`default_collation_fn` gives the batch the samples' shape (tuple samples a tuple of
columns, lists a list, dicts a dict; anything else is one column) and combines each column by
what it holds: tensors with ``torch.stack`` and numpy arrays with ``np.stack`` (of one shape,
else a :class:`~webds.errors.SampleError` names the two samples), numbers (bools included) into
one numpy array; dicts (JSON metadata) stay a list unless ``combine_dicts=True``, and anything
else (strings, bytes, ``None``, a mix of types) stays a list. :func:`unbatched` inverts this:
tensors and arrays are split along their first dimension (copies, not views, so a sample kept
downstream does not keep its whole batch alive), and every column needs one entry per sample.
"""

from __future__ import annotations

import functools
import numbers
from typing import (
    Any,
    Callable,
    Dict,
    Generator,
    Iterable,
    Iterator,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Sequence,
)

import numpy as np
import torch

from ..base.slots import pulled_back
from ..base.stage import BATCH, UNBATCH, stage
from ..errors import ArgumentError, SampleError
from .batchmemory import BatchMemory, arrays_into, stacked_into
from .filters import _check_callable, _check_int, _where

__all__ = ["batched", "listed", "unbatched", "unlisted", "default_collation_fn"]


def _is_scalar(x: Any) -> bool:
    return isinstance(x, (numbers.Number, np.bool_)) and not isinstance(
        x, (torch.Tensor, np.ndarray)
    )


#: Types :func:`_is_scalar` holds for, told by ``type()`` alone: asking ``numbers.Number``
#: (an abstract class) of each value cost more than the rest of a small record's batching.
_SCALAR_TYPES = frozenset(
    {int, float, bool, complex, np.bool_, np.int64, np.int32, np.float32, np.float64}
)


def _all_scalars(values: List[Any]) -> bool:
    """Whether :func:`_is_scalar` holds for every value."""
    return set(map(type, values)) <= _SCALAR_TYPES or all(_is_scalar(v) for v in values)


def _sample_label(samples: Sequence[Any], i: int) -> str:
    where = _where(samples[i])
    return repr(where["key"]) if where.get("key") is not None else f"#{i}"


def _stack_error(
    kind: str, column: str, values: Sequence[Any], samples: Sequence[Any]
) -> SampleError:
    shapes = [tuple(v.shape) for v in values]
    j = next(i for i, s in enumerate(shapes) if s != shapes[0])
    return SampleError(
        f"cannot stack the {kind}s of field {column}: sample {_sample_label(samples, 0)} has shape "
        f"{shapes[0]} but sample {_sample_label(samples, j)} has shape {shapes[j]}; resize or pad "
        "them to one shape, or pass batched(..., collation_fn=...) a function that handles "
        "varying shapes",
        **_where(samples[j]),
    )


class _Collation(NamedTuple):
    """How :func:`default_collation_fn` combines a column (its keyword arguments), and where
    big stacks go (``memory``: a batching pass's reused blocks, or None)."""

    tensors: bool = True
    scalars: bool = True
    dicts: bool = False
    memory: Optional[BatchMemory] = None


def _collate_column(values: List[Any], column: str, samples: Sequence[Any], how: _Collation) -> Any:
    if all(isinstance(v, Mapping) for v in values):
        # Nested dicts (JSON metadata) stay a list of dicts, as webdataset's collation gives and
        # code like metadata[i]["filename"] expects; with combine_dicts, those with one set of
        # fields are collated field by field.
        if not how.dicts or any(v.keys() != values[0].keys() for v in values):
            return values
        return _collate_dicts(values, samples, how, prefix=column)
    if all(isinstance(v, torch.Tensor) for v in values):
        if not how.tensors:
            return values
        if any(v.shape != values[0].shape for v in values):
            raise _stack_error("tensor", column, values, samples)
        return _stack_tensors(values, how.memory)
    if all(isinstance(v, np.ndarray) for v in values):
        if not how.tensors:
            return values
        if any(v.shape != values[0].shape for v in values):
            raise _stack_error("array", column, values, samples)
        return _stack_arrays(values, how.memory)
    if how.scalars and _all_scalars(values):
        return np.array(values)
    return values


def _batch_memory() -> BatchMemory:
    """A batching pass's :class:`BatchMemory`. In a DataLoader worker a tensor stack goes
    straight into shared memory instead (see :func:`_stack_tensors`), unless the WebLoader
    copies the worker's batches into its reused buffers anyway (``channel.packs``)."""
    info = torch.utils.data.get_worker_info()
    if info is None:
        return BatchMemory()
    channel = getattr(info.dataset, "channel", None)
    return BatchMemory(tensors=bool(getattr(channel, "packs", False)))


def _stack_tensors(values: List[Any], memory: Optional[BatchMemory] = None) -> Any:
    """``torch.stack(values)``: into a reused block of ``memory`` where it takes tensors;
    else inside a DataLoader worker, straight into shared memory.

    The batch leaves a worker through shared memory anyway. Stacking into a shared block (as
    torch's default_collate does) saves that copy and, above all, leaves no batch-sized block
    on the worker's heap: freed ones are kept by the C allocator, and a persistent worker's
    memory grew by about an epoch of batches per epoch before this (see docs/benchmarks.md).
    """
    if memory is not None and memory.tensors:
        stacked = stacked_into(values, memory)
        if stacked is not None:
            return stacked
    out = None
    first = values[0]
    if torch.utils.data.get_worker_info() is not None and first.device.type == "cpu":
        numel = sum(v.numel() for v in values)
        storage = first._typed_storage()._new_shared(numel, device=first.device)
        out = first.new(storage).resize_(len(values), *first.shape)
    return torch.stack(values, 0, out=out)


def _stack_arrays(values: List[Any], memory: Optional[BatchMemory] = None) -> Any:
    """``np.stack(values)``, into a reused block of ``memory`` where it is big."""
    stacked = None if memory is None else arrays_into(values, memory)
    return np.stack(values) if stacked is None else stacked


def _collate_dicts(
    dicts: List[Any], samples: Sequence[Any], how: _Collation, prefix: str
) -> Dict[str, Any]:
    keys = list(dicts[0].keys())
    keyset = set(keys)
    for i, d in enumerate(dicts):
        if d.keys() != keyset and set(d.keys()) != keyset:  # (the first: no new set)
            extra = sorted(_strs(set(d.keys()) - keyset))
            lacking = sorted(_strs(keyset - set(d.keys())))
            raise SampleError(
                f"cannot batch dicts with different fields{' in ' + prefix if prefix else ''}: "
                f"sample {_sample_label(samples, i)} has extra {extra} and lacks {lacking} "
                f"compared with sample {_sample_label(samples, 0)}; select or rename fields to a "
                "common set first (e.g. with to_tuple or rename(keep=False))",
                **_where(samples[i]),
            )
    return {
        k: _collate_column(
            [d[k] for d in dicts], f"{prefix}.{k}" if prefix else repr(k), samples, how
        )
        for k in keys
    }


def _strs(xs: Iterable[Any]) -> List[str]:
    return [str(x) for x in xs]


def default_collation_fn(
    samples: Sequence[Any],
    combine_tensors: bool = True,
    combine_scalars: bool = True,
    combine_dicts: bool = False,
) -> Any:
    """Collate a list of samples into a batch, column by column.

    Tuples give a tuple of columns (lists a list), dicts a dict (all with the same fields). A
    column of dicts (JSON metadata) stays a list of dicts, as in webdataset; with
    ``combine_dicts=True`` dicts with the same fields are collated field by field into a dict of
    columns (``batched(n, collation_fn=partial(default_collation_fn, combine_dicts=True))``).
    In each column: tensors are stacked with ``torch.stack``,
    arrays with ``np.stack`` (unless ``combine_tensors`` is false), numbers become a numpy array
    (unless ``combine_scalars`` is false), anything else a list. Tensors of different shapes are a
    :class:`SampleError`; pad them, or pass your own ``collation_fn`` to :func:`batched`.
    """
    return _collate(samples, _Collation(combine_tensors, combine_scalars, combine_dicts))


def _collate(samples: Sequence[Any], how: _Collation) -> Any:
    """:func:`default_collation_fn`, its arguments in ``how``."""
    samples = list(samples)
    if not samples:
        raise ArgumentError("default_collation_fn needs at least one sample")
    first = samples[0]
    # (Each sample's kind told by its type, once per type: asking each sample costs more than a
    # small record's batching.)
    kinds = set(map(type, samples))
    if isinstance(first, Mapping):
        if not all(issubclass(k, Mapping) for k in kinds):
            for i, s in enumerate(samples):
                if not isinstance(s, Mapping):
                    raise SampleError(
                        f"cannot batch a dict sample with a {type(s).__name__} (sample #{i})"
                    )
        return _collate_dicts(samples, samples, how, prefix="")
    if isinstance(first, (tuple, list)):
        if not (
            all(issubclass(k, (tuple, list)) for k in kinds) and len(set(map(len, samples))) == 1
        ):
            for i, s in enumerate(samples):
                if not isinstance(s, (tuple, list)) or len(s) != len(first):
                    what = (
                        f"{len(s)} elements" if isinstance(s, (tuple, list)) else type(s).__name__
                    )
                    raise SampleError(
                        f"cannot batch tuples of different lengths: sample #0 has {len(first)} "
                        f"elements, sample #{i} has {what}"
                    )
        columns = [
            _collate_column(list(col), f"#{j}", samples, how) for j, col in enumerate(zip(*samples))
        ]
        return tuple(columns) if isinstance(first, tuple) else columns
    return _collate_column(samples, "#0", samples, how)


def _batches(
    src: Iterable[Any], batchsize: Any, partial: bool, ledger: Any = None
) -> Iterator[List[Any]]:
    """Lists of ``batchsize`` items; with a ``ledger``, a list's ids become one bundle (see
    :mod:`webds.base.ledger`)."""
    batchsize = _check_int("batchsize", batchsize)
    if batchsize < 1:
        raise ArgumentError(f"batchsize must be at least 1, got {batchsize}")
    buf: List[Any] = []
    if ledger is None:
        for item in src:
            buf.append(item)
            if len(buf) == batchsize:
                yield buf
                buf = []
        if buf and partial:
            yield buf
        return
    # The items of the list being filled need not be recorded as held: whenever a checkpoint
    # can be taken, this generator is suspended at its yield, holding nothing.
    if ledger.resuming:
        src = yield from _regroup(src, ledger)
    ledger = getattr(ledger, "ledger", ledger)  # the pipeline's (its current, without the view)
    ids: List[Any] = []
    for item in src:
        buf.append(item)
        ids.append(ledger.current)
        if len(buf) == batchsize:
            ledger.current = ids
            yield buf
            buf, ids = [], []
    if buf:
        ledger.current = ids  # a short last batch dropped by partial=False is consumed too
        if partial:
            yield buf


def _regroup(src: Iterable[Any], ledger: Any) -> Generator[List[Any], None, Iterator[Any]]:
    """Resuming: the samples that stages after this one held come first (see
    :meth:`~webds.base.slots.Slot.restore`); each item they held is batched again on its
    own, as it was (a batch held whole, or one sample of a batch split later), so that the
    batches after them start where the uninterrupted run's did. Returns the rest of ``src``."""
    plan = ledger.restore_plan()
    it = iter(src)
    group: Any = None
    buf: List[Any] = []
    ids: List[Any] = []
    for item in it:
        i = ledger.current
        where = plan.where(i)
        if where is None or where[0] <= ledger.position:
            if buf:
                ledger.current = ids
                yield buf
            return pulled_back(item, i, it, ledger)
        if where[:2] != group and buf:
            ledger.current = ids
            yield buf
            buf, ids = [], []
        group = where[:2]
        buf.append(item)
        ids.append(i)
    if buf:
        ledger.current = ids
        yield buf
    return iter(())


@stage(count=BATCH)
def batched(
    src: Iterable[Any],
    batchsize: int = 20,
    collation_fn: Optional[Callable[[List[Any]], Any]] = default_collation_fn,
    partial: bool = True,
    *,
    ledger: Any = None,
) -> Iterator[Any]:
    """Group items into batches of ``batchsize``, collated by ``collation_fn``.

    ``collation_fn=None`` yields plain lists; ``partial=False`` drops a short last batch.
    """
    if collation_fn is not None:
        _check_callable("batched", "collation_fn", collation_fn)
    memory = None
    if collation_fn is default_collation_fn:
        # The default collation stacks big columns into blocks reused across the pass.
        memory = _batch_memory()
        collation_fn = functools.partial(_collate, how=_Collation(memory=memory))
    try:
        for batch in _batches(src, batchsize, partial, ledger):
            yield batch if collation_fn is None else collation_fn(batch)
    finally:
        if memory is not None:
            memory.release()


@stage(count=BATCH)
def listed(
    src: Iterable[Any], batchsize: int, partial: bool = True, *, ledger: Any = None
) -> Iterator[List[Any]]:
    """Group items into lists of ``batchsize`` (no collation); ``partial=False`` drops a short
    last list."""
    yield from _batches(src, batchsize, partial, ledger)


def _split(items: Iterable[Any], n: int, ledger: Any, slot: Any) -> Iterator[Any]:
    """Yield the ``n`` items of one batch; with a ``ledger``, the batch's bundle of ids is split
    too: the items not yet yielded are held in ``slot``, and each yielded one's id becomes
    current."""
    if ledger is None:
        yield from items
        return
    bundle = ledger.current
    if not (isinstance(bundle, list) and len(bundle) == n):
        if n == 1 and not isinstance(bundle, list):
            bundle = [bundle]
        else:
            if ledger.problem is None:
                ledger.problem = (
                    f"unbatched got a batch of {n} items that was not made by batched() or a "
                    "DataLoader in this pipeline, so which samples it holds is unknown"
                )
            yield from items
            return
    for i in bundle:
        slot.hold(i)
    for item in items:
        slot.take_first()
        yield item


def _splitter_slot(ledger: Any) -> Any:
    """An unbatching stage's slot. Resuming, the rest of the batch it was splitting comes back
    as ordinary input (re-batched before it, in its order), so it holds nothing at first."""
    if ledger is None:
        return None
    slot = ledger.slot()
    if ledger.resuming:
        slot.forget_saved()
    return slot


@stage(count=UNBATCH)
def unlisted(src: Iterable[Any], *, ledger: Any = None) -> Iterator[Any]:
    """Flatten lists of items (the inverse of :func:`listed`)."""
    slot = _splitter_slot(ledger)
    for batch in src:
        if not isinstance(batch, list):
            raise SampleError(
                f"unlisted expects lists (as listed() makes), got a {type(batch).__name__}; "
                "use unbatched() for collated batches",
                **_where(batch),
            )
        yield from _split(batch, len(batch), ledger, slot)


def _column_len(value: Any, column: str) -> int:
    if isinstance(value, Mapping):
        lengths = {k: _column_len(v, f"{column}.{k}") for k, v in value.items()}
        return _common_len(lengths, column)
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim == 0:
            raise SampleError(f"unbatched: field {column} is a 0-d tensor, not a batch column")
        return int(value.shape[0])
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise SampleError(
            f"unbatched: field {column} is a {type(value).__name__}, not a batch column (a list, "
            "tensor or array with one entry per sample)"
        )
    return len(value)


def _common_len(lengths: Mapping[str, int], where: str) -> int:
    distinct = set(lengths.values())
    if len(distinct) > 1:
        detail = ", ".join(f"{k}: {n}" for k, n in lengths.items())
        raise SampleError(
            f"unbatched: the columns of {where or 'the batch'} have different lengths ({detail}); "
            "every column needs one entry per sample"
        )
    return distinct.pop() if distinct else 0


def _column_item(value: Any, i: int) -> Any:
    if isinstance(value, Mapping):
        return {k: _column_item(v, i) for k, v in value.items()}
    if isinstance(value, (torch.Tensor, np.ndarray)):
        # A copy, not a view: a view would keep the whole batch alive as long as any one of its
        # samples sits in a shuffle buffer downstream.
        return value[i].clone() if isinstance(value, torch.Tensor) else value[i].copy()
    return value[i]


@stage(count=UNBATCH)
def unbatched(src: Iterable[Any], *, ledger: Any = None) -> Iterator[Any]:
    """Split batches back into samples (the inverse of :func:`batched`).

    A tuple or list batch gives tuples; a dict batch gives dicts, nested dicts included. Tensors
    and arrays are split along their first dimension; every column must have the same length.
    """
    slot = _splitter_slot(ledger)
    for batch in src:
        if isinstance(batch, Mapping):
            lengths = {repr(k): _column_len(v, repr(k)) for k, v in batch.items()}
            n = _common_len(lengths, "")
            items = ({k: _column_item(v, i) for k, v in batch.items()} for i in range(n))
            yield from _split(items, n, ledger, slot)
        elif isinstance(batch, (tuple, list)):
            lengths = {f"#{j}": _column_len(v, f"#{j}") for j, v in enumerate(batch)}
            n = _common_len(lengths, "")
            items = (tuple(_column_item(v, i) for v in batch) for i in range(n))
            yield from _split(items, n, ledger, slot)
        else:
            raise SampleError(
                f"unbatched expects tuple, list or dict batches, got a {type(batch).__name__}"
            )
