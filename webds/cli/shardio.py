"""Raw samples in and out for the tar-writing commands (``create``, ``split``, ``cat``, ``sort``).

These commands copy samples, so they keep member names exactly as they are in the input:
:func:`webds.cli.common.read_samples` keeps each extension's case, and :func:`write_samples`
writes every field back (fields starting with ``_`` included), so ``webds cat a.tar > b.tar``
lists the same names as ``a.tar``.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Iterable, List, Optional, Union

from ..base.redact import redact
from ..errors import ArgumentError, EncodeError
from ..shardwriter import ShardWriter
from ..tarwriter import TarWriter, is_numbered_pattern, refused_input
from .common import open_output

__all__ = [
    "tar_fields",
    "require_shard_pattern",
    "open_writer",
    "write_samples",
    "shard_range",
    "output_name",
    "close_iterator",
    "warn",
]

Sample = Dict[str, Any]
Writer = Union[TarWriter, ShardWriter]


def tar_fields(sample: Sample) -> Sample:
    """The sample as a writer takes it: ``__key__`` plus its fields, without ``__url__`` and
    the other ``__name__`` entries the reader adds."""
    return {
        name: value
        for name, value in sample.items()
        if name == "__key__" or not (name.startswith("__") and name.endswith("__"))
    }


def require_shard_pattern(output: str) -> str:
    """``output`` if it is a shard name pattern, else an ArgumentError saying how to write one."""
    if not is_numbered_pattern(output):
        raise ArgumentError(
            f"output pattern {output!r} has no field for the shard number; use one such as "
            "'out-%06d.tar' (write a literal '%' as '%%')"
        )
    return output


def open_writer(
    output: str,
    *,
    maxcount: int = 100000,
    maxsize: float = 3e9,
    start_shard: int = 0,
    index: bool = True,
    post: Any = None,
) -> Writer:
    """A :class:`ShardWriter` if ``output`` is a shard pattern, else a :class:`TarWriter`
    (``-`` is stdout, refused when it is a terminal). Both write raw samples as they are."""
    if is_numbered_pattern(output):
        return ShardWriter(
            output,
            maxcount=maxcount,
            maxsize=maxsize,
            start_shard=start_shard,
            index=index,
            post=post,
            encoder=False,
            keep_meta=True,
        )
    return open_output(output, keep_meta=True)


def write_samples(writer: Writer, samples: Iterable[Sample], command: str) -> int:
    """Write the samples; return how many. Warns (once) when a sample follows another with the
    same key: every reader would merge the two into one sample."""
    count = 0
    repeats = 0
    first_repeat: Optional[str] = None
    last_key: Optional[str] = None
    for sample in samples:
        key = sample["__key__"]
        if key == last_key:
            repeats += 1
            if first_repeat is None:
                first_repeat = key
        last_key = key
        try:
            writer.write(tar_fields(sample))
        except EncodeError as exn:
            # The writer sees no __url__ (not written): name the input, the shard at fault.
            raise refused_input(exn, sample, exn.url) from None
        count += 1
    if repeats:
        warn(
            command,
            f"{repeats} sample(s) follow a sample with the same key (first: {first_repeat!r}); "
            "readers merge such neighbours into one sample (or report a duplicate field)",
        )
    return count


def output_name(output: str) -> str:
    """An output as a summary line names it."""
    return "standard output" if output == "-" else output


def close_iterator(iterator: Any) -> None:
    """Close a generator (ending its shard streams and ``pipe:`` commands) if it can be."""
    close = getattr(iterator, "close", None)
    if callable(close):
        close()


def shard_range(shards: List[str]) -> str:
    """``"a-000.tar .. a-009.tar (10 shards)"`` for a summary line."""
    if not shards:
        return "no shards"
    if len(shards) == 1:
        return f"{shards[0]} (1 shard)"
    return f"{shards[0]} .. {shards[-1]} ({len(shards)} shards)"


def warn(command: str, message: str) -> None:
    """A warning on stderr (shown even with ``--quiet``), credentials redacted."""
    print(redact(f"webds {command}: warning: {message}"), file=sys.stderr)
