"""Decoding sample fields: the :class:`Decoder` and the ``decode`` stage.

A :class:`Decoder` runs a chain of handlers over each field of a sample. A handler is called as
``f(".ext", data)`` (``".jpg"``, ``".seg.jpg"``, ``".txt.gz"``); the first result that is not None
wins, and a :class:`Continue` result rewrites the key and data and carries on down the chain (that
is how ``.gz`` fields are gunzipped and then decoded by their inner extension). The default chain
is ``[gzfilter] + handlers + [basichandlers]``; the handlers themselves (the extension table,
images by image spec, video, audio) are in :mod:`webds.stages.codecs`, webdataset's
stream-reading ``xdecode`` in :mod:`webds.stages.xdecode`, and the bounds on decompressed fields
(``max_field_bytes``) and image pixels (``max_pixels``) in :mod:`webds.stages.limits`. Pickles
are decoded only with ``allow_pickle=True``, and ``.pth`` with ``torch.load(weights_only=True)``
unless ``weights_only=False`` (docs/formats.md has the whole table)::

    decoder = Decoder([imagehandler("rgb8")])
    decoder({"__key__": "a", "jpg": b"...", "cls": b"3"})   # {"jpg": uint8 HxWx3 array, "cls": 3}
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Union

from ..base.handlers import Handler, reraise_exception
from ..base.runs import Run
from ..base.stage import SAME, stage
from ..errors import ArgumentError, DecodeError, SampleTooLargeError, SecureModeError
from .codecs import ALWAYS_DECODE, BasicHandlers, Route, imagehandler, imagespecs, pure_route
from .limits import (
    FIELD_CODECS,
    MAX_FIELD_BYTES,
    MAX_PIXELS,
    MAX_SAMPLE_BYTES,
    SampleBudget,
    check_max,
    decompress_field,
)
from .threads import apply_maybe_threaded, check_threads

__all__ = [
    "Continue",
    "Decoder",
    "Decompress",
    "DecodingError",
    "ExtensionHandler",
    "decode",
    "default_decoder",
    "gzfilter",
    "handle_extension",
    "make_decoder",
]

#: webdataset's flag for ``.pth`` decoding. In webds it documents the default of
#: ``decode(..., weights_only=True)``; assigning it changes nothing (as in webdataset, where it
#: was a copy of a bool): pass ``weights_only=False`` to ``decode`` instead.
pytorch_weights_only = True

#: webdataset's name for :class:`~webds.errors.DecodeError`.
DecodingError = DecodeError


class Continue:
    """A handler result meaning "go on down the chain with this key and data instead"."""

    def __init__(self, key: str, data: Any) -> None:
        self.key = key
        self.data = data

    def __repr__(self) -> str:
        return f"Continue({self.key!r}, <{type(self.data).__name__}>)"


def gzfilter(key: str, data: bytes) -> Optional[Continue]:
    """Gunzip ``.gz`` fields and continue with the inner extension (``.txt.gz`` -> ``.txt``),
    to at most :data:`~webds.stages.limits.MAX_FIELD_BYTES`."""
    if not key.lower().endswith(".gz"):
        return None
    return Continue(key[:-3], decompress_field(data, "gz", MAX_FIELD_BYTES))


class Decompress:
    """The decoder's first handler: decompress ``.gz``, ``.bz2`` and ``.xz`` fields and continue
    with the inner extension (``.npy.xz`` -> ``.npy``), refusing more than ``max_field_bytes``
    of output (None: no limit) with a DecodeError, at bounded memory; within a
    :class:`Decoder`'s sample, also to what is left of its ``max_sample_bytes``."""

    def __init__(self, max_field_bytes: Optional[int] = MAX_FIELD_BYTES) -> None:
        self.max_field_bytes = check_max("max_field_bytes", max_field_bytes)

    def __call__(self, key: str, data: bytes) -> Optional[Continue]:
        stem, _, codec = key.rpartition(".")
        codec = codec.lower()
        if codec not in FIELD_CODECS:
            return None
        budget = SampleBudget.current()
        if budget is not None:
            return Continue(stem, budget.decompress(data, codec, self.max_field_bytes))
        return Continue(stem, decompress_field(data, codec, self.max_field_bytes))

    def decode_route(self, key: str) -> Optional[Route]:
        # A codec field goes on under another key: its route is not known from this one.
        return () if key.rpartition(".")[2].lower() not in FIELD_CODECS else None

    def __repr__(self) -> str:
        return f"Decompress(max_field_bytes={self.max_field_bytes!r})"


