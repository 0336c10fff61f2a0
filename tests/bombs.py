"""Decompression bombs for tests, and a runner that measures a subprocess's peak memory under an
address-space limit.

- :func:`zero_bomb` builds compressed data that expands to gigabytes of zeros (4 GiB gzip to
  4 MB), without ever holding more than 64 MiB of it: the bomb tests read them.
- :func:`png_zeros` and :func:`png_claiming` build image bombs: a real 13000x13000 PNG of 160
  KB, and a small PNG whose header claims any size.
- :func:`run_limited` runs Python code in a fresh interpreter under ``RLIMIT_AS`` and returns its
  exit status, its output and its peak resident memory, so a test can show that webds stops a
  bomb with an error at bounded memory (a MemoryError or a kill is a failure, not a pass).
"""

from __future__ import annotations

import bz2
import lzma
import struct
import subprocess
import sys
import zlib
from typing import Tuple

GiB = 1 << 30
MiB = 1 << 20

_ZEROS = 64 * MiB  # the gzip body repeats the compressed form of this many zeros
_STREAM = 256 * MiB  # bz2/xz: the zeros of one stream (a few hundred bytes of bz2)


def zero_bomb(codec: str, size: int, prefix: bytes = b"", suffix: bytes = b"") -> bytes:
    """``prefix + size zero bytes + suffix`` compressed with ``codec`` ("gz", "bz2" or "xz"),
    built in about a second whatever ``size`` is, and valid for the command-line tools.

    gz is one gzip member: after a full flush deflate starts afresh, so the compressed form of
    64 MiB of zeros is computed once and repeated (and the CRC computed over the whole). bz2 and
    xz are concatenated streams: the prefix, 256 MiB of zeros each, the suffix (one stream of
    256 MiB is computed and repeated), which ``bzip2 -d``, ``xz -d`` and Python's modules read
    as one. For a tar member bomb, pass its header as ``prefix`` and the padding and
    end-of-archive blocks as ``suffix``.

        zero_bomb("gz", 4 << 30)   # 4 MB that gunzip to 4 GiB
    """
    if codec == "gz":
        return _gzip_bomb(size, prefix, suffix)
    if codec not in ("bz2", "xz"):
        raise ValueError(f"codec must be gz, bz2 or xz, not {codec!r}")
    full, rest = divmod(size, _STREAM)
    parts = [_stream(codec, 0, prefix)] if prefix else []
    if full:
        parts.append(_stream(codec, _STREAM) * full)
    if rest:
        parts.append(_stream(codec, rest))
    if suffix or not parts:
        parts.append(_stream(codec, 0, suffix))
    return b"".join(parts)


def _stream(codec: str, zeros: int, data: bytes = b"") -> bytes:
    """One bz2 or xz stream of ``data`` followed by ``zeros`` zero bytes."""
    c = bz2.BZ2Compressor(9) if codec == "bz2" else lzma.LZMACompressor(preset=0)
    out = [c.compress(data)]
    block = bytes(min(zeros, 16 * MiB))
    for i in range(0, zeros, len(block) or 1):
        out.append(c.compress(block[: zeros - i]))
    out.append(c.flush())
    return b"".join(out)


def _gzip_bomb(size: int, prefix: bytes, suffix: bytes) -> bytes:
    zeros = bytes(_ZEROS)
    c = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS, 9, zlib.Z_RLE)
    body = [c.compress(prefix), c.flush(zlib.Z_FULL_FLUSH)]
    crc = zlib.crc32(prefix)
    repeats, rest = divmod(size, _ZEROS)
    if repeats:
        block = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
        again = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
        assert block == again, "deflate did not start afresh after a full flush"
        body.append(block * repeats)
        for _ in range(repeats):
            crc = zlib.crc32(zeros, crc)
    body += [c.compress(zeros[:rest]), c.compress(suffix), c.flush()]
    crc = zlib.crc32(suffix, zlib.crc32(zeros[:rest], crc))
    total = len(prefix) + size + len(suffix)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    return header + b"".join(body) + struct.pack("<II", crc, total & 0xFFFFFFFF)


# -- images -----------------------------------------------------------------------------------


def png_zeros(width: int, height: int, mode: str = "L") -> bytes:
    """A PNG of ``width`` x ``height`` zero pixels (mode "L" or "RGB"), built row by row:
    13000x13000 is 160 KB."""
    color, channels = {"L": (0, 1), "RGB": (2, 3)}[mode]
    c = zlib.compressobj(9, zlib.DEFLATED, 15, 9, zlib.Z_RLE)
    row = bytes(1 + width * channels)  # filter byte 0, then the pixels
    idat = b"".join(c.compress(row) for _ in range(height)) + c.flush()

    def chunk(kind, body):
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, color, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def png_claiming(width: int, height: int) -> bytes:
    """A 16x16 PNG whose header claims ``width`` x ``height`` pixels."""
    data = bytearray(png_zeros(16, 16))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


# -- the runner -------------------------------------------------------------------------------


_WRAPPER = """\
import resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
code = sys.stdin.read()
try:
    exec(compile(code, "<run_limited>", "exec"), {"__name__": "__main__"})
finally:
    # VmHWM: the peak of this process image. ru_maxrss would also count the parent's memory
    # that the child shared between fork and exec.
    with open("/proc/self/status") as status:
        peak = [line.split()[1] for line in status if line.startswith("VmHWM:")][0]
    sys.stdout.flush()
    sys.stderr.write(f"\\n{MARK} {int(peak) * 1024}\\n")
"""

_MARK = "__run_limited_peak_rss__"


def run_limited(code: str, as_limit: int, timeout: float = 300.0) -> Tuple[int, str, int]:
    """Run ``code`` in a fresh ``python`` (this interpreter, this environment: ``PYTHONPATH``
    included) whose address space is limited to ``as_limit`` bytes; return ``(returncode,
    output, peak_rss)``: the exit status (negative: killed by that signal), stdout and stderr
    together, and the child's peak resident memory in bytes (``VmHWM``, reported by the child as
    it exits, also after an exception; -1 if it was killed). Past ``timeout`` seconds the child
    is killed.

    A Python interpreter with webds, numpy and Pillow imported needs ~200 MB of address space
    and ~40 MB resident; ``import torch`` needs several GB of address space, so keep torch out
    of ``code`` or measure what it needs first.

        rc, out, peak = run_limited("import webds; print('ok')", 2 << 30)
    """
    wrapper = _WRAPPER.replace("{MARK}", _MARK)
    proc = subprocess.Popen(
        [sys.executable, "-c", wrapper, str(int(as_limit))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        output, _ = proc.communicate(code.encode(), timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    text = output.decode(errors="replace")
    peak = -1
    head, mark, tail = text.rpartition("\n" + _MARK + " ")
    if mark:
        text, peak = head, int(tail.split()[0])
    return proc.returncode, text, peak
