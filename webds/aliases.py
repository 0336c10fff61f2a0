"""webdataset's module names, served from one table: ``import webds.shardlists`` and the like.

Code written for webdataset imports its modules by name (``from webdataset.tariterators import
tar_file_expander``, ``webdataset.autodecode.Decoder``, ``from webdataset.gopen import
gopen_schemes``). webds keeps its own layout, and :data:`ALIASES` says, for each webdataset
module name that webds has no real module for, which webds objects it holds. A small import
hook creates those modules on first import; their attributes are looked up in the real modules
every time, so they are the very same objects (``webds.shardlists.SimpleShardList is
webds.shards.SimpleShardList``), never copies. Modules whose name already matches (``filters``,
``handlers``, ``pipeline``, ``writer``, ``tenbin``, ``mix``, ``compat``, ``cache``,
``tariterators``) are the real modules.

``webds.gopen`` is special, as in webdataset where the package attribute ``gopen`` is the
function: here it is one object that is both the module (``webds.gopen.gopen_schemes``) and
callable like the function (``webds.gopen("a.tar")``), whatever the import order.

Importing this module (``webds/__init__.py`` does) installs the hook; :func:`package_getattr`
is the package's ``__getattr__``, so ``webds.shardlists`` works without an import statement.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["ALIASES", "PACKAGE", "AliasModule", "CallableAliasModule", "package_getattr"]

PACKAGE = "webds"

#: {webdataset module name: [(real module, [names])...]}. A name written ``"new=old"`` serves
#: the real module's ``old`` as ``new``. Entries may name objects that a real module does not
#: have (yet): only that name then fails, with an AttributeError saying where it should be.
ALIASES: Dict[str, List[Tuple[str, List[str]]]] = {
    "autodecode": [
        (
            "webds.decode",
            [
                "Continue",
                "Decoder",
                "DecodingError",
                "gzfilter",
                "handle_extension",
                "imagehandler",
                "ImageHandler",
                "IMAGE_EXTENSIONS",
                "imagespecs",
                "basichandlers",
                "default_decoder",
                "npy_loads",
                "npz_loads",
                "unpickle_loads",
                "torch_loads",
                "msgpack_loads",
                "cbor_loads",
                "tenbin_loads",
                "torch_audio",
                "torch_video",
                "xdecode",
                "pytorch_weights_only",
            ],
        ),
    ],
    "extradatasets": [("webds.legacy", ["MockDataset", "with_epoch", "with_length"])],
    "gopen": [("webds.compat", ["gopen", "gopen_schemes", "reader"])],
    "pytorch": [
        ("torch.utils.data", ["IterableDataset", "DataLoader"]),
        ("torch", ["TorchTensor=Tensor"]),
    ],
    "shardlists": [
        (
            "webds.shards",
            [
                "SimpleShardList",
                "ResampledShards",
                "ResampledShardList",
                "expand_urls",
                "split_by_node",
                "split_by_worker",
                "single_node_only",
                "non_empty",
                "resampled",
            ],
        ),
        ("webds.shardsources", ["MultiShardSample", "shardspec", "DirectoryShardList"]),
    ],
    "utils": [
        (
            "webds.legacy",
            [
                "PipelineStage",
                "repeatedly",
                "repeatedly0",
                "make_seed",
                "pytorch_worker_info",
                "pytorch_worker_seed",
                "is_iterable",
                "safe_eval",
                "lookup_sym",
                "guess_batchsize",
                "deprecated",
                "obsolete",
                "ObsoleteException",
                "compute_sample_weights",
            ],
        ),
        ("webds.filters", ["identity"]),
    ],
}

#: Names that webdataset's modules of the same name as a real webds module (``filters``,
#: ``writer``) exported but that live elsewhere in webds. The real module's ``__getattr__``
#: (:func:`module_getattr`) serves them, so ``from webds.filters import batched`` works without
#: the real module importing (or copying) them.
EXTRAS: Dict[str, List[Tuple[str, List[str]]]] = {
    "filters": [
        (
            "webds.batching",
            ["batched", "unbatched", "listed", "unlisted", "default_collation_fn"],
        ),
        ("webds.decode", ["decode", "xdecode", "default_decoders=default_xdecoders"]),
        ("webds.stages", ["pipelinefilter"]),
        ("webds.replay", ["Cached", "LMDBCached"]),
    ],
    "writer": [
        (
            "webds.encode",
            [
                "imageencoder",
                "default_handlers",
                "encode_based_on_extension=encode_sample",
                "make_encoder",
                "numpy_npz_dumps",
                "tenbin_dumps",
                "mp_dumps",
                "cbor_dumps",
            ],
        ),
    ],
}

#: Alias modules that are also callable, and the attribute a call goes to.
CALLABLE_ALIASES: Dict[str, str] = {"gopen": "gopen"}


def _index(table: Dict[str, List[Tuple[str, List[str]]]]) -> Dict[str, Dict[str, Tuple[str, str]]]:
    """{alias: {name: (real module, real name)}}, refusing a name listed twice for one alias."""
    index: Dict[str, Dict[str, Tuple[str, str]]] = {}
    for alias, entries in table.items():
        names: Dict[str, Tuple[str, str]] = {}
        for module, listed in entries:
            for entry in listed:
                name, _, real = entry.partition("=")
                if name in names:
                    raise ValueError(f"webds.aliases: {alias}.{name} is listed twice")
                names[name] = (module, real or name)
        index[alias] = names
    return index


_INDEX = _index(ALIASES)
_EXTRAS_INDEX = _index(EXTRAS)


def module_getattr(module_name: str) -> Any:
    """A ``__getattr__`` for the real module ``module_name`` serving its :data:`EXTRAS`.

    In ``webds/filters.py``: ``__getattr__ = aliases.module_getattr(__name__)``.
    """
    short = module_name.rpartition(".")[2]
    names = _EXTRAS_INDEX.get(short, {})

    def __getattr__(name: str) -> Any:
        if name in names:
            real_module, real = names[name]
            return getattr(importlib.import_module(real_module), real)
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    return __getattr__


class AliasModule(types.ModuleType):
    """A webdataset module name whose attributes are looked up in webds's real modules."""

    def __getattr__(self, name: str) -> Any:
        alias = self.__name__.rpartition(".")[2]
        names = _INDEX.get(alias, {})
        if name == "__all__":
            return [n for n in names if _resolve(alias, n) is not _MISSING]
        if name not in names:
            raise AttributeError(
                f"module {self.__name__!r} (webdataset's {alias!r} module, served from "
                f"{_sources(alias)}) has no attribute {name!r}"
            )
        value = _resolve(alias, name)
        if value is _MISSING:
            module, real = names[name]
            raise AttributeError(
                f"{self.__name__}.{name} is webdataset's {alias}.{name}, which webds serves as "
                f"{module}.{real}; that is not available in this version of webds"
            )
        return value

    def __dir__(self) -> List[str]:
        alias = self.__name__.rpartition(".")[2]
        present = [n for n in _INDEX.get(alias, {}) if _resolve(alias, n) is not _MISSING]
        return sorted(set(self.__dict__) | set(present))

    def __repr__(self) -> str:
        return f"<module {self.__name__!r} (webdataset name, from {_sources(self.__name__)})>"