class ExtensionHandler:
    """Calls ``f(data)`` for fields whose trailing extensions match one of ``extensions``."""

    def __init__(self, extensions: Union[str, Sequence[str]], f: Callable[[bytes], Any]) -> None:
        if isinstance(extensions, str):
            extensions = extensions.split()
        self.extensions = [e.lower().lstrip(".").split(".") for e in extensions]
        self.f = f

    def __call__(self, key: str, data: bytes) -> Any:
        return self.f(data) if self.decode_route(key) else None

    def decode_route(self, key: str) -> Route:
        parts = key.lower().lstrip(".").split(".")
        for target in self.extensions:
            if len(target) <= len(parts) and parts[-len(target) :] == target:
                return (self.f,)
        return ()

    def __repr__(self) -> str:
        exts = " ".join(".".join(t) for t in self.extensions)
        return f"handle_extension({exts!r}, {self.f!r})"


def handle_extension(
    extensions: Union[str, Sequence[str]], f: Callable[[bytes], Any]
) -> ExtensionHandler:
    """A handler applying ``f(data)`` to the given space-separated extensions (case-insensitive).

    A multi-dot extension matches the trailing parts: ``handle_extension("seg.png", f)`` fires on
    ``".seg.png"`` and ``".x.seg.png"`` but not on ``".png"``.
    """
    return ExtensionHandler(extensions, f)


# -- the decoder ----------------------------------------------------------------------------

KeyHandler = Callable[[str, bytes], Any]
_BYTES_LIKE = (bytes, bytearray, memoryview)
_UNPLANNED = object()


