"""Shard lists described by a spec: :class:`MultiShardSample`, :func:`shardspec`.

A multi-source spec is a YAML file or a dict::

    prefix: /data/                 # optional, put before every shard
    buckets: train/                # optional default bucket (a directory under the prefix)
    datasets:
      - name: web                  # optional; defaults to "@" + bucket
        shards: web-{000000..000099}.tar
        choose: 10                 # optional: 10 distinct shards per epoch
      - shards: [books-{0..9}.tar, extra.tar]
        buckets: other/
        resample: 30               # optional: 30 shards drawn with replacement per epoch

Each epoch takes every dataset's shards (or its ``choose``/``resample`` selection), shuffles the
union and yields ``{"url": ...}`` for each. The selection depends only on (seed, epoch), so every
node and worker sees the same list and ``split_by_node``/``split_by_worker`` partition it.
``WebDataset(spec)`` takes such a dict or ``.yaml`` file name in place of URLs, as in webdataset.
"""

from __future__ import annotations

import os
import random
import re
from typing import Any, Dict, Iterator, List, Mapping, Union

import braceexpand
from torch.utils.data import IterableDataset

from ..base.redact import redact
from ..base.workers import derive_seed
from ..errors import ArgumentError, WebdsError
from ..io.security import refuse, secure
from ..io.streams import read_document
from ..io.urls import open_url
from .datasets import SimpleShardList

__all__ = ["MultiShardSample", "shardspec", "is_spec"]

Spec = Union[str, "os.PathLike[str]", Mapping[str, Any]]

_TOP_KEYS = {"prefix", "datasets", "buckets"}
_DATASET_KEYS = {"buckets", "name", "shards", "resample", "choose"}


def is_spec(urls: Any) -> bool:
    """Whether ``urls`` is a spec (a dict, or a ``.yaml``/``.yml`` file name) rather than URLs."""
    if isinstance(urls, Mapping):
        return True
    return isinstance(urls, (str, os.PathLike)) and os.fspath(urls).endswith((".yaml", ".yml"))


_VARIABLE = re.compile(r"\$(\w+|\{([^}]*)\})")


def _expand(s: str) -> str:
    """``~`` and ``$VAR`` expanded, as webdataset's MultiShardSample does; in secure mode only
    ``WDS_`` variables: a spec from someone else must not put ``$AWS_SECRET_ACCESS_KEY`` into
    the URLs it reads (refused whether the variable is set or not)."""
    if secure():
        for m in _VARIABLE.finditer(s):
            name = m.group(1) if m.group(2) is None else m.group(2)
            if not name.startswith("WDS_"):
                refuse(
                    f"reading ${name} of the shard spec value {s!r} from the environment "
                    "(secure mode reads only WDS_-prefixed variables)"
                )
    return os.path.expanduser(os.path.expandvars(s))


#: The largest spec file read (a list of shards and their weights is a few KB).
MAX_SPEC_BYTES = 16 << 20


def _read_spec(fname: str) -> bytes:
    """A spec file's bytes, from a local path or any URL :func:`~webds.io.urls.open_url` opens
    (its secure-mode checks included: a local spec file is refused there, as any local file)."""
    with open_url(fname) as stream:
        return read_document(stream, MAX_SPEC_BYTES, f"the shard spec {redact(fname)!r}")


def _load_spec(spec: Spec) -> tuple:
    if isinstance(spec, Mapping):
        return dict(spec), "<dict>"
    fname = os.fspath(spec)
    try:
        import yaml
    except ImportError:
        raise WebdsError(
            f"reading the shard spec {fname!r} needs PyYAML: pip install pyyaml "
            "(or pass the spec as a dict)"
        ) from None
    try:
        loaded = yaml.safe_load(_read_spec(fname))
    except OSError as exn:
        raise ArgumentError(f"cannot read the shard spec {redact(fname)!r}: {exn}") from None
    except yaml.YAMLError as exn:
        raise ArgumentError(f"the shard spec {fname!r} is not valid YAML: {exn}") from None
    if not isinstance(loaded, Mapping):
        raise ArgumentError(f"the shard spec {fname!r} must be a mapping with a 'datasets' list")
    return dict(loaded), fname


def _count(ds: Mapping[str, Any], key: str, where: str) -> int:
    value = ds.get(key, -1)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentError(f"{where}: {key!r} must be an integer, got {value!r}")
    return value


