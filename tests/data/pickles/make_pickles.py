"""Writes the pickles that tests/test_layout.py loads: objects pickled by webds 0.1.0 before the
package layout changed (commit 1461765), which named the old flat modules (webds.stages,
webds.filters, webds.sharddatasets, ...). Kept to show how they were made; rerunning it with the
current code would write the new module names and test nothing.

Run from the repository root: python tests/data/pickles/make_pickles.py
"""

import io
import pickle
import tarfile
from pathlib import Path

import webds

HERE = Path("tests/data/pickles")
SHARD = str(HERE / "shard-000000.tar")


def write_shard() -> None:
    with tarfile.open(SHARD, "w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(6):
            for ext, data in (("txt", f"text {i}".encode()), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                info.mtime = 1_600_000_000
                tf.addfile(info, io.BytesIO(data))


def objects() -> dict:
    from webds import compat, legacy, mix, plan, shardsources, stages
    from webds.index import ShardIndex

    return {
        "fluent": webds.WebDataset(SHARD, shardshuffle=False)
        .decode()
        .map_dict(txt=str.upper)
        .to_tuple("txt", "cls")
        .batched(2),
        "fluent_shuffled": webds.WebDataset(SHARD, shardshuffle=True, seed=3).shuffle(4, seed=1),
        "pipeline": webds.DataPipeline(
            webds.SimpleShardList([SHARD]),
            webds.split_by_worker,
            webds.tarfile_to_samples(handler=webds.warn_and_continue),
            webds.rename(text="txt"),
            webds.to_tuple("text", "cls"),
        ),
        "resampled": webds.ResampledShards([SHARD], seed=0),
        "legacy_keywords": _legacy(),
        "stage_factory": webds.shuffle,
        "stage": webds.shuffle(10, initial=5),
        "count": stages.BATCH,
        "decoder": webds.Decoder([webds.imagehandler("rgb8")]),
        "planned": plan.PlannedShards([SHARD], [6], balance="pad", seed=1, shuffle=True),
        "roundrobin": mix.RoundRobin([[1, 2], [3]]),
        "index": ShardIndex.build([SHARD]),
        "cached_stage": webds.cache.cached_shards("cache-dir", cache_size=10),
        "replay": webds.Cached(),
        "loader": webds.WebLoader(webds.WebDataset(SHARD), batch_size=None, num_workers=0),
        "tenbin_fn": webds.tenbin.encode_buffer if hasattr(webds.tenbin, "encode_buffer") else None,
        "multishard_cls": shardsources.MultiShardSample,
        "gopen": compat.gopen,
        "legacy_stage": legacy.PipelineStage,
        "error": webds.ShardReadError("bad", url=SHARD) if _takes_url() else webds.WebdsError("x"),
        "split_by_node": webds.split_by_node,
        "handler": webds.warn_and_continue,
    }


def _takes_url() -> bool:
    import inspect

    return "url" in inspect.signature(webds.ShardReadError).parameters


def _legacy():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return webds.WebDataset(SHARD, extensions="txt cls", shuffle=0)


if __name__ == "__main__":
    write_shard()
    for name, obj in objects().items():
        if obj is None:
            continue
        (HERE / f"{name}.pkl").write_bytes(pickle.dumps(obj))
        print(name, type(obj).__module__, type(obj).__qualname__)
    # What iterating the datasets gave before the move, for the test to compare against.
    import json

    expected = {}
    for name in ("fluent", "fluent_shuffled", "pipeline", "resampled", "legacy_keywords", "loader"):
        obj = pickle.loads((HERE / f"{name}.pkl").read_bytes())
        items = list(obj) if name != "resampled" else [next(iter(obj)) for _ in range(3)]
        expected[name] = repr(items)
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
