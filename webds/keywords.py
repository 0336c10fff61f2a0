"""The old ``WebDataset(...)`` keywords, translated into the modern constructor and stages.

webdataset 1.x's ``mode=``, ``detshuffle=``, ``verbose=``, ``url_to_name=``, and the 0.1 style
``extensions=``, ``decoder=``, ``transforms=``, ``shuffle=``: :func:`legacy_keywords` turns them
into :class:`LegacyPlan` (constructor values plus the stages they stand for), which
:class:`~webds.fluent.WebDataset` applies. It lives beside the core rather than in
:mod:`webds.compat` because the core's constructor takes these keywords and the core never
imports compat; :mod:`webds.compat` re-exports both names, as before.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from .errors import ArgumentError
from .stages import filters
from .stages.decode import Decoder, handle_extension, make_decoder
from .stages.decode import decode as decode_stage
from .stages.fields import associate, map_tuple, to_tuple

__all__ = ["LegacyPlan", "legacy_keywords"]

_V1_KEYWORDS = ("mode", "detshuffle", "verbose", "url_to_name")
_V01_KEYWORDS = ("extensions", "decoder", "transforms", "shuffle", "pipeline", "associate")

# webdataset 0.1 keywords webds does not take, with what to write instead.
_V01_REPLACED = {
    "opener": "register a handler in webds.compat.gopen_schemes, or use 'pipe:CMD' URLs",
    "keys": "pass rename_files= to WebDataset, or .rename_keys(...)",
    "errors": "pass handler=warn_and_continue (or another handler) to WebDataset",
    "container": "decode the records in a .map(f) stage",
    "prepare_for_worker": "shards are split by worker already; see workersplitter=",
    "size": "declare a length with .with_length(n)",
    "length": "declare a length with .with_length(n)",
    "epochs": "repeat with .repeat(nepochs)",
}

Transforms = Union[None, Callable[[Any], Any], Sequence[Optional[Callable[[Any], Any]]]]


@dataclass
class LegacyPlan:
    """What old keywords mean for ``WebDataset``: constructor values, then stages to append."""

    resampled: bool
    shardshuffle: Union[bool, int, None]
    stages: List[Any] = field(default_factory=list)
    #: The modern spelling of the 0.1 keywords (shown in the DeprecationWarning), or None.
    fluent: Optional[str] = None


def legacy_keywords(
    options: Mapping[str, Any],
    *,
    resampled: bool = False,
    shardshuffle: Union[bool, int, None] = None,
    warn_stacklevel: int = 3,
) -> LegacyPlan:
    """Translate old ``WebDataset`` keywords into a :class:`LegacyPlan`.

    ``legacy_keywords({"extensions": "jpg cls", "decoder": "pil"})`` gives the stages
    ``decode("pil"), to_tuple("jpg", "cls")`` and warns once with the fluent spelling. Unknown
    keywords raise TypeError, as Python does for any other function.
    """
    options = dict(options)
    for name in options:
        if name in _V01_REPLACED:
            raise ArgumentError(
                f"WebDataset({name}=...) is a webdataset 0.1 keyword that webds does not take: "
                f"{_V01_REPLACED[name]}"
            )
        if name not in _V1_KEYWORDS and name not in _V01_KEYWORDS:
            raise TypeError(f"WebDataset() got an unexpected keyword argument {name!r}")
    resampled = _mode(options.get("mode"), resampled)
    if options.get("url_to_name") is not None:
        warnings.warn(
            "WebDataset(url_to_name=...) has no effect (webdataset ignored it too) and will be "
            "removed; drop the argument",
            DeprecationWarning,
            stacklevel=warn_stacklevel,
        )
    # detshuffle=True asked for a shard order that changes with the epoch: webds's shard shuffle
    # always does. verbose= never had an effect.
    plan = LegacyPlan(resampled=resampled, shardshuffle=shardshuffle)
    if any(name in options for name in _V01_KEYWORDS):
        _plan_v01(plan, options)
        warnings.warn(
            "WebDataset(url, extensions=..., decoder=..., transforms=..., shuffle=...) is the "
            f"webdataset 0.1 style and is deprecated; write {plan.fluent}",
            DeprecationWarning,
            stacklevel=warn_stacklevel,
        )
    return plan


def _mode(mode: Any, resampled: bool) -> bool:
    if mode is None:
        return resampled
    if mode == "resampled":
        return True
    raise ArgumentError(
        f"WebDataset(mode={mode!r}): the only mode is 'resampled' (the same as resampled=True); "
        "a directory used as a work queue is DirectoryShardList(path, mode=...)"
    )


def _plan_v01(plan: LegacyPlan, options: Dict[str, Any]) -> None:
    """Fill ``plan`` with the stages the 0.1 keywords stand for, in 0.1's order of effects."""
    stages: List[Any] = []
    calls: List[str] = []
    shuffle = options.get("shuffle", 0) or 0
    if not isinstance(shuffle, int) or isinstance(shuffle, bool) or shuffle < 0:
        raise ArgumentError(f"WebDataset(shuffle={shuffle!r}): give a buffer size, e.g. 1000")
    ctor = "url"
    # 0.1: shuffle > 0 shuffled the shards, shuffle > 1 also the samples through that buffer.
    if shuffle > 0 and plan.shardshuffle is None and not plan.resampled:
        plan.shardshuffle = True
        ctor += ", shardshuffle=True"
    if shuffle > 1:
        stages.append(filters.shuffle(shuffle))
        calls.append(f".shuffle({shuffle})")
    # 0.1 decoded with "rgb" unless told otherwise; decoder=None/False left bytes.
    decoder = options.get("decoder", "rgb")
    stage, call = _decoder_stage(decoder)
    if stage is not None:
        stages.append(stage)
        calls.append(call)
    assoc = options.get("associate")
    if assoc is not None:
        stages.append(associate(assoc))
        calls.append(f".associate({_name(assoc)})")
    fields = _extensions(options.get("extensions"))
    transforms = _transforms(options.get("transforms"))
    if fields is not None:
        stages.append(to_tuple(*fields))
        calls.append(f".to_tuple({', '.join(_lit(f) for f in fields)})")
    if transforms:
        if fields is None:
            raise ArgumentError(
                "WebDataset(transforms=[...]) applies one function per tuple element, so it "
                "needs extensions= too (e.g. extensions='jpg cls'); for a function of the whole "
                "sample use .map(f)"
            )
        stages.append(map_tuple(*transforms))
        calls.append(f".map_tuple({', '.join(_name(f) for f in transforms)})")
    pipeline = options.get("pipeline")
    if pipeline is not None:
        if not callable(pipeline):
            raise ArgumentError(
                f"WebDataset(pipeline={pipeline!r}): give a function iterator -> iterator"
            )
        stages.append(pipeline)
        calls.append(f".compose({_name(pipeline)})")
    plan.stages = stages
    plan.fluent = f"WebDataset({ctor})" + "".join(calls)


