"""Every name webdataset 1.x exports at top level, and every module it exposes, exists in webds.

The list is webdataset 1.0.2's ``__init__`` (see ../shared/reference/webdataset-1.x.md, A.0). The
behaviour of each name is tested in the module of the matching concern (test_filters,
test_compat_*, test_legacy, test_mix, ...); this file makes sure none is forgotten.
"""

from __future__ import annotations

import dataclasses
import importlib
import os

import pytest

import webds

EXPORTS = {
    "autodecode": "Continue Decoder DecodingError gzfilter handle_extension imagehandler "
    "pytorch_weights_only torch_audio torch_loads torch_video",
    "cache": "LRUCleanup pipe_cleaner",
    "compat": "FluidInterface FluidWrapper WebDataset WebLoader",
    "extradatasets": "MockDataset with_epoch with_length",
    "filters": "Cached LMDBCached associate batched decode detshuffle extract_keys getfirst "
    "info map map_dict map_tuple pipelinefilter rename rename_keys rsample select shuffle "
    "slice to_tuple transform_with unbatched xdecode",
    "gopen": "gopen gopen_schemes",
    "handlers": "ignore_and_continue ignore_and_stop reraise_exception warn_and_continue "
    "warn_and_stop",
    "mix": "RandomMix RoundRobin",
    "pipeline": "DataPipeline",
    "shardlists": "MultiShardSample ResampledShards SimpleShardList non_empty resampled "
    "shardspec single_node_only split_by_node split_by_worker",
    "tariterators": "tarfile_samples tarfile_to_samples",
    "utils": "PipelineStage repeatedly",
    "writer": "ShardWriter TarWriter numpy_dumps torch_dumps",
}
MODULES = (
    "tenbin utils autodecode cache compat extradatasets filters handlers mix pipeline pytorch "
    "shardlists tariterators writer gopen"
).split()
ALL_NAMES = sorted({n for names in EXPORTS.values() for n in names.split()})


def test_count():
    assert len(ALL_NAMES) == 69


@pytest.mark.parametrize("name", ALL_NAMES)
def test_top_level_name(name):
    assert hasattr(webds, name), f"webds.{name} is missing"


@pytest.mark.parametrize("module,names", sorted(EXPORTS.items()))
def test_names_in_their_webdataset_module(module, names):
    mod = importlib.import_module(f"webds.{module}")
    for name in names.split():
        obj = getattr(mod, name)
        top = getattr(webds, name)
        # The same object from both places (gopen: the callable module stands for the function).
        assert obj is top or (name == "gopen" and callable(top)), f"webds.{module}.{name}"


@pytest.mark.parametrize("module", MODULES)
def test_module_attribute(module):
    assert getattr(webds, module) is not None
    importlib.import_module(f"webds.{module}")


def test_the_underscore_generator_functions_of_filters():
    # 1.x code calls them on plain iterators (webdataset's FAQ: filters._unbatched).
    import webdataset.filters as theirs

    ours = importlib.import_module("webds.filters")
    names = [n for n in dir(theirs) if n.startswith("_") and not n.startswith("__")]
    names = [n for n in names if callable(getattr(theirs, n))]
    assert "_unbatched" in names and len(names) >= 18
    missing = [n for n in names if not callable(getattr(ours, n, None))]
    assert not missing, f"webds.filters lacks {missing}"
    samples = [(i, f"s{i}") for i in range(7)]

    def run(mod):
        batches = list(mod._batched(iter(samples), 3))
        return (
            [[list(c) for c in b] for b in batches],
            list(mod._unbatched(iter(batches))),
            list(mod._map(iter(samples), lambda s: s[0] * 2)),
            list(mod._select(iter(samples), lambda s: s[0] % 2)),
            list(mod._to_tuple(iter([{"a": 1, "b": 2}]), "b", "a")),
        )

    assert run(ours) == run(theirs)


