"""Memory bounds one step past the field limit (issue 54, items 4-6): a sample's budget at decode
and in a compressed shard, a gzip body over HTTP, and counts and ranges from an index or a saved
state that would size an allocation. Each bomb is a few MB on disk, read in a subprocess under an
address-space limit (tests/bombs.py): refused with the named error, at bounded peak memory."""

import gzip
import json
import tarfile

import pytest
from bombs import GiB, MiB, run_limited, zero_bomb

import webds
from webds.base.saved import read_state

MB = 1000 * 1000


def member_header(name, size):
    info = tarfile.TarInfo(name)
    info.size = size
    return info.tobuf(tarfile.GNU_FORMAT)


def zero_members_tar_gz(path, names, size):
    """A .tar.gz whose members ``names`` are each ``size`` zero bytes: two gzip members per tar
    member, its header's and its data's (concatenated gzip is one stream to every reader); the
    data's is the same for all, built once (in about a second)."""
    data = zero_bomb("gz", size, b"", bytes(-size % 512))
    parts = [gzip.compress(member_header(n, size), 1) + data for n in names]
    parts.append(gzip.compress(bytes(1024), 1))
    path.write_bytes(b"".join(parts))
    return str(path)


# Read a shard's samples (torch-free), print the error and exit 0, or exit 1 without one.
READ = """
import sys
from webds.errors import WebdsError
from webds.tar.samples import tarfile_samples
try:
    for sample in tarfile_samples(iter([{{"url": {url!r}}}]){args}):
        print("read", sample["__key__"], {{k: len(v) for k, v in sample.items() if k[0] != "_"}})
except WebdsError as exn:
    print(type(exn).__name__ + ":", exn)
    sys.exit(0)
sys.exit(1)
"""


# -- item 5: one sample, many fields or members -----------------------------------------------


def test_five_gz_fields_of_250mib_stop_at_the_sample_budget(tmp_path):
    # 1.2 MB of input; each field is under max_field_bytes (256 MiB), the five 1.22 GiB. It
    # peaked at 1.5 GB (issue 54); now the third field stops at 512 MiB, under 640 MB held.
    field = zero_bomb("gz", 250 * MiB)  # (the same bytes each time: built once)
    fields = {f"f{i}.bin.gz": field for i in range(5)}
    url = str(tmp_path / "fields.tar")
    with webds.TarWriter(url) as w:
        w.write({"__key__": "s7", **fields})
    code = (
        READ.replace("tarfile_samples(", "webds.decode()(tarfile_samples(")
        .replace("{args}):", "{args})):")
        .replace("from webds.errors", "import webds\nfrom webds.errors")
    )
    rc, out, peak = run_limited(code.format(url=url, args=""), 3 * GiB)
    assert rc == 0, out  # a SampleTooLargeError, not a MemoryError, not a kill
    assert "SampleTooLargeError: the sample's compressed fields decompress to more than " in out
    assert "max_sample_bytes=536,870,912 (512 MiB)" in out  # the default
    assert "decode(..., max_sample_bytes=N)" in out and "member 's7.f2.bin.gz'" in out
    assert peak < 640 * MB, peak


def test_six_200mb_members_of_one_sample_in_a_tar_gz_are_refused_on_a_header(tmp_path):
    # 1.2 MB of .tar.gz; each member under the member limit (1 GiB), the sample 1.2 GB. It
    # peaked at 1.63 GB; now the third header would pass 512 MiB: refused before it is read
    # (the reader holds a member twice while it joins its chunks: 400 MB held, 600 MB peak).
    names = [f"s3.f{i}.bin" for i in range(6)]
    url = zero_members_tar_gz(tmp_path / "six.tar.gz", names, 200 * MB)
    rc, out, peak = run_limited(READ.format(url=url, args=""), 3 * GiB)
    assert rc == 0, out
    assert "SampleTooLargeError: sample 's3' holds more than max_sample_bytes=536,870,912" in out
    assert "max_sample_bytes=N (tarfile_to_samples, WebDataset)" in out
    assert "member 's3.f2.bin'" in out and "read s3" not in out
    assert peak < 700 * MB, peak


