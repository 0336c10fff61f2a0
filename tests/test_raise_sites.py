"""docs/migrating.md's table of webdataset 1.0.2's raise sites: complete against webdataset's
source, and true of webds (each situation met, the error's type checked)."""

from __future__ import annotations

import ast
import builtins
import re
import warnings
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest
from raise_sites import Site, triggers

import webds as wds
from webds import errors

ROOT = Path(__file__).resolve().parents[1]
webdataset = pytest.importorskip("webdataset")


def webdataset_sites() -> Set[Site]:
    """(module, function, type) of every raise and assert statement in webdataset's package."""
    sites: Set[Site] = set()
    for path in sorted(Path(webdataset.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())

        def walk(node: ast.AST, where: List[str], module: str = path.stem) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    walk(child, where + [child.name], module)
                    continue
                if isinstance(child, ast.Assert):
                    sites.add((module, ".".join(where), "AssertionError"))
                elif isinstance(child, ast.Raise) and child.exc is not None:
                    exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                    sites.add((module, ".".join(where), ast.unparse(exc)))
                walk(child, where, module)

        walk(tree, [])
    return sites


def table() -> Dict[Site, Tuple[str, str, str]]:
    """{site: (situation, webds column, same-except column)} from docs/migrating.md."""
    text = (ROOT / "docs" / "migrating.md").read_text()
    section = text.split("## Every raise site of webdataset 1.0.2", 1)[1]
    rows: Dict[Site, Tuple[str, str, str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[0].startswith("`") or cells[0] == "---":
            continue
        where, situation, raised, ours, same = cells
        module, _, function = where.strip("`").partition(".")
        kind = "exn" if raised == "the exception" else raised.strip("`")
        site = (module, function, kind)
        assert site not in rows, f"two rows for {site}"
        rows[site] = (situation, ours, same)
    return rows


def test_the_table_has_a_row_for_every_raise_site_and_no_other():
    theirs, ours = webdataset_sites(), set(table())
    assert sorted(theirs - ours) == [], "raise sites of webdataset without a row"
    assert sorted(ours - theirs) == [], "rows for raise sites webdataset does not have"
    assert len(theirs) >= 80  # the parse found them: 1.0.2 has 89 (module, function, type)


def _old_type(name: str) -> type:
    """The type 1.x code catches for ``name``, spelled as it is after ``import webds as wds``."""
    special = {
        "IOError": OSError,
        "DecodingError": wds.DecodingError,
        "ObsoleteException": wds.utils.ObsoleteException,
    }
    return special.get(name) or getattr(builtins, name)


def _classes(column: str) -> List[type]:
    names = re.findall(r"`(\w+)`", column)
    out = []
    for name in names:
        cls = getattr(errors, name, None) or getattr(builtins, name, None)
        cls = cls or getattr(wds.cache, name, None) or getattr(wds.utils, name, None)
        assert isinstance(cls, type), f"{name} in the table is not an exception class"
        out.append(cls)
    return out


ROWS = table()
SITES = sorted(ROWS)


@pytest.mark.parametrize("site", SITES, ids=[".".join(s) for s in SITES])
def test_webds_raises_what_the_table_says(site, tmp_path, monkeypatch):
    situation, ours, same = ROWS[site]
    call = triggers(tmp_path)[site]
    if ours == "—":
        assert call is None and same.startswith("unreachable: "), "say why it is unreachable"
        return
    assert call is not None, f"tests/raise_sites.py has no call for {site}"
    if ours == "nothing":
        assert same.startswith("no: "), "a difference needs its reason"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            call()
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(BaseException) as err:
            call()
    exn = err.value
    if ours == "the same exception":
        assert type(exn) is KeyError  # what the trigger's handler was given
        return
    classes = _classes(ours)
    assert any(isinstance(exn, cls) for cls in classes), f"{type(exn)} is none of {classes}"
    assert isinstance(exn, errors.WebdsError) or type(exn) is NotImplementedError, (
        f"{type(exn).__name__} is outside webds's error hierarchy"
    )
    if same.startswith("yes"):
        assert isinstance(exn, _old_type(site[2])), f"{type(exn)} is not a {site[2]}"
    else:
        assert same.startswith("no: ") and len(same) > 6, "a difference needs its reason"
        assert not isinstance(exn, _old_type(site[2])), "it is the same: say yes"
    assert str(exn).strip(), "an error without a message"


def test_a_missing_row_fails(tmp_path):
    # The completeness check is not vacuous: dropping a row is noticed.
    rows = dict(ROWS)
    rows.pop(("tenbin", "read", "ValueError"))
    assert webdataset_sites() - set(rows) == {("tenbin", "read", "ValueError")}