#: Callables whose signature differs from webdataset 1.0.2's on purpose, and why.
SIGNATURE_DIFFERENCES = {
    # webds's is DecodeError (message and where, by keyword); 1.x code catches it, rarely
    # raises it with 1.x's (url, key, k, sample).
    "DecodingError": "the same class as DecodeError",
    # A module that is also callable (webds.gopen.gopen_schemes, webds.gopen(url)): its
    # signature can't be read, its call is gopen(url, mode="rb", bufsize=8192, **kw).
    "gopen": "a callable module",
}


def _positional(f):
    import inspect

    try:
        params = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [(p.name, p.default) for p in params if p.kind in kinds]


def test_positional_parameters_match_webdataset():
    # 1.x code calls these positionally: webds takes the same parameters in the same order
    # (and may add its own after them). 1.x's filters are curried (wds.batched(16)): their
    # signature shows the data parameter first, which the curried call doesn't take.
    import warnings

    import webdataset

    curried = {n[1:] for n in dir(webdataset.filters) if n.startswith("_") and n[1:2] != "_"}
    curried |= {"resampled", "tarfile_to_samples"}
    checked, wrong = 0, []
    for name in sorted(dir(webdataset)):
        theirs = getattr(webdataset, name)
        ours = getattr(webds, name, None)
        if name.startswith("_") or not callable(theirs) or ours is None:
            continue
        if name in SIGNATURE_DIFFERENCES:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t, o = _positional(theirs), _positional(ours)
        if t is None or o is None:
            continue
        if name in curried:
            t = t[1:]
        checked += 1
        if [n for n, _ in t] != [n for n, _ in o][: len(t)]:
            wrong.append(f"{name}: webdataset {[n for n, _ in t]}, webds {[n for n, _ in o]}")
    assert not wrong, "\n".join(wrong)
    assert checked >= 40


#: Module callables (besides the top-level ones above) whose positional parameters are named
#: differently from webdataset 1.0.2's, and why. Positional calls work the same.
MODULE_SIGNATURE_DIFFERENCES = {
    "autodecode.DecodingError": "the same class as DecodeError",
    "tenbin.encode_list": "renamed l -> arrays (l reads as 1)",
    "tenbin.decode_list": "renamed l -> chunks (l reads as 1)",
    "tenbin.encode_chunks": "renamed l -> chunks (l reads as 1)",
    "tenbin.write_chunk": "renamed buf -> payload (any bytes-like, not only a buffer)",
    "filters.tuple2dict": "renamed l -> value (l reads as 1)",
    "shardlists.envsubst": "webds.shards.expand_env(spec): also expands ${NAME} from NAME",
    "writer.numpy_npz_dumps": "renamed data -> x, as the other dumps functions",
    "writer.encode_based_on_extension": "renamed handlers -> encoder (an encoder spec)",
}
# The data parameter of a stage (1.x names it data or source; webds src) is passed
# positionally, or by the pipeline.
_DATA = {"data", "source", "src"}


def test_positional_parameters_of_every_module_callable_match_webdataset():
    import types
    import warnings

    checked, wrong = 0, []
    for module in MODULES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = importlib.import_module(f"webdataset.{module}")
            ours = importlib.import_module(f"webds.{module}")
        own = f"webdataset.{module}"
        for name, obj in vars(theirs).items():
            if name.startswith("__") or isinstance(obj, types.ModuleType) or not callable(obj):
                continue
            if getattr(obj, "__module__", own) != own or f"{module}.{name}" in (
                MODULE_SIGNATURE_DIFFERENCES
            ):
                continue
            mine = getattr(ours, name)
            t, o = _positional(obj), _positional(mine)
            if t is None or o is None:
                continue
            t = [n for n, _ in t if n != "self"]
            o = [n for n, _ in o if n != "self"]
            if t and t[0] in _DATA and not (o and o[0] in _DATA):
                t = t[1:]  # curried in webds (wds.batched(16)): the pipeline passes the data
            t = ["src" if n in _DATA else n for n in t]
            o = ["src" if n in _DATA else n for n in o]
            checked += 1
            if o[: len(t)] != t:
                wrong.append(f"{module}.{name}: webdataset {t}, webds {o}")
    assert not wrong, "\n".join(wrong)
    assert checked >= 180