def test_the_sample_budget_is_a_knob_and_a_handler_skips_the_sample(tmp_path):
    import numpy as np

    payload = np.random.default_rng(0).integers(0, 255, 3000, dtype=np.uint8).tobytes()
    big = {"__key__": "a", "__url__": "s.tar", "x.bin.gz": gzip.compress(payload)}
    big["y.bin.gz"] = big["x.bin.gz"]
    small = {"__key__": "b", "x.bin.gz": gzip.compress(b"ok")}
    assert webds.Decoder([], max_sample_bytes=6000)(big)["y.bin.gz"] == payload
    assert webds.Decoder([], max_sample_bytes=None)(big)["y.bin.gz"] == payload
    with pytest.raises(webds.SampleTooLargeError) as info:
        webds.Decoder([], max_sample_bytes=5999)(big)
    assert isinstance(info.value, webds.DecodeError) and info.value.url == "s.tar"
    assert info.value.key == "a" and info.value.member == "a.y.bin.gz"
    stage = webds.decode(max_sample_bytes=5999, handler=webds.ignore_and_continue)
    assert [s["__key__"] for s in stage(iter([big, small]))] == ["b"]
    # In a shard: given, the budget holds a plain tar's samples too; the handler skips the rest
    # of the shard, as for other bad shards.
    url = str(tmp_path / "p.tar")
    with webds.TarWriter(url) as w:
        w.write({"__key__": "a", "x.bin": payload, "y.bin": payload})
    assert [s["__key__"] for s in webds.tarfile_to_samples()(iter([url]))] == ["a"]
    with pytest.raises(webds.ShardReadError, match="max_sample_bytes=5,999"):
        list(webds.tarfile_to_samples(max_sample_bytes=5999)(iter([url])))
    with pytest.raises(webds.ArgumentError, match="max_sample_bytes must be a positive"):
        list(webds.tarfile_to_samples(max_sample_bytes=0)(iter([url])))


# -- item 4: a gzip body over HTTP --------------------------------------------------------------


def test_a_gzip_coded_http_body_is_bounded_as_a_tar_gz(tmp_path, http_server):
    # A 1.1 MB body declaring Content-Encoding: gzip, a tar of one 1.1 GiB member: aiohttp
    # inflated it, and webds read a plain tar (peak 2.4 GB). Read as sent, it is a .tar.gz.
    size = 1100 * MiB
    prefix = member_header("0000.cls", 1) + b"7" + bytes(511) + member_header("0001.bin", size)
    http_server.put("coded.tar", zero_bomb("gz", size, prefix, bytes(-size % 512) + bytes(1024)))
    http_server.content_encoding = "gzip"
    try:
        code = READ.format(url=http_server.url("coded.tar"), args="")
        rc, out, peak = run_limited(code, 3 * GiB)
    finally:
        http_server.content_encoding = None
    assert rc == 0, out
    assert "allowed for a member of a gzip-compressed shard" in out, out
    assert peak < 300 * MB, peak


def test_a_body_in_another_coding_is_refused_naming_it(http_server):
    http_server.put("br.tar", b"\x1b" * 600)
    http_server.content_encoding = "br"
    try:
        with pytest.raises(webds.OpenError, match="'Content-Encoding: br'"):
            list(webds.tarfile_to_samples()(iter([http_server.url("br.tar")])))
    finally:
        http_server.content_encoding = None


# -- item 6: counts and ranges that size an allocation -----------------------------------------


def test_an_index_claiming_1e12_samples_is_refused_before_the_sampler_allocates(tmp_path):
    url = str(tmp_path / "a.tar")
    with webds.TarWriter(url) as w:
        for i in range(3):
            w.write({"__key__": f"{i:04d}", "cls": b"1"})
    entry = {"url": "a.tar", "samples": 10**12, "bytes": len(open(url, "rb").read())}
    index = tmp_path / "index.json"
    doc = {"format": "webds-shard-index", "version": 1, "shards": [entry]}
    index.write_text(json.dumps(doc))
    code = f"""
import sys, webds
try:
    webds.ChunkedSampler(webds.ShardListDataset({str(index)!r}))
except webds.ArgumentError as exn:
    print("ArgumentError:", exn)
    sys.exit(0)
sys.exit(1)
"""
    rc, out, peak = run_limited(code, 1 * GiB)
    assert rc == 0, out  # it raised MemoryError (issue 54)
    assert "has 'samples': 1000000000000, more than its" in out, out
    assert peak < 200 * MB, peak