class CallableAliasModule(AliasModule):
    """An alias module that can be called like one of its functions (``webds.gopen(url)``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        alias = self.__name__.rpartition(".")[2]
        return getattr(self, CALLABLE_ALIASES[alias])(*args, **kwargs)


_MISSING = object()


def _resolve(alias: str, name: str) -> Any:
    module_name, real = _INDEX[alias][name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exn:
        # Only "that module does not exist" means missing; a broken import inside it is a bug
        # that must surface.
        if exn.name != module_name:
            raise
        return _MISSING
    return getattr(module, real, _MISSING)


def _sources(alias: str) -> str:
    alias = alias.rpartition(".")[2]
    return ", ".join(module for module, _ in ALIASES.get(alias, []))


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``webds.<alias>`` for the names in :data:`ALIASES` and creates their modules.

    It sits at the end of ``sys.meta_path``, so a real module file of the same name wins.
    """

    _webds_alias_finder = True

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Any = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        package, _, alias = fullname.rpartition(".")
        if package != PACKAGE or alias not in ALIASES:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=f"alias:{_sources(alias)}")

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        alias = spec.name.rpartition(".")[2]
        cls = CallableAliasModule if alias in CALLABLE_ALIASES else AliasModule
        doc = f"webdataset's {alias!r} module: names served from {_sources(alias)}."
        return cls(spec.name, doc)

    def exec_module(self, module: types.ModuleType) -> None:
        # Nothing to run: attributes are looked up on access (AliasModule.__getattr__).
        pass


def _install() -> None:
    # The import system's finder list is process-wide by nature; keep exactly one of ours there
    # (a reload of this module replaces the old finder instead of adding a second).
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "_webds_alias_finder", False)]
    sys.meta_path.append(_AliasFinder())


def package_getattr(name: str) -> Any:
    """The ``webds`` package's ``__getattr__``: ``webds.shardlists`` imports the alias module."""
    if name in ALIASES:
        return importlib.import_module(f"{PACKAGE}.{name}")
    raise AttributeError(f"module {PACKAGE!r} has no attribute {name!r}")


_install()
