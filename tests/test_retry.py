"""Retries with resume (webds.io.retrying) against real HTTP servers on loopback.

The fault-injecting server cuts responses after N body bytes (promising the full
Content-Length) or answers with an error status; the samples read through it must equal the
local read exactly, and the retry counts must be what the injected faults imply.
"""

from __future__ import annotations

import io
import logging
import random
import socket
import tarfile
import threading
from pathlib import Path
from typing import Any, Dict, List, Tuple
from urllib.request import Request, urlopen

import pytest
from conftest import write_tar
from hypothesis import given, settings
from hypothesis import strategies as st
from servers import LOOPBACK, free_port

from webds.errors import OpenError, ShardReadError
from webds.fluent import WebDataset
from webds.io.remote import open_resumable, resumable_fsspec
from webds.io.retrying import Backoff, ResumableStream, is_transient
from webds.io.urls import SCHEMES, open_url
from webds.tar.reader import read_members

FAST = Backoff(initial=0.001, maximum=0.005)


# ---------------------------------------------------------------------------------------------
# Shards and helpers


def _members(shard: int, n: int = 40) -> List[Tuple[str, bytes]]:
    rng = random.Random(shard)
    out = []
    for i in range(n):
        key = f"s{shard}-{i:04d}"
        out.append((f"{key}.bin", rng.randbytes(rng.randrange(100, 3000))))
        out.append((f"{key}.cls", str(i).encode()))
    return out


@pytest.fixture
def shards(flaky_http_server: Any) -> Dict[str, Any]:
    """Three shards served by the flaky server, and their local copies."""
    names = [f"shard-{i}.tar" for i in range(3)]
    for i, name in enumerate(names):
        write_tar(flaky_http_server.root / name, _members(i))
    return {
        "server": flaky_http_server,
        "names": names,
        "urls": [flaky_http_server.url(n) for n in names],
        "local": [str(flaky_http_server.root / n) for n in names],
    }


def _samples(urls: List[str]) -> List[Tuple[str, Dict[str, bytes]]]:
    """(key, {ext: bytes}) of every sample, in order: what a reader must see. One shard at a
    time (no read-ahead): the server's faults are armed for the next request, whichever it is."""
    out = []
    for sample in WebDataset(urls, shardshuffle=False, readahead=False):
        fields = {k: v for k, v in sample.items() if not k.startswith("__")}
        out.append((sample["__key__"], fields))
    return out


def _layout(path: Path) -> List[Tuple[str, int, int, int]]:
    """(name, header offset, data offset, size) of each member, from Python's tarfile."""
    with tarfile.open(path) as tf:
        return [(m.name, m.offset, m.offset_data, m.size) for m in tf.getmembers()]


def _inside_header(path: Path, index: int, into: int = 100) -> int:
    name, header, data, size = _layout(path)[index]
    assert data - header == 512 and 0 < into < 512
    return header + into


def _inside_data(path: Path, index: int) -> int:
    name, header, data, size = _layout(path)[index]
    assert size > 2
    return data + size // 2


class Opener:
    """A ``SCHEMES`` handler: opens http URLs with open_resumable and keeps every stream.

    ``before_open(url)`` / ``after_open(url)`` arm the server's faults for that shard.
    """

    def __init__(
        self, retries: int = 5, before_open: Any = None, after_open: Any = None, **open_kwargs: Any
    ) -> None:
        self.retries = retries
        self.before_open = before_open
        self.after_open = after_open
        self.open_kwargs = open_kwargs
        self.streams: List[ResumableStream] = []

    def __call__(self, url: str, mode: str, bufsize: int, **storage_options: Any) -> Any:
        assert mode == "rb"
        if self.before_open:
            self.before_open(url)
        stream = open_resumable(
            url,
            retries=self.retries,
            backoff=FAST,
            open_kwargs=self.open_kwargs or None,
            **storage_options,
        )
        self.streams.append(stream)
        if self.after_open:
            self.after_open(url)
        return stream


