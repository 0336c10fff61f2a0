"""Runs of samples (webds.base.runs) change nothing but speed: a pipeline gives with runs what it
gives without them, item for item, the same error after the same items, the same checkpoint
after every item (seeded or not, with an index or not), on random shards (mostly samples alike,
now and then one that is not: other fields, a field twice, metadata, a name without a dot, a
large member, a label that is not a number, a JSON null) through random chains of stages, some
that take runs and some that do not, some that drop items, with error handlers that raise and
that skip, in one process and in 1-3 DataLoader workers; on shards cut at every block boundary
or with a flipped byte, and over a server that cuts its bodies. And runs are really used where
they can be, and a handler of yours never sees a field twice."""

from __future__ import annotations

import itertools
import json
import random
import tarfile
from pathlib import Path
from typing import Any, Callable, List, Tuple

import numpy as np
import pytest
import torch
from conftest import write_tar
from test_access import tarfile_shard
from test_resume import assert_exact

import webds
from webds import pipeline as pipeline_module
from webds.base import runs as runs_module
from webds.shards.index import ShardIndex
from webds.stages.decode import Decoder
from webds.tar import bulk

# (the skipping handler's warnings, one per sample skipped: what is compared is what is read)
pytestmark = pytest.mark.filterwarnings("ignore:webds. skipping:UserWarning")


def without_runs(monkeypatch: Any) -> None:
    monkeypatch.setattr(pipeline_module, "runs_span", lambda stages: (-1, -1))


def shard(path: Path, rng: random.Random, k: int) -> str:
    """A shard of samples alike (bin, cls, maybe txt/json), now and then one that is not."""
    layout = rng.choice([["bin", "cls"], ["cls", "bin", "txt"], ["json", "cls"], ["bin"]])
    members: List[Tuple[str, bytes]] = []
    for j in range(rng.randint(0, 120)):
        key = f"s{k}-{j:04d}"
        exts = list(layout)
        odd = rng.random()
        if odd < 0.03:
            exts = exts[:-1] or ["txt"]  # fewer fields
        elif odd < 0.05:
            exts = exts + ["seg.png"]  # more
        elif odd < 0.06:
            exts = exts + [exts[0]]  # a field twice
        elif odd < 0.07:
            exts = [e.upper() for e in exts]  # the same fields, lower-cased
        for ext in exts:
            if ext.lower() == "cls":
                data = str(j).encode() if rng.random() > 0.02 else b"not a number"
            elif ext == "json":
                data = rng.choice([b"null", b'{"a": 1}', b"[1, 2]"])
            elif ext == "txt":
                data = f"caf\u00e9 {j}".encode()
            else:
                size = rng.choice([0, 1, 100, 700, 1500]) if rng.random() > 0.02 else 40_000
                data = rng.randbytes(size)
            members.append((f"{key}.{ext}", data))
        if rng.random() < 0.02:
            members.append(("__meta__", b"{}"))
        if rng.random() < 0.02:
            members.append((f"s{k}-README", b"no extension"))
    out = path / f"shard-{k}.tar"
    if rng.random() < 0.3:  # as webdataset writes them: tarfile_shard(out, members, PAX, rng)
        out.write_bytes(tarfile_bytes(members, [1795639586 + rng.random() for _ in members]))
    else:  # write_tar(out, members)
        out.write_bytes(tarfile_bytes(members))
    return str(out)


def _header(name: bytes, size: int, mtime: int, mode: int, kind: bytes) -> bytes:
    """The ustar header Python's tarfile writes for a member (or a pax header: kind b"x")."""
    head = b"".join([name.ljust(100, b"\0"), b"%07o\0" % mode, b"0000000\0" * 2,
                     b"%011o\0" % size, b"%011o\0" % mtime, b" " * 8, kind, bytes(100),
                     b"ustar\x0000", bytes(32 + 32 + 8 + 8 + 155 + 12)])  # fmt: skip
    return head[:148] + b"%06o\0" % sum(head) + head[155:]