def test_a_ledger_run_past_the_id_space_is_refused_and_the_largest_kept_as_a_run(tmp_path):
    url = str(tmp_path / "a.tar")
    with webds.TarWriter(url) as w:
        for i in range(5):
            w.write({"__key__": f"{i:04d}", "cls": b"1"})
    pipeline = webds.DataPipeline(webds.SimpleShardList([url] * 3), webds.tarfile_to_samples())
    it = iter(pipeline)
    for _ in range(7):
        next(it)
    state = pipeline.state_dict()
    # Past the id space (2**32 source items) a run is refused where it is read...
    state["ledger"]["complete"] = [[0, 10**10]]  # 384 bytes of JSON
    state["ledger"]["partial"] = {}
    with pytest.raises(webds.ArgumentError, match=r"state\['ledger'\]\['complete'\]\[0\]"):
        read_state(state)
    # ... and the largest run in it is kept as a run (expanded, it allocated until MemoryError)
    state["ledger"]["complete"] = [[0, 2**32]]
    code = f"""
import json, webds
state = json.loads({json.dumps(json.dumps(state))})
pipeline = webds.DataPipeline(webds.SimpleShardList([{url!r}] * 3), webds.tarfile_to_samples())
pipeline.load_state_dict(state)
print("resumed", len(list(pipeline)))
"""
    rc, out, peak = run_limited(code, 1 * GiB)
    assert rc == 0 and "resumed 0" in out, out  # it allocated until MemoryError (1.36 GB)
    assert peak < 400 * MB, peak  # (the pipeline's imports: about 230 MB)
    from webds.base.saved import Runs

    ledger = read_state(state).ledger
    assert isinstance(ledger.complete, Runs) and 2**32 - 1 in ledger.complete
    assert ledger.to_dict()["complete"] == [[0, 2**32]]
    state["ledger"]["complete"] = [[-3, 2]]
    with pytest.raises(webds.ArgumentError, match=r"state\['ledger'\]\['complete'\]\[0\]"):
        read_state(state)


def test_runs_behave_as_a_set():
    from webds.base.saved import Runs

    runs = Runs([5, 1, 2, 3, 9])
    assert runs.runs() == [[1, 4], [5, 6], [9, 10]] and runs == {1, 2, 3, 5, 9}
    runs.add(4)
    runs.discard(9)
    runs.add_run(7, 9)
    assert runs.runs() == [[1, 6], [7, 9]] and len(runs) == 7 and 6 not in runs
    runs.discard(3)
    assert list(runs) == [1, 2, 4, 5, 7, 8] and Runs(runs) == runs


# -- sparse members, long names and index counts (issue 54, fresh-eyes items) -------------------


def sparse_bomb(tmp_path, sizes, fmt="posix"):
    """A GNU tar of one sample ``k``: a sparse member of each size (all holes), then k.cls; a
    few KB whatever the sizes (skipped where GNU tar or holes are missing)."""
    import shutil
    import subprocess

    if shutil.which("tar") is None:
        pytest.skip("no tar")
    folder = tmp_path / "sp"
    folder.mkdir()
    names = []
    for i, size in enumerate(sizes):
        with open(folder / f"k.f{i}.bin", "wb") as f:
            f.truncate(size)
        names.append(f"k.f{i}.bin")
    (folder / "k.cls").write_bytes(b"1\n")
    shard = tmp_path / "bomb.tar"
    options = ["--sparse", f"--format={fmt}"]
    subprocess.run(["tar", *options, "-cf", str(shard), "-C", str(folder), *names, "k.cls"])
    if shard.stat().st_size > 1 << 20:
        pytest.skip("this filesystem reports no holes: GNU tar wrote plain members")
    return shard


SPARSE = """
import gzip, json, shutil, sys
import webds
from webds.tar.samples import tarfile_samples
url = {url!r}
def attempt(what, fn):
    try:
        fn()
        print(what, "read")
    except webds.WebdsError as exn:
        print(what, type(exn).__name__ + ":", exn)
def stream(u, **kw):
    for s in tarfile_samples(iter([{{"url": u}}]), **kw):
        pass
attempt("plain", lambda: stream(url))
attempt("given", lambda: stream(url, max_sample_bytes=1 << 20))
with open(url, "rb") as f, gzip.open(url + ".gz", "wb", 1) as g:
    shutil.copyfileobj(f, g)
attempt("gz", lambda: stream(url + ".gz"))
attempt("index", lambda: webds.ShardIndex.build([url]))
size = len(open(url, "rb").read())
doc = {{"format": "webds-shard-index", "version": 1,
       "shards": [{{"url": url, "samples": 1, "bytes": size, "offsets": [0, size]}}]}}
open(url + ".json", "w").write(json.dumps(doc))
attempt("access", lambda: webds.ShardListDataset(url + ".json")[0])
"""


