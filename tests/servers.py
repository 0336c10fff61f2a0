"""Real servers on loopback for the remote-data tests: S3 (moto), GCS (the emulator), HTTP.

Loaded as a pytest plugin (``pytest_plugins = ["servers"]`` in conftest.py). Fixtures:

- ``s3_server`` (session) / ``s3`` (per test, a fresh bucket): moto's S3 server in a thread;
- ``gcs_server`` (session) / ``gcs`` (per test, a fresh bucket): ``gcp-storage-emulator`` as a
  subprocess;
- ``http_server``: a range-capable HTTP/1.1 file server over a temporary folder;
- ``flaky_http_server``: the same, plus injected faults (cut bodies, error statuses, stalls,
  bodies without a Content-Length).

Every server listens on 127.0.0.1 only, on a free port, and stops at teardown. A fixture whose
package is missing skips its tests, naming the package.
"""

from __future__ import annotations

import contextlib
import email.utils
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple
from urllib.parse import quote, unquote, urlparse
from urllib.request import Request, urlopen

import pytest

LOOPBACK = "127.0.0.1"
#: moto accepts any key pair while it does not enforce authentication.
S3_KEY = "webds-test-key"
S3_SECRET = "webds-test-secret"
S3_REGION = "us-east-1"


# Read once, when gcsfs / google-auth are imported (test modules import them during collection,
# so a per-test monkeypatch would come too late):
# - gcsfs's experimental filesystem stalls 40-60 s per call against the emulator;
# - google-auth probes the GCE metadata server (3 s of retries) while looking for credentials;
#   pointed at a closed loopback port and told not to, it stays on loopback and gives up at once.
_IMPORT_TIME_ENV = {
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    "NO_GCE_CHECK": "true",
    "GCE_METADATA_HOST": "127.0.0.1:1",
    "GCE_METADATA_IP": "127.0.0.1:1",
}


_SAVED_ENV = pytest.StashKey[Dict[str, Optional[str]]]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_SAVED_ENV] = {name: os.environ.get(name) for name in _IMPORT_TIME_ENV}
    os.environ.update(_IMPORT_TIME_ENV)


