"""Module names that code imports but webds has no file for: one table each, served by one hook.

- :data:`ALIASES`: webdataset's module names served name by name. Code written for webdataset
  imports its modules by name (``from webdataset.tariterators import tar_file_expander``,
  ``webdataset.autodecode.Decoder``, ``from webdataset.gopen import gopen_schemes``); for each
  such name that webds has no real module for, the table says which webds objects it holds.
  Their attributes are looked up in the real modules every time, so they are the very same
  objects (``webds.shardlists.SimpleShardList is webds.shards.SimpleShardList``), never copies.
- :data:`MOVED`: webdataset's module names whose code webds holds in modules of its own
  (``filters`` in ``webds.stages.filters`` and ``webds.stages.fields``, ``tenbin`` in
  ``webds.stages.tenbin``, ...). ``import webds.tenbin`` gives ``webds.stages.tenbin`` itself (the
  same module object, so ``mock.patch("webds.tenbin....")`` patches what the code uses); a name
  served by several modules, or that also serves names webdataset kept elsewhere
  (:data:`EXTRAS`), is an :class:`AliasModule` that looks each name up in its modules in order.

``webds.gopen`` is both the module (``webds.gopen.gopen_schemes``) and callable like the
function (``webds.gopen("a.tar")``), as in webdataset. Importing this module installs the hook;
:func:`package_getattr` is the package's ``__getattr__`` (``webds.shardlists`` needs no import).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = [
    "ALIASES",
    "MOVED",
    "EXTRAS",
    "PACKAGE",
    "AliasModule",
    "CallableAliasModule",
    "package_getattr",
]

PACKAGE = "webds"

#: {webdataset module name: [(real module, [names])...]}. A name written ``"new=old"`` serves
#: the real module's ``old`` as ``new``. Entries may name objects that a real module does not
#: have (yet): only that name then fails, with an AttributeError saying where it should be.
ALIASES: Dict[str, List[Tuple[str, List[str]]]] = {
    "autodecode": [
        (
            "webds.stages.decode",
            [
                "Continue",
                "Decoder",
                "DecodingError",
                "gzfilter",
                "handle_extension",
                "default_decoder",
                "pytorch_weights_only",
            ],
        ),
        (
            "webds.stages.codecs",
            [
                "imagehandler",
                "ImageHandler",
                "IMAGE_EXTENSIONS",
                "imagespecs",
                "basichandlers",
                "npy_loads",
                "npz_loads",
                "unpickle_loads",
                "torch_loads",
                "msgpack_loads",
                "cbor_loads",
                "tenbin_loads",
                "torch_audio",
                "torch_video",
            ],
        ),
        ("webds.stages.xdecode", ["xdecode"]),
        (
            "webds.compat.helpers",
            ["call_extension_handler", "default_pre_handlers", "default_post_handlers", "decoders"],
        ),
    ],
    "extradatasets": [
        ("webds.compat.legacy", ["MockDataset", "with_epoch", "with_length"]),
        ("webds.compat.helpers", ["repeatedly=RepeatedlyDataset"]),
    ],
    "gopen": [
        ("webds.compat", ["gopen", "gopen_schemes", "reader"]),
        ("webds.io.urls", ["rewrite_url"]),
        (
            "webds.compat.openers",
            "PIPE info Pipe set_options gopen_file gopen_pipe gopen_curl gopen_htgs gopen_hf "
            "gopen_gsutil gopen_ais gopen_error".split(),
        ),
    ],
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
                "envsubst=expand_env",
            ],
        ),
        (
            "webds.compat.helpers",
            "envlookup expand expand_source resampled_ MSSource default_rng check_pid_is_running "
            "without_last_extension get_pid_from_filename".split(),
        ),
        ("webds.shards.specs", ["MultiShardSample", "shardspec"]),
        ("webds.compat.shardsources", ["DirectoryShardList"]),
    ],
    "utils": [
        (
            "webds.compat.legacy",
            "PipelineStage repeatedly repeatedly0 make_seed pytorch_worker_info "
            "pytorch_worker_seed is_iterable safe_eval lookup_sym guess_batchsize deprecated "
            "obsolete ObsoleteException compute_sample_weights".split(),
        ),
        ("webds.stages.filters", ["identity"]),
        ("webds.io.security", ["enforce_security"]),
        ("webds.compat.helpers", ["glob_with_braces", "fnmatch_with_braces"]),
    ],
}

#: webdataset's module names that webds serves by modules of its own, and those modules (the
#: first that has a name gives it).
MOVED: Dict[str, List[str]] = {
    "cache": ["webds.io.cache", "webds.tar.cached"],
    "filters": ["webds.stages.filters", "webds.stages.fields"],
    "handlers": ["webds.base.handlers"],
    "mix": ["webds.stages.mix"],
    "tariterators": ["webds.compat.tariterators"],
    "tenbin": ["webds.stages.tenbin"],
}

#: Names that webdataset's ``cache`` and ``filters`` modules exported but that live elsewhere in
#: webds than :data:`MOVED` says: ``from webds.filters import batched`` works, and the real module
#: neither imports nor copies them.
EXTRAS: Dict[str, List[Tuple[str, List[str]]]] = {
    "cache": [
        (
            "webds.compat.filecache",
            "default_cache_dir default_cache_size verbose_cache islocal magic_filetype "
            "get_filetype check_tar_format url_to_cache_name download StreamingOpen "
            "FileCache".split(),
        )
    ],
    "filters": [
        (
            "webds.stages.batching",
            ["batched", "unbatched", "listed", "unlisted", "default_collation_fn"],
        ),
        ("webds.stages.decode", ["decode"]),
        ("webds.stages.xdecode", ["xdecode", "default_decoders=default_xdecoders"]),
        ("webds.base.stage", ["pipelinefilter"]),
        ("webds.stages.replay", ["Cached", "LMDBCached"]),
        (
            "webds.compat.helpers",
            "FilterFunction RestCurried compose2 compose pipeline combine_values tuple2dict "
            "dict2tuple decode_bin decode_text decode_pickle find_decoder".split(),
        ),
        (
            "webds.compat.underscored",
            # webdataset's plain generator functions: wds.filters._batched(data, 16)
            "_associate _batched _decode _extract_keys _info _log_keys _map _map_dict _map_tuple "
            "_rename _rename_keys _rsample _select _shuffle _to_tuple _unbatched _unlisted "
            "_xdecode".split(),
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
                    raise ValueError(f"webds.compat.aliases: {alias}.{name} is listed twice")
                names[name] = (module, real or name)
        index[alias] = names
    return index


_INDEX = _index(ALIASES)
_EXTRAS_INDEX = _index(EXTRAS)


class AliasModule(types.ModuleType):
    """A module name whose attributes are looked up in webds's real modules."""

    def __getattr__(self, name: str) -> Any:
        alias = self.__name__.rpartition(".")[2]
        if name == "__all__":
            return _public(alias)
        value = _lookup(alias, name)
        if value is _MISSING:
            names = _names(alias)
            if name in names:
                module, real = names[name]
                raise AttributeError(
                    f"{self.__name__}.{name} is webdataset's {alias}.{name}, which webds serves "
                    f"as {module}.{real}; that is not available in this version of webds"
                )
            raise AttributeError(
                f"module {self.__name__!r} ({_what(alias)}, served from {_sources(alias)}) has "
                f"no attribute {name!r}"
            )
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        # Assigning a listed name assigns the real module's, which webds reads: a setting such
        # as webdataset's ``utils.enforce_security = True`` must reach the code it governs.
        alias = self.__name__.rpartition(".")[2]
        names = _names(alias)
        if name in names:
            module, real = names[name]
            setattr(importlib.import_module(module), real, value)
            return
        super().__setattr__(name, value)

    def __dir__(self) -> List[str]:
        alias = self.__name__.rpartition(".")[2]
        moved = [n for m in MOVED.get(alias, []) for n in dir(importlib.import_module(m))]
        return sorted(set(self.__dict__) | set(_public(alias)) | set(moved))

    def __repr__(self) -> str:
        alias = self.__name__.rpartition(".")[2]
        return f"<module {self.__name__!r} ({_what(alias)}, from {_sources(alias)})>"


