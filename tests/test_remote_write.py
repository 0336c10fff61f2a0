"""Writing shards to S3 (moto) and GCS (the emulator) on loopback: a shard becomes an object only
when it is complete, an abandoned shard leaves nothing behind, and big shards stream in parts."""

from __future__ import annotations

import gc
import io
import subprocess
import sys
import tarfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any, Dict, Iterator, List
from urllib.request import urlopen

import pytest
from servers import free_port

from webds.fluent import WebDataset
from webds.writer import ShardWriter, TarWriter

MiB = 2**20
#: s3fs's smallest block: S3 parts other than the last must be at least 5 MiB.
S3_BLOCK = 5 * MiB


def _sample(i: int, size: int = 100) -> Dict[str, Any]:
    return {"__key__": f"{i:06d}", "bin": bytes([i % 251]) * size, "cls": i}


def _members(data: bytes) -> Dict[str, bytes]:
    """Read a tar with Python's tarfile (an independent reader): name -> payload."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf.getmembers()}  # type: ignore


def _pending_uploads(s3) -> List[dict]:
    return s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])


# --- S3 ---------------------------------------------------------------------------------------


def test_s3_shards_appear_only_when_each_shard_is_committed(s3) -> None:
    seen_at_post: List[List[str]] = []
    writer = ShardWriter(
        s3.url("train/part-%06d.tar"),
        maxcount=3,
        index=False,  # the shards alone are under test here; test_index covers the index
        storage_options=s3.storage_options,
        post=lambda fname: seen_at_post.append(s3.list("train/")),
    )
    for i in range(10):
        writer.write(_sample(i))
        # Only committed shards are objects; the one being written is not.
        committed = [u.split("/", 3)[3] for u in writer.shards]
        assert s3.list("train/") == committed
    writer.close()
    names = [f"train/part-{n:06d}.tar" for n in range(4)]
    assert s3.list("train/") == names
    # post ran after each commit: it saw its own shard.
    assert seen_at_post == [names[: k + 1] for k in range(4)]
    got = {}
    for name in names:
        got.update(_members(s3.get(name)))
    assert got["000007.bin"] == _sample(7)["bin"] and got["000009.cls"] == b"9"
    assert len(got) == 20
    keys = [s["__key__"] for s in WebDataset(s3.url("train/"), storage_options=s3.storage_options)]
    assert sorted(keys) == [f"{i:06d}" for i in range(10)]


def test_s3_big_shard_streams_in_parts_and_completes_on_close(s3) -> None:
    opts = dict(s3.storage_options, default_block_size=S3_BLOCK)
    url = s3.url("big.tar")
    sink = TarWriter(url, storage_options=opts)
    payloads = [bytes([i]) * (2 * MiB) for i in range(7)]
    for i, p in enumerate(payloads):
        sink.write({"__key__": f"k{i}", "bin": p})
    # 14 MiB written with 5 MiB blocks: parts are on the server, yet no object exists.
    (upload,) = _pending_uploads(s3)
    parts = s3.client.list_parts(Bucket=s3.bucket, Key="big.tar", UploadId=upload["UploadId"])
    assert len(parts["Parts"]) == 2
    assert s3.list() == []
    sink.close()
    assert s3.list() == ["big.tar"]
    assert _pending_uploads(s3) == []
    got = _members(s3.get("big.tar"))
    assert [got[f"k{i}.bin"] for i in range(7)] == payloads


@pytest.mark.parametrize("size", [1000, 3 * MiB], ids=["one-put", "multipart"])
def test_s3_exception_mid_shard_leaves_no_object(s3, size: int) -> None:
    opts = dict(s3.storage_options, default_block_size=S3_BLOCK)
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(
            s3.url("x-%03d.tar"), maxcount=2, storage_options=opts, index=False
        ) as sink:
            for i in range(5):
                sink.write(_sample(i, size))
            raise RuntimeError("boom")
    # Shards 0 and 1 were full and committed; shard 2 (one sample) was abandoned.
    assert s3.list() == ["x-000.tar", "x-001.tar"]
    assert _pending_uploads(s3) == []
    gc.collect()  # no finalizer uploads the abandoned shard later
    assert s3.list() == ["x-000.tar", "x-001.tar"]


@pytest.mark.parametrize("size", [1000, 6 * MiB], ids=["one-put", "multipart"])
def test_s3_tarwriter_dropped_without_close_leaves_no_object(s3, size: int) -> None:
    opts = dict(s3.storage_options, default_block_size=S3_BLOCK)
    sink = TarWriter(s3.url("dropped.tar"), storage_options=opts)
    sink.write(_sample(0, size))
    del sink
    gc.collect()
    assert s3.list() == []
    assert _pending_uploads(s3) == []


def test_s3_discard_aborts_and_marks_the_upload_closed(s3) -> None:
    opts = dict(s3.storage_options, default_block_size=S3_BLOCK)
    sink = TarWriter(s3.url("d.tar"), storage_options=opts)
    sink.write(_sample(0, 6 * MiB))
    raw = sink._raw
    sink.discard()
    assert raw.closed
    assert s3.list() == [] and _pending_uploads(s3) == []


def test_s3_maxsize_rollover_and_gzip_read_back(s3) -> None:
    with ShardWriter(
        s3.url("s-%04d.tar.gz"),
        maxsize=10_000,
        maxcount=1000,
        storage_options=s3.storage_options,
        index=False,
    ) as sink:
        for i in range(10):
            sink.write(_sample(i, 4000))
    # A shard takes samples until it holds >= 10000 payload bytes (3 x 4001).
    assert s3.list() == ["s-0000.tar.gz", "s-0001.tar.gz", "s-0002.tar.gz", "s-0003.tar.gz"]
    counts = [len(_members(s3.get(name))) // 2 for name in s3.list()]
    assert counts == [3, 3, 3, 1]
    samples = list(WebDataset(s3.url("s-*.tar.gz"), storage_options=s3.storage_options))
    assert [s["__key__"] for s in samples] == [f"{i:06d}" for i in range(10)]
    assert samples[4]["bin"] == _sample(4, 4000)["bin"]


def test_s3_writer_without_storage_options_uses_the_environment(s3) -> None:
    with TarWriter(s3.url("env.tar")) as sink:
        sink.write(_sample(1))
    assert list(_members(s3.get("env.tar"))) == ["000001.bin", "000001.cls"]


# --- bounded memory -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_process(tmp_path_factory) -> Iterator[str]:
    """moto's S3 server as a separate process, so tracemalloc here sees only the client.

    (The shared ``s3`` fixture runs moto in a thread of this process; its copies of the
    uploaded parts would swamp the measurement.)
    """
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            if proc.poll() is not None:
                pytest.fail(f"moto server exited with {proc.returncode}")
            try:
                with urlopen(f"{endpoint}/moto-api/", timeout=1):
                    break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail("moto server did not start in 30 s")
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _peak_while_writing(url: str, opts: Dict[str, Any], nsamples: int, size: int) -> int:
    """Peak traced memory (bytes above the start) while writing ``nsamples`` of ``size``."""
    sink = TarWriter(url, storage_options=opts)
    sink.write({"__key__": "warmup", "bin": b"x"})  # connections, clients: not the shard
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(nsamples):
            sink.write({"__key__": f"{i:06d}", "bin": bytes([i % 251]) * size})
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    sink.close()
    return peak


def test_s3_big_shard_memory_stays_bounded(s3_process: str) -> None:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=s3_process,
        aws_access_key_id="k",
        aws_secret_access_key="s",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket="webds-mem")
    opts = {
        "key": "k",
        "secret": "s",
        "default_block_size": S3_BLOCK,
        "client_kwargs": {"endpoint_url": s3_process, "region_name": "us-east-1"},
    }
    # 64 MiB (about 13 blocks) through a 5 MiB block: the client holds a few blocks at most.
    peak = _peak_while_writing("s3://webds-mem/big.tar", opts, 64, MiB)
    assert peak < 8 * S3_BLOCK, f"peak {peak / MiB:.1f} MiB while writing a 64 MiB shard"
    head = client.head_object(Bucket="webds-mem", Key="big.tar")
    assert head["ContentLength"] > 64 * MiB


# --- GCS --------------------------------------------------------------------------------------


def test_gcs_shards_appear_only_when_committed_and_read_back(gcs) -> None:
    committed: List[List[str]] = []
    with ShardWriter(
        gcs.url("g-%03d.tar"),
        maxcount=4,
        index=False,
        storage_options=gcs.storage_options,
        post=lambda fname: committed.append(gcs.list()),
    ) as sink:
        for i in range(10):
            sink.write(_sample(i))
            assert gcs.list() == [u.split("/", 3)[3] for u in sink.shards]
    assert gcs.list() == ["g-000.tar", "g-001.tar", "g-002.tar"]
    assert committed[-1] == gcs.list() and len(committed) == 3
    samples = list(WebDataset(gcs.url("g-*.tar"), storage_options=gcs.storage_options))
    assert [s["__key__"] for s in samples] == [f"{i:06d}" for i in range(10)]


def _gcsfs_deferred_closes_done() -> None:
    """Wait for the closes gcsfs's finalizers queued so far: one worker thread runs them in
    order, so a job queued now runs after them. (A gcsfs without that queue closes in the
    finalizer itself.)"""
    import gcsfs.core

    work = getattr(gcsfs.core, "_deferred_close_queue", None)
    if work is None:
        return
    done = threading.Event()
    work.put(done.set)
    assert done.wait(60), "gcsfs's deferred closes did not finish"


def test_gcs_exception_mid_shard_leaves_no_object(gcs) -> None:
    # A small shard, still in gcsfs's buffer (no upload session yet). A shard past the block
    # size is a resumable upload, which discard() cancels with a DELETE; the emulator answers
    # that with 501 and gcsfs retries for about 35 s, so that case is left to real GCS (the
    # unfinished session never becomes an object either way).
    size = 1000
    opts = dict(gcs.storage_options, block_size=MiB)
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(
            gcs.url("x-%03d.tar"), maxcount=1, storage_options=opts, index=False
        ) as sink:
            sink.write(_sample(0, size))
            sink.write(_sample(1, size))
            raise RuntimeError("boom")
    gc.collect()
    _gcsfs_deferred_closes_done()
    assert gcs.list() == ["x-000.tar"]
    assert _members(gcs.get("x-000.tar"))["000000.bin"] == _sample(0, size)["bin"]


def test_gcs_resumable_shard_is_invisible_until_close(gcs) -> None:
    opts = dict(gcs.storage_options, block_size=MiB)
    sink = TarWriter(gcs.url("r.tar"), storage_options=opts)
    for i in range(4):
        sink.write(_sample(i, MiB))
    assert gcs.list() == []
    sink.close()
    assert gcs.list() == ["r.tar"]
    assert len(_members(gcs.get("r.tar"))) == 8


def test_gcs_big_shard_memory_stays_bounded(gcs) -> None:
    # The emulator is another process, so tracemalloc sees only this side.
    block = MiB
    opts = dict(gcs.storage_options, block_size=block)
    peak = _peak_while_writing(gcs.url("big.tar"), opts, 48, 256 * 1024)
    assert peak < 6 * block, f"peak {peak / MiB:.1f} MiB while writing a 12 MiB shard"
    assert len(gcs.get("big.tar")) > 12 * MiB


def test_local_writer_still_atomic(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        with TarWriter(str(tmp_path / "a.tar")) as sink:
            sink.write(_sample(0))
            raise RuntimeError("x")
    assert list(tmp_path.iterdir()) == []


# -- refused and broken uploads (issue 36) -----------------------------------------------------


def test_s3_write_refused_is_the_open_error_a_read_gives(s3) -> None:
    # A wrong secret: the commit is refused with 403. It was a WriteError carrying botocore's
    # text; now the OpenError a read gives (also a WriteError), with the credentials hint.
    from webds.errors import OpenError, WriteError

    options = dict(s3.storage_options, key="AKIAWRONGWRONGWRONG1", secret="wrong")
    with s3.enforce_auth():
        with pytest.raises(OpenError) as info:
            with TarWriter(s3.url("refused.tar"), storage_options=options) as w:
                w.write({"__key__": "a", "txt": "x"})
    assert isinstance(info.value, WriteError)
    text = str(info.value)
    assert "permission denied (HTTP 403)" in text and "AWS_ACCESS_KEY_ID" in text
    assert "refused.tar" in text
    assert "refused.tar" not in s3.list()


class _ResetPuts:
    """A TCP proxy to moto that resets every connection whose request is a PUT or a POST (an
    upload), after reading part of it: a link that drops uploads, the store still answering."""

    def __init__(self, upstream: str) -> None:
        import socket
        import threading
        from urllib.parse import urlparse

        u = urlparse(upstream)
        self.target = (u.hostname, u.port)
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(16)
        self.endpoint = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.resets = 0
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import threading

        while not self._stop:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(client,), daemon=True).start()

    def _one(self, client: Any) -> None:
        import socket
        import struct
        import threading

        first = client.recv(65536)
        if first[:4] in (b"PUT ", b"POST"):
            self.resets += 1
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()  # RST
            return
        up = socket.create_connection(self.target)
        up.sendall(first)

        def pipe(a: Any, b: Any) -> None:
            try:
                while True:
                    data = a.recv(65536)
                    if not data:
                        break
                    b.sendall(data)
            except OSError:
                pass
            finally:
                for s in (a, b):
                    try:
                        s.close()
                    except OSError:
                        pass

        threading.Thread(target=pipe, args=(up, client), daemon=True).start()
        pipe(client, up)

    def stop(self) -> None:
        self._stop = True
        self.server.close()


def test_s3_upload_reset_says_the_link_broke_not_cannot_connect(s3) -> None:
    # It read "Could not connect to the endpoint URL" while the endpoint answered (issue 36).
    from webds.errors import OpenError, WriteError

    proxy = _ResetPuts(s3.storage_options["client_kwargs"]["endpoint_url"])
    try:
        client_kwargs = dict(s3.storage_options["client_kwargs"], endpoint_url=proxy.endpoint)
        options = dict(
            s3.storage_options,
            client_kwargs=client_kwargs,
            config_kwargs={"retries": {"max_attempts": 1}},
        )
        with pytest.raises(WriteError) as info:
            with TarWriter(s3.url("reset.tar"), storage_options=options) as w:
                w.write({"__key__": "a", "txt": "x"})
        text = str(info.value)
        assert "connection broke during the upload" in text and "write it again" in text
        assert "Could not connect" not in text.split("(")[0]
        assert not isinstance(info.value, OpenError) and proxy.resets >= 1
    finally:
        proxy.stop()
