"""The memory bounds of the member reader (:func:`~webds.tar.reader.read_members`): the largest
member, the bytes one sample may hold, the longest name, and the errors past them.

What a sample's budget (``max_sample_bytes``) counts: each member's data and the extended headers
read for it (pax records, GNU long names; not the one-block pax headers that change nothing),
where the budget is on (a compressed stream, or given); and always, in plain streams too, a GNU
sparse member's real size and a link's bytes, which the bytes on disk at their place say nothing
of (20 KB of tar can declare five sparse members of 900 MB). Each is counted before it is read.
"""

from __future__ import annotations

from typing import Optional, Tuple

from ..errors import SampleTooLargeError, ShardReadError

__all__ = ["DEFAULT_MAX_MEMBER_SIZE", "DEFAULT_MAX_SAMPLE_BYTES", "MAX_NAME"]

# No real member is this large; a size beyond it means a corrupt header, not a big file.
_MAX_MEMBER_SIZE = 1 << 46
#: The longest member name read (characters): one longer is no WebDataset name, and a pax
#: ``path`` can give each member of a sample one of 64 MiB.
MAX_NAME = 1 << 16
#: The largest member read out of a compressed shard (.tar.gz, .tar.bz2, .tar.xz) by default. A
#: plain tar's members are bounded by the file itself; a compressed one can claim (and expand to)
#: any size from a few KB, and every member is held whole in memory.
DEFAULT_MAX_MEMBER_SIZE = 1 << 30
#: The most bytes the members of one sample of a compressed shard may hold together, by default
#: (and decode's budget for a sample's decompressed fields: ``webds.stages.limits``): 512 MiB.
#: A sample is held whole in memory; a few KB of gzip can hold six members of 200 MB each, all
#: under the member limit. Checked on each member's header, before a byte of it is read. It
#: counts each member's data and the extended headers before it (pax records, GNU long names);
#: a GNU sparse member's real size counts always, in plain shards too, whose bytes on disk say
#: nothing of it (20 KB of tar can declare five members of 900 MB).
DEFAULT_MAX_SAMPLE_BYTES = 512 << 20


def _member_limit(max_member_size: Optional[int], compression: Optional[str]) -> int:
    """The largest member to read: ``max_member_size``, else that of a compressed or a plain
    stream."""
    if max_member_size is not None:
        return max_member_size
    return DEFAULT_MAX_MEMBER_SIZE if compression else _MAX_MEMBER_SIZE


def _sample_limit(max_sample_bytes: Optional[int], compression: Optional[str]) -> Optional[int]:
    """The most bytes one sample's members may hold together (None: no limit)."""
    if max_sample_bytes is not None:
        return max_sample_bytes
    return DEFAULT_MAX_SAMPLE_BYTES if compression else None


def _sample_held(
    name: str, size: int, held: int, key: str, budget: int, url: Optional[str], hoff: int
) -> Tuple[int, str]:
    """``(held, key)`` once member ``name`` of ``size`` bytes is read: the bytes its sample
    holds and its key; raise SampleTooLargeError past ``budget``. A name without a key (no
    sample holds it) counts for none."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot <= 0:
        return held, key
    this = name[:dot]
    held = held + size if this == key else size
    if held > budget:
        raise SampleTooLargeError(
            f"sample {this!r} holds more than max_sample_bytes={budget:,} ({budget >> 20} MiB) "
            f"in its members (this one, {size:,} bytes, would bring it to {held:,}): a sample is "
            "held whole in memory, and one in a compressed shard (or a sparse member, counted at "
            "its real size) may be a decompression bomb. "
            "If such samples are genuine, raise the limit: max_sample_bytes=N "
            "(tarfile_to_samples, WebDataset)",
            url=url,
            member=name,
            key=this,
            offset=hoff,
        )
    return held, this


def _long_name(name: str, url: Optional[str], offset: int) -> ShardReadError:
    return ShardReadError(
        f"member name of {len(name):,} characters, more than the {MAX_NAME:,} a member name may "
        f"have ({name[:60]!r}...): no WebDataset name is this long, it is a damaged or hostile "
        "shard (a pax path or GNU long name); re-create the shard",
        url=url,
        offset=offset,
    )


def _too_large(
    size: int, limit: int, compression: Optional[str], url: Optional[str], name: str, hoff: int
) -> ShardReadError:
    if size < 0 or size > _MAX_MEMBER_SIZE:
        message = f"corrupt header: member claims {size} bytes, which is impossible; re-create it"
    else:
        where = f"a {compression}-compressed shard" if compression else "this shard"
        message = (
            f"member is {size} bytes, more than the {limit} bytes allowed for a member of "
            f"{where} (each member is held whole in memory; a compressed one may be a "
            "decompression bomb); if it is genuine, raise the limit with "
            "max_member_size= (tarfile_to_samples, WebDataset)"
        )
    return ShardReadError(message, url=url, member=name, offset=hoff)