class CallableAliasModule(AliasModule):
    """An alias module that can be called like one of its functions (``webds.gopen(url)``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        alias = self.__name__.rpartition(".")[2]
        return getattr(self, CALLABLE_ALIASES[alias])(*args, **kwargs)


_MISSING = object()


def _names(alias: str) -> Dict[str, Tuple[str, str]]:
    """The names listed for ``alias``: {name: (real module, real name)}."""
    return _INDEX.get(alias) or _EXTRAS_INDEX.get(alias) or {}


def _lookup(alias: str, name: str) -> Any:
    """``alias.name``: a listed name, else the first of the alias's moved modules that has it."""
    if name in _names(alias):
        return _resolve(alias, name)
    for module in MOVED.get(alias, []):
        value = getattr(importlib.import_module(module), name, _MISSING)
        if value is not _MISSING:
            return value
    return _MISSING


def _public(alias: str) -> List[str]:
    listed = [n for n in _names(alias) if _resolve(alias, n) is not _MISSING]
    moved = [
        n for m in MOVED.get(alias, []) for n in getattr(importlib.import_module(m), "__all__", [])
    ]
    return list(dict.fromkeys(listed + moved))


def _resolve(alias: str, name: str) -> Any:
    module_name, real = _names(alias)[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exn:
        # Only "that module does not exist" means missing; a broken import inside it is a bug
        # that must surface.
        if exn.name != module_name:
            raise
        return _MISSING
    return getattr(module, real, _MISSING)


def _what(alias: str) -> str:
    return f"webdataset's {alias!r} module"


def _sources(alias: str) -> str:
    alias = alias.rpartition(".")[2]
    modules = [module for module, _ in ALIASES.get(alias, []) + EXTRAS.get(alias, [])]
    return ", ".join(dict.fromkeys(MOVED.get(alias, []) + modules))


def _is_whole_module(alias: str) -> bool:
    """True when ``webds.<alias>`` is simply another name for one real module."""
    return len(MOVED.get(alias, [])) == 1 and alias not in EXTRAS


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``webds.<alias>`` for the names in :data:`ALIASES` and :data:`MOVED`.

    It sits at the end of ``sys.meta_path``, so a real module file of the same name wins.
    """

    _webds_alias_finder = True

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Any = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        package, _, alias = fullname.rpartition(".")
        if package != PACKAGE or (alias not in ALIASES and alias not in MOVED):
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=f"alias:{_sources(alias)}")

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        alias = spec.name.rpartition(".")[2]
        if _is_whole_module(alias):
            module = importlib.import_module(MOVED[alias][0])
            # The import system sets the module's __spec__ to this alias spec; exec_module
            # puts the real one back.
            spec.loader_state = module.__spec__
            return module
        cls = CallableAliasModule if alias in CALLABLE_ALIASES else AliasModule
        return cls(spec.name, f"{_what(alias)}: names served from {_sources(alias)}.")

    def exec_module(self, module: types.ModuleType) -> None:
        # Nothing to run: attributes are looked up on access (AliasModule.__getattr__).
        alias_spec = module.__spec__
        if alias_spec is not None and alias_spec.loader_state is not None:
            module.__spec__ = alias_spec.loader_state


def _install() -> None:
    # The import system's finder list is process-wide by nature; keep exactly one of ours there
    # (a reload of this module replaces the old finder instead of adding a second).
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "_webds_alias_finder", False)]
    sys.meta_path.append(_AliasFinder())


def package_getattr(name: str) -> Any:
    """The ``webds`` package's ``__getattr__``: ``webds.shardlists`` (or ``webds.tenbin``)
    imports the alias module."""
    if name in ALIASES or name in MOVED:
        return importlib.import_module(f"{PACKAGE}.{name}")
    raise AttributeError(f"module {PACKAGE!r} has no attribute {name!r}")


_install()