class Decoder:
    """Decode every field of a sample through a chain of handlers ``pre + handlers + post``.

    ``pre`` defaults to ``[Decompress(max_field_bytes)]`` (``.gz``, ``.bz2``, ``.xz`` fields, at
    most 256 MiB each by default, and 512 MiB for all of one sample's: ``max_sample_bytes``,
    None for no limit) and ``post`` to ``[BasicHandlers(allow_pickle, weights_only)]``.
    ``only`` (a space-separated string or a list of exact field names) limits decoding to those
    fields. With ``partial=False`` every field must still be bytes; with
    ``partial=True`` fields that are not bytes pass through.
    """

    def __init__(
        self,
        handlers: Sequence[KeyHandler],
        pre: Optional[Sequence[KeyHandler]] = None,
        post: Optional[Sequence[KeyHandler]] = None,
        only: Union[None, str, Iterable[str]] = None,
        partial: bool = False,
        *,
        allow_pickle: bool = False,
        weights_only: bool = True,
        max_field_bytes: Optional[int] = MAX_FIELD_BYTES,
        max_sample_bytes: Optional[int] = MAX_SAMPLE_BYTES,
    ) -> None:
        self.max_sample_bytes = check_max("max_sample_bytes", max_sample_bytes)
        pre = [Decompress(max_field_bytes)] if pre is None else list(pre)
        post = [BasicHandlers(allow_pickle, weights_only)] if post is None else list(post)
        chain = pre + list(handlers) + post
        for h in chain:
            if not callable(h):
                raise ArgumentError(f"decoder handlers must be callables f(key, data); got {h!r}")
        self.handlers = chain
        if isinstance(only, str):
            only = only.split()
        self.only = None if only is None else frozenset(only)
        self.partial = bool(partial)

    def decode1(self, key: str, data: bytes, sample: Optional[Mapping[str, Any]] = None) -> Any:
        """Decode one field's bytes; ``key`` is the field name without the leading dot.

        Handlers with a true ``wants_sample`` attribute (the crop decoders, which draw each crop
        from the sample's key) are called as ``f(key, data, sample)``.
        """
        key = "." + key
        for f in self.handlers:
            if sample is not None and getattr(f, "wants_sample", False):
                result = f(key, data, sample)
            else:
                result = f(key, data)
            if result is None:
                continue
            if isinstance(result, Continue):
                key, data = result.key, result.data
                continue
            return result
        return data

    def decode(self, sample: Mapping[str, Any]) -> Dict[str, Any]:
        """Return a new dict with every selected field decoded; raise DecodeError naming it."""
        # (type() first: isinstance against typing's Mapping costs a microsecond a sample)
        if type(sample) is not dict and not isinstance(sample, Mapping):
            raise DecodeError(
                f"decode works on dict samples, got a {type(sample).__name__}; "
                "put decode before to_tuple / batched"
            )
        limit = self.__dict__.get("max_sample_bytes", MAX_SAMPLE_BYTES)
        if limit is None:
            return self._decode(sample)
        with SampleBudget(limit):
            return self._decode(sample)

    def _decode(self, sample: Mapping[str, Any]) -> Dict[str, Any]:
        result: Dict[str, Any] = {}
        routes = self._routes()
        only = self.only
        for k, v in sample.items():
            try:
                if k[:2] == "__":
                    if type(v) is not str and isinstance(v, _BYTES_LIKE):
                        v = bytes(v).decode("utf-8")
                    result[k] = v
                    continue
                if only is not None and k not in only:
                    result[k] = v
                    continue
                if type(v) is not bytes:
                    if not isinstance(v, _BYTES_LIKE):
                        if self.partial:
                            result[k] = v
                            continue
                        raise DecodeError(
                            f"field holds a {type(v).__name__}, not bytes: decode expects raw "
                            "fields from the tar reader. Decode only once, or pass partial=True "
                            "to leave non-bytes fields as they are"
                        )
                    v = bytes(v)
                route = routes.get(k, _UNPLANNED)
                if route is _UNPLANNED:
                    route = routes[k] = self._route(k)
                if route is None:
                    result[k] = self.decode1(k, v, sample)
                    continue
                result[k] = _decoded(route, v)
            except (SecureModeError, SampleTooLargeError) as exn:
                # A refusal, or the sample's budget: raised as it is, saying where.
                url, skey = sample.get("__url__"), sample.get("__key__")
                exn.url = exn.url or (url if isinstance(url, str) else None)
                exn.member = exn.member or (f"{skey}.{k}" if isinstance(skey, str) else None)
                exn.key = exn.key or (skey if isinstance(skey, str) else None)
                raise
            except Exception as exn:
                raise _decode_error(exn, sample.get("__url__"), sample.get("__key__"), k) from exn
        return result

    def __call__(self, sample: Mapping[str, Any]) -> Dict[str, Any]:
        return self.decode(sample)

    def over_run(self, run: Run) -> Optional[Run]:
        """:meth:`decode` of every sample of ``run``, column by column (None where a field
        needs it sample by sample: a handler that is not webds's own, or a field that is not
        the reader's bytes); see :mod:`webds.base.runs`."""
        columns, raw = run.columns, run.raw
        if columns is None:
            return None
        routes = self._routes()
        only = self.only
        result: Dict[str, List[Any]] = {}
        kept = set()
        for k, column in columns.items():
            if k[:2] == "__" or (only is not None and k not in only):
                result[k] = column  # (the reader's __key__ and __url__ are str)
                if k in raw:
                    kept.add(k)
                continue
            if k not in raw:
                return None
            route = routes.get(k, _UNPLANNED)
            if route is _UNPLANNED:
                route = routes[k] = self._route(k)
            if route is None or not pure_route(route):
                return None
            if not route:
                result[k] = column
                kept.add(k)
            elif len(route) == 1 and route[0] in ALWAYS_DECODE:
                result[k] = list(map(ALWAYS_DECODE[route[0]], column))
            else:
                result[k] = [_decoded(route, v) for v in column]
        return run.with_columns(result, frozenset(kept))

    def _routes(self) -> Dict[str, Optional[Route]]:
        # Each field name's route, worked out on first sight. Kept with the chain it was worked
        # out from, so that a chain changed afterwards (even in place) is routed afresh.
        cached = self.__dict__.get("_routed")
        if cached is None or cached[0] != self.handlers:
            cached = self._routed = (list(self.handlers), {})
        return cached[1]

    def _route(self, key: str) -> Optional[Route]:
        """The chain's route for fields named ``key`` (see :data:`~webds.stages.codecs.Route`),
        or None when one of its handlers can't tell it from the name."""
        route: Route = ()
        for h in self.handlers:
            find = getattr(h, "decode_route", None)
            part = find("." + key) if find is not None else None
            if part is None:
                return None
            route += part
        return route

    def __getstate__(self) -> Dict[str, Any]:
        # The routes hold the handlers' functions (maybe lambdas): worked out again, not sent.
        state = dict(self.__dict__)
        state.pop("_routed", None)
        return state

    def bind_pass(self, pipeline_seed: Optional[int], epoch: int) -> "Decoder":
        """The decoder one pass of a decode stage uses: handlers with a ``bind_pass`` method
        (the random crop decoder) are replaced by their copy for this seed and epoch, so their
        draws follow the pipeline's seed and epoch. ``self`` when no handler has one."""
        if not any(hasattr(h, "bind_pass") for h in self.handlers):
            return self
        bound = copy.copy(self)
        bound.handlers = [
            h.bind_pass(pipeline_seed, epoch) if hasattr(h, "bind_pass") else h
            for h in self.handlers
        ]
        return bound

    def __repr__(self) -> str:
        return f"Decoder({self.handlers!r}, only={self.only!r}, partial={self.partial})"


