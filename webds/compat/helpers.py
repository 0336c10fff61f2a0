"""webdataset's small helper names, which 1.x code imports from its modules: function
composition and collation helpers of ``filters``, ``tariterators``' constants and checks,
``utils``' brace globbing, ``autodecode``'s extension matching. Each behaves as 1.x's did;
``webds.filters``, ``webds.tariterators``, ``webds.utils`` and ``webds.autodecode`` serve them
(see :mod:`webds.compat.aliases`).
"""

from __future__ import annotations

import dataclasses
import fnmatch as _fnmatch
import functools
import glob
import itertools
import os
import pickle
import random
import re
import sys
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import braceexpand
from torch.utils.data import IterableDataset

from ..errors import ArgumentError, NoSamplesError
from ..io.cache import pid_alive
from ..io.security import WEBDATASET_PICKLE, refuse
from ..shards.shardlists import expand_urls
from ..stages.batching import _collate_column, _Collation
from ..stages.codecs import basichandlers
from ..stages.decode import gzfilter
from .legacy import repeatedly as legacy_repeatedly
from .shardsources import _CLAIMED

__all__ = [
    "FilterFunction",
    "RestCurried",
    "check_empty",
    "RepeatedlyDataset",
    "compose2",
    "compose",
    "pipeline",
    "combine_values",
    "tuple2dict",
    "dict2tuple",
    "decode_bin",
    "decode_text",
    "decode_pickle",
    "find_decoder",
    "trace",
    "meta_prefix",
    "meta_suffix",
    "valid_sample",
    "shardlist",
    "glob_with_braces",
    "fnmatch_with_braces",
    "call_extension_handler",
    "decoders",
    "default_pre_handlers",
    "default_post_handlers",
    "envlookup",
    "expand",
    "expand_source",
    "resampled_",
    "MSSource",
    "default_rng",
    "check_pid_is_running",
    "without_last_extension",
    "get_pid_from_filename",
]

# -- filters, compat, extradatasets ------------------------------------------------------------


class FilterFunction:
    """``f`` with its arguments bound after the data: ``FilterFunction(f, *a)(data) ==
    f(data, *a)`` (picklable, unlike a lambda)."""

    def __init__(self, f: Callable[..., Any], *args: Any, **kw: Any) -> None:
        self.f, self.args, self.kw = f, args, kw

    def __call__(self, data: Any) -> Any:
        return self.f(data, *self.args, **self.kw)

    def __str__(self) -> str:
        return f"<{getattr(self.f, '__name__', self.f)} {self.args} {self.kw}>"


class RestCurried:
    """``RestCurried(f)(*a)`` is ``FilterFunction(f, *a)``: webdataset's currying of stages."""

    def __init__(self, f: Callable[..., Any]) -> None:
        self.f = f

    def __call__(self, *args: Any, **kw: Any) -> FilterFunction:
        return FilterFunction(self.f, *args, **kw)


def check_empty(source: Iterable[Any]) -> Iterator[Any]:
    """The items of ``source``; :class:`~webds.errors.NoSamplesError` (a ValueError) if there
    were none."""
    count = 0
    for sample in source:
        yield sample
        count += 1
    if count == 0:
        raise NoSamplesError(
            "no samples found in the dataset; perhaps there are fewer shards than workers. "
            "Turn the check off with empty_check=False in the WebDataset constructor"
        )


