"""A slow link on loopback: an HTTP server that waits before the first byte of every answer and
paces each connection's bytes, as S3, GCS or a web server look from a box in another zone.

Two modes, in a process of its own (so that its threads do not share the reader's GIL):

- ``--root DIR``: serves the files under DIR (GET and HEAD, byte ranges, keep-alive);
- ``--s3``: starts moto's S3 server in the same process and forwards every request to it, so
  that ``s3://`` URLs read through s3fs with ``endpoint_url`` = this server see the same link.

``python -m benchmarks.slowlink --root DIR --latency 0.1 --rate 16e6`` prints one JSON line with
``port`` (and ``upstream``, moto's own port, with ``--s3``), then serves until stdin closes.
:class:`SlowLink` starts and stops one from Python.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, Optional
from urllib.parse import unquote, urlparse

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_PIECE = 64 << 10
# Hop-by-hop headers a proxy must not forward.
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: with Nagle's algorithm the body would wait for
    # the client's delayed ACK (40 ms on Linux), which no object store adds to a request.
    disable_nagle_algorithm = True
    server: "_Server"
    timeout = 60

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._answer()

    def do_HEAD(self) -> None:
        self._answer()

    def do_PUT(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self._answer()

    def do_DELETE(self) -> None:
        self._answer()

    def _answer(self) -> None:
        srv = self.server
        with srv.lock:
            srv.requests += 1
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        time.sleep(srv.latency)  # before the first byte of the answer
        if srv.upstream is not None:
            status, headers, payload = self._forward(body)
        else:
            status, headers, payload = self._file()
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        if self.command == "HEAD" or not payload:
            return
        start = time.perf_counter()
        sent = 0
        try:
            for i in range(0, len(payload), _PIECE):
                piece = payload[i : i + _PIECE]
                self.wfile.write(piece)
                sent += len(piece)
                wait = start + sent / srv.rate - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the reader stopped early

    def _file(self) -> Any:
        root = self.server.root
        assert root is not None
        path = (root / unquote(urlparse(self.path).path).lstrip("/")).resolve()
        if root.resolve() not in path.parents or not path.is_file():
            return 404, [("Content-Length", "0")], b""
        data = path.read_bytes()
        start, end, status = 0, len(data), 200
        m = _RANGE.match((self.headers.get("Range") or "").strip())
        if m and (m.group(1) or m.group(2)):
            if m.group(1):
                start = int(m.group(1))
                end = min(end, int(m.group(2)) + 1) if m.group(2) else end
            else:
                start = max(0, end - int(m.group(2)))
            status = 206
        payload = data[start:end]
        headers = [
            ("Content-Type", "application/x-tar"),
            ("Content-Length", str(len(payload))),
            ("Accept-Ranges", "bytes"),
        ]
        if status == 206:
            headers.append(("Content-Range", f"bytes {start}-{end - 1}/{len(data)}"))
        return status, headers, payload

    def _forward(self, body: bytes) -> Any:
        host, port = self.server.upstream  # type: ignore[misc]
        conn = http.client.HTTPConnection(host, port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            conn.request(self.command, self.path, body=body, headers=headers)
            r = conn.getresponse()
            payload = r.read()
            out = [(k, v) for k, v in r.getheaders() if k.lower() not in _HOP]
            if self.command != "HEAD":  # a HEAD's length is the object's
                out = [(k, v) for k, v in out if k.lower() != "content-length"]
                out.append(("Content-Length", str(len(payload))))
            return r.status, out, payload
        finally:
            conn.close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 128  # not socketserver's 5: many connections open at once

    def __init__(
        self,
        root: Optional[Path],
        upstream: Optional[Any],
        latency: float,
        rate: float,
    ) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.upstream = upstream
        self.latency = latency
        self.rate = rate
        self.requests = 0
        self.lock = threading.Lock()


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: Optional[list] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, help="serve the files under this folder")
    p.add_argument("--s3", action="store_true", help="start moto's S3 server and forward to it")
    p.add_argument("--latency", type=float, default=0.1, help="seconds before each answer")
    p.add_argument("--rate", type=float, default=16e6, help="bytes/s per connection")
    args = p.parse_args(argv)
    upstream = None
    moto = None
    if args.s3:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise

        moto_port = _free_port()
        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=moto_port, verbose=False)
        moto.start()
        upstream = ("127.0.0.1", moto_port)
    server = _Server(args.root, upstream, args.latency, args.rate)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    info: Dict[str, Any] = {"port": server.server_address[1]}
    if upstream is not None:
        info["upstream"] = upstream[1]
    print(json.dumps(info), flush=True)
    sys.stdin.read()  # until the parent closes our stdin (or dies)
    print(json.dumps({"requests": server.requests}), flush=True)
    server.shutdown()
    if moto is not None:
        moto.stop()


class SlowLink:
    """A :func:`main` server in a child process: ``endpoint`` (http://127.0.0.1:PORT),
    ``upstream`` (moto's endpoint with ``s3=True``); ``stop()`` returns its request count."""

    def __init__(
        self,
        root: Optional[Path] = None,
        s3: bool = False,
        latency: float = 0.1,
        rate: float = 16e6,
    ) -> None:
        cmd = [sys.executable, "-m", "benchmarks.slowlink", "--latency", str(latency)]
        cmd += ["--rate", str(rate)]
        cmd += ["--s3"] if s3 else ["--root", str(root)]
        here = Path(__file__).resolve().parent.parent
        self.latency, self.rate = latency, rate
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=here, text=True
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            self._proc.kill()
            raise RuntimeError(f"the slow-link server did not start: {' '.join(cmd)}")
        info = json.loads(line)
        self.endpoint = f"http://127.0.0.1:{info['port']}"
        self.upstream = f"http://127.0.0.1:{info['upstream']}" if "upstream" in info else None

    def stop(self) -> int:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.close()
        line = self._proc.stdout.readline()
        self._proc.wait(timeout=30)
        return int(json.loads(line)["requests"]) if line else -1

    def __enter__(self) -> "SlowLink":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


if __name__ == "__main__":
    main()