def tarfile_bytes(members: List[Tuple[str, bytes]], pax_mtimes: Any = None) -> bytes:
    """The bytes write_tar(path, members) writes (tarfile, ustar, mtime 1_600_000_000), or with
    ``pax_mtimes``, tarfile_shard(path, members, PAX_FORMAT, rng) with those float mtimes (a pax
    header before each member), five times faster than tarfile builds them (checked equal below:
    the shards are tarfile's, byte for byte). Names of at most 100 ASCII bytes."""
    out = []
    for i, (name, data) in enumerate(members):
        mtime = 1_600_000_000
        if pax_mtimes is not None:
            value = str(pax_mtimes[i]).encode()
            n, p = 0, -1  # "NN mtime=" + value + "\n", NN its length (its own digits too)
            while n != p:
                n, p = len(value) + 8 + len(str(n)), n
            record = b"%d mtime=%s\n" % (n, value)
            assert len(record) == n
            out += [_header(b"././@PaxHeader", n, 0, 0, b"x"), record, bytes(-n % 512)]
            mtime = round(pax_mtimes[i])
        raw = name.encode("ascii")
        assert len(raw) <= 100
        out += [_header(raw, len(data), mtime, 0o644, b"0"), data, bytes(-len(data) % 512)]
    body = b"".join(out) + bytes(1024)
    return body + bytes(-len(body) % tarfile.RECORDSIZE)


@pytest.fixture(autouse=True, scope="module")
def _tarfile_bytes_are_tarfiles(tmp_path_factory: Any) -> None:
    """tarfile_bytes writes what tarfile writes (sizes at the block edges, the names shard()
    gives, the longest), or no test of this module runs."""
    folder = tmp_path_factory.mktemp("writers")
    rng = random.Random(3)
    for size in (0, 1, 511, 512, 513, 40_000):
        names = ["a.bin", "__meta__", "s1-README", "s0-0001.SEG.PNG", "x" * 96 + ".cls"]
        members = [(n, rng.randbytes(size)) for n in names]
        write_tar(folder / "w.tar", members)
        assert tarfile_bytes(members) == (folder / "w.tar").read_bytes()
        state = rng.getstate()
        tarfile_shard(folder / "p.tar", members, tarfile.PAX_FORMAT, rng)
        rng.setstate(state)
        mtimes = [1795639586 + rng.random() for _ in members]
        assert tarfile_bytes(members, mtimes) == (folder / "p.tar").read_bytes()