class _Source:
    """One dataset of a spec: its name, shard URLs and per-epoch selection."""

    def __init__(self, name: str, urls: List[str], choose: int, resample: int) -> None:
        self.name = name
        self.urls = urls
        self.choose = choose
        self.resample = resample

    def per_epoch(self) -> int:
        if self.resample > 0:
            return self.resample
        if self.choose > 0:
            return self.choose
        return len(self.urls)

    def select(self, rng: random.Random) -> List[str]:
        if self.resample > 0:
            return rng.choices(self.urls, k=self.resample)
        if self.choose > 0:
            return rng.sample(self.urls, self.choose)
        return list(self.urls)


def _parse(spec: Mapping[str, Any], where: str) -> List[_Source]:
    unknown = set(spec) - _TOP_KEYS
    if unknown:
        raise ArgumentError(
            f"{where}: unknown key(s) {sorted(unknown)}; a spec has {sorted(_TOP_KEYS)}"
        )
    datasets = spec.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        raise ArgumentError(f"{where}: 'datasets' must be a non-empty list of datasets")
    prefix = _expand(str(spec.get("prefix", "")))
    sources = []
    for i, ds in enumerate(datasets):
        here = f"{where}, dataset {i}"
        if not isinstance(ds, Mapping):
            raise ArgumentError(f"{here}: must be a mapping, got {ds!r}")
        unknown = set(ds) - _DATASET_KEYS
        if unknown:
            raise ArgumentError(
                f"{here}: unknown key(s) {sorted(unknown)}; a dataset has {sorted(_DATASET_KEYS)}"
            )
        buckets = ds.get("buckets", spec.get("buckets", []))
        buckets = [buckets] if isinstance(buckets, str) else list(buckets)
        if len(buckets) > 1:
            raise ArgumentError(
                f"{here}: several buckets {buckets} are not supported; give one bucket, or one "
                "dataset entry per bucket"
            )
        bucket = _expand(str(buckets[0])) if buckets else ""
        shards = ds.get("shards")
        if isinstance(shards, str):
            shards = [shards]
        if not shards or not all(isinstance(s, str) for s in shards):
            raise ArgumentError(f"{here}: 'shards' must be a shard spec or a list of them")
        urls = [
            prefix + os.path.join(bucket, url)
            for spec_url in shards
            for url in braceexpand.braceexpand(_expand(spec_url))
        ]
        choose, resample = _count(ds, "choose", here), _count(ds, "resample", here)
        if choose > 0 and resample > 0:
            raise ArgumentError(f"{here}: give 'choose' or 'resample', not both")
        if choose > len(urls):
            raise ArgumentError(f"{here}: choose={choose} but it has only {len(urls)} shards")
        sources.append(_Source(str(ds.get("name", "@" + bucket)), urls, choose, resample))
    return sources


class MultiShardSample(IterableDataset):
    """The shards of several datasets, selected and shuffled per epoch from a YAML spec file or
    a dict (the format is in this module's docstring).

    ``MultiShardSample("mix.yaml", seed=0)``; call :meth:`set_epoch` (a DataPipeline does) to
    get a new selection. The selection depends only on (seed, epoch).
    """

    def __init__(self, fname: Spec, seed: int = 0) -> None:
        super().__init__()
        spec, self.fname = _load_spec(fname)
        self.sources = _parse(spec, f"shard spec {self.fname}")
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose selection the next iteration yields."""
        self.epoch = int(epoch)

    def get_shards_for_epoch(self) -> List[str]:
        """The shard URLs of the current epoch, in order."""
        rng = random.Random(derive_seed("multishardsample", self.seed, self.epoch))
        urls = [url for source in self.sources for url in source.select(rng)]
        rng.shuffle(urls)
        return urls

    def __len__(self) -> int:
        return sum(source.per_epoch() for source in self.sources)

    def __iter__(self) -> Iterator[Dict[str, str]]:
        for url in self.get_shards_for_epoch():
            yield {"url": url}

    def __repr__(self) -> str:
        names = ", ".join(s.name for s in self.sources)
        return redact(f"MultiShardSample({self.fname!r}: {names}; seed={self.seed})")


def shardspec(spec: Union[Spec, List[str]]) -> IterableDataset:
    """A shard list for ``spec``: a ``.yaml``/``.yml`` file or a dict gives a
    :class:`MultiShardSample`, anything else a :class:`SimpleShardList`."""
    if is_spec(spec):
        return MultiShardSample(spec)  # type: ignore[arg-type]
    return SimpleShardList(spec)
