"""Write ``webds/__init__.pyi`` from the export table in ``webds/__init__.py`` (``_EXPORTS``):
the imports type checkers and IDEs see, since the package imports its names lazily.

    python tests/exports_stub.py        # rewrite the stub after changing the table

tests/test_imports.py fails while the stub is out of date.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
STUB = ROOT / "webds" / "__init__.pyi"
_HOLDER = {"cache": "io.cache"}


def stub_text() -> str:
    """The stub the current table gives."""
    sys.path.insert(0, str(ROOT))
    try:
        import webds
    finally:
        sys.path.pop(0)
    # "from X import a as a" re-exports a; one per line, so that a diff shows each name.
    imports: List[str] = []
    for module, names in webds._EXPORTS:
        for entry in names.split():
            name, _, real = entry.partition("=")
            if real == ".":  # the module itself: from its package
                # webds.cache is webdataset's module name, an alias with no file of its own:
                # type checkers see webds.io.cache, which holds most of it.
                package, _, leaf = _HOLDER.get(module, module).rpartition(".")
                imports.append(f"from .{package} import {leaf} as {name}")
            else:
                imports.append(f"from .{module} import {real or name} as {name}")
    lines = [
        "# Generated from the export table in webds/__init__.py by tests/exports_stub.py: do not",
        "# edit; change the table and run: python tests/exports_stub.py",
        "from typing import Any, List",
        "",
        *sorted(imports),
        "from .compat import gopen as gopen",
        "",
        "__version__: str",
        "__all__: List[str]",
        "",
        "def __getattr__(name: str) -> Any: ...  # webdataset's module names, submodules",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    STUB.write_text(stub_text())
    print(f"wrote {STUB}")
