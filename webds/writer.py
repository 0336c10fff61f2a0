"""Writing shards: :class:`~webds.tarwriter.TarWriter` (one tar) and
:class:`~webds.shardwriter.ShardWriter` (a numbered series).

Samples are dicts with a ``__key__`` and one value per extension; each field is encoded by
:mod:`webds.stages.encode` and written as the tar member ``f"{key}.{ext}"``, fields in sorted order.
Output is deterministic by default (mtime 0, uid/gid 0, gzip without timestamp or name), so the
same samples always give byte-identical shards. A shard appears under its final name only once
it is complete: an exception while writing discards it. That holds for remote URLs too
(``s3://``, ``gs://``, any fsspec store, with ``storage_options``): S3 multipart and GCS
resumable uploads create the object only when the shard is closed, and a discarded shard's
upload is aborted. A shard larger than memory streams out in parts as the upload buffer fills
(its size is the store's block size, e.g. s3fs's ``default_block_size``, 50 MiB by default).

    with ShardWriter("out/train-%06d.tar", maxcount=10000) as sink:
        for i, (image, label) in enumerate(data):
            sink.write({"__key__": f"{i:08d}", "jpg": image, "cls": label})
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Union

from .shardwriter import ShardWriter

# webdataset's writer module also exported its encoders; code imports them from there.
from .stages.encode import (  # noqa: F401
    EncoderSpec,
    cbor_dumps,
    default_handlers,
    encode_value,
    imageencoder,
    make_encoder,
    mp_dumps,
    numpy_dumps,
    numpy_npz_dumps,
    tenbin_dumps,
    torch_dumps,
)
from .stages.encode import encode_sample as encode_based_on_extension  # noqa: F401
from .tarwriter import TarWriter, check_key, is_numbered_pattern, single_shard_name  # noqa: F401

# numpy_dumps and torch_dumps are re-exported because webdataset's writer module has them.
__all__ = ["TarWriter", "ShardWriter", "check_key", "numpy_dumps", "torch_dumps"]


# webdataset's writer module helpers, with its signatures.

#: webdataset's name: a new ``{extension: encoder}`` table (webds's defaults).
make_handlers = default_handlers


def add_handlers(d: Dict[str, Any], keys: Union[str, Iterable[str]], value: Callable) -> None:
    """Set ``d[k] = value`` for each extension in ``keys`` (a list, or space-separated)."""
    for k in keys.split() if isinstance(keys, str) else keys:
        d[k] = value


def bytestr(data: Any) -> bytes:
    """``data`` as bytes: bytes as they are, anything else as its ``str``, ASCII-encoded."""
    if isinstance(data, bytes):
        return data
    return (data if isinstance(data, str) else str(data)).encode("ascii")


def encode_based_on_extension1(data: Any, tname: str, handlers: Dict[str, Callable]) -> Any:
    """One field encoded by its extension ``tname`` with ``handlers`` (``.gz``: gzipped;
    metadata names starting with ``_`` must be str and stay str)."""
    return encode_value(tname, data, handlers)