def plain(x: Any) -> Any:
    """An item in comparable form (tensors and arrays as lists)."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return ("array", x.tolist())
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(plain(v) for v in x)
    return x


def outcome(items: Any, most: int = 10_000) -> Tuple[List[Any], Any]:
    got: List[Any] = []
    try:
        for item in itertools.islice(items, most):
            got.append(plain(item))
    except Exception as exn:
        return got, (type(exn).__name__, str(exn))
    return got, None


def key_of(s: Any) -> Any:
    return s["__key__"] if isinstance(s, dict) else s


#: Stages to chain: (name, stage, whether it takes runs).
CHOICES: List[Tuple[str, Callable[[Any], Any]]] = [
    ("decode", lambda ds, h: ds.decode(handler=h)),
    ("decode-only", lambda ds, h: ds.decode(only="cls", handler=h)),
    ("decode-threads", lambda ds, h: ds.decode(handler=h, threads=2)),
    ("to_tuple", lambda ds, h: ds.to_tuple("bin;json", "cls", handler=h)),
    ("to_tuple-missing", lambda ds, h: ds.to_tuple("txt", "bin", missing_is_error=False)),
    ("to_tuple-key", lambda ds, h: ds.to_tuple("__key__", "cls;CLS", handler=h)),
    ("map", lambda ds, h: ds.map(lambda s: s, handler=h)),
    ("rename", lambda ds, h: ds.rename(label="cls", handler=h)),
    ("select", lambda ds, h: ds.select(lambda s: len(repr(s)) % 3 != 0)),  # drops some
    ("shuffle", lambda ds, h: ds.shuffle(7)),
    ("batched", lambda ds, h: ds.batched(5, collation_fn=list)),
]


def random_pipeline(urls: List[str], rng: random.Random) -> Callable[[], Any]:
    chosen = [rng.choice(CHOICES) for _ in range(rng.randint(0, 4))]
    if chosen and rng.random() < 0.7:  # mostly a stage that takes runs first
        chosen[0] = rng.choice(CHOICES[:6])
    handler = rng.choice([webds.reraise_exception, webds.warn_and_continue])
    shardshuffle = rng.random() < 0.5
    local = rng.random() < 0.2
    check = rng.random() < 0.5  # (with it, a stage that takes runs after the reader)
    # Unseeded where nothing is drawn; an index now and then (its plan: no runs, same items).
    seed = 3 if shardshuffle or any(name == "shuffle" for name, _ in chosen) else None
    source: Any = urls
    if rng.random() < 0.5:
        try:
            index = ShardIndex.build(urls)
        except webds.WebdsError:
            pass  # (a sample with a field twice: the index refuses the shard)
        else:
            source = str(Path(urls[0]).parent / "index.json")
            index.save(source)

    def make() -> Any:
        ds = webds.WebDataset(source, shardshuffle=shardshuffle, seed=seed, empty_check=check,
                              handler=handler)  # fmt: skip
        if local:
            ds = webds.DataPipeline(
                webds.SimpleShardList(urls), webds.tarfile_to_samples(handler=handler)
            )
            ds.seed = 3  # (the shuffle's draws, alike in both)
        for _, add in chosen:
            ds = add(ds, handler) if not local else ds.compose(*add(_Fluent(), handler).stages)
        return ds

    make.chosen = [name for name, _ in chosen]  # type: ignore[attr-defined]
    return make


class _Fluent:
    """Collects the stages a fluent call appends (to chain them onto a DataPipeline)."""

    def __init__(self) -> None:
        self.stages: List[Any] = []

    def __getattr__(self, name: str) -> Any:
        def add(*args: Any, **kw: Any) -> "_Fluent":
            self.stages.append(getattr(webds.filters, name)(*args, **kw))
            return self

        return add


@pytest.fixture(params=[None, 32768], ids=["chunks-4MiB", "chunks-32KiB"])
def chunks(request, monkeypatch):
    if request.param is not None:  # runs of a few samples, many cut by the chunks' ends
        monkeypatch.setattr(bulk, "_FIRST", request.param)
        monkeypatch.setattr(bulk, "_CHUNK", request.param)
        monkeypatch.setattr(bulk, "_SMALL", 4096)
    return request.param


def runs_made(monkeypatch: Any) -> List[int]:
    """From now on, the sample count of every run made."""
    made: List[int] = []
    real = runs_module.Run.__init__

    def spy(self: Any, columns: Any, rows: Any, count: int, *args: Any) -> None:
        made.append(count)
        real(self, columns, rows, count, *args)

    monkeypatch.setattr(runs_module.Run, "__init__", spy)
    return made


#: A random case compares at least this many items, and its pipeline used runs.
MOST_DRAWS, LEAST_ITEMS = 50, 5


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """The shards the random cases drew, kept for the module: a case draws the same ones with
    either chunk size (its rng in the same state), so each is written once. A folder, and
    {rng state before a draw: (its urls, the rng state after it)}."""
    return tmp_path_factory.mktemp("drawn"), {}


def draw_shards(drawn: Any, rng: random.Random) -> List[str]:
    """1-3 random shards in a folder of their own; drawn before (the rng in this state), those
    same files, the rng left as writing them leaves it."""
    root, seen = drawn
    before = rng.getstate()
    if before in seen:
        urls, after = seen[before]
        rng.setstate(after)
        return urls
    folder = root / f"draw-{rng.random()}"
    folder.mkdir()
    urls = [shard(folder, rng, k) for k in range(rng.randint(1, 3))]
    seen[before] = urls, rng.getstate()
    return urls


@pytest.mark.parametrize("case", range(60))
def test_random_pipelines_give_alike_with_and_without_runs(drawn, monkeypatch, chunks, case):
    """Not vacuous: each case draws shards and a pipeline until the pipeline used runs and
    gave at least LEAST_ITEMS items (a chain of two decodes gives none: its second fails on
    every sample), then compares them with the same pipeline's items without runs."""
    rng = random.Random(case)
    made = runs_made(monkeypatch)
    for _ in range(MOST_DRAWS):
        urls = draw_shards(drawn, rng)
        make = random_pipeline(urls, rng)
        made.clear()
        with_runs = outcome(iter(make()))
        if made and len(with_runs[0]) >= LEAST_ITEMS:
            break
    else:
        pytest.fail(f"no pipeline with runs and {LEAST_ITEMS} items in {MOST_DRAWS} draws")
    with monkeypatch.context() as m:
        without_runs(m)
        made.clear()
        assert outcome(iter(make())) == with_runs, make.chosen
        assert not made