def test_sparse_members_count_their_real_size_in_the_sample_budget(tmp_path):
    # 20 KB of plain tar: five sparse members of 900 MB, all holes, in one sample. Every path
    # read it whole (peak 4.7 GB): the budget never counted a sparse member's real size, which
    # now counts always (plain shards too: the bytes on disk say nothing of it), before the
    # member is expanded.
    shard = sparse_bomb(tmp_path, [900 * MiB] * 5)
    rc, out, peak = run_limited(SPARSE.format(url=str(shard)), 3 * GiB)
    assert rc == 0, out
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line[:1].isalpha())
    for what in ("plain", "gz", "access", "index"):
        assert lines[what].startswith("SampleTooLargeError: sample 'k' holds more than "), out
        assert "max_sample_bytes=536,870,912" in lines[what] and "'k.f0.bin'" in lines[what]
    assert "max_sample_bytes=1,048,576" in lines["given"], out  # (given: the same)
    assert "'k.f0.bin'" in lines["given"] and "sparse member" in lines["given"], out
    assert peak < 400 * MB, peak


def test_a_sample_of_small_sparse_members_reads_and_counts_them_together(tmp_path):
    shard = sparse_bomb(tmp_path, [300 << 10, 300 << 10, 300 << 10], fmt="gnu")
    (sample,) = tarfile_samples_of(str(shard))
    assert [len(sample[f"f{i}.bin"]) for i in range(3)] == [300 << 10] * 3
    assert sample["cls"] == b"1\n"
    with pytest.raises(webds.SampleTooLargeError, match="'k.f2.bin'") as info:
        tarfile_samples_of(str(shard), max_sample_bytes=800 << 10)
    assert info.value.key == "k"


def tarfile_samples_of(url, **kw):
    from webds.tar.samples import tarfile_samples

    return list(tarfile_samples(iter([{"url": url}]), **kw))


def pax_named(names, sizes=None):
    """A pax tar (bytes) of zero-byte (or ``sizes``) members with these names."""
    import io

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for i, name in enumerate(names):
            info = tarfile.TarInfo(name)
            info.size = sizes[i] if sizes else 0
            tf.addfile(info, io.BytesIO(bytes(info.size)))
    return out.getvalue()


def test_member_names_count_in_the_sample_budget(tmp_path):
    # 20 members of one sample, each named by a 60 KB pax path and holding nothing: the names
    # (1.2 MB) are held with the sample, and now count in its budget.
    names = [f"k.f{i:02d}." + "n" * 60000 for i in range(20)]
    for suffix, data in ((".tar", pax_named(names)), (".tar.gz", gzip.compress(pax_named(names)))):
        url = str(tmp_path / ("names" + suffix))
        open(url, "wb").write(data)
        with pytest.raises(webds.SampleTooLargeError, match="max_sample_bytes=1,048,576") as info:
            tarfile_samples_of(url, max_sample_bytes=1 << 20)
        assert info.value.member.startswith("k.f17.")  # 18 names of 60 KB: past 1 MiB
    # Without a budget, a plain tar reads them (its names are bytes on disk).
    (sample,) = tarfile_samples_of(url[: -len(".gz")])
    assert len([k for k in sample if k[0] != "_"]) == 20


def test_a_member_name_over_64_kib_is_refused_naming_shard_and_offset(tmp_path):
    url = str(tmp_path / "long.tar")
    open(url, "wb").write(pax_named(["a.cls", "k." + "n" * (64 << 10)], [1, 0]))
    with pytest.raises(webds.ShardReadError, match=r"member name of 65,538 characters") as info:
        tarfile_samples_of(url)
    assert info.value.url == url and info.value.offset == 1024  # its pax header's
    assert len(str(info.value)) < 1000  # (the name is cut in the message)
    ok = str(tmp_path / "ok.tar")
    open(ok, "wb").write(pax_named(["k." + "n" * 60000]))
    assert len(tarfile_samples_of(ok)) == 1