def test_tar_file_expander_eof_value_as_webdatasets(tmp_path):
    import warnings

    from conftest import sample_members, write_tar

    import webds.tariterators as ours

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import webdataset.tariterators as theirs
    urls = [str(write_tar(tmp_path / f"{s}.tar", sample_members(2, prefix=s))) for s in "ab"]
    for eof in ({}, None, "EOF"):
        got = []
        for mod in (ours, theirs):
            src = mod.url_opener(iter([{"url": u} for u in urls]))
            items = mod.tar_file_expander(src, eof_value=eof)
            got.append([x.get("fname", x) if isinstance(x, dict) else x for x in items])
        assert got[0] == got[1] and len(got[0]) == 8 + (0 if eof is None else 2), eof


def test_resampled_shards_positionally_and_its_epoch():
    import webdataset

    urls = ["a.tar", "b.tar", "c.tar"]
    theirs = webdataset.ResampledShards(urls, 4, 0, None, True)
    ours = webds.ResampledShards(urls, 4, 0, None, True)
    assert ours.epoch == theirs.epoch == -1
    assert len([s["url"] for s in ours]) == len([s["url"] for s in theirs]) == 4


@pytest.mark.parametrize("module", MODULES)
def test_module_contents_match_webdatasets(module):
    import types
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = importlib.import_module(f"webdataset.{module}")
        ours = importlib.import_module(f"webds.{module}")
    own = f"webdataset.{module}"
    names = [
        n
        for n, v in vars(theirs).items()
        if not n.startswith("__")
        and not isinstance(v, types.ModuleType)
        and (getattr(v, "__module__", own) == own or not callable(v))
    ]
    missing = sorted(n for n in names if not hasattr(ours, n))
    assert missing == [], f"webds.{module} lacks webdataset's {missing}"


