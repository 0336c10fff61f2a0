"""The webds exception hierarchy.

Every error webds raises on purpose derives from :class:`WebdsError` and carries the context a
user needs to act on it: the shard ``url``, the tar ``member`` (or sample ``key``) and the byte
``offset`` in the shard where that is known. Each class also derives from the builtin exception a
caller would naturally catch (``IOError`` for I/O, ``ValueError`` for bad data or arguments), so
``except ValueError`` keeps working for code written against webdataset.

What an error shows (``str``, ``repr``, a traceback) has its credentials redacted
(:func:`webds.base.redact.redact`): a URL's password and signature, secret storage options. The
attributes keep the raw values (``exc.url`` reopens the shard).
"""

from __future__ import annotations

import tarfile
from typing import Any, Optional

from .base.redact import redact, redact_exception

__all__ = [
    "WebdsError",
    "ArgumentError",
    "OpenError",
    "ShardReadError",
    "SampleError",
    "DecodeError",
    "EncodeError",
    "WriteError",
    "LengthError",
    "ResumeError",
    "SecureModeError",
    "NotFoundError",
    "MissingFieldError",
    "NoSamplesError",
    "NotATarError",
    "SampleTooLargeError",
]


class WebdsError(Exception):
    """Root of all webds errors.

    ``message`` says what went wrong and what to do; ``url``, ``member``, ``key`` and ``offset``
    (all optional) say where. ``str(exc)`` renders all of them, credentials redacted.
    """

    #: str() and repr() hide credentials themselves (see webds.base.redact.redact_exception).
    redacts_itself = True

    def __init__(
        self,
        message: str,
        *,
        url: Optional[str] = None,
        member: Optional[str] = None,
        key: Optional[str] = None,
        offset: Optional[int] = None,
    ) -> None:
        super().__init__(redact(message))  # args: what a generic display shows
        self.message = message
        self.url = url
        self.member = member
        self.key = key
        self.offset = offset

    def __str__(self) -> str:
        # A traceback shows the chained exceptions too, built after this text: a client's error
        # naming the signed URL it fetched is redacted in place here, wherever it was raised.
        redact_exception(self)
        where = []
        if self.url is not None:
            where.append(f"shard {redact(self.url)!r}")
        if self.member is not None:
            where.append(f"member {self.member!r}")
        elif self.key is not None:
            where.append(f"sample {self.key!r}")
        if self.offset is not None:
            where.append(f"byte offset {self.offset}")
        message = redact(self.message)
        if not where:
            return message
        return f"{message} [{', '.join(where)}]"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact(self.message)!r})"

    def __reduce__(self) -> Any:
        # Exceptions cross DataLoader worker boundaries by pickling; keep the keyword context.
        return (
            _rebuild,
            (type(self), self.message, self.url, self.member, self.key, self.offset),
        )


def _rebuild(cls: type, message: str, url: Any, member: Any, key: Any, offset: Any) -> Any:
    return cls(message, url=url, member=member, key=key, offset=offset)


class ArgumentError(WebdsError, ValueError):
    """A webds function was called with an argument it cannot use."""


class ResumeError(ArgumentError):
    """A saved position (``state_dict()``) cannot be resumed exactly: the message says why and
    what to change."""


class SecureModeError(WebdsError, ValueError):
    """Secure mode (:mod:`webds.io.security`) refused a URL or a field: a ``pipe:`` command, a
    local file, a pickle (a ValueError, as webdataset raised)."""


class OpenError(WebdsError, IOError):
    """A URL could not be opened, or a ``pipe:`` command failed (the message has its status)."""


class NotFoundError(OpenError, FileNotFoundError):
    """The URL names nothing: no such file, object or page (a ``FileNotFoundError`` too, as
    webdataset's open raised)."""


class ShardReadError(WebdsError, IOError, tarfile.ReadError):
    """A shard is truncated, corrupt, empty or not a tar archive (a ``tarfile.ReadError`` too,
    as webdataset's reader raised)."""


class NotATarError(ShardReadError, ValueError):
    """A downloaded or cached file is not a tar archive (also a ``ValueError``, as webdataset's
    ``FileCache`` raised)."""


class SampleError(WebdsError, ValueError):
    """A sample is malformed: a duplicate member, a missing field, a bad key."""


class MissingFieldError(SampleError, KeyError):
    """A stage needs a field the sample lacks (a ``KeyError`` too, as webdataset's ``map_dict``
    raised)."""


class NoSamplesError(WebdsError, ValueError):
    """A pipeline found no samples at all (a ``ValueError``, as webdataset's check raised)."""


class DecodeError(WebdsError, ValueError):
    """A field of a sample could not be decoded."""


class SampleTooLargeError(ShardReadError, DecodeError):
    """A sample holds more bytes than ``max_sample_bytes`` allows: its members in a compressed
    shard, or its fields as decompressed at decode (maybe a decompression bomb). Both a
    :class:`ShardReadError` (raised by the tar reader) and a :class:`DecodeError` (by decode),
    so the handlers that skip or raise either decide for it too."""


class EncodeError(WebdsError, ValueError):
    """A field of a sample could not be encoded for writing."""


class WriteError(WebdsError, IOError):
    """A shard could not be written or committed."""


class LengthError(WebdsError, TypeError):
    """``len()`` of a pipeline that cannot know its length (a TypeError, as ``len()`` expects)."""