def pax_path_bomb(path, members, name_size):
    """A .tar.gz of one sample of ``members`` empty members, each named by a pax ``path`` of
    ``name_size`` bytes (mostly NULs: gzip makes 60 MB of them 60 KB; built in well under a
    second, the NULs compressed once)."""
    zeros = gzip.compress(bytes(name_size - 12), 1)
    parts = []
    for i in range(members):
        value = b"k.f%02d.bin" % i
        body = len(b" path=" + value) + name_size - 12 + 1  # (its length: b" path=" ... b"\n")
        n = body + len(str(body))
        n = body + len(str(n))
        info = tarfile.TarInfo("PaxHeader")
        info.type, info.size = tarfile.XHDTYPE, n
        head = info.tobuf(tarfile.USTAR_FORMAT) + (b"%d path=" % n) + value
        plain = tarfile.TarInfo("k.bin").tobuf(tarfile.USTAR_FORMAT)
        parts += [gzip.compress(head), zeros, gzip.compress(b"\n" + bytes(-n % 512) + plain)]
    parts.append(gzip.compress(bytes(1024)))
    path.write_bytes(b"".join(parts))
    return str(path)


def test_twenty_60mb_pax_names_in_a_tar_gz_are_refused_at_the_first(tmp_path):
    # 1.2 MB of .tar.gz read with no error at a peak of 1.66 GB; now the first name is refused
    # (over 64 KiB), after the one 60 MB extended header it came in.
    url = pax_path_bomb(tmp_path / "names.tar.gz", 20, 60 * MB)
    rc, out, peak = run_limited(READ.format(url=url, args=""), 3 * GiB)
    assert rc == 0, out
    assert "ShardReadError: member name of 59,999,997 characters, more than the 65,536" in out
    assert "names.tar.gz', byte offset 0]" in out, out
    assert peak < 400 * MB, peak


class _Sized:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def test_a_chunked_sampler_of_1e9_indices_holds_one_chunk(tmp_path):
    code = """
import webds
s = webds.ChunkedSampler(Sized(10**9), chunksize=1000, seed=1)
it = iter(s)
first = [next(it) for _ in range(3000)]
print("len", len(s), len(set(first)))
d = webds.DistributedChunkedSampler(Sized(10**9 + 1), num_replicas=4, rank=0, seed=1)
print("dlen", len(d), next(iter(d)) >= 0)
"""
    sized = "class Sized:\n    def __init__(self, n): self.n = n\n"
    code = sized + "    def __len__(self): return self.n\n" + code
    rc, out, peak = run_limited(code, 1 * GiB)
    assert rc == 0, out  # it allocated the whole order: MemoryError
    assert "len 1000000000 3000" in out and "dlen 250000001 True" in out, out
    assert peak < 600 * MB, peak
    # The lazy order is the list's (the order the tests of access compare).
    from webds.shards.samplers import chunked_order

    small = webds.ChunkedSampler(_Sized(10007), chunksize=100, seed=5)
    small.set_epoch(3)
    assert list(small) == chunked_order([10007], 100, True, 5, 3) and len(small) == 10007
    dist = [
        list(webds.DistributedChunkedSampler(_Sized(10), num_replicas=4, rank=r, chunksize=3))
        for r in range(4)
    ]
    order = chunked_order([10], 3, True, 0, 0)
    assert sum(dist, []) == order + order[:2]


def test_an_index_count_is_checked_against_the_uncompressed_shard_size(tmp_path):
    # A real index of a 21,504-byte tar, edited to samples=10**9 (offsets removed): it loaded
    # (len 10**9) and the sampler hit MemoryError. A tar holds at most size/512 samples, and
    # ShardListDataset reads only uncompressed tars.
    url = str(tmp_path / "a.tar")
    with webds.TarWriter(url) as w:
        for i in range(10):
            w.write({"__key__": f"{i:04d}", "cls": b"1"})
    size = len(open(url, "rb").read())
    index = tmp_path / "index.json"
    doc = {"format": "webds-shard-index", "version": 1}
    doc["shards"] = [{"url": url, "samples": 10**9, "bytes": size}]
    index.write_text(json.dumps(doc))
    with pytest.raises(webds.ArgumentError, match=f"'samples': 1000000000, more than its {size:,}"):
        webds.ShardListDataset(str(index))
    # Without 'bytes', the count is checked against the file when the shard is first opened.
    doc["shards"] = [{"url": url, "samples": 10**9}]
    index.write_text(json.dumps(doc))
    ds = webds.ShardListDataset(str(index))
    with pytest.raises(
        webds.ShardReadError, match="too small for the 1000000000 samples the index says"
    ):
        ds[5]
    doc["shards"] = [{"url": url, "samples": 10}]
    index.write_text(json.dumps(doc))
    assert webds.ShardListDataset(str(index))[9]["cls"] == b"1"