def pytest_unconfigure(config: pytest.Config) -> None:
    for name, value in config.stash.get(_SAVED_ENV, {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _need(module: str, package: str) -> Any:
    """Import ``module`` or skip the test, naming the pip package that provides it."""
    return pytest.importorskip(module, reason=f"{package} is not installed")


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def _clear_fsspec_instances() -> None:
    """Forget cached filesystem objects, whose listings would outlive a test's bucket."""
    for module, name in (("s3fs", "S3FileSystem"), ("gcsfs", "GCSFileSystem")):
        mod = sys.modules.get(module)
        if mod is not None:
            getattr(mod, name).clear_instance_cache()
    gcs_core = sys.modules.get("gcsfs.core")
    if gcs_core is not None:
        gcs_core.GCSFileSystem.clear_instance_cache()
    http = sys.modules.get("fsspec.implementations.http")
    if http is not None:
        http.HTTPFileSystem.clear_instance_cache()


def _fresh_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


# ---------------------------------------------------------------------------------------------
# S3: moto


class S3Server:
    """moto's S3 endpoint, running in a thread of this process."""

    def __init__(self) -> None:
        server_mod = _need("moto.server", "moto[server]")
        self._boto3 = _need("boto3", "boto3")
        self._server = server_mod.ThreadedMotoServer(ip_address=LOOPBACK, port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def client(self, key: str = S3_KEY, secret: str = S3_SECRET) -> Any:
        """A boto3 S3 client for this endpoint."""
        return self._boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
            region_name=S3_REGION,
        )

    def set_auth(self, enforce: bool) -> None:
        """Make moto check credentials (unknown keys get 403) or accept any, server-wide."""
        body = b"0" if enforce else b"inf"
        # text/plain: with urllib's default form type, moto's Flask app would eat the body.
        url = f"{self.endpoint}/moto-api/reset-auth"
        req = Request(url, data=body, headers={"Content-Type": "text/plain"})
        with urlopen(req, timeout=10):
            pass

    def stop(self) -> None:
        self._server.stop()


class S3Bucket:
    """One fresh bucket on the moto server, with helpers to put, get and list objects."""

    def __init__(self, server: S3Server) -> None:
        self.server = server
        self.endpoint = server.endpoint
        self.bucket = _fresh_name("webds")
        self.key = S3_KEY
        self.secret = S3_SECRET
        #: For s3fs, ``open_url(url, **storage_options)``, ``WebDataset(storage_options=)``.
        self.storage_options: Dict[str, Any] = {
            "key": S3_KEY,
            "secret": S3_SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": S3_REGION},
        }
        self.client = server.client()
        self.client.create_bucket(Bucket=self.bucket)

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def put(self, key: str, data: bytes) -> str:
        """Store ``data`` under ``key``; returns its ``s3://`` URL."""
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)
        return self.url(key)

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=key)

    def list(self, prefix: str = "") -> List[str]:
        """All keys under ``prefix``, sorted (follows pagination)."""
        keys: List[str] = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            keys.extend(obj["Key"] for obj in page.get("Contents", []))
        return sorted(keys)

    @contextlib.contextmanager
    def enforce_auth(self) -> Iterator[None]:
        """Inside the block moto rejects unknown credentials (403), as real S3 does.

        Our own key pair is unknown to moto's IAM too, so put objects before entering.
        """
        self.server.set_auth(True)
        try:
            yield
        finally:
            self.server.set_auth(False)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server on a free loopback port for the whole session."""
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    """A fresh bucket on moto; env points credential-less clients (boto3, s3fs) at moto too."""
    _need("s3fs", "s3fs")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", S3_REGION)
    # A developer's own AWS configuration must not leak into the tests.
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    # Without keys botocore would ask the EC2 metadata service; stay on loopback.
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    _clear_fsspec_instances()
    bucket = S3Bucket(s3_server)
    try:
        yield bucket
    finally:
        _clear_fsspec_instances()


# ---------------------------------------------------------------------------------------------
# GCS: gcp-storage-emulator


class GCSServer:
    """``gcp-storage-emulator`` (in memory) as a child process on a free loopback port."""

    def __init__(self, log_path: Path) -> None:
        _need("gcp_storage_emulator", "gcp-storage-emulator")
        exe = shutil.which("gcp-storage-emulator", path=os.path.dirname(sys.executable))
        command = [exe] if exe else [sys.executable, "-m", "gcp_storage_emulator"]
        self.port = free_port()
        self.endpoint = f"http://{LOOPBACK}:{self.port}"
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            command + ["start", "--host", LOOPBACK, "--port", str(self.port), "--in-memory"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.log_path = log_path
        try:
            self._wait_ready(timeout=30.0)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"gcp-storage-emulator exited with {self.proc.returncode}: "
                    + self.log_path.read_text(errors="replace")[-2000:]
                )
            try:
                with urlopen(f"{self.endpoint}/storage/v1/b?project=test", timeout=2):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"gcp-storage-emulator did not answer on {self.endpoint} in {timeout}s")

    def request(
        self, method: str, path: str, data: Optional[bytes] = None, **headers: str
    ) -> bytes:
        """One JSON-API request to the emulator; returns the body (raises HTTPError on 4xx/5xx)."""
        req = Request(self.endpoint + path, data=data, method=method, headers=headers)
        with urlopen(req, timeout=30) as resp:
            return resp.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class GCSBucket:
    """One fresh bucket on the emulator, with helpers to put, get and list objects."""

    def __init__(self, server: GCSServer) -> None:
        self.server = server
        self.endpoint = server.endpoint
        self.bucket = _fresh_name("webds")
        #: Options for gcsfs: anonymous, pointed at the emulator.
        self.storage_options: Dict[str, Any] = {
            "token": "anon",
            "endpoint_url": self.endpoint,
            "project": "test",
        }
        body = json.dumps({"name": self.bucket}).encode()
        server.request(
            "POST", "/storage/v1/b?project=test", body, **{"Content-Type": "application/json"}
        )

    def url(self, name: str) -> str:
        return f"gs://{self.bucket}/{name}"

    def put(self, name: str, data: bytes) -> str:
        """Store ``data`` as object ``name``; returns its ``gs://`` URL."""
        self.server.request(
            "POST",
            f"/upload/storage/v1/b/{self.bucket}/o?uploadType=media&name={quote(name, safe='')}",
            data,
            **{"Content-Type": "application/octet-stream"},
        )
        return self.url(name)

    def get(self, name: str) -> bytes:
        return self.server.request(
            "GET", f"/storage/v1/b/{self.bucket}/o/{quote(name, safe='')}?alt=media"
        )

    def delete(self, name: str) -> None:
        self.server.request("DELETE", f"/storage/v1/b/{self.bucket}/o/{quote(name, safe='')}")

    def list(self, prefix: str = "") -> List[str]:
        """All object names under ``prefix``, sorted (follows pagination)."""
        names: List[str] = []
        token = ""
        for _ in range(10_000):
            query = f"prefix={quote(prefix, safe='')}" + (f"&pageToken={token}" if token else "")
            page = json.loads(self.server.request("GET", f"/storage/v1/b/{self.bucket}/o?{query}"))
            names.extend(item["name"] for item in page.get("items", []))
            token = page.get("nextPageToken", "")
            if not token:
                break
        return sorted(names)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GCSServer]:
    """The GCS emulator on a free loopback port for the whole session."""
    server = GCSServer(tmp_path_factory.mktemp("gcs") / "emulator.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def gcs(gcs_server: GCSServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[GCSBucket]:
    """A fresh bucket on the emulator; env points gcsfs at it even without storage_options."""
    _need("gcsfs", "gcsfs")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint)
    # Credential discovery without a token must not use a developer's gcloud login or reach
    # the GCE metadata server: it ends on loopback, where nothing answers, then anonymous.
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(gcs_server.log_path.parent / "gcloud"))
    for name, value in _IMPORT_TIME_ENV.items():
        monkeypatch.setenv(name, value)
    _clear_fsspec_instances()
    bucket = GCSBucket(gcs_server)
    try:
        yield bucket
    finally:
        _clear_fsspec_instances()