@pytest.mark.parametrize("case", range(12))
def test_checkpoints_alike_after_every_item(tmp_path, monkeypatch, case):
    """The state after each item is the one the pipeline without runs has after it."""
    rng = random.Random(100 + case)
    urls = [shard(tmp_path, rng, k) for k in range(rng.randint(1, 3))]
    make = random_pipeline(urls, rng)

    def states() -> List[Any]:
        ds = make()
        out = []
        try:
            for _ in ds:
                state = ds.state_dict(strict=False)
                state.pop("entropy")  # (drawn once per pipeline object; so is an unset seed)
                if state["config"]["seed"] is None:
                    state.pop("seed")
                out.append(json.dumps(state, sort_keys=True))
        except Exception as exn:
            out.append(type(exn).__name__)
        return out

    with_runs = states()
    with monkeypatch.context() as m:
        without_runs(m)
        assert states() == with_runs, make.chosen


@pytest.mark.parametrize("k", [0, 1, 4, 13, 40, 77])
def test_a_resume_from_inside_a_run_is_exact(tmp_path, k):
    """Saved mid-run and resumed: the rest of the epoch and the next one as uninterrupted, in
    one process, with a shuffle after the runs, across with_epoch's epochs, and in DataLoader
    workers."""
    urls = []
    for s in range(3):
        members = [(f"s{s}-{i:04d}.{ext}", str(i).encode()) for i in range(30)
                   for ext in ("bin", "cls")]  # fmt: skip
        urls.append(str(write_tar(tmp_path / f"r{s}.tar", members)))
    assert_exact(
        lambda: (
            webds.WebDataset(urls, shardshuffle=True, seed=5).decode().to_tuple("__key__", "cls")
        ),
        k,
    )
    assert_exact(
        lambda: (
            webds.WebDataset(urls, shardshuffle=True, seed=5)
            .decode()
            .to_tuple("__key__", "cls")
            .shuffle(9)
        ),
        k,
    )
    assert_exact(
        lambda: (
            webds.WebDataset(urls, shardshuffle=True, seed=5)
            .decode()
            .to_tuple("__key__", "cls")
            .with_epoch(37)
        ),
        k % 37,
    )
    assert_exact(
        lambda: webds.WebLoader(
            webds.WebDataset(urls, shardshuffle=True, seed=5).decode().to_tuple("__key__", "cls"),
            batch_size=None,
            num_workers=2,
        ),
        k,
    )


def test_runs_are_used_and_taken_apart_one_by_one(tmp_path, monkeypatch):
    """Not a vacuous comparison: decode and to_tuple get each chunk as one run."""
    members = [(f"{i:05d}.{ext}", str(i).encode()) for i in range(500) for ext in ("bin", "cls")]
    url = str(write_tar(tmp_path / "s.tar", members))
    seen: List[int] = []
    real = Decoder.over_run

    def over_run(self: Decoder, run: Any) -> Any:
        seen.append(run.count)
        return real(self, run)

    monkeypatch.setattr(Decoder, "over_run", over_run)
    got = list(webds.WebDataset(url).decode().to_tuple("__key__", "cls"))
    assert got == [(f"{i:05d}", i) for i in range(500)]
    # Every sample but the last (which the member reader ends), in two runs: the first read's
    # (64 KiB) and the next chunk's.
    assert sum(seen) == 499 and len(seen) == 2
    assert all(type(x) is tuple for x in got)