def _decoded(route: Route, data: bytes) -> Any:
    """What :meth:`Decoder.decode` makes of a field by its route."""
    for f in route:
        value = f(data)
        if value is not None:
            return value
    return data


def _decode_error(exn: Exception, url: Any, key: Any, field: str) -> DecodeError:
    if isinstance(exn, DecodeError):
        detail = exn.message
    elif isinstance(exn, MemoryError):
        # Not "check that the member holds valid data": the data may be fine, the memory is not.
        detail = (
            "out of memory while decoding it (MemoryError): the field may be a decompression "
            "bomb, or larger than this process can hold. decode's limits stop such fields "
            "before memory runs out: keep or lower max_field_bytes / max_pixels (None turns "
            "them off), or give the process more memory"
        )
    elif type(exn).__name__ == "DecompressionBombError":  # Pillow's, without importing Pillow
        detail = (
            f"Pillow refused it as a possible decompression bomb ({exn}). Pillow's limit is its "
            "process-global PIL.Image.MAX_IMAGE_PIXELS, which webds neither sets nor reads: "
            "decode's own limit is decode(..., max_pixels=N); for your own Image.open calls, "
            "raise Pillow's in your program if such images are genuine"
        )
    else:
        detail = (
            f"{type(exn).__name__}: {exn}. Check that the member holds valid '.{field}' data; "
            "decode(only=[...]) limits which fields are decoded, and "
            "handler=warn_and_continue skips bad samples"
        )
    member = f"{key}.{field}" if isinstance(key, str) else None
    return DecodeError(
        f"cannot decode field {field!r}: {detail}",
        url=url if isinstance(url, str) else None,
        member=member,
        key=key if isinstance(key, str) else None,
    )


#: A decoder with only the default extension table (no images, no pickles).
default_decoder = Decoder([])


