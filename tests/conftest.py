"""Shared fixtures: real tar files written by independent tools, and the peer shards."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import Iterable, Optional, Sequence, Tuple

import pytest

#: Loopback S3 (moto), GCS (emulator) and HTTP servers for the remote tests: tests/servers.py.
pytest_plugins = ["servers"]

#: Shards written by another implementation (webdataset); present in CI, maybe absent elsewhere.
PEER_DIR = Path(__file__).resolve().parents[2] / "shared" / "peer-testdata"


def find_peer_dir(folder: Path) -> Path:
    """``folder`` if it is there; else skip the test, or fail it where the environment says
    these tests must run (``.ci/run`` sets ``WEBDS_REQUIRE_PEER_TESTDATA=1``)."""
    if not folder.is_dir():
        message = f"peer test data not found at {folder}"
        if os.environ.get("WEBDS_REQUIRE_PEER_TESTDATA") == "1":
            pytest.fail(f"{message}, and WEBDS_REQUIRE_PEER_TESTDATA=1 says these tests must run")
        pytest.skip(message)
    return folder


@pytest.fixture
def peer_dir() -> Path:
    """The folder of peer-written shards (see :func:`find_peer_dir`)."""
    return find_peer_dir(PEER_DIR)


def write_tar(
    path: os.PathLike | str,
    members: Iterable[Tuple[str, bytes]],
    *,
    format: int = tarfile.USTAR_FORMAT,
    compress: Optional[str] = None,
) -> Path:
    """Write ``members`` (name, data) with Python's ``tarfile``: an independent writer."""
    mode = "w" if compress is None else f"w:{compress}"
    with tarfile.open(str(path), mode, format=format) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_600_000_000
            tf.addfile(info, io.BytesIO(data))
    return Path(path)


def sample_members(n: int, exts: Sequence[str] = ("txt", "cls"), prefix: str = "") -> list:
    """Members for ``n`` samples keyed ``{prefix}{i:06d}``, with one field per extension."""
    out = []
    for i in range(n):
        key = f"{prefix}{i:06d}"
        for ext in exts:
            data = str(i).encode() if ext == "cls" else f"sample {key} {ext}".encode()
            out.append((f"{key}.{ext}", data))
    return out


@pytest.fixture
def tar_factory(tmp_path: Path):
    """``tar_factory(name, members, **kw)`` writes a tar with Python's tarfile under tmp_path."""

    def make(name: str, members: Iterable[Tuple[str, bytes]], **kw) -> Path:
        return write_tar(tmp_path / name, members, **kw)

    return make


class Tracked:
    """An iterator over range(n) that records how many items have been pulled from it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pulled = 0

    def __iter__(self):
        return self

    def __next__(self) -> int:
        if self.pulled >= self.n:
            raise StopIteration
        self.pulled += 1
        return self.pulled - 1


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group ``pgid`` is still running (``pipe:`` tests)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


#: Test modules whose slow steps are subprocesses only (virtualenvs, pip, builds): started as the
#: session starts, at low priority, they run on the core that pytest, running on one, leaves
#: idle, instead of holding the suite up when their turn comes. Each has start_...(folder, items),
#: given the module's selected tests (``-k 3.9`` starts only Python 3.9's check).
_BACKGROUND = {"test_pythons.py": "start_checks", "test_package.py": "start_builds"}


def pytest_collection_finish(session: pytest.Session) -> None:
    selected = {item.path.name for item in session.items} & set(_BACKGROUND)
    if not selected:
        return
    import importlib
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="webds-background-"))
    session.config.stash[_BACKGROUND_DIR] = folder
    for name in sorted(selected):
        module = importlib.import_module(name[: -len(".py")])
        items = [item for item in session.items if item.path.name == name]
        getattr(module, _BACKGROUND[name])(folder / name[: -len(".py")], items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    folder = session.config.stash.get(_BACKGROUND_DIR, None)
    if folder is not None:
        import subprocess

        # Virtualenvs and builds (one holds torch): gigabytes of small files, removed by a
        # process of their own that outlives the session instead of holding up its report.
        subprocess.Popen(
            ["nice", "-n", "15", "rm", "-rf", str(folder)],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )


_BACKGROUND_DIR = pytest.StashKey[Path]()