def test_a_handler_of_yours_sees_each_field_once(tmp_path, monkeypatch):
    """A decoder handler of yours is called sample by sample, once per field, even where a
    column of webds's own fails (a label that is not a number) and the run is replayed."""
    members = []
    for i in range(200):
        members += [(f"{i:04d}.foo", b"x"), (f"{i:04d}.cls", b"7" if i != 150 else b"seven")]
    url = str(write_tar(tmp_path / "s.tar", members))
    calls: List[bytes] = []

    def foo(data: bytes) -> str:
        calls.append(data)
        return "foo"

    ds = webds.WebDataset(url).decode(webds.handle_extension("foo", foo),
                                      handler=webds.warn_and_continue)  # fmt: skip
    with pytest.warns(UserWarning):
        got = list(ds.to_tuple("foo", "cls"))
    assert len(got) == 199 and len(calls) == 200


def test_a_failing_column_meets_its_error_where_samples_would(tmp_path):
    members = []
    for i in range(100):
        members += [(f"{i:04d}.bin", b"b"), (f"{i:04d}.cls", b"1" if i != 42 else b"x")]
    url = str(write_tar(tmp_path / "s.tar", members))
    ds = webds.WebDataset(url).decode().to_tuple("__key__", "cls")
    got = []
    with pytest.raises(webds.DecodeError, match=r"0042\.cls"):
        for item in ds:
            got.append(item)
    assert got == [(f"{i:04d}", 1) for i in range(42)]


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_workers_read_alike_with_and_without_runs(tmp_path, monkeypatch, workers):
    rng = random.Random(5)
    urls = [shard(tmp_path, rng, k) for k in range(4)]

    def read() -> Any:
        ds = webds.WebDataset(urls, handler=webds.warn_and_continue, empty_check=False)
        ds = ds.decode(handler=webds.warn_and_continue).to_tuple(
            "__key__", "cls;CLS", handler=webds.warn_and_continue
        )
        loader = webds.WebLoader(ds, batch_size=None, num_workers=workers)
        return sorted(map(tuple, (plain(x) for x in loader)))

    with_runs = read()
    with monkeypatch.context() as m:
        without_runs(m)
        assert read() == with_runs
    assert len(with_runs) > 50


def test_a_run_is_never_seen_outside_the_stages_that_take_them(tmp_path):
    members = [(f"{i:05d}.{ext}", b"1") for i in range(300) for ext in ("bin", "cls")]
    url = str(write_tar(tmp_path / "s.tar", members))
    seen = []

    def look(src: Any) -> Any:
        for x in src:
            seen.append(type(x))
            yield x

    ds = webds.WebDataset(url).decode().compose(webds.stateless(look)).to_tuple("bin", "cls")
    assert len(list(ds)) == 300
    assert set(seen) == {dict} and runs_module.Run not in seen


def test_every_default_decoder_gives_alike_in_columns(tmp_path, monkeypatch):
    """Each extension the default decoder knows, decoded in columns as sample by sample: a JSON
    null stays bytes, arrays come out as arrays."""
    import io

    members = []
    for i in range(120):
        array = io.BytesIO()
        np.save(array, np.arange(i % 5))
        fields = {
            "cls": b"%d" % i,
            "id": b" 7\n",
            "txt": "caf\u00e9".encode(),
            "json": b"null" if i % 3 == 0 else b'{"i": %d}' % i,
            "npy": array.getvalue(),
            "bin": b"\x00\x01",
            "seg.png": b"not decoded",
        }
        members += [(f"{i:04d}.{ext}", data) for ext, data in fields.items()]
    url = str(write_tar(tmp_path / "s.tar", members))
    decoded = []
    real = Decoder.over_run

    def over_run(self: Decoder, run: Any) -> Any:
        done = real(self, run)
        decoded.append(done is not None)
        return done

    monkeypatch.setattr(Decoder, "over_run", over_run)
    with_runs = outcome(iter(webds.WebDataset(url).decode()))
    assert decoded and all(decoded)
    with monkeypatch.context() as m:
        without_runs(m)
        assert outcome(iter(webds.WebDataset(url).decode())) == with_runs
    assert with_runs[1] is None and len(with_runs[0]) == 120
    assert with_runs[0][3]["json"] == b"null" and with_runs[0][4]["json"] == {"i": 4}