# ---------------------------------------------------------------------------------------------
# HTTP: a small range-capable file server, and a flaky variant

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body are separate writes: with Nagle's algorithm the body waits for the
    # client's delayed ACK (40 ms a request on Linux).
    disable_nagle_algorithm = True
    server: "RangeHTTPServer"
    # Idle keep-alive connections end by themselves, so handler threads never outlive a test.
    timeout = 10

    def log_message(self, format: str, *args: Any) -> None:  # quiet: pytest shows failures
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        srv = self.server
        with srv.lock:
            srv.in_flight += 1
            srv.most_in_flight = max(srv.most_in_flight, srv.in_flight)
        try:
            if srv.latency:
                srv.stopping.wait(srv.latency)  # a far server: time to the first byte
            self._serve(body=True)
        finally:
            with srv.lock:
                srv.in_flight -= 1

    def _serve(self, body: bool) -> None:
        srv = self.server
        with srv.lock:
            srv.requests += 1
            srv.log.append((self.command, self.path, self.headers.get("Range")))
            fail = srv._take_fault("fail")
            cut = srv._take_fault("cut") if body and not fail else None
            stall = srv._take_stall() if body and not fail and cut is None else None
            unsized, unsized_cut = srv.unsized, srv.unsized_cut
        if fail:
            self._reply(fail, b"injected failure\n", body)
            return
        path = srv.file_for(self.path)
        if path is None:
            self._reply(404, b"not found\n", body)
            return
        data = path.read_bytes()
        size = len(data)
        status, start, end = 200, 0, size  # end is exclusive
        spec = None if unsized else self.headers.get("Range")
        # A strong ETag of the content (or, with srv.dates_only, a Last-Modified date); If-Range
        # with another one asks for the whole new object.
        etag = '"' + hashlib.sha1(data).hexdigest() + '"'
        modified = email.utils.formatdate(path.stat().st_mtime, usegmt=True)
        validator = modified if srv.dates_only else etag
        if_range = self.headers.get("If-Range")
        if spec and if_range is not None and if_range != validator:
            spec = None
        if spec:
            m = _RANGE.match(spec.strip())
            if m is None or (m.group(1) == "" and m.group(2) == ""):
                self._reply(416, b"", body, extra={"Content-Range": f"bytes */{size}"})
                return
            if m.group(1) == "":  # "bytes=-N": the last N bytes
                start = max(0, size - int(m.group(2)))
            else:
                start = int(m.group(1))
                if m.group(2) != "":
                    end = min(size, int(m.group(2)) + 1)
            if start >= size or start >= end:
                self._reply(416, b"", body, extra={"Content-Range": f"bytes */{size}"})
                return
            status = 206
        payload = data[start:end]
        self.send_response(status)
        self.send_header("Content-Type", "application/x-tar")
        if srv.content_encoding is not None:
            # The file's bytes as they are, declared as coded: a server that stores shards
            # gzipped and says so (or a hostile one).
            self.send_header("Content-Encoding", srv.content_encoding)
        if not unsized:
            self.send_header(*(("Last-Modified", modified) if srv.dates_only else ("ETag", etag)))
        if unsized:
            # No Content-Length: the body ends when the connection closes, so a cut looks
            # exactly like the end (a proxy or dynamic server streaming the object).
            self.send_header("Connection", "close")
            self.close_connection = True
        else:
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if not body:
            return
        if unsized:
            self.wfile.write(payload if unsized_cut is None else payload[:unsized_cut])
            self.wfile.flush()
            return
        if stall is not None:
            # Send the headers and part of the body, then nothing: a stalled server. The
            # connection stays open until the stall ends (or the server stops).
            after, seconds = stall
            self.wfile.write(payload[:after])
            self.wfile.flush()
            srv.stopping.wait(seconds)
            self.close_connection = True
            return
        if cut is not None:
            # Promise the whole body, send part of it, then hang up: a dropped connection.
            self.wfile.write(payload[:cut])
            self.wfile.flush()
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            after, srv.after_cut = srv.after_cut, None
            if after is not None:
                after()  # (a test replaces the object before the client asks again)
            return
        self.wfile.write(payload)

    def _reply(
        self, status: int, text: bytes, body: bool, extra: Optional[Dict[str, str]] = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(text)))
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if body:
            self.wfile.write(text)