def test_small_helpers_behave_as_webdatasets(tmp_path):
    import webdataset

    import webds.autodecode as oa
    import webds.filters as of
    import webds.tariterators as ot
    import webds.utils as ou

    tf, tt, tu, ta = (
        webdataset.filters,
        webdataset.tariterators,
        webdataset.utils,
        webdataset.autodecode,
    )
    inc, dbl = (lambda x: x + 1), (lambda x: x * 2)
    assert of.compose(inc, dbl)(3) == tf.compose(inc, dbl)(3) == 8
    assert list(of.pipeline(iter([1, 2]), lambda s: (x * 3 for x in s))) == [3, 6]
    assert of.tuple2dict((4, 5)) == tf.tuple2dict((4, 5)) and of.dict2tuple({0: 4, 1: 5}) == (4, 5)
    decoders = [("*.txt", "text"), ("*.jpg", "image"), (".cls", "cls")]
    for path in ("a/b.txt", "x.JPG", "cls", "__key__", "y.bin"):
        mine, theirs = of.find_decoder(decoders, path), tf.find_decoder(decoders, path)
        assert (mine == theirs) or (callable(mine) and callable(theirs)), path
    assert of.combine_values([1, 2]).tolist() == tf.combine_values([1, 2]).tolist()
    for sample in ({}, None, {"a": 1}, {"__bad__": True, "a": 1}):
        assert ot.valid_sample(sample) == tt.valid_sample(sample)
    assert list(ot.shardlist("a-{0..2}.tar")) == list(tt.shardlist("a-{0..2}.tar"))
    assert (ot.meta_prefix, ot.meta_suffix) == (tt.meta_prefix, tt.meta_suffix)
    for name in ("a.tar", "b.tgz", "c.txt"):
        (tmp_path / name).write_bytes(b"")
    pattern = str(tmp_path / "*.{tar,tgz}")
    assert sorted(ou.glob_with_braces(pattern)) == sorted(tu.glob_with_braces(pattern))
    assert ou.fnmatch_with_braces("x.tgz", "*.{tar,tgz}") and not ou.fnmatch_with_braces(
        "x.txt", "*.{tar,tgz}"
    )
    for key in ("png", "seg.png", "jpg"):
        args = (key, b"d", lambda d: "hit", ["png"])
        assert oa.call_extension_handler(*args) == ta.call_extension_handler(*args)
    assert of.RestCurried(lambda data, k: [x * k for x in data])(3)([1, 2]) == [3, 6]
    assert list(webds.compat.check_empty(iter([1]))) == [1]
    with pytest.raises(ValueError, match="no samples"):
        list(webds.compat.check_empty(iter([])))
    rep = webds.extradatasets.repeatedly([1, 2], nepochs=2, length=4)
    assert list(rep) == [1, 2, 1, 2] and len(rep) == 4
    assert sorted(oa.decoders) == sorted(ta.decoders)
    for ext, data in (("cls", b"7"), ("txt", b"hi"), ("json", b'{"a": 1}')):
        assert oa.decoders[ext](data) == ta.decoders[ext](data)
    osl, tsl = webds.shardlists, webdataset.shardlists
    for name in ("a.tar._123_", "a.tar", "x._done_", "noext"):
        assert osl.without_last_extension(name) == tsl.without_last_extension(name)
        assert osl.get_pid_from_filename(name) == tsl.get_pid_from_filename(name)
    assert osl.expand_source("a-{0..1}.tar") == tsl.expand_source("a-{0..1}.tar")
    three = ["x", "y", "z"]
    assert osl.expand_source(iter(three), 2) == tsl.expand_source(iter(three), 2) == three[:2]
    assert osl.check_pid_is_running(os.getpid()) == tsl.check_pid_is_running(os.getpid())
    assert sorted(osl.resampled_(["a"], 3)) == ["a", "a", "a"]
    otb, ttb = webds.tenbin, webdataset.tenbin
    for name in ("magic", "magic_str", "magic_bytes"):
        assert getattr(otb, name) == getattr(ttb, name)
    theirs = {("uint32" if k == "unit32" else k): v for k, v in ttb.long_to_short.items()}
    assert otb.long_to_short == theirs  # (webdataset spells uint32 "unit32")
    assert otb.roundup(65) == ttb.roundup(65) == 128 and otb.bytelen(b"abc") == 3
    ow, tw = webds.writer, webdataset.writer
    for value, ext in ((3, "cls"), ("text", "txt"), ({"a": 1}, "json")):
        assert ow.encode_based_on_extension1(
            value, ext, ow.make_handlers()
        ) == tw.encode_based_on_extension1(value, ext, tw.make_handlers())
    assert ow.bytestr(7) == tw.bytestr(7) == b"7"
    handlers: dict = {}
    ow.add_handlers(handlers, "a b", len)
    assert handlers == {"a": len, "b": len}
    assert [f.name for f in dataclasses.fields(osl.MSSource)] == [
        f.name for f in dataclasses.fields(tsl.MSSource)
    ]


def test_stages_are_found_by_name_in_the_pipeline():
    # 1.x code finds a stage by its str(): [s for s in ds.pipeline if "shuffle" in str(s)].
    ds = webds.WebDataset("a.tar", shardshuffle=False).shuffle(10).decode("pil").batched(4)
    names = [str(s) for s in ds.pipeline]
    assert "shuffle(10)" in names and "decode('pil')" in names and "batched(4)" in names
    (found,) = [s for s in ds.pipeline if str(s).startswith("shuffle")]
    assert found is ds.pipeline[names.index("shuffle(10)")]