#: Labels and texts at the edges of what int() and a strict UTF-8 decode take: a column of
#: them goes through int and bytes.decode at once, or fails and is taken sample by sample.
_LABELS = [b"7", b" -3\n", b"+0", b"1_000", b"\xd9\xa3", b"", b"x", b"0x1f", b"\x00", b"9" * 40]
_TEXTS = ["caf\u00e9".encode(), b"", b"\xef\xbb\xbfbom", b"\xff\xfe", b"\xed\xa0\x80", b"a\x00b"]


@pytest.mark.parametrize("handler", ["reraise", "skip"])
@pytest.mark.parametrize("odd", range(len(_LABELS) + len(_TEXTS)))
def test_labels_and_texts_at_the_edges_decode_alike_in_columns(tmp_path, monkeypatch, handler, odd):
    """One label or text at an edge of int() or UTF-8 (a sign, an underscore, a non-ASCII
    digit, an empty field, a BOM, bytes a strict decode refuses) in the 43rd sample of runs of
    good ones: with runs as without, item for item, then the same error or the same skip."""
    labels = _LABELS[odd] if odd < len(_LABELS) else b"1"
    text = _TEXTS[odd - len(_LABELS)] if odd >= len(_LABELS) else b"t"
    members = []
    for i in range(100):
        members += [
            (f"{i:04d}.cls", labels if i == 42 else b"%d" % i),
            (f"{i:04d}.txt", text if i == 42 else b"t%d" % i),
        ]
    url = str(write_tar(tmp_path / "s.tar", members))
    how = webds.reraise_exception if handler == "reraise" else webds.ignore_and_continue

    def read() -> Any:
        ds = webds.WebDataset(url).decode(handler=how).to_tuple("__key__", "cls", "txt")
        return outcome(iter(ds))

    with_runs = read()
    with monkeypatch.context() as m:
        without_runs(m)
        assert read() == with_runs
    items, error = with_runs
    if handler == "skip":
        assert error is None and len(items) in (99, 100)
    else:
        assert len(items) == (100 if error is None else 42)


@pytest.mark.parametrize("damage", ["cut", "flip"])
def test_damaged_shards_read_alike_with_and_without_runs(tmp_path, monkeypatch, damage):
    """A shard cut at every 512-byte boundary, or with a byte flipped in each block in turn:
    the same samples, then the same error, with runs and without (32 KiB chunks, so that runs
    come before the damage)."""
    monkeypatch.setattr(bulk, "_FIRST", 32768)
    monkeypatch.setattr(bulk, "_CHUNK", 32768)
    monkeypatch.setattr(bulk, "_SMALL", 4096)
    members = [(f"{i:04d}.{ext}", b"%d" % i * (i % 7)) for i in range(60) for ext in ("bin", "cls")]
    data = write_tar(tmp_path / "whole.tar", members).read_bytes()
    used = []
    real = bulk._run

    def watched(*args: Any) -> Any:
        run = real(*args)
        used.append(run is not None)
        return run

    monkeypatch.setattr(bulk, "_run", watched)
    for at in range(0, len(data), 512):
        broken = bytearray(data[:at] if damage == "cut" else data)
        if damage == "flip":
            broken[at + 148] ^= 0x10  # a header's checksum, or a byte of data
        path = tmp_path / "s.tar"
        path.write_bytes(bytes(broken))
        with_runs = outcome(iter(webds.WebDataset(str(path)).decode().to_tuple("__key__", "cls")))
        with monkeypatch.context() as m:
            without_runs(m)
            alone = outcome(iter(webds.WebDataset(str(path)).decode().to_tuple("__key__", "cls")))
        assert alone == with_runs, at
    assert any(used)


