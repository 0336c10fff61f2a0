"""map_shards: sample- and shard-level functions over many shards, on local processes, threads
and a Dask LocalCluster; atomic outputs, reruns that skip complete shards, failures that leave
the other outputs, local and S3 (moto) shards."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Iterator, List

import pytest
import shardfns
from clitools import tar_members, tar_names
from conftest import sample_members, write_tar

import webds
from webds.errors import ArgumentError, WebdsError
from webds.parallel import MapShardsError, ShardResult, map_shards, output_urls

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


@pytest.fixture
def shards(tmp_path: Path) -> List[Path]:
    """Three shards by Python's tarfile, the last gzipped: 4, 5 and 6 samples."""
    data = tmp_path / "in"
    data.mkdir()
    paths = [
        write_tar(data / f"part-{i:03d}.tar", sample_members(4 + i, prefix=f"s{i}_"))
        for i in range(2)
    ]
    paths.append(
        write_tar(data / "part-002.tar.gz", sample_members(6, prefix="s2_"), compress="gz")
    )
    return paths


def members(path: Path) -> Dict[str, bytes]:
    return dict(tar_members(path))


def snapshot(folder: Path) -> Dict[str, tuple]:
    """Every file (hidden ones too) with its inode and mtime: a rewrite changes the inode."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def test_sample_level_on_default_process_pool(tmp_path: Path, shards: List[Path]) -> None:
    results = map_shards(
        shardfns.upper, str(tmp_path / "in") + "/", str(tmp_path / "out/{stem}.tar")
    )
    out = tmp_path / "out"
    assert [r.output for r in results] == [
        str(out / "part-000.tar"),
        str(out / "part-001.tar"),
        str(out / "part-002.tar"),
    ]
    assert [(r.samples_in, r.samples_out, r.skipped, r.error) for r in results] == [
        (4, 4, False, None),
        (5, 5, False, None),
        (6, 6, False, None),
    ]
    assert all(r.ok for r in results)
    # GNU tar reads the outputs; fields sorted per sample, samples in input order.
    assert tar_names(out / "part-001.tar")[:4] == [
        "s1_000000.cls",
        "s1_000000.txt",
        "s1_000001.cls",
        "s1_000001.txt",
    ]
    got = members(out / "part-002.tar")
    assert got["s2_000005.txt"] == b"SAMPLE S2_000005 TXT"
    assert got["s2_000005.cls"] == b"6"
    assert len(got) == 12


@pytest.mark.slow
def test_dask_and_default_executor_give_identical_outputs(
    tmp_path: Path, shards: List[Path], dask_client
) -> None:
    inputs = [str(p) for p in shards]
    for fn, level in (
        (shardfns.upper, "sample"),
        (shardfns.split_two, "sample"),
        (webds.map(shardfns.upper), "shard"),
        (shardfns.number_samples, "shard"),
    ):
        name = getattr(fn, "__name__", "map")
        local = map_shards(fn, inputs, str(tmp_path / f"{name}-local/{{stem}}.tar"), level=level)
        dask = map_shards(
            fn, inputs, str(tmp_path / f"{name}-dask/{{stem}}.tar"), dask_client, level=level
        )
        assert [(r.samples_in, r.samples_out) for r in local] == [
            (r.samples_in, r.samples_out) for r in dask
        ]
        for a, b in zip(local, dask):
            assert Path(a.output).read_bytes() == Path(b.output).read_bytes(), (name, a.output)
    # The executor itself (not just the client) works too.
    again = map_shards(
        shardfns.upper, inputs, str(tmp_path / "exec/{index}.tar"), dask_client.get_executor()
    )
    assert (tmp_path / "exec/0.tar").read_bytes() == Path(
        str(tmp_path / "upper-local/part-000.tar")
    ).read_bytes()
    assert [r.samples_out for r in again] == [4, 5, 6]


@pytest.fixture(scope="module")
def dask_client() -> Iterator[object]:
    """One two-process Dask LocalCluster for the module (its start-up is the slow part)."""
    distributed = pytest.importorskip("distributed", reason="dask distributed is not installed")
    # Dask's worker processes import the test functions by module name.
    path = os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", path.rstrip(os.pathsep))
        with (
            distributed.LocalCluster(
                n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None
            ) as cluster,
            distributed.Client(cluster) as client,
        ):
            yield client


def test_rerun_skips_complete_shards_and_redoes_a_deleted_one(
    tmp_path: Path, shards: List[Path]
) -> None:
    out = tmp_path / "out"
    first = map_shards(shardfns.upper, [str(p) for p in shards], str(out) + "/", workers=2)
    assert [Path(r.output).name for r in first] == [
        "part-000.tar",
        "part-001.tar",
        "part-002.tar.gz",
    ]
    before = snapshot(out)
    second = map_shards(shardfns.upper, [str(p) for p in shards], str(out) + "/")
    assert [r.skipped for r in second] == [True, True, True]
    assert [(r.samples_in, r.samples_out) for r in second] == [(0, 0)] * 3
    assert snapshot(out) == before  # nothing rewritten, no stray temporary file

    original = (out / "part-001.tar").read_bytes()
    (out / "part-001.tar").unlink()
    third = map_shards(shardfns.upper, [str(p) for p in shards], str(out) + "/")
    assert [r.skipped for r in third] == [True, False, True]
    assert third[1].samples_out == 5
    assert (out / "part-001.tar").read_bytes() == original
    after = snapshot(out)
    assert after["part-000.tar"] == before["part-000.tar"]
    assert after["part-002.tar.gz"] == before["part-002.tar.gz"]

    forced = map_shards(shardfns.upper, [str(p) for p in shards], str(out) + "/", overwrite=True)
    assert [r.skipped for r in forced] == [False, False, False]
    assert snapshot(out)["part-000.tar"][0] != before["part-000.tar"][0]  # a new file


def test_failing_shard_leaves_the_others_and_no_partial_output(
    tmp_path: Path, shards: List[Path]
) -> None:
    out = tmp_path / "out"
    inputs = [str(p) for p in shards]
    with pytest.raises(MapShardsError) as info:
        map_shards(shardfns.fail_in_shard_1, inputs, str(out / "{stem}.tar"))
    err = info.value
    assert isinstance(err, WebdsError)
    text = str(err)
    assert "1 of 3 shards failed" in text
    assert "part-001.tar" in text and "ValueError: cannot handle s1_000002" in text
    assert "shardfns.py" in text and "fail_in_shard_1" in text  # where the user's code raised
    assert "run again to redo only the failed shards" in text
    assert [r.ok for r in err.results] == [True, False, True]
    failed = err.failed[0]
    assert (failed.input, failed.samples_in, failed.samples_out) == (inputs[1], 3, 0)
    # The other shards are complete; the failed one left nothing, not even a temporary file.
    assert sorted(os.listdir(out)) == ["part-000.tar", "part-002.tar"]
    assert len(members(out / "part-002.tar")) == 12

    # A rerun with a fixed function does only the failed shard.
    fixed = map_shards(shardfns.upper, inputs, str(out / "{stem}.tar"))
    assert [r.skipped for r in fixed] == [True, False, True]
    assert len(tar_names(out / "part-001.tar")) == 10


def test_lambda_is_refused_for_processes_but_fine_on_threads(
    tmp_path: Path, shards: List[Path]
) -> None:
    with pytest.raises(ArgumentError, match="define fn at module top level"):
        map_shards(lambda s: s, str(shards[0]), str(tmp_path / "a.tar"))

    def local_fn(sample):
        return sample

    with pytest.raises(ArgumentError, match="define fn at module top level"):
        map_shards(local_fn, str(shards[0]), str(tmp_path / "a.tar"), "processes")
    assert not (tmp_path / "a.tar").exists()
    results = map_shards(lambda s: s, str(shards[0]), str(tmp_path / "a.tar"), "threads")
    assert results[0].samples_out == 4
    assert members(tmp_path / "a.tar") == members(shards[0])  # raw bytes pass through as they are


def test_sample_results_none_lists_and_bad_types(tmp_path: Path, shards: List[Path]) -> None:
    src = str(shards[1])
    [dropped] = map_shards(shardfns.drop_odd, src, str(tmp_path / "even.tar"), "serial")
    assert (dropped.samples_in, dropped.samples_out) == (5, 3)
    assert tar_names(tmp_path / "even.tar") == [
        f"s1_00000{i}.{ext}" for i in (0, 2, 4) for ext in ("cls", "txt")
    ]
    [split] = map_shards(shardfns.split_two, src, str(tmp_path / "split.tar"), "serial")
    assert split.samples_out == 10
    assert tar_names(tmp_path / "split.tar")[:2] == ["s1_000000_a.txt", "s1_000000_b.cls"]
    with pytest.raises(MapShardsError, match="fn returned str for sample 's1_000000'"):
        map_shards(shardfns.returns_text, src, str(tmp_path / "bad.tar"), "serial")
    assert not (tmp_path / "bad.tar").exists()


def test_shard_level_generator_and_stage(tmp_path: Path, shards: List[Path]) -> None:
    ex = ThreadPoolExecutor(2)
    try:
        results = map_shards(
            shardfns.number_samples,
            [str(p) for p in shards],
            str(tmp_path / "{index:02d}.tar"),
            ex,
            level="shard",
        )
    finally:
        ex.shutdown()
    assert [r.samples_out for r in results] == [4, 5, 6]
    got = members(tmp_path / "02.tar")
    assert got["s2_000003.index"] == b"3" and got["s2_000003.txt"] == b"sample s2_000003 txt"
    staged = map_shards(
        webds.map(shardfns.drop_odd), str(shards[0]), str(tmp_path / "st.tar"), level="shard"
    )
    assert staged[0].samples_out == 2
    with pytest.raises(ArgumentError, match="level must be 'sample' or 'shard'"):
        map_shards(shardfns.upper, str(shards[0]), str(tmp_path / "x.tar"), level="batch")


def test_progress_bar_on_stderr(
    tmp_path: Path, shards: List[Path], capsys: pytest.CaptureFixture
) -> None:
    map_shards(
        shardfns.upper,
        str(tmp_path / "in") + "/",
        str(tmp_path / "o") + "/",
        "serial",
        progress=True,
    )
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "map_shards" in captured.err and "3/3" in captured.err


def test_output_specs() -> None:
    ins = ["d/a-000.tar", "s3://b/x/a-001.tar.gz", "d/c.tgz"]
    assert output_urls(ins, "o/{name}") == ["o/a-000.tar", "o/a-001.tar.gz", "o/c.tgz"]
    assert output_urls(ins, "o/{stem}.tar") == ["o/a-000.tar", "o/a-001.tar", "o/c.tar"]
    assert output_urls(ins, "s3://o/p/{index:06d}.tar") == [
        f"s3://o/p/{i:06d}.tar" for i in range(3)
    ]
    assert output_urls(ins, "gs://o/") == [
        "gs://o/a-000.tar",
        "gs://o/a-001.tar.gz",
        "gs://o/c.tgz",
    ]
    assert output_urls(ins, ["x", "y", "z"]) == ["x", "y", "z"]
    assert output_urls(["pipe:cat a.tar"], "o/{index}.tar") == ["o/0.tar"]
    assert output_urls(["d/a.tar"], "one.tar") == ["one.tar"]


@pytest.mark.parametrize(
    "inputs, outputs, message",
    [
        (["d/a.tar", "e/a.tar"], "o/{name}", "both map to output 'o/a.tar'"),
        (["a.tar", "b.tar"], "one.tar", "both map to output 'one.tar'"),
        (["a.tar", "b.tar"], ["x.tar"], "2 input shards but 1 outputs"),
        (["a.tar"], "{stem}.tar", "is also an input shard"),
        (["a.tar"], "o/{shard}.tar", "can be {name}, {stem} and {index}"),
        (["a.tar"], "o/a-{000..009}.tar", "can be {name}, {stem} and {index}"),
        (["pipe:cat a.tar"], "o/{name}", "has no file name for {name}"),
        (["a.tar"], "-", "'-' (stdout) can't be one"),
    ],
)
def test_bad_output_specs(inputs: List[str], outputs, message: str) -> None:
    with pytest.raises(ArgumentError) as info:
        output_urls(inputs, outputs)
    assert message in str(info.value)


def test_bad_arguments(tmp_path: Path, shards: List[Path]) -> None:
    with pytest.raises(ArgumentError, match="'-' \\(stdin\\) can't be one"):
        map_shards(shardfns.upper, "-", str(tmp_path / "o") + "/")
    with pytest.raises(ArgumentError, match="fn must be callable"):
        map_shards("upper", str(shards[0]), str(tmp_path / "o") + "/")  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="executor must be"):
        map_shards(shardfns.upper, str(shards[0]), str(tmp_path / "o") + "/", "gpu")
    with pytest.raises(ArgumentError, match="workers must be a positive int"):
        map_shards(shardfns.upper, str(shards[0]), str(tmp_path / "o") + "/", workers=0)
    with pytest.raises(ArgumentError, match="found no files matching"):
        map_shards(shardfns.upper, str(tmp_path / "empty*.tar"), str(tmp_path / "o") + "/")


def test_missing_and_truncated_inputs_fail_their_shards(tmp_path: Path, shards: List[Path]) -> None:
    shards[1].write_bytes(shards[1].read_bytes()[:5000])  # cut inside the fifth member
    missing = str(tmp_path / "in" / "nope.tar")
    with pytest.raises(MapShardsError) as info:
        map_shards(
            shardfns.upper, [str(shards[0]), str(shards[1]), missing], str(tmp_path / "o") + "/"
        )
    results = info.value.results
    assert [r.ok for r in results] == [True, False, False]
    assert "truncated" in (results[1].error or "")
    assert "nope.tar" in (results[2].error or "")
    assert sorted(os.listdir(tmp_path / "o")) == ["part-000.tar"]


def test_results_pickle_and_error_keeps_results() -> None:
    import pickle

    r = ShardResult("a.tar", "o/a.tar", 3, 2)
    err = MapShardsError("1 of 1 shards failed", [r])
    back = pickle.loads(pickle.dumps(err))
    assert back.results == [r] and str(back) == "1 of 1 shards failed"


def test_s3_round_trip(s3, tmp_path: Path) -> None:
    """Inputs listed under an S3 prefix, outputs written to S3 with storage_options; a rerun
    skips the objects that exist; a failing shard leaves no object."""
    for i in range(3):
        local = write_tar(tmp_path / f"part-{i:03d}.tar", sample_members(3 + i, prefix=f"s{i}_"))
        s3.put(f"in/part-{i:03d}.tar", local.read_bytes())
    opts = s3.storage_options
    with pytest.raises(MapShardsError):
        map_shards(
            shardfns.fail_in_shard_1,
            s3.url("in/"),
            s3.url("out/{stem}.tar"),
            storage_options=opts,
        )
    assert s3.list("out/") == ["out/part-000.tar", "out/part-002.tar"]
    results = map_shards(
        shardfns.upper, s3.url("in/"), s3.url("out/{stem}.tar"), storage_options=opts
    )
    assert [r.skipped for r in results] == [True, False, True]
    assert s3.list("out/") == ["out/part-000.tar", "out/part-001.tar", "out/part-002.tar"]
    local = map_shards(shardfns.upper, str(tmp_path / "part-001.tar"), str(tmp_path / "l.tar"))
    assert local[0].samples_out == 4
    assert s3.get("out/part-001.tar") == (tmp_path / "l.tar").read_bytes()
