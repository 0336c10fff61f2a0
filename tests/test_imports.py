"""Importing webds is cheap: ``import webds`` and the ``webds`` command do not import torch, and
every public name still resolves, the same object from every place, in a fresh process."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import webds
import webds.pipeline
import webds.shards
import webds.stages
import webds.stages.filters

ROOT = Path(__file__).resolve().parents[1]

#: Modules that must import without torch: what the ``webds`` command and the writers use.
TORCH_FREE = (
    "webds webds.cli webds.tar.reader webds.tar.writing webds.tar.compression webds.tar.fields "
    "webds.io.urls webds.writer webds.tar.samples "
    "webds.shards.index webds.stages.encode webds.errors webds.stages webds.shards "
    "webds.stages.filters webds.stages.decode webds.io.cache webds.shards.plan "
    "webds.base.handlers webds.io webds.tar webds.compat webds.keywords "
    # webdataset's module names for some of them
    "webds.filters webds.cache webds.handlers"
).split()


def _python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (nothing imported yet) from the project root."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_does_not_import_torch():
    out = _python(
        f"""
        import sys
        import {", ".join(TORCH_FREE)}
        heavy = sorted(m for m in ("torch", "numpy", "PIL") if m in sys.modules)
        assert not heavy, heavy
        """
    )
    assert out.returncode == 0, out.stderr


def test_cli_help_does_not_import_torch():
    # `python -m webds.cli --help`, with every subcommand registered, in this very process.
    out = _python(
        """
        import runpy, sys
        sys.argv = ["webds", "--help"]
        try:
            runpy.run_module("webds.cli", run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            assert exit.code in (0, None), exit.code
        assert "torch" not in sys.modules, "webds --help imported torch"
        """
    )
    assert out.returncode == 0, out.stderr
    assert "usage: webds" in out.stdout


def test_every_public_name_resolves_in_a_fresh_process():
    # Both ways of asking, per name, and each is the object its own module holds.
    out = _python(
        """
        import importlib, sys, webds
        assert "torch" not in sys.modules
        for name in webds.__all__:
            value = getattr(webds, name)
            namespace = {}
            exec(f"from webds import {name}", namespace)
            assert namespace[name] is value, name
            where = webds._WHERE.get(name)
            if where is not None:
                module, attribute = where
                real = importlib.import_module(module)
                assert value is (real if attribute is None else getattr(real, attribute)), name
        assert callable(webds.gopen) and webds.decode is webds.filters.decode
        print(len(webds.__all__))
        """
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(webds.__all__)


def test_decode_stays_the_stage_whatever_is_imported_first():
    # The stage's module, webds.stages.decode, has the stage's name: importing it (directly, or
    # through fluent.py) must not turn webds.decode into the module.
    out = _python(
        """
        import webds.stages.decode, webds.fluent
        import webds as wds
        from webds.stages import StageFactory
        assert isinstance(wds.decode, StageFactory), wds.decode
        wds.decode("pil")
        ds = wds.WebDataset("a.tar").decode("pil")
        """
    )
    assert out.returncode == 0, out.stderr


def test_submodules_and_webdataset_modules_without_an_import_statement():
    out = _python(
        """
        import sys, webds
        assert "torch" not in sys.modules
        assert webds.shards.expand_urls("a-{0..1}.tar") == ["a-0.tar", "a-1.tar"]
        assert webds.filters.shuffle is webds.shuffle
        assert webds.tenbin.__name__ == "webds.stages.tenbin"
        assert webds.cache.__name__ == "webds.cache"  # webdataset's: io.cache and tar.cached
        assert webds.cache.LRUCleanup is webds.LRUCleanup and webds.cache.cached_shards
        assert "torch" not in sys.modules
        assert webds.shardlists.SimpleShardList is webds.shards.SimpleShardList
        assert webds.compat.WebDataset is webds.WebDataset and webds.mix.RandomMix
        for missing in ("nope", "_nope"):
            try:
                getattr(webds, missing)
            except AttributeError as exn:
                assert f"has no attribute {missing!r}" in str(exn), exn
            else:
                raise AssertionError(missing)
        """
    )
    assert out.returncode == 0, out.stderr


def test_dir_lists_the_public_names():
    names = dir(webds)
    assert set(webds.__all__) <= set(names)
    assert "__version__" in names
    assert {"SimpleShardList", "ResampledShards", "expand_urls"} <= set(dir(webds.shards))


def test_one_export_table():
    # __all__ and the lazy lookup come from webds._EXPORTS; so does the stub type checkers read.
    entries = [e.partition("=")[0] for _, names in webds._EXPORTS for e in names.split()]
    twice = sorted({n for n in entries if entries.count(n) > 1})
    assert not twice, f"exported twice in webds._EXPORTS: {twice}"
    assert webds.__all__ == ["gopen", *entries]
    for name in entries:
        module, attribute = webds._WHERE[name]
        value = importlib.import_module(module)
        assert getattr(webds, name) is (value if attribute is None else getattr(value, attribute))
    # No other list: outside the table, the package's source neither imports a public name nor
    # lists one in a literal.
    tree = ast.parse((ROOT / "webds" / "__init__.py").read_text())
    table = next(n for n in tree.body if isinstance(n, ast.AnnAssign) and n.target.id == "_EXPORTS")
    inside = {id(n) for n in ast.walk(table)}
    public = set(entries)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert not {a.asname or a.name for a in node.names} & public, ast.dump(node)
        elif isinstance(node, ast.Constant) and id(node) not in inside:
            assert node.value not in public, f"{node.value!r} named outside webds._EXPORTS"


def test_the_stub_follows_the_table():
    from exports_stub import STUB, stub_text

    assert STUB.read_text() == stub_text(), (
        "webds/__init__.pyi is out of date with webds._EXPORTS: run python tests/exports_stub.py"
    )
    tree = ast.parse(STUB.read_text())
    imported = {
        a.asname for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names if a.asname
    }
    assert imported == set(webds.__all__)
    for node in tree.body:  # every import in the stub resolves to a real module
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                package = f"webds.{node.module}" if node.module else "webds"
                target = importlib.import_module(package)
                assert hasattr(target, alias.name) or importlib.util.find_spec(
                    f"{package}.{alias.name}"
                ), f"{package}.{alias.name}"


def test_pipeline_and_shards_keep_their_names():
    # webdataset code imports these from webds.pipeline / webds.shards; they are the very objects
    # now defined in webds.stages / webds.shards.datasets.
    for name in webds.stages.__all__:
        assert getattr(webds.pipeline, name) is getattr(webds.stages, name), name
    from webds.shards import ResampledShards as shards_resampled
    from webds.shards import SimpleShardList as shards_simple
    from webds.shards.datasets import ResampledShardList, ResampledShards, SimpleShardList

    assert shards_simple is SimpleShardList and shards_resampled is ResampledShards
    assert webds.shards.ResampledShardList is ResampledShardList


def test_stages_and_shard_lists_round_trip_through_pickle(tmp_path):
    stage = webds.shuffle(10, seed=1)
    again = pickle.loads(pickle.dumps(stage))
    assert again.factory is webds.shuffle and again.kwargs == {"seed": 1}
    shards = webds.SimpleShardList(["a.tar", "b.tar"], seed=3)
    loaded = pickle.loads(pickle.dumps(shards))
    assert type(loaded) is webds.shards.SimpleShardList and list(loaded) == list(shards)