class RangeHTTPServer(ThreadingHTTPServer):
    """Serves the files under ``root`` over HTTP/1.1 with Range, HEAD and keep-alive.

    ``requests`` counts every request; ``log`` holds ``(method, path, range_header)`` of each.
    ``latency`` (seconds) delays every GET's answer; ``most_in_flight`` is the most GETs it
    served at once.
    """

    daemon_threads = True
    block_on_close = False
    # socketserver's default backlog is 5: readers with several connections in flight (read-ahead
    # in two workers) overflow it, and a dropped connect is retried by TCP after 1, 3, 7... s.
    request_queue_size = 128

    def __init__(self, root: Path) -> None:
        super().__init__((LOOPBACK, 0), _Handler)
        self.root = Path(root)
        self.port = self.server_address[1]
        self.endpoint = f"http://{LOOPBACK}:{self.port}"
        self.lock = threading.Lock()
        self.requests = 0
        self.log: List[Tuple[str, str, Optional[str]]] = []
        self._faults: Dict[str, List[int]] = {"fail": [0, 0], "cut": [0, 0]}
        self._cuts: List[int] = []  # per-response cuts, in order, before the "cut" fault
        #: Called once, right after the next cut response hung up (FlakyHTTPServer).
        self.after_cut: Optional[Any] = None
        #: Send Last-Modified instead of an ETag (a server that has no ETags).
        self.dates_only = False
        self._stalls: List[Tuple[int, float]] = []
        self.unsized = False
        self.unsized_cut: Optional[int] = None
        self.latency = 0.0
        #: Send every file with this ``Content-Encoding`` header (its bytes unchanged).
        self.content_encoding: Optional[str] = None
        self.in_flight = 0
        self.most_in_flight = 0
        self.stopping = threading.Event()
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A reader that stops early (or cancels a shard read ahead) hangs up mid-body: expected.
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionResetError, BrokenPipeError)):
            return
        super().handle_error(request, client_address)

    def url(self, name: str) -> str:
        return f"{self.endpoint}/{quote(name)}"

    def put(self, name: str, data: bytes) -> str:
        """Write ``data`` to ``root/name``; returns its URL."""
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return self.url(name)

    def file_for(self, request_path: str) -> Optional[Path]:
        rel = unquote(urlparse(request_path).path).lstrip("/")
        path = (self.root / rel).resolve()
        root = self.root.resolve()
        if root not in path.parents or not path.is_file():
            return None
        return path

    def _take_fault(self, kind: str) -> Optional[int]:
        # Called with the lock held. Returns the fault's value if one is still armed.
        if kind == "cut" and self._cuts:
            return self._cuts.pop(0)
        value, left = self._faults[kind]
        if left <= 0:
            return None
        self._faults[kind][1] = left - 1
        return value

    def _take_stall(self) -> Optional[Tuple[int, float]]:
        return self._stalls.pop(0) if self._stalls else None

    def stop(self) -> None:
        self.stopping.set()  # ends stalled responses
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=10)


