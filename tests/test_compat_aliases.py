"""webdataset's module names (webds.shardlists, webds.gopen, ...) served from
webds.compat.aliases."""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys
import types
from pathlib import Path

import pytest

import webds
import webds.compat.aliases as aliases
from webds import compat, shards
from webds.io import urls
from webds.tar import samples

# Not "from webds import decode": the package attribute is the decode stage, not the module.
decode = importlib.import_module("webds.stages.decode")

ROOT = Path(__file__).resolve().parents[1]

ENTRIES = [
    (alias, module, entry.partition("=")[0], entry.partition("=")[2] or entry.partition("=")[0])
    for alias, groups in aliases.ALIASES.items()
    for module, names in groups
    for entry in names
]


def real_object(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except (ModuleNotFoundError, AttributeError):
        return aliases._MISSING


# Names that exist in webds now: each must be served (so these tests can fail).
SERVED_NOW = {
    "shardlists": [
        "SimpleShardList",
        "ResampledShards",
        "split_by_node",
        "split_by_worker",
        "single_node_only",
        "expand_urls",
    ],
    "tariterators": [
        "tar_file_expander",
        "group_by_keys",
        "tarfile_to_samples",
        "url_opener",
        "base_plus_ext",
        "tarfile_samples",
    ],
    "autodecode": [
        "Decoder",
        "Continue",
        "DecodingError",
        "gzfilter",
        "handle_extension",
        "imagehandler",
        "torch_loads",
        "torch_video",
        "torch_audio",
    ],
    "gopen": ["gopen", "gopen_schemes", "reader"],
    "pytorch": ["IterableDataset", "DataLoader", "TorchTensor"],
    "utils": ["identity"],
}


@pytest.mark.parametrize("alias", sorted(aliases.ALIASES))
def test_every_alias_module_imports(alias):
    module = importlib.import_module(f"webds.{alias}")
    assert isinstance(module, aliases.AliasModule)
    assert sys.modules[f"webds.{alias}"] is module
    assert getattr(webds, alias) is module  # the import made it a package attribute
    assert module.__spec__.name == f"webds.{alias}"
    assert set(module.__all__) <= set(dir(module))


@pytest.mark.parametrize(("alias", "module", "name", "real"), ENTRIES)
def test_each_name_is_the_real_object_or_a_clear_attribute_error(alias, module, name, real):
    alias_module = importlib.import_module(f"webds.{alias}")
    expected = real_object(module, real)
    if expected is aliases._MISSING:
        assert name not in alias_module.__all__
        with pytest.raises(AttributeError, match=rf"{module}\.{real}.*not available"):
            getattr(alias_module, name)
        return
    assert getattr(alias_module, name) is expected
    namespace: dict = {}
    exec(f"from webds.{alias} import {name} as value", namespace)
    assert namespace["value"] is expected
    assert name in alias_module.__all__


@pytest.mark.parametrize("alias", sorted(SERVED_NOW))
def test_core_names_are_served_now(alias):
    module = importlib.import_module(f"webds.{alias}")
    for name in SERVED_NOW[alias]:
        assert name in module.__all__, f"webds.{alias}.{name}"
        getattr(module, name)


def test_same_objects_not_copies():
    import webds.autodecode
    import webds.shardlists
    import webds.tariterators

    assert webds.shardlists.SimpleShardList is shards.SimpleShardList
    assert webds.tariterators.tarfile_samples is samples.tarfile_samples
    assert webds.autodecode.Decoder is decode.Decoder
    assert webds.gopen.gopen_schemes is urls.SCHEMES
    f = webds.shardlists.split_by_node
    assert pickle.loads(pickle.dumps(f)) is shards.split_by_node


def test_star_import_takes_the_served_names():
    namespace: dict = {}
    exec("from webds.shardlists import *", namespace)
    assert namespace["SimpleShardList"] is shards.SimpleShardList
    assert "split_by_worker" in namespace


def test_unknown_name_and_missing_target_errors(monkeypatch):
    import webds.utils

    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        webds.utils.no_such_name  # noqa: B018
    with pytest.raises(ImportError):
        exec("from webds.utils import no_such_name", {})
    # A target module that does not exist fails only that name, with where it should be.
    monkeypatch.setitem(aliases._INDEX["utils"], "future_name", ("webds.no_such_module", "f"))
    with pytest.raises(AttributeError, match=r"webds\.no_such_module\.f.*not available"):
        webds.utils.future_name  # noqa: B018
    assert "future_name" not in webds.utils.__all__
    assert webds.utils.identity is not None


def test_gopen_is_callable_and_a_module(tmp_path):
    import webds.gopen

    path = tmp_path / "x.bin"
    path.write_bytes(b"data")
    assert isinstance(webds.gopen, types.ModuleType)
    assert callable(webds.gopen)
    with webds.gopen(str(path)) as f:
        assert f.read() == b"data"
    assert webds.gopen.gopen is compat.gopen
    from webds.gopen import gopen, gopen_schemes

    assert gopen is compat.gopen and gopen_schemes is urls.SCHEMES


GOPEN_ORDERS = {
    "module first": (
        "import webds.compat.aliases\n"
        "from webds.gopen import gopen_schemes\n"
        "from webds import gopen\n"
    ),
    "name first": (
        "import webds.compat.aliases\n"
        "from webds import gopen\n"
        "from webds.gopen import gopen_schemes\n"
    ),
    "attribute": (
        "import webds.compat.aliases, webds.gopen, webds\n"
        "gopen = webds.gopen\n"
        "gopen_schemes = webds.gopen.gopen_schemes\n"
    ),
}


@pytest.mark.parametrize("order", sorted(GOPEN_ORDERS))
def test_gopen_both_spellings_whatever_the_import_order(order, tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"payload")
    code = GOPEN_ORDERS[order] + (
        "import sys, webds, webds.io.urls\n"
        "assert gopen is sys.modules['webds.gopen'] is webds.gopen\n"
        "assert gopen_schemes is webds.io.urls.SCHEMES\n"
        f"print(gopen({str(path)!r}).read().decode())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "payload"


#: webdataset 1.0.2's modules (../shared/reference/webdataset-1.x.md, A.0).
WEBDATASET_MODULES = set(
    "autodecode cache compat extradatasets filters gopen handlers mix multi pipeline pytorch "
    "shardlists tariterators tenbin typecheck utils writer".split()
)


def test_only_webdatasets_module_names_are_served():
    assert set(aliases.ALIASES) | set(aliases.MOVED) <= WEBDATASET_MODULES
    # webds's own module names from before its layout (webds.urls, ...) were never released.
    for old in ("urls", "tario", "samples", "sharddatasets", "index", "legacy", "decode"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"webds.{old}")
    assert webds.decode is decode.decode  # the stage, as always


@pytest.mark.parametrize("alias", sorted(aliases.MOVED))
def test_each_moved_module_name_serves_its_modules_public_names(alias):
    module = importlib.import_module(f"webds.{alias}")
    for target in aliases.MOVED[alias]:
        real = importlib.import_module(target)
        for name in getattr(real, "__all__", []):
            assert getattr(module, name) is getattr(real, name), f"webds.{alias}.{name}"
    if aliases._is_whole_module(alias):
        # The very same module: mock.patch("webds.tenbin.x") patches what the code uses.
        (target,) = aliases.MOVED[alias]
        assert module is importlib.import_module(target)
        assert module.__spec__.name == target  # not clobbered by the alias import


def test_real_modules_win_and_no_alias_shadows_a_module_file():
    # webds.compat, webds.pipeline, ... are the real modules, never alias modules.
    for name in ("compat", "pipeline", "writer", "shards", "stages", "fluent", "loader"):
        module = importlib.import_module(f"webds.{name}")
        assert not isinstance(module, aliases.AliasModule), name
        assert module.__spec__.name == f"webds.{name}"
    for alias in [*aliases.ALIASES, *aliases.MOVED]:
        for path in (ROOT / "webds" / f"{alias}.py", ROOT / "webds" / alias / "__init__.py"):
            assert not path.exists(), (
                f"{path} is a real module now: remove {alias!r} from webds.compat.aliases "
                "and make the real module hold those names"
            )


def test_package_getattr_imports_lazily():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, webds.compat.aliases as a\n"
            "assert 'webds.shardlists' not in sys.modules\n"
            "m = a.package_getattr('shardlists')\n"
            "assert sys.modules['webds.shardlists'] is m\n"
            "try:\n    a.package_getattr('nope')\nexcept AttributeError as e:\n    print(e)\n",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "has no attribute 'nope'" in out.stdout


def test_package_attribute_without_import():
    out = subprocess.run(
        [sys.executable, "-c", "import webds; print(webds.shardlists.SimpleShardList.__name__)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "SimpleShardList"


def test_reload_keeps_one_finder():
    importlib.reload(aliases)
    importlib.reload(aliases)
    finders = [f for f in sys.meta_path if getattr(f, "_webds_alias_finder", False)]
    assert len(finders) == 1
    assert sys.meta_path[-1] is finders[0]
    import webds.shardlists

    assert webds.shardlists.SimpleShardList is shards.SimpleShardList