class RepeatedlyDataset(IterableDataset):
    """webdataset's ``extradatasets.repeatedly``: ``source`` iterated again and again (up to
    ``nepochs`` passes or ``nbatches`` items; see :func:`webds.utils.repeatedly`), with
    ``len() == length`` when given. (webdataset's own class failed on iteration.)"""

    def __init__(
        self,
        source: Any,
        nepochs: Optional[int] = None,
        nbatches: Optional[int] = None,
        length: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.source, self.nepochs, self.nbatches, self.length = source, nepochs, nbatches, length

    def invoke(self, source: Any) -> Iterator[Any]:
        """The repeated stream of ``source``."""
        return legacy_repeatedly(source, nepochs=self.nepochs, nbatches=self.nbatches)

    def __iter__(self) -> Iterator[Any]:
        return self.invoke(self.source)

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("this repeatedly dataset was given no length")
        return self.length


def compose2(f: Callable[[Any], Any], g: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``g(f(x))``."""
    return lambda x: g(f(x))


def compose(*args: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The functions applied left to right."""
    return functools.reduce(compose2, args)


def pipeline(source: Any, *args: Callable[[Any], Any]) -> Any:
    """``source`` through the filters ``args``, left to right."""
    return compose(*args)(source) if args else source


def combine_values(
    b: Sequence[Any], combine_tensors: bool = True, combine_scalars: bool = True
) -> Any:
    """One column of a batch, collated as :func:`~webds.stages.batching.default_collation_fn`
    collates a column (numbers to an array, tensors and arrays stacked, the rest a list)."""
    values = list(b)
    return _collate_column(values, "#0", values, _Collation(combine_tensors, combine_scalars))


def tuple2dict(value: Any) -> Dict[Any, Any]:
    """A tuple or list as ``{0: first, 1: second, ...}``; a dict as it is."""
    return value if isinstance(value, dict) else dict(enumerate(value))


def dict2tuple(d: Dict[int, Any]) -> Tuple[Any, ...]:
    """The inverse of :func:`tuple2dict`."""
    return tuple(d[i] for i in range(1 + max(d.keys())))


def decode_bin(stream: Any) -> bytes:
    """All of ``stream``'s bytes."""
    return stream.read()


def decode_text(stream: Any) -> str:
    """All of ``stream``, as UTF-8 text."""
    return stream.read().decode("utf-8")


def decode_pickle(stream: Any) -> Any:
    """``pickle.load(stream)``: calling it is opting in (only for data you trust); refused in
    secure mode."""
    refuse("unpickling (decode_pickle)", webdataset=WEBDATASET_PICKLE)
    return pickle.load(stream)


def find_decoder(
    decoders: Sequence[Tuple[str, Callable[[Any], Any]]], path: str
) -> Optional[Callable[[Any], Any]]:
    """The decoder of the last ``(pattern, decoder)`` whose pattern matches the file name of
    ``path`` (with or without a leading dot); meta names (``__key__``) pass as they are."""
    fname = re.sub(r".*/", "", path)
    if fname.startswith("__"):
        return lambda x: x
    for pattern, fun in decoders[::-1]:
        if _fnmatch.fnmatch(fname.lower(), pattern) or _fnmatch.fnmatch(
            "." + fname.lower(), pattern
        ):
            return fun
    return None


# -- tariterators -------------------------------------------------------------------------------

#: webdataset's switch for printing every member read (webds logs on the ``webds`` logger).
trace = False
#: A meta member's name starts and ends with these (``__key__``, ``__meta__``).
meta_prefix = "__"
meta_suffix = "__"


def valid_sample(sample: Any) -> bool:
    """Whether ``sample`` is a non-empty dict not marked ``__bad__``."""
    return isinstance(sample, dict) and len(sample) > 0 and not sample.get("__bad__", False)


def shardlist(urls: Any, *, shuffle: bool = False) -> Iterator[Dict[str, str]]:
    """``{"url": url}`` for each URL of a brace pattern or a list (shuffled with
    ``shuffle=True``, by a generator of its own)."""
    listed: List[str] = list(braceexpand.braceexpand(urls)) if isinstance(urls, str) else list(urls)
    if shuffle:
        random.Random().shuffle(listed)
    for url in listed:
        yield {"url": url}


# -- shardlists ---------------------------------------------------------------------------------


def envlookup(m: "re.Match[str]") -> str:
    """The value of ``WDS_<m.group(1)>`` (webdataset's ``${NAME}`` rule); an
    :class:`ArgumentError` if it is not set."""
    key = "WDS_" + m.group(1)
    if key not in os.environ:
        raise ArgumentError(f"{m.group(0)} needs the environment variable {key}, which is not set")
    return os.environ[key]


def expand(s: str) -> str:
    """``~`` and ``$VAR`` expanded, as ``MultiShardSample`` expands its shard specs."""
    return os.path.expanduser(os.path.expandvars(s))


def expand_source(source: Any, max_urls: int = int(1e9)) -> List[str]:
    """A shard source as a list of URLs: a spec string expanded (:func:`webds.expand_urls`), a
    list as it is, another iterable's first ``max_urls`` items."""
    if isinstance(source, str):
        return expand_urls(source)
    if isinstance(source, list):
        return source
    if isinstance(source, Iterable):
        return list(itertools.islice(source, max_urls))
    raise ArgumentError(f"cannot take shard URLs from a {type(source).__name__}")


def resampled_(src: Iterable[Any], n: int = sys.maxsize) -> Iterator[Any]:
    """``n`` items drawn with replacement from all of ``src`` (read first), with fresh entropy."""
    items = list(src)
    rng = random.Random(os.urandom(16))
    for _ in range(n):
        yield rng.choice(items)


@dataclasses.dataclass
class MSSource:
    """One source of a ``MultiShardSample`` spec, as webdataset describes it."""

    name: str = ""
    perepoch: int = -1
    resample: bool = False
    urls: List[str] = dataclasses.field(default_factory=list)


#: webdataset's module-wide generator (webds's own shard lists draw from generators of their
#: own, seeded per epoch, rank and worker).
default_rng = random.Random()


#: Whether a process with this pid exists on this machine.
check_pid_is_running = pid_alive


def without_last_extension(fname: str) -> str:
    """``fname`` without its last ``.ext``."""
    return re.sub(r"\.[^.]*$", "", fname)


def get_pid_from_filename(fname: str) -> Optional[int]:
    """The pid of a ``DirectoryShardList`` claim ``NAME._PID_``, or None."""
    match = _CLAIMED.match(fname)
    return int(match.group(2)) if match else None


# -- utils --------------------------------------------------------------------------------------


def glob_with_braces(pattern: str) -> List[str]:
    """``glob`` of each brace expansion of ``pattern``, in order."""
    return [f for pat in braceexpand.braceexpand(pattern) for f in glob.glob(pat)]


def fnmatch_with_braces(filename: str, pattern: str) -> bool:
    """Whether ``filename`` matches any brace expansion of ``pattern``."""
    return any(_fnmatch.fnmatch(filename, pat) for pat in braceexpand.braceexpand(pattern))


# -- autodecode ---------------------------------------------------------------------------------


def call_extension_handler(
    key: str, data: bytes, f: Callable[[bytes], Any], extensions: Iterable[str]
) -> Any:
    """``f(data)`` if the field name ``key`` ends with one of ``extensions`` (``"seg.png"``
    ends with ``"png"`` and ``"seg.png"``), else None."""
    extension = key.lower().split(".")
    for target in extensions:
        parts = target.split(".")
        if len(parts) <= len(extension) and extension[-len(parts) :] == parts:
            return f(data)
    return None


def _by_extension(ext: str) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        return basichandlers(ext, data)

    decode.__name__ = f"decode_{ext}"
    return decode


#: webdataset's ``{extension: decoder(data)}`` table of its basic handlers, here webds's
#: (pickles refused unless a Decoder is told ``allow_pickle=True``; ``.pth`` weights only).
decoders: Dict[str, Callable[[bytes], Any]] = {
    ext: _by_extension(ext)
    for ext in "txt text transcript cls cls2 index inx id json jsn pyd pickle pkl pth ten tb "
    "mp msg npy npz cbor".split()
}

#: The handlers a :class:`~webds.stages.decode.Decoder` runs before and after its own.
default_pre_handlers = [gzfilter]
default_post_handlers = [basichandlers]
