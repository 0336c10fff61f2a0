"""The house keeps its shape: rooms follow the data flow, arrows point one way, no import cycles,
no module over 550 lines, few modules flat at the top."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "webds"

MAX_LINES = 550
MAX_TOP_LEVEL = 14

#: The rooms in the order of the data flow: a module may import only from its own room and the
#: rooms before it. The foundation (errors, the stage machinery and handlers, the ledger, slots
#: and saved state that resuming is built on, progress bars) imports nothing of webds but errors,
#: so every room may build on it.
ROOMS: List[List[str]] = [
    ["webds.errors", "webds.progress", "webds.base"],
    ["webds.io"],
    ["webds.tar"],
    ["webds.shards"],
    ["webds.stages"],
    # composition and writing: DataPipeline, WebDataset, WebLoader, the writers, map_shards
    [
        "webds.counting",
        "webds.epochs",
        "webds.pipeline",
        "webds.keywords",
        "webds.fluent",
        "webds.channel",
    ],
    ["webds.loader"],
    ["webds.tarwriter", "webds.shardwriter", "webds.writing", "webds.writer", "webds.parallel"],
    ["webds.convert", "webds.cli"],
    ["webds.compat"],
    ["webds"],  # the package's __init__: the public API over all of it
]


def module_files() -> Dict[str, Path]:
    """{dotted module name: file} for every module of the webds package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    assert "webds.tar.reader" in out, f"not the webds package under {PACKAGE}: {sorted(out)}"
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, path: Path, modules: Set[str]) -> Set[str]:
    """The webds modules that ``module`` imports, from its source: imports inside functions
    count, ``if TYPE_CHECKING:`` blocks do not (they never run)."""
    is_package = path.name == "__init__.py"
    found: Set[str] = set()

    def resolve(name: str) -> Optional[str]:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in modules else None

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if _is_type_checking(node.test):
                for stmt in node.orelse:
                    self.visit(stmt)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            for alias in node.names:
                if alias.name == "webds" or alias.name.startswith("webds."):
                    found.add(alias.name)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not (target == "webds" or target.startswith("webds.")):
                return
            for alias in node.names:  # "from . import filters" imports a module
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)

    Visitor().visit(ast.parse(path.read_text(), str(path)))
    return {m for m in (resolve(name) for name in found) if m is not None and m != module}


def import_graph() -> Dict[str, Set[str]]:
    files = module_files()
    graph = {m: imports_of(m, p, set(files)) for m, p in files.items()}
    # The checks on the house pass on a graph without edges: make sure the imports were seen
    # (fluent's cross rooms down the flow).
    want = {"webds.pipeline", "webds.tar.samples", "webds.io.urls"}
    assert want <= graph["webds.fluent"], f"webds.fluent imports {graph['webds.fluent']}"
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one module (Tarjan), or a module that
    imports itself."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def room_of(module: str) -> int:
    """The index in :data:`ROOMS` of the most specific prefix naming ``module``'s room."""
    best, best_len = None, -1
    for i, prefixes in enumerate(ROOMS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    assert best is not None, f"{module} is in no room of tests/test_layout.py's ROOMS: add it"
    return best


# -- the checks, first on hand-made graphs so that they can be seen to fail -----------------------


def test_cycle_finder_finds_direct_hidden_and_self_cycles():
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"a"}}) == [["a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_counts_imports_inside_functions_but_not_type_checking(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from ..errors import WebdsError\n"
        "if TYPE_CHECKING:\n"
        "    from ..fluent import WebDataset\n"
        "def f():\n"
        "    from ..io import urls\n"
        "    import webds.tar.samples\n"
    )
    modules = {"webds.stages.mod", "webds.errors", "webds.fluent", "webds.io", "webds.io.urls"}
    modules |= {"webds.tar", "webds.tar.samples", "webds.stages", "webds.stages.core"}
    # Relative to webds/stages/mod.py: "." is webds.stages, ".." is webds.
    got = imports_of("webds.stages.mod", source, modules)
    assert got == {"webds.errors", "webds.io.urls", "webds.tar.samples"}
    source.write_text("from . import core\nfrom .core import stage\n")
    assert imports_of("webds.stages.mod", source, modules) == {"webds.stages.core"}


# -- the house ------------------------------------------------------------------------------------


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, f"import cycles (imports inside functions count): {found}"


def test_no_module_over_550_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for path in module_files().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these by concern (at most {MAX_LINES} lines a module): {long}"


def test_few_modules_flat_at_the_top():
    flat = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(flat) <= MAX_TOP_LEVEL, f"{len(flat)} modules flat in webds/: {flat}"


def test_arrows_point_down_the_flow():
    wrong = []
    for module, imported in import_graph().items():
        for target in imported:
            if room_of(target) > room_of(module):
                wrong.append(f"{module} -> {target}")
    assert not wrong, (
        "a module imports from a room later in the flow (io <- tar <- shards <- stages <- "
        f"composition <- cli/convert <- compat): {sorted(wrong)}"
    )


def test_the_core_never_imports_compat():
    graph = import_graph()  # once: it parses every module
    core = {m for m in graph if room_of(m) < room_of("webds.compat")}
    assert {"webds.errors", "webds.tar.reader", "webds.fluent", "webds.loader"} <= core
    # An import of compat is seen where there is one: the package's __init__ has one.
    assert any(t.startswith("webds.compat") for t in graph["webds"]), graph["webds"]
    offenders = sorted(
        f"{m} -> {t}" for m in core for t in graph[m] if t.startswith("webds.compat")
    )
    assert not offenders, offenders


def test_every_module_is_in_a_room():
    for module in module_files():
        room_of(module)