def _decoder_stage(decoder: Any) -> tuple:
    if decoder is None or decoder is False:
        return None, ""
    if decoder is True:
        return decode_stage(), ".decode()"
    if isinstance(decoder, str):
        make_decoder(decoder)  # an unknown image spec fails here, at construction
        return decode_stage(decoder), f".decode({_lit(decoder)})"
    if isinstance(decoder, Decoder):
        return decode_stage(decoder), f".decode({_name(decoder)})"
    if isinstance(decoder, Mapping):
        handlers = [handle_extension(ext, fn) for ext, fn in decoder.items()]
        shown = ", ".join(f"handle_extension({_lit(e)}, {_name(f)})" for e, f in decoder.items())
        return decode_stage(*handlers), f".decode({shown})"
    if callable(decoder):
        # 0.1 called a decoder function on the whole sample dict.
        return filters.map(decoder), f".map({_name(decoder)})"
    raise ArgumentError(
        f"WebDataset(decoder={decoder!r}): give an image spec such as 'pil' or 'rgb8', True, "
        "None, a dict {extension: function}, or a function of the sample"
    )


def _extensions(extensions: Any) -> Optional[List[str]]:
    """``"jpg;png cls"``, ``["jpg;png", "cls"]`` or ``[["jpg", "png"], ["cls"]]`` → fields."""
    if extensions is None:
        return None
    if isinstance(extensions, str):
        fields = extensions.split()
    elif isinstance(extensions, (list, tuple)):
        fields = [";".join(f) if isinstance(f, (list, tuple)) else f for f in extensions]
    else:
        fields = []
    if not fields or not all(isinstance(f, str) and f for f in fields):
        raise ArgumentError(
            f"WebDataset(extensions={extensions!r}): give a string like 'jpg;png cls' or a list "
            "of extensions"
        )
    return fields


def _transforms(transforms: Transforms) -> List[Optional[Callable[[Any], Any]]]:
    if transforms is None:
        return []
    # 0.1 made a single function into a one-element list: it transforms the first element.
    fns = [transforms] if callable(transforms) else list(transforms)
    for i, f in enumerate(fns):
        if f is not None and not callable(f):
            raise ArgumentError(
                f"WebDataset(transforms=...): element {i} is {f!r}, not a function or None"
            )
    return fns


def _lit(value: str) -> str:
    return json.dumps(value)


def _name(obj: Any) -> str:
    """How ``obj`` is shown in the suggested code: its name, a short repr, or its type."""
    if obj is None:
        return "None"
    name = getattr(obj, "__name__", None)
    if isinstance(name, str):
        return name
    shown = repr(obj)
    return shown if len(shown) <= 60 and "\n" not in shown else type(obj).__name__