def make_decoder(
    *args: Union[str, KeyHandler, Decoder],
    pre: Optional[Sequence[KeyHandler]] = None,
    post: Optional[Sequence[KeyHandler]] = None,
    only: Union[None, str, Iterable[str]] = None,
    partial: bool = False,
    allow_pickle: bool = False,
    weights_only: bool = True,
    max_field_bytes: Optional[int] = MAX_FIELD_BYTES,
    max_pixels: Optional[int] = MAX_PIXELS,
    max_sample_bytes: Optional[int] = MAX_SAMPLE_BYTES,
) -> Decoder:
    """Build the Decoder that ``decode(*args, ...)`` uses.

    Strings are image specs (``"rgb8"``, decoded up to ``max_pixels``), callables are handlers
    ``f(key, data)``, and a single :class:`Decoder` is used as it is.
    """
    max_pixels = check_max("max_pixels", max_pixels)
    if len(args) == 1 and isinstance(args[0], Decoder):
        return args[0]
    handlers: List[KeyHandler] = []
    for arg in args:
        if isinstance(arg, str):
            handlers.append(imagehandler(arg, max_pixels=max_pixels))
        elif isinstance(arg, Decoder):
            raise ArgumentError(
                "decode: pass a Decoder on its own (decode(my_decoder)), or pass handlers and "
                "image specs, not both"
            )
        elif callable(arg):
            handlers.append(arg)
        else:
            raise ArgumentError(
                f"decode: arguments must be image specs (one of {', '.join(imagespecs)}), "
                f"handlers f(key, data) or a Decoder; got {arg!r}"
            )
    return Decoder(
        handlers,
        pre=pre,
        post=post,
        only=only,
        partial=partial,
        allow_pickle=allow_pickle,
        weights_only=weights_only,
        max_field_bytes=max_field_bytes,
        max_sample_bytes=max_sample_bytes,
    )


@stage(count=SAME, runs=True)
def decode(
    src: Iterable[Mapping[str, Any]],
    *args: Union[str, KeyHandler, Decoder],
    handler: Handler = reraise_exception,
    pre: Optional[Sequence[KeyHandler]] = None,
    post: Optional[Sequence[KeyHandler]] = None,
    only: Union[None, str, Iterable[str]] = None,
    partial: bool = False,
    allow_pickle: bool = False,
    weights_only: bool = True,
    max_field_bytes: Optional[int] = MAX_FIELD_BYTES,
    max_pixels: Optional[int] = MAX_PIXELS,
    max_sample_bytes: Optional[int] = MAX_SAMPLE_BYTES,
    threads: int = 0,
    epoch: int = 0,
    pipeline_seed: Optional[int] = None,
    ledger: Any = None,
) -> Iterator[Dict[str, Any]]:
    """Decode the fields of each sample by extension; strings are image specs.

    ``decode("rgb8")`` gives images as uint8 HxWx3 arrays, ``.cls`` as int, ``.json`` parsed...
    ``allow_pickle=True`` enables ``.pyd/.pickle/.pkl``; ``weights_only=False`` lets ``.pth``
    hold arbitrary objects. ``.gz``, ``.bz2`` and ``.xz`` fields are decompressed to at most
    ``max_field_bytes`` (256 MiB) each and ``max_sample_bytes`` (512 MiB) for all of one sample's
    together, and images decoded up to ``max_pixels`` (89,478,485): a field past either is a
    DecodeError (the sample's budget a SampleTooLargeError, also a DecodeError; None: no limit).
    Failures raise DecodeError unless ``handler`` says otherwise. Random decoders
    (``RandomResizedCropDecoder``) draw from the pipeline's seed and epoch. ``threads=N``
    decodes in N threads, samples in input order (see
    :mod:`webds.stages.threads`).
    """
    threads = check_threads("decode", threads)
    decoder = make_decoder(
        *args,
        pre=pre,
        post=post,
        only=only,
        partial=partial,
        allow_pickle=allow_pickle,
        weights_only=weights_only,
        max_field_bytes=max_field_bytes,
        max_pixels=max_pixels,
        max_sample_bytes=max_sample_bytes,
    ).bind_pass(pipeline_seed, epoch)
    return apply_maybe_threaded(src, decoder, handler, "decode", threads, ledger=ledger)