class FlakyHTTPServer(RangeHTTPServer):
    """A :class:`RangeHTTPServer` that can drop connections or fail requests on demand."""

    def cut_after(self, nbytes: int, times: int = 1) -> None:
        """The next ``times`` GET responses send ``nbytes`` of their body, then close."""
        with self.lock:
            self._faults["cut"] = [int(nbytes), int(times)]

    def cut_each(self, nbytes: List[int]) -> None:
        """The next GET responses send ``nbytes[0]``, ``nbytes[1]``... bytes of their body,
        one each, then close (ahead of any :meth:`cut_after`)."""
        with self.lock:
            self._cuts = [int(n) for n in nbytes]

    def stall_after(self, nbytes: int, seconds: float = 60.0, times: int = 1) -> None:
        """The next ``times`` GET responses send their headers and ``nbytes`` of their body,
        then nothing for ``seconds`` (or until the server stops), then close."""
        with self.lock:
            self._stalls = [(int(nbytes), float(seconds))] * int(times)

    def serve_unsized(self, cut: Optional[int] = None) -> None:
        """Answer without Content-Length (the body ends at the close) and without range
        support; with ``cut``, close after that many bytes of every body."""
        with self.lock:
            self.unsized, self.unsized_cut = True, cut

    def fail_with(self, status: int, times: int = 1) -> None:
        """The next ``times`` requests (any method) are answered with ``status``."""
        with self.lock:
            self._faults["fail"] = [int(status), int(times)]

    @property
    def faults_left(self) -> Dict[str, int]:
        """How many injected cuts and failures are still armed."""
        with self.lock:
            out = {kind: left for kind, (_, left) in self._faults.items()}
            out["cut"] += len(self._cuts)
            out["stall"] = len(self._stalls)
            return out


def _http_fixture(cls: type, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    _clear_fsspec_instances()  # fsspec's HTTP filesystem caches sessions bound to old ports
    server = cls(tmp_path_factory.mktemp("http-root"))
    try:
        yield server
    finally:
        server.stop()
        _clear_fsspec_instances()


@pytest.fixture
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RangeHTTPServer]:
    """A range-capable HTTP server over a fresh folder (``.root``, ``.url(name)``)."""
    yield from _http_fixture(RangeHTTPServer, tmp_path_factory)


@pytest.fixture
def flaky_http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FlakyHTTPServer]:
    """Like ``http_server``, plus ``.cut_after(nbytes, times)``, ``.fail_with(status, times)``."""
    yield from _http_fixture(FlakyHTTPServer, tmp_path_factory)
