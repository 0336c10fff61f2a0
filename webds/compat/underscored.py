"""webdataset's plain generator functions behind its filters, under their names.

1.x code calls them on plain iterators (webdataset's FAQ recommends
``webdataset.filters._unbatched``)::

    for batch in wds.filters._batched(samples, 16, collation_fn=None): ...

Each is the very function behind the webds stage of the same name without the underscore (the
stage's ``fn``), so it takes the same arguments and behaves the same; ``webds.filters`` serves
them (see :data:`webds.compat.aliases.EXTRAS`).
"""

from __future__ import annotations

from ..stages import batching, decode, fields, filters, xdecode

__all__ = [
    "_associate",
    "_batched",
    "_decode",
    "_extract_keys",
    "_info",
    "_log_keys",
    "_map",
    "_map_dict",
    "_map_tuple",
    "_rename",
    "_rename_keys",
    "_rsample",
    "_select",
    "_shuffle",
    "_to_tuple",
    "_unbatched",
    "_unlisted",
    "_xdecode",
]

_associate = fields.associate.fn
_batched = batching.batched.fn
_decode = decode.decode.fn
_extract_keys = fields.extract_keys.fn
_info = filters.info.fn
_log_keys = filters.log_keys.fn
_map = filters.map.fn
_map_dict = fields.map_dict.fn
_map_tuple = fields.map_tuple.fn
_rename = fields.rename.fn
_rename_keys = fields.rename_keys.fn
_rsample = filters.rsample.fn
_select = filters.select.fn
_shuffle = filters.shuffle.fn
_to_tuple = fields.to_tuple.fn
_unbatched = batching.unbatched.fn
_unlisted = batching.unlisted.fn
_xdecode = xdecode.xdecode.fn