@pytest.fixture
def register(monkeypatch: pytest.MonkeyPatch):
    """Route ``scheme://`` URLs (http by default) through an :class:`Opener` for the test."""

    def install(opener: Opener, scheme: str = "http") -> Opener:
        monkeypatch.setitem(SCHEMES, scheme, opener)
        return opener

    return install


def _retry_records(caplog: pytest.LogCaptureFixture) -> List[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "webds" and r.levelno == logging.WARNING and "retry" in r.getMessage()
    ]


# ---------------------------------------------------------------------------------------------
# WebDataset over the flaky server


def test_cut_connections_in_every_shard_lose_and_repeat_nothing(
    shards: Dict[str, Any], register: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = shards["server"]
    local = [Path(p) for p in shards["local"]]
    # Per shard, where the first GET of the shard is cut: inside the first header, inside the
    # data of member 4, inside the header of member 7. Three cuts per shard; each resumed GET
    # starts where the last complete read ended, so these are absolute positions too.
    cut_at = {
        shards["urls"][0]: _inside_header(local[0], 0, 100),
        shards["urls"][1]: _inside_data(local[1], 4),
        shards["urls"][2]: _inside_header(local[2], 7, 300),
    }
    armed: List[str] = []

    def arm(url: str) -> None:
        armed.append(url)
        server.cut_after(cut_at[url], times=3)

    caplog.set_level(logging.WARNING, logger="webds")
    opener = register(Opener(retries=5, after_open=arm))
    got = _samples(shards["urls"])

    assert got == _samples(shards["local"])
    assert len(got) == 3 * 40
    assert armed == shards["urls"]
    assert [s.retries for s in opener.streams] == [3, 3, 3]
    assert server.faults_left["cut"] == 0
    records = _retry_records(caplog)
    assert len(records) == 9
    for url in shards["urls"]:
        assert sum(url in r.getMessage() for r in records) == 3
    assert all("byte offset 0" in r.getMessage() for r in records)
    assert all("ClientPayloadError" in r.getMessage() for r in records)


def test_fsspec_resumes_mid_shard_with_a_ranged_request(flaky_http_server: Any) -> None:
    data = random.Random(5).randbytes(20_000)
    url = flaky_http_server.put("a.tar", data)
    stream = open_resumable(
        url, retries=5, backoff=FAST, open_kwargs={"block_size": 4096, "cache_type": "none"}
    )
    assert stream.read(1234) == data[:1234]
    flaky_http_server.cut_after(10, times=2)
    del flaky_http_server.log[:]
    rest = stream.read()
    assert data[:1234] + rest == data
    assert stream.retries == 2
    ranges = [r for method, _, r in flaky_http_server.log if method == "GET"]
    # Two cut GETs and the one that worked all start at the offset reached; then the rest.
    assert len(ranges) >= 3 and all(r.startswith("bytes=1234-") for r in ranges[:3])
    stream.close()


def test_503_then_success(
    shards: Dict[str, Any], register: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = shards["server"]

    def arm(url: str) -> None:
        # Armed once the stream is open, so the first ranged GET of the shard gets it.
        server.fail_with(503, times=1)

    caplog.set_level(logging.WARNING, logger="webds")
    opener = register(Opener(retries=5, after_open=arm))
    assert _samples(shards["urls"]) == _samples(shards["local"])
    assert [s.retries for s in opener.streams] == [1, 1, 1]
    records = _retry_records(caplog)
    assert len(records) == 3 and all("503" in r.getMessage() for r in records)


def test_503_while_opening_is_retried(shards: Dict[str, Any], register: Any) -> None:
    server = shards["server"]

    def arm(url: str) -> None:
        # fsspec asks HEAD, then GET, for the size: both failing is one failed open.
        server.fail_with(503, times=4)

    opener = register(Opener(retries=5, before_open=arm))
    assert _samples(shards["urls"]) == _samples(shards["local"])
    assert [s.retries for s in opener.streams] == [2, 2, 2]
    assert server.faults_left["fail"] == 0


def test_too_many_faults_raise_shard_read_error(shards: Dict[str, Any], register: Any) -> None:
    server = shards["server"]
    url = shards["urls"][0]
    opener = register(Opener(retries=3, after_open=lambda u: server.cut_after(50, times=100)))
    with pytest.raises(ShardReadError) as info:
        _samples([url])
    err = info.value
    assert err.url == url
    assert err.offset == 0
    assert "4 attempts" in str(err) and "3 retries" in str(err)
    assert url in str(err) and "byte offset 0" in str(err)
    assert opener.streams[0].retries == 3
    assert server.faults_left["cut"] == 100 - 4


def test_too_many_faults_mid_shard_name_the_offset(flaky_http_server: Any) -> None:
    url = flaky_http_server.put("a.tar", bytes(range(256)) * 100)
    stream = open_resumable(
        url, retries=2, backoff=FAST, open_kwargs={"block_size": 4096, "cache_type": "none"}
    )
    assert stream.read(1000) == bytes(range(256)) * 3 + bytes(range(232))
    flaky_http_server.fail_with(500, times=100)
    with pytest.raises(ShardReadError) as info:
        stream.read(1000)
    assert info.value.offset == 1000 and info.value.url == url
    assert "after 3 attempts" in str(info.value)
    assert stream.retries == 2
    stream.close()


@pytest.mark.parametrize("status", [404, 403])
def test_not_found_and_forbidden_are_not_retried(
    flaky_http_server: Any, register: Any, caplog: pytest.LogCaptureFixture, status: int
) -> None:
    server = flaky_http_server
    url = server.put("a.tar", b"x" * 1024)
    caplog.set_level(logging.WARNING, logger="webds")
    if status == 404:
        url = server.url("missing.tar")
    else:
        server.fail_with(403, times=100)
    register(Opener(retries=5))
    with pytest.raises(OpenError) as info:
        _samples([url])
    assert info.value.url == url
    assert ("not found" if status == 404 else "permission denied") in str(info.value)
    assert _retry_records(caplog) == []
    # fsspec's size lookup is one HEAD and one GET; no second attempt followed.
    assert server.requests == 2


def test_translate_names_errors_retrying_cannot_fix(http_server: Any) -> None:
    import fsspec

    url = http_server.url("nope.tar")

    def translate(exn: Exception) -> Exception:
        return OpenError(f"custom: {type(exn).__name__}", url=url)

    with pytest.raises(OpenError, match="custom: FileNotFoundError") as info:
        resumable_fsspec(fsspec.filesystem("http"), url, backoff=FAST, translate=translate)
    assert info.value.url == url


def test_missing_object_is_open_error_at_open(http_server: Any) -> None:
    with pytest.raises(OpenError):
        open_resumable(http_server.url("nope.tar"), retries=5, backoff=FAST)
    assert http_server.requests == 2


def test_s3_shards_read_through_resumable_streams(s3: Any, tmp_path: Path, register: Any) -> None:
    local = [write_tar(tmp_path / f"s-{i}.tar", _members(i, 10)) for i in range(2)]
    urls = [s3.put(p.name, p.read_bytes()) for p in local]
    opener = register(Opener(retries=3), "s3")
    got = []
    for sample in WebDataset(urls, shardshuffle=False, storage_options=s3.storage_options):
        got.append((sample["__key__"], {k: v for k, v in sample.items() if k[:2] != "__"}))
    assert got == _samples([str(p) for p in local])
    assert [s.size for s in opener.streams] == [p.stat().st_size for p in local]
    assert [s.retries for s in opener.streams] == [0, 0]


def test_refused_connection_is_retried_not_reported_missing() -> None:
    # fsspec's http backend reports "could not connect" as FileNotFoundError from the
    # connection error; that is a network fault to retry, not a missing object.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/a.tar"
    with pytest.raises(ShardReadError) as info:
        open_resumable(url, retries=2, backoff=FAST)
    assert "after 3 attempts" in str(info.value) and info.value.url == url


def test_attempts_are_counted_in_good_english(flaky_http_server: Any) -> None:
    url = flaky_http_server.put("a.tar", bytes(range(256)) * 100)
    flaky_http_server.fail_with(503, times=100)
    with pytest.raises(OpenError) as info:
        open_url(url, retries=0)
    assert str(info.value).endswith(f"(after 1 attempt) [shard {url!r}]")
    with pytest.raises(OpenError, match=r"\(after 2 attempts\)"):
        open_url(url, retries=1, retry_backoff=0.001)
    flaky_http_server.fail_with(503, times=0)
    for retries, words in ((0, "after 1 attempt (0 retries)"), (1, "after 2 attempts (1 retry)")):
        stream = open_resumable(
            url,
            retries=retries,
            backoff=FAST,
            open_kwargs={"block_size": 4096, "cache_type": "none"},
        )
        assert len(stream.read(1000)) == 1000
        flaky_http_server.fail_with(500, times=100)
        with pytest.raises(ShardReadError) as failed:
            stream.read(1000)
        assert words in str(failed.value)
        flaky_http_server.fail_with(500, times=0)
        stream.close()


# -- an unreachable endpoint -------------------------------------------------------------------
# s3fs's client (botocore) retries a failed connection itself, and s3fs retries a connection
# closed without an answer on top of that: webds adds no retries of its own until the server has
# answered once, or a wrong endpoint took a minute (6 x 5 connects) to be reported.


class HangUpServer:
    """A TCP server on loopback that reads each request's head, then closes the connection
    without answering; ``connections`` counts the connections it accepted."""

    def __init__(self) -> None:
        self._sock = socket.create_server((LOOPBACK, 0))
        self._sock.settimeout(0.05)  # so that the loop sees stop() soon
        self.endpoint = f"http://{LOOPBACK}:{self._sock.getsockname()[1]}"
        self.connections = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:  # the timeout
                continue
            self.connections += 1
            with conn:
                conn.settimeout(5)
                head = b""
                try:
                    while b"\r\n\r\n" not in head:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        head += chunk
                except OSError:
                    pass

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=10)
        self._sock.close()


@pytest.fixture
def hang_up_server() -> Any:
    server = HangUpServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("given_by", ["storage_options", "AWS_ENDPOINT_URL"])
def test_refused_s3_endpoint_fails_at_once_saying_what_to_check(
    s3: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, given_by: str
) -> None:
    # One botocore attempt (its own retries would only make the test slower), and webds's
    # backoff short, so that without the fix the test fails in seconds too.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    endpoint = f"http://{LOOPBACK}:{free_port()}"
    options: Dict[str, Any] = {"retry_backoff": 0.001}
    if given_by == "AWS_ENDPOINT_URL":
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    else:
        options["client_kwargs"] = {"endpoint_url": endpoint}
    url = f"s3://{s3.bucket}/a.tar"
    caplog.set_level(logging.WARNING, logger="webds")
    with pytest.raises(OpenError) as info:
        next(iter(WebDataset(url, storage_options=options)))
    message = str(info.value)
    assert info.value.url == url and url in message
    assert message.startswith(f"cannot connect to {endpoint} (ConnectionRefusedError")
    assert "'endpoint_url'" in message and "AWS_ENDPOINT_URL" in message and "network" in message
    # A refused connection is not retried. (Once, on a loaded CI machine, the first attempt
    # waited past the 30 s watchdog before it was refused, and that stall was retried: a
    # different cause, which the retry tests below cover.)
    refused = [r for r in _retry_records(caplog) if "ReadStalled" not in r.getMessage()]
    assert refused == []


def test_s3_server_hanging_up_gets_no_retries_on_top_of_the_clients(
    s3: Any,
    hang_up_server: HangUpServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    options = {"client_kwargs": {"endpoint_url": hang_up_server.endpoint}, "retry_backoff": 0.001}
    url = f"s3://{s3.bucket}/a.tar"
    caplog.set_level(logging.WARNING, logger="webds")
    # The clients' own attempts, with webds's retries turned off:
    with pytest.raises(OpenError, match="closed the connection without answering"):
        open_url(url, retries=0, **options)
    by_clients = hang_up_server.connections
    assert by_clients >= 1
    # With webds's default retries: not one connection more.
    with pytest.raises(OpenError) as info:
        open_url(url, **options)
    assert hang_up_server.connections == 2 * by_clients
    assert info.value.url == url and hang_up_server.endpoint in str(info.value)
    assert _retry_records(caplog) == []


def test_only_backends_that_retry_connections_themselves_get_no_connect_retries(
    s3: Any, gcs: Any, http_server: Any
) -> None:
    opened = [
        (open_url(s3.put("a.tar", b"s3"), **s3.storage_options), 0),
        (open_url(gcs.put("a.tar", b"gcs")), 0),
        (open_url(http_server.put("a.tar", b"http")), 5),  # fsspec's http: webds retries it
    ]
    for stream, connect_retries in opened:
        with stream:
            assert isinstance(stream, ResumableStream) and stream.max_retries == 5
            assert stream.connect_retries == connect_retries
            assert stream.read() in (b"s3", b"gcs", b"http")


def test_a_server_that_answered_once_is_retried_when_it_goes_away(flaky_http_server: Any) -> None:
    data = bytes(range(256)) * 100
    url = flaky_http_server.put("a.tar", data)
    served = _urllib_open_at(url)
    refused = _urllib_open_at(f"http://{LOOPBACK}:{free_port()}/a.tar")
    opens: List[int] = []

    def open_at(offset: int) -> Any:
        opens.append(offset)
        return refused(offset) if len(opens) in (2, 3) else served(offset)

    flaky_http_server.cut_after(1000)
    stream = ResumableStream(
        open_at, url=url, size=len(data), retries=5, backoff=FAST, connect_retries=0
    )
    assert stream.read() == data
    assert opens == [0, 1000, 1000, 1000] and stream.retries == 3


def test_connect_retries_bound_only_an_unreached_server() -> None:
    port = free_port()
    calls: List[int] = []

    def open_at(offset: int) -> Any:
        calls.append(offset)
        return socket.create_connection((LOOPBACK, port), timeout=5)  # refused

    with pytest.raises(ShardReadError, match=r"after 1 attempt \(0 retries\)"):
        ResumableStream(open_at, url="tcp://x", retries=3, backoff=0, connect_retries=0)
    assert calls == [0]
    with pytest.raises(ShardReadError, match=r"after 4 attempts \(3 retries\)"):
        ResumableStream(open_at, url="tcp://x", retries=3, backoff=0)
    assert len(calls) == 5
    with pytest.raises(ValueError, match="connect_retries"):
        ResumableStream(open_at, connect_retries=-1)


# ---------------------------------------------------------------------------------------------
# A streaming ranged open_at over urllib: cuts deliver part of a body, and a cut body ends
# without an error (http.client returns b"" early), so only the known size reveals it.


def _urllib_open_at(url: str):
    def open_at(offset: int) -> Any:
        resp = urlopen(Request(url, headers={"Range": f"bytes={offset}-"}), timeout=10)
        if offset and resp.status != 206:
            resp.close()
            raise OSError(f"server ignored the range request (status {resp.status})")
        return resp

    return open_at


def test_silently_truncated_bodies_are_detected_and_resumed(
    flaky_http_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = flaky_http_server
    path = write_tar(server.root / "a.tar", _members(7))
    url = server.url("a.tar")
    size = path.stat().st_size
    in_header = _inside_header(path, 5, 200)
    in_data = _inside_data(path, 12)
    first = in_header
    second = in_data - in_header  # the resumed GET starts at in_header

    caplog.set_level(logging.WARNING, logger="webds")
    server.cut_after(first, times=1)
    stream = ResumableStream(_urllib_open_at(url), url=url, size=size, retries=3, backoff=FAST)
    # The server took the first fault when it answered the first GET; arm the second for the
    # GET that resumes at ``in_header``.
    server.cut_after(second, times=1)
    got = [(name, data) for name, data, _ in read_members(stream, url)]
    with tarfile.open(path) as tf:
        expected = [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]
    assert got == expected
    assert stream.retries == 2
    offsets = [r.args[3] for r in _retry_records(caplog)]
    assert offsets == [in_header, in_data]
    assert stream.offset == size
    stream.close()


def test_non_seekable_source_says_it_cannot_resume(flaky_http_server: Any) -> None:
    url = flaky_http_server.put("a.tar", b"y" * (24 << 20))
    # block_size=0: fsspec's streaming HTTP file, which cannot seek. It sends its one GET when
    # opened, so arm the cut first (HEADs are never cut). The cut comes late enough that the
    # first read gets bytes before the server can hang up: aiohttp drops buffered bytes once
    # it sees the close.
    flaky_http_server.cut_after(16 << 20, times=1)
    stream = open_resumable(url, retries=5, backoff=FAST, open_kwargs={"block_size": 0})
    assert stream.read(1000) == b"y" * 1000
    with pytest.raises(ShardReadError) as info:
        while stream.read(1 << 20):
            pass
    assert "cannot resume" in str(info.value)
    assert info.value.offset is not None and info.value.offset >= 1000
    assert stream.retries == 1
    stream.close()


def test_non_seekable_source_retries_before_its_first_byte(flaky_http_server: Any) -> None:
    data = b"z" * 50_000
    url = flaky_http_server.put("a.tar", data)
    flaky_http_server.fail_with(503, times=2)  # HEAD and GET of the size lookup
    stream = open_resumable(url, retries=5, backoff=FAST, open_kwargs={"block_size": 0})
    assert stream.read() == data and stream.retries == 1
    stream.close()


# ---------------------------------------------------------------------------------------------
# ResumableStream with an in-process source (real tar bytes, real exceptions)


class _FlakySource:
    """``open_at(offset)`` over bytes; each opened stream fails at the next planned position.

    A failure either raises ConnectionResetError or (``silent``) ends the body early.
    """

    def __init__(self, data: bytes, cuts: List[int], silent: bool = False) -> None:
        self.data, self.cuts, self.silent = data, sorted(cuts), silent
        self.opens: List[int] = []

    def __call__(self, offset: int) -> Any:
        self.opens.append(offset)
        cut = next((c for c in self.cuts if c >= offset), None)
        if cut is not None:
            self.cuts.remove(cut)
        return _Cut(self.data, offset, cut, self.silent)


class _Cut(io.RawIOBase):
    def __init__(self, data: bytes, offset: int, cut: Any, silent: bool) -> None:
        self.data, self.pos, self.cut, self.silent = data, offset, cut, silent

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        end = len(self.data) if self.cut is None else self.cut
        if self.pos >= end:
            if self.cut is not None and not self.silent:
                raise ConnectionResetError("connection reset by peer")
            return b""
        out = self.data[self.pos : min(end, self.pos + (n if n >= 0 else end))]
        self.pos += len(out)
        return out


@settings(max_examples=60, deadline=None)
@given(
    cuts=st.lists(st.integers(0, 9999), max_size=6, unique=True),
    reads=st.lists(st.integers(1, 3000), min_size=1, max_size=5),
    silent=st.booleans(),
)
def test_any_cuts_any_read_sizes_deliver_every_byte_once(
    cuts: List[int], reads: List[int], silent: bool
) -> None:
    data = random.Random(1).randbytes(10_000)
    source = _FlakySource(data, cuts, silent)
    stream = ResumableStream(source, url="mem://x", size=len(data), retries=1, backoff=0)
    out = []
    i = 0
    while True:
        chunk = stream.read(reads[i % len(reads)])
        i += 1
        if not chunk:
            break
        out.append(chunk)
    assert b"".join(out) == data
    assert stream.retries == len(cuts) == len(source.opens) - 1
    assert source.opens[0] == 0 and source.opens == sorted(source.opens)


def test_tar_read_through_cuts_in_header_and_data(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "a.tar", _members(3))
    data = path.read_bytes()
    cuts = [_inside_header(path, 2, 1), _inside_header(path, 9, 511), _inside_data(path, 20)]
    source = _FlakySource(data, list(cuts))
    stream = ResumableStream(source, url="mem://a.tar", size=len(data), backoff=0)
    got = [(n, d) for n, d, _ in read_members(stream, "mem://a.tar")]
    with tarfile.open(path) as tf:
        assert got == [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]
    assert source.opens == [0] + cuts
    assert stream.retries == 3


def test_early_end_without_size_is_the_end() -> None:
    source = _FlakySource(b"abcdef", [3], silent=True)
    stream = ResumableStream(source, url="mem://x", backoff=0)
    assert stream.read() == b"abc"
    assert stream.retries == 0


def test_object_changing_size_is_not_stitched() -> None:
    sizes = iter([100, 120])

    def open_at(offset: int) -> Any:
        f = _Cut(b"q" * 100, offset, 50 if offset == 0 else None, False)
        f.size = next(sizes)  # type: ignore[attr-defined]
        return f

    stream = ResumableStream(open_at, url="mem://x", backoff=0)
    assert stream.size == 100
    assert stream.read(50) == b"q" * 50
    with pytest.raises(ShardReadError, match="changed while it was being read"):
        stream.read(50)


def test_permanent_error_is_not_retried() -> None:
    calls = []

    def open_at(offset: int) -> Any:
        calls.append(offset)
        raise IsADirectoryError("is a directory")

    with pytest.raises(ShardReadError, match="retrying cannot fix"):
        ResumableStream(open_at, url="mem://x", backoff=0)
    assert calls == [0]


def test_classification_of_real_exceptions() -> None:
    import aiohttp
    from botocore.exceptions import ClientError

    def boto(code: str, status: int) -> ClientError:
        return ClientError(
            {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"
        )

    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert is_transient(aiohttp.ServerDisconnectedError())
    assert is_transient(aiohttp.ClientPayloadError("Response payload is not completed"))
    assert is_transient(boto("SlowDown", 503))
    assert not is_transient(boto("NoSuchKey", 404))
    assert not is_transient(boto("AccessDenied", 403))
    assert not is_transient(FileNotFoundError("x"))
    assert not is_transient(ValueError("bad range"))
    # fsspec's http size lookup: FileNotFoundError raised *from* a 503 is transient.
    try:
        try:
            raise boto("ServiceUnavailable", 503)
        except ClientError as exn:
            raise FileNotFoundError("http://h/a.tar") from exn
    except FileNotFoundError as wrapped:
        assert is_transient(wrapped)


def test_backoff_grows_to_its_cap_with_jitter() -> None:
    rng = random.Random(0)
    b = Backoff(initial=0.5, maximum=4.0, multiplier=2.0, jitter=0.25)
    for failure, base in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (10, 4.0)]:
        d = b.delay(failure, rng)
        assert 0.75 * base <= d <= base
    with pytest.raises(ValueError):
        Backoff(jitter=2)
    with pytest.raises(ValueError):
        ResumableStream(lambda off: io.BytesIO(b""), retries=-1)


def test_resumable_fsspec_on_a_local_filesystem(tmp_path: Path) -> None:
    import fsspec

    path = write_tar(tmp_path / "a.tar", _members(1))
    stream = resumable_fsspec(fsspec.filesystem("file"), str(path), retries=1, backoff=0)
    assert stream.size == path.stat().st_size
    assert stream.read() == path.read_bytes()
    stream.close()
