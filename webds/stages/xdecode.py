"""``xdecode``: webdataset's second decoder family, whose functions read a stream.

Fields are matched by fnmatch patterns on their names (``("*.jpg", PIL.Image.open)``) rather
than run through the handler chain of :class:`~webds.stages.decode.Decoder`; failures raise the
same :class:`~webds.errors.DecodeError` naming the field.
"""

from __future__ import annotations

import io
import pickle
import re
from fnmatch import fnmatchcase
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence

from ..base.handlers import Handler, apply_each, reraise_exception
from ..base.stage import SAME, stage
from ..errors import ArgumentError, DecodeError, SecureModeError
from ..io.security import WEBDATASET_PICKLE, refuse
from .decode import _BYTES_LIKE, _decode_error

__all__ = [
    "xdecode",
    "default_xdecoders",
    "decode_bin",
    "decode_text",
    "decode_pickle",
    "find_decoder",
]


def decode_bin(stream: Any) -> bytes:
    """Read the whole stream as bytes."""
    return stream.read()


def decode_text(stream: Any) -> str:
    """Read the whole stream as UTF-8 text."""
    return stream.read().decode("utf-8")


def decode_pickle(stream: Any) -> Any:
    """``pickle.load``: only for data you trust. :func:`xdecode` uses it only with
    ``allow_pickle=True``; secure mode (:mod:`webds.io.security`) refuses it always."""
    refuse("unpickling fields, even with allow_pickle=True", webdataset=WEBDATASET_PICKLE)
    return pickle.load(stream)


StreamDecoder = Callable[[Any], Any]

#: xdecode's defaults: ``(pattern, fn)`` pairs; later entries win.
default_xdecoders: List[tuple] = [
    ("*.bin", decode_bin),
    ("*.txt", decode_text),
    ("*.pyd", decode_pickle),
]


def find_decoder(decoders: Sequence[tuple], path: str) -> Optional[StreamDecoder]:
    """The decoder of the last ``(pattern, fn)`` whose fnmatch pattern matches the lower-cased
    basename of ``path`` (or it with a leading dot); None if none does."""
    fname = re.sub(r".*/", "", path).lower()
    for pattern, fn in reversed(decoders):
        if fnmatchcase(fname, pattern) or fnmatchcase("." + fname, pattern):
            return fn
    return None


@stage(count=SAME, stateless=True)
def xdecode(
    src: Iterable[Mapping[str, Any]],
    *args: tuple,
    must_decode: bool = True,
    defaults: Sequence[tuple] = default_xdecoders,
    allow_pickle: bool = False,
    handler: Handler = reraise_exception,
    **kw: StreamDecoder,
) -> Iterator[Dict[str, Any]]:
    """Decode fields with functions that read a stream, chosen by fnmatch patterns on the name.

    ``xdecode(("*.jpg", PIL.Image.open), npy=numpy.load)``: ``args`` are ``(pattern, fn)`` pairs,
    ``ext=fn`` means ``("*.ext", fn)``, later entries win, and ``fn=False`` keeps a field raw.
    Defaults: ``*.bin`` -> bytes, ``*.txt`` -> str, ``*.pyd`` -> pickle (only with
    ``allow_pickle=True``, as in :func:`~webds.stages.decode.decode`). ``__`` fields pass
    through. With ``must_decode`` a field no pattern matches is a DecodeError; otherwise it stays
    bytes.
    """
    decoders = list(defaults) + list(args) + [("*." + k, v) for k, v in kw.items()]
    for entry in decoders:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
            raise ArgumentError(f"xdecode: decoders are (pattern, fn) pairs, got {entry!r}")
        if entry[1] is not False and not callable(entry[1]):
            raise ArgumentError(f"xdecode: the decoder for {entry[0]!r} is not callable")

    def decode_sample(sample: Mapping[str, Any]) -> Dict[str, Any]:
        if not isinstance(sample, Mapping):
            raise DecodeError(f"xdecode works on dict samples, got a {type(sample).__name__}")
        url, skey = sample.get("__url__"), sample.get("__key__")
        result: Dict[str, Any] = {}
        for path, data in sample.items():
            if path.startswith("__"):
                result[path] = data
                continue
            try:
                fn = find_decoder(decoders, path)
                if fn is False or (fn is None and not must_decode):
                    result[path] = data
                    continue
                if fn is None:
                    raise DecodeError(
                        f"no xdecode pattern matches this field; add one, e.g. "
                        f'xdecode(("*.{path}", fn)), or pass must_decode=False'
                    )
                if fn is decode_pickle and not allow_pickle:
                    raise DecodeError(
                        "pickle fields can run arbitrary code when loaded; if you trust the "
                        "data, enable them with xdecode(..., allow_pickle=True)"
                    )
                stream = io.BytesIO(data) if isinstance(data, _BYTES_LIKE) else data
                result[path] = fn(stream)
            except SecureModeError as exn:
                # A refusal, not bad data: raised as it is, saying where (as decode does).
                exn.url = exn.url or (url if isinstance(url, str) else None)
                exn.member = exn.member or (f"{skey}.{path}" if isinstance(skey, str) else None)
                raise
            except Exception as exn:
                raise _decode_error(exn, url, skey, path) from exn
        return result

    return apply_each(src, decode_sample, handler, "xdecode")
