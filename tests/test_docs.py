"""The documentation site: it builds without a single warning, and documents the public API.

The build runs ``python -m mkdocs build --strict`` from the repository root, as a contributor
would. It needs mkdocs and mkdocstrings-python (in the test extra): where they are missing the
build test is skipped, except in CI (``CI`` set), where a missing tool must fail the run.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

import webds

ROOT = Path(__file__).resolve().parent.parent
API_PAGES = ROOT / "docs" / "api"

# Public names documented under another path than the one `webds.NAME` is imported from.
DOCUMENTED_ELSEWHERE = {
    # webds.gopen is both a module (webdataset's module name) and callable: the function is
    # documented as webds.compat.gopen.
    "gopen": "webds.compat.gopen",
    # webds.cache is webdataset's module name, an alias serving webds.io.cache (and the stage in
    # webds.tar.cached): the module is documented under its real name.
    "cache": "webds.io.cache",
}


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


def test_site_builds_without_warnings(tmp_path: Path) -> None:
    missing = [m for m in ("mkdocs", "mkdocstrings_handlers.python") if not _installed(m)]
    if missing:
        message = f"{', '.join(missing)} not installed: pip install mkdocs mkdocstrings-python"
        if _in_ci():
            pytest.fail(f"CI must build the documentation, but {message}")
        pytest.skip(message)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = proc.stdout + proc.stderr
    problems = [line for line in output.splitlines() if not line.startswith("INFO")]
    assert proc.returncode == 0, (
        "mkdocs build --strict failed; fix these (docs/, mkdocs.yml or the docstrings):\n"
        + "\n".join(problems or output.splitlines()[-40:])
    )
    assert not [line for line in problems if "WARNING" in line], "\n".join(problems)
    page = (site / "api" / "datasets" / "index.html").read_text(encoding="utf-8")
    # The reference is rendered from the docstrings, and their Sphinx roles became links:
    # FluentMixin.mix says "see :class:`~webds.stages.mix.RandomMix`".
    assert 'id="webds.fluent.WebDataset"' in page
    assert re.search(r'href="#webds\.stages\.mix\.RandomMix"><code>RandomMix</code></a>', page)
    assert ":class:" not in page


def _directives() -> Dict[str, List[str]]:
    """{path named by a ``::: path`` line: [the api pages naming it]}."""
    found: Dict[str, List[str]] = {}
    for page in sorted(API_PAGES.glob("*.md")):
        for match in re.finditer(r"^::: *([\w.]+) *$", page.read_text(encoding="utf-8"), re.M):
            found.setdefault(match[1], []).append(page.name)
    return found


def _object_at(path: str) -> Any:
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def test_api_reference_documents_every_public_name() -> None:
    directives = _directives()
    assert directives, f"no '::: webds...' lines in {API_PAGES}"
    documented = {}
    for path in directives:
        try:
            documented[id(_object_at(path))] = path
        except (ImportError, AttributeError) as exn:
            pytest.fail(f"{directives[path]}: '::: {path}' names nothing importable ({exn})")
    missing = []
    for name in webds.__all__:
        if name in DOCUMENTED_ELSEWHERE:
            assert DOCUMENTED_ELSEWHERE[name] in directives, name
            continue
        if id(getattr(webds, name)) not in documented:
            missing.append(name)
    assert not missing, (
        "public names (webds.__all__) missing from the API reference: add a '::: module.NAME' "
        f"line for each to a page of docs/api/: {', '.join(missing)}"
    )
