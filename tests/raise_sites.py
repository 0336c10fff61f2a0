"""Each raise site of webdataset 1.0.2 (its ``raise`` and ``assert`` statements, by module,
function and exception type) and the call that meets the same situation in webds, as 1.x code
makes it after ``import webds as wds``. Used by test_raise_sites.py, which checks the table in
docs/migrating.md against webdataset's source and against what these calls raise."""

from __future__ import annotations

import io
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import numpy as np

import webds as wds
from webds.io import security

Site = Tuple[str, str, str]  # (webdataset module, function, exception type)


@contextmanager
def secure_mode() -> Iterator[None]:
    before = security.enforce_security
    security.enforce_security = True
    try:
        yield
    finally:
        security.enforce_security = before


def in_secure_mode(call: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with secure_mode():
            return call()

    return run


def drain(iterable: Any) -> list:
    return list(iterable)


def sample(**fields: Any) -> Dict[str, Any]:
    return {"__key__": "k", "__url__": "a.tar", **fields}


def triggers(tmp: Path) -> Dict[Site, Optional[Callable[[], Any]]]:
    """{site: the webds call for that situation}; None: the situation cannot arise in webds
    (the row's note in docs/migrating.md says why)."""
    A, C, F, G, S, T, U, W = (
        wds.autodecode,
        wds.cache,
        wds.filters,
        wds.gopen,
        wds.shardlists,
        wds.tenbin,
        wds.utils,
        wds.writer,
    )
    shard = tmp / "a.tar"
    with wds.TarWriter(str(shard)) as out:
        out.write({"__key__": "0", "txt": "zero"})
    empty = tmp / "empty.tar"
    with wds.TarWriter(str(empty)):
        pass
    text = tmp / "notatar.txt"
    text.write_text("hello")
    mode_error = [
        ("gopen_curl", "http://h/a"),
        ("gopen_gsutil", "gs://b/a"),
        ("gopen_ais", "ais://b/a"),
    ]
    t: Dict[Site, Optional[Callable[[], Any]]] = {
        # autodecode
        ("autodecode", "torch_loads", "ValueError"): in_secure_mode(lambda: A.torch_loads(b"x")),
        ("autodecode", "unpickle_loads", "ValueError"): in_secure_mode(
            lambda: A.unpickle_loads(b"x")
        ),
        ("autodecode", "ImageHandler.__init__", "ValueError"): lambda: A.ImageHandler("nope"),
        ("autodecode", "ImageHandler.__call__", "ValueError"): None,
        ("autodecode", "ImageHandler.__call__", "AssertionError"): None,
        ("autodecode", "Decoder.__init__", "AssertionError"): lambda: A.Decoder(["notcallable"]),
        ("autodecode", "Decoder.decode", "AssertionError"): lambda: A.Decoder([])("not a dict"),
        ("autodecode", "Decoder.decode", "DecodingError"): lambda: A.Decoder(
            [A.handle_extension("txt", lambda b: 1 / 0)]
        )(sample(txt=b"x")),
        ("autodecode", "Decoder.__call__", "AssertionError"): lambda: A.Decoder([])(["a list"]),
        # cache
        ("cache", "get_filetype", "AssertionError"): lambda: C.get_filetype(str(tmp / "none")),
        ("cache", "check_tar_format", "AssertionError"): lambda: C.check_tar_format(
            str(tmp / "none")
        ),
        ("cache", "url_to_cache_name", "AssertionError"): lambda: C.url_to_cache_name(3),
        ("cache", "FileCache.get_file", "AssertionError"): lambda: C.FileCache(
            cache_dir=str(tmp / "c")
        ).get_file(3),
        ("cache", "FileCache.get_file", "ValueError"): lambda: C.FileCache(
            cache_dir=str(tmp / "c2")
        ).get_file(f"pipe:cat {text}"),
        # compat
        ("compat", "check_empty", "ValueError"): lambda: drain(
            wds.WebDataset(str(empty), shardshuffle=False)
        ),
        ("compat", "WebDataset.update_cache_info", "ValueError"): lambda: wds.WebDataset(
            str(shard), cache_dir=str(tmp / "missing" / "cache")
        ),
        ("compat", "WebDataset.create_url_iterator", "AssertionError"): lambda: wds.WebDataset(
            {"no": "datasets"}
        ),
        ("compat", "WebDataset.create_url_iterator", "ValueError"): lambda: wds.WebDataset(3.5),
        # filters
        ("filters", "reraise_exception", "exn"): lambda: F.reraise_exception(KeyError("k")),
        ("filters", "getfirst", "AssertionError"): lambda: F.getfirst({"a": 1}, "a b"),
        ("filters", "getfirst", "ValueError"): lambda: F.getfirst(
            {"a": 1}, "b", missing_is_error=True
        ),
        ("filters", "transform_with", "AssertionError"): lambda: F.transform_with((1,), [str, str]),
        ("filters", "_shuffle", "AssertionError"): lambda: drain(
            F._shuffle(iter([1]), rng=__import__("random").Random(), seed=1)
        ),
        ("filters", "_decode", "AssertionError"): lambda: drain(F._decode(iter([3]), "rgb")),
        ("filters", "_map_dict", "AssertionError"): lambda: drain(F._map_dict(iter([3]), a=str)),
        ("filters", "_to_tuple", "ValueError"): lambda: drain(F._to_tuple(iter([sample()]), "jpg")),
        ("filters", "_map_tuple", "AssertionError"): lambda: drain(F._map_tuple(iter([3]), str)),
        ("filters", "combine_values", "AssertionError"): lambda: F.combine_values(
            [np.zeros(2), np.zeros(3)]
        ),
        ("filters", "default_collation_fn", "AssertionError"): lambda: F.default_collation_fn(
            [{"a": 1}, {"b": 2}]
        ),
        ("filters", "_unlisted", "AssertionError"): lambda: drain(F._unlisted(iter([3]))),
        ("filters", "_unbatched", "AssertionError"): lambda: drain(
            F._unbatched(iter([([1, 2], [3])]))
        ),
        ("filters", "_unbatched", "ValueError"): lambda: drain(F._unbatched(iter([3]))),
        ("filters", "_rsample", "AssertionError"): lambda: drain(F._rsample(iter([1]), 2.0)),
        ("filters", "_extract_keys", "ValueError"): lambda: drain(
            F._extract_keys(iter([sample(txt=1)]), "jpg")
        ),
        ("filters", "_rename_keys", "ValueError"): lambda: drain(
            F._rename_keys(iter([sample(txt=1)]), x="jpg")
        ),
        ("filters", "_xdecode", "ValueError"): lambda: drain(
            F._xdecode(iter([sample(zzz=b"x")]), must_decode=True)
        ),
        # gopen
        ("gopen", "Pipe.__init__", "ValueError"): None,
        ("gopen", "Pipe.wait_for_child", "IOError"): lambda: G.Pipe(
            "exit 3", mode="rb", shell=True
        ).read(),
        ("gopen", "gopen_pipe", "AssertionError"): lambda: G.gopen_pipe(str(shard)),
        ("gopen", "gopen_pipe", "ValueError"): in_secure_mode(lambda: G.gopen_pipe("pipe:true")),
        ("gopen", "gopen_htgs", "ValueError"): lambda: G.gopen_htgs("htgs://b/a", "wb"),
        ("gopen", "gopen_hf", "ValueError"): lambda: G.gopen_hf("hf://d/a", "wb"),
        ("gopen", "gopen_error", "ValueError"): lambda: G.gopen_error("x://a"),
        ("gopen", "rewrite_url", "ValueError"): None,  # set below: needs GOPEN_REWRITE
        ("gopen", "gopen", "AssertionError"): lambda: wds.gopen(str(shard), "r"),
        ("gopen", "gopen", "ValueError"): in_secure_mode(lambda: wds.gopen(str(shard))),
        # handlers
        ("handlers", "reraise_exception", "exn"): lambda: wds.reraise_exception(KeyError("k")),
        # pipeline
        ("pipeline", "DataPipeline.invoke", "ValueError"): lambda: drain(wds.DataPipeline(3)),
        # shardlists
        ("shardlists", "envlookup", "AssertionError"): lambda: S.envlookup(
            __import__("re").match(r"\$\{(\w+)\}", "${WDS_NOT_SET_ANYWHERE}")
        ),
        ("shardlists", "single_node_only", "ValueError"): None,  # set below: needs a world
        ("shardlists", "expand_source", "ValueError"): lambda: S.expand_source(3.5),
        ("shardlists", "SimpleShardList.__init__", "AssertionError"): lambda: S.SimpleShardList(
            [3]
        ),
        ("shardlists", "non_empty", "ValueError"): lambda: drain(S.non_empty(iter([]))),
        ("shardlists", "ResampledShards.__init__", "ValueError"): lambda: S.ResampledShards(
            [], empty_check=True
        ),
        ("shardlists", "ResampledShards.__init__", "AssertionError"): lambda: S.ResampledShards(
            [3]
        ),
        ("shardlists", "DirectoryShardList.__init__", "AssertionError"): lambda: (
            S.DirectoryShardList(str(tmp / "no-such-dir"))
        ),
        ("shardlists", "DirectoryShardList.__iter__", "ValueError"): lambda: drain(
            S.DirectoryShardList(str(tmp), select="sideways")
        ),
        ("shardlists", "MultiShardSample.parse_spec", "AssertionError"): lambda: S.MultiShardSample(
            {"datasets": [], "extra": 1}
        ),
        ("shardlists", "MultiShardSample.parse_spec", "ValueError"): lambda: S.MultiShardSample(
            {"datasets": [{"shards": "a-{0..1}.tar", "choose": 5}]}
        ),
        # tariterators
        ("tariterators", "url_opener", "AssertionError"): lambda: drain(
            wds.tariterators.url_opener(iter([{"no_url": 1}]))
        ),
        ("tariterators", "tar_file_expander", "AssertionError"): lambda: drain(
            wds.tariterators.tar_file_expander(iter([{"url": "a.tar"}]))
        ),
        ("tariterators", "group_by_keys", "AssertionError"): lambda: drain(
            wds.tariterators.group_by_keys(iter([3]))
        ),
        ("tariterators", "group_by_keys", "ValueError"): lambda: drain(
            wds.tariterators.group_by_keys(
                iter([{"fname": "a.txt", "data": b"1"}, {"fname": "a.txt", "data": b"2"}])
            )
        ),
        # tenbin
        ("tenbin", "bytelen", "ValueError"): lambda: T.bytelen(3),
        ("tenbin", "bytedata", "ValueError"): lambda: T.bytedata(3),
        ("tenbin", "check_acceptable_input_type", "ValueError"): lambda: (
            T.check_acceptable_input_type([np.zeros(2, dtype=np.float64)], False)
        ),
        ("tenbin", "check_infos", "ValueError"): lambda: T.check_infos([np.zeros(1)], ["a"], 3),
        ("tenbin", "encode_header", "ValueError"): lambda: T.encode_header(
            np.zeros(1, dtype=np.complex64)
        ),
        ("tenbin", "decode_header", "ValueError"): lambda: T.decode_header(
            T.encode_header(np.zeros(1, dtype=np.float32)).replace(b"f4", b"zz", 1)
        ),
        ("tenbin", "encode_list", "ValueError"): lambda: T.encode_list([np.zeros(1)], ["a", "b"]),
        ("tenbin", "decode_chunks", "ValueError"): lambda: T.decode_chunks(b"x" * 64),
        ("tenbin", "encode_buffer", "ValueError"): lambda: T.encode_buffer(np.zeros(1)),
        ("tenbin", "read_chunk", "ValueError"): lambda: T.read_chunk(io.BytesIO(b"x" * 64)),
        ("tenbin", "read", "ValueError"): lambda: T.read(
            io.BytesIO(bytes(T.encode_buffer([np.zeros(4, dtype=np.float32)]))[:-8])
        ),
        ("tenbin", "save", "ValueError"): lambda: T.save(str(tmp / "a.npy"), np.zeros(1)),
        ("tenbin", "load", "ValueError"): lambda: T.load(str(tmp / "a.npy")),
        # utils
        ("utils", "PipelineStage.invoke", "NotImplementedError"): lambda: (
            U.PipelineStage().invoke()
        ),
        ("utils", "safe_eval", "ValueError"): lambda: U.safe_eval("1; import os"),
        ("utils", "obsolete.new_func", "ObsoleteException"): lambda: U.obsolete(lambda: 1)(),
        # writer
        ("writer", "imageencoder", "AssertionError"): lambda: W.imageencoder("not an image"),
        ("writer", "imageencoder", "ValueError"): lambda: W.imageencoder(
            np.full((2, 2), 300.0), "png"
        ),
        ("writer", "numpy_npz_dumps", "AssertionError"): lambda: W.numpy_npz_dumps([1]),
        ("writer", "encode_based_on_extension1", "ValueError"): lambda: (
            W.encode_based_on_extension1(3, "_meta", W.default_handlers)
        ),
        ("writer", "make_encoder", "ValueError"): lambda: W.make_encoder(3),
        ("writer", "TarWriter.write", "ValueError"): lambda: wds.TarWriter(
            str(tmp / "w.tar")
        ).write({"txt": "no key"}),
        ("writer", "ShardWriter.finish", "AssertionError"): None,
    }
    for name, url in mode_error:
        t[("gopen", name, "ValueError")] = lambda name=name, url=url: getattr(G, name)(url, "ab")
    t[("gopen", "rewrite_url", "ValueError")] = lambda: _with_env(
        "GOPEN_REWRITE", "a=b", in_secure_mode(lambda: G.rewrite_url("a.tar"))
    )
    two_nodes = lambda: drain(S.single_node_only(iter(["a.tar", "b.tar"])))  # noqa: E731
    t[("shardlists", "single_node_only", "ValueError")] = lambda: _with_env(
        "WORLD_SIZE", "2", lambda: _with_env("RANK", "1", two_nodes)
    )
    return t


def _with_env(name: str, value: str, call: Callable[[], Any]) -> Any:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        return call()
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before