def test_a_server_that_cuts_its_bodies_reads_alike_with_runs(flaky_http_server):
    """Remote shards whose bodies the server closes mid-way (ranged resumes), decoded in runs:
    what the local copies give without runs."""
    urls, local = [], []
    for s in range(2):
        members = [(f"s{s}-{i:04d}.{ext}", b"%d" % i) for i in range(300) for ext in ("bin", "cls")]
        path = write_tar(flaky_http_server.root / f"h{s}.tar", members)
        urls.append(flaky_http_server.url(path.name))
        local.append(str(path))
    flaky_http_server.cut_each([7_000, 90_000, 3_000])
    fast = {"retry_backoff": 0.01}  # (the default waits half a second and more before a resume)
    ds = webds.WebDataset(urls, readahead=False, storage_options=fast)
    got = list(ds.decode().to_tuple("__key__", "cls"))
    assert flaky_http_server.faults_left["cut"] == 0  # every cut was met
    with pytest.MonkeyPatch.context() as m:
        without_runs(m)
        want = list(webds.WebDataset(local).decode().to_tuple("__key__", "cls"))
    assert got == want and len(got) == 600


def test_samples_of_a_run_are_the_dicts_zip_would_make_in_the_same_field_order():
    """A run's samples as dicts (a dict display written out for the field count) are the dicts
    ``dict(zip(names, row))`` makes, their fields in the same order, for every field count (past
    the written-out ones too) and for names that would break code if they were part of it."""
    rng = random.Random(7)
    odd = ["'", '"', "}", "{k0: v0}", "\n", "rows", "k0", "v1", "__key__", "é.jpg", "a b", ""]
    for _ in range(300):
        n = rng.randint(1, 20)
        names = rng.sample(odd + [f"f{i}" for i in range(20)], n)
        count = rng.randint(0, 5)
        columns = {name: [rng.random() for _ in range(count)] for name in names}
        got = runs_module._dicts(columns)
        want = [dict(zip(names, row)) for row in zip(*columns.values())]
        assert got == want
        assert [list(d) for d in got] == [names] * count


def test_run_samples_keep_the_shards_field_order(tmp_path, monkeypatch):
    """Through the pipeline, a sample read in a run has its fields in the order the member
    reader gives them (the shard's order, after the reader's own)."""
    members = [
        (f"{i:05d}.{ext}", str(i).encode()) for i in range(300) for ext in ("txt", "cls", "bin")
    ]
    url = str(write_tar(tmp_path / "s.tar", members))
    with_runs = [list(s) for s in webds.WebDataset(url).decode()]
    without_runs(monkeypatch)
    assert with_runs == [list(s) for s in webds.WebDataset(url).decode()]
    assert with_runs[0][-3:] == ["txt", "cls", "bin"]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("fields", [3, 20])
def test_run_samples_keep_the_field_order_through_workers_and_past_the_written_out(
    tmp_path, monkeypatch, workers, fields
):
    """One step off the above: samples with more fields than the written-out dict displays
    take (20 + the reader's), and samples that cross DataLoader workers, keep the order too."""
    exts = [f"f{j:02d}" for j in reversed(range(fields))]
    urls = []
    for k in range(2):  # (two shards: one for each worker)
        members = [(f"{i:05d}.{e}", b"%d" % i) for i in range(k, 300, 2) for e in exts]
        urls.append(str(write_tar(tmp_path / f"s{k}.tar", members)))

    def read() -> List[Any]:
        ds = webds.WebDataset(urls, shardshuffle=False)
        loader = webds.WebLoader(ds, batch_size=None, num_workers=workers)
        return sorted(([s["__key__"]] + list(s) for s in loader), key=lambda x: x[0])

    with_runs = read()
    without_runs(monkeypatch)
    assert with_runs == read()
    assert len(with_runs) == 300 and with_runs[0][-fields:] == exts
