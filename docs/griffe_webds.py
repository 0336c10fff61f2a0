"""Griffe extension for the API reference: webds's reStructuredText habits, read as Markdown.

The docstrings are written for humans reading the source and ``help()``, in the reST style
Sphinx understands; mkdocstrings renders Markdown. Rather than editing every docstring, this
extension rewrites them once the ``webds`` package is loaded (the source is never touched):

- ``:class:`~webds.errors.ShardReadError``` (and ``:func:``, ``:meth:``, ``:data:``, ``:mod:``,
  ...) becomes a cross-reference to where that object is documented in the reference, or plain
  code where it is not (an *optional* autoref: no broken-reference warning either way). Short
  targets (``:func:`stage```) resolve in the docstring's own scope, as Sphinx resolves them
  from the current module, then among the package's public names.
- A reST literal in double backquotes becomes Markdown code in single ones; ``text::`` and the
  indented block after it, and ``>>>`` examples, become fenced code blocks.
- ``#:`` comments above a module or class attribute become its docstring, as Sphinx's autodoc
  reads them (``SCHEMES``, ``DEFAULT_RETRIES``, ...).
- The chainable methods of ``FluentMixin``, made at import time by ``_chain(filters.shuffle)``,
  become methods with the stage's signature and a link to the stage's full documentation.

Loaded from ``mkdocs.yml`` (``plugins: mkdocstrings: handlers: python: options: extensions``).
"""

from __future__ import annotations

import html
import importlib
import inspect
import re
from typing import Any, Iterator, List, Optional

import griffe

PACKAGE = "webds"

# :role:`target`, :role:`~target`, :py:role:`target`; the optional "title <target>" form too.
_ROLE = re.compile(r":(?:py:)?(?P<role>[a-z]+):`(?P<body>[^`]+)`")
# ``literal`` (possibly over a line break, as reST allows).
_LITERAL = re.compile(r"(?<!`)``(?P<text>[^`](?:.*?[^`])??)``(?!`)", re.DOTALL)
_FLUENT = re.compile(r"^_chain\((?P<target>[\w.]+)\)$")
# @stage, @stage(count=SAME), @pipelinefilter: a generator function made a curried factory.
_STAGE_DECORATOR = re.compile(
    r"^(?:[\w.]+\.)?(?:stage|pipelinefilter|\w*Factory)(?:\(.*\))?$", re.DOTALL
)
# Parameters the pipeline passes to a stage function itself (see webds.base.stage.StageFactory).
_INJECTED = ("epoch", "pipeline_seed")


class WebdsDocstrings(griffe.Extension):
    """Rewrite the docstrings of the ``webds`` package for mkdocstrings (see this module)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != PACKAGE:
            return
        objects = list(_walk(pkg))
        for obj in objects:
            if obj.is_attribute and obj.docstring is None:
                comment = _doc_comment(obj)
                if comment:
                    obj.docstring = griffe.Docstring(comment, lineno=obj.lineno, parent=obj)
        for obj in objects:
            if obj.docstring is not None:
                obj.docstring.value = markdown(obj.docstring.value, obj, loader)
        for obj in objects:
            if obj.is_function and _is_stage(obj):  # type: ignore[arg-type]
                _stage_signature(obj)  # type: ignore[arg-type]
        for obj in objects:
            if obj.is_class:
                _fluent_methods(obj, loader)  # type: ignore[arg-type]


def _walk(obj: griffe.Object) -> Iterator[griffe.Object]:
    """Every object defined in ``obj`` (not the names it imports), ``obj`` first."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)  # type: ignore[arg-type]


def _doc_comment(obj: griffe.Object) -> Optional[str]:
    """The ``#:`` comment lines right above an attribute, without the ``#:``."""
    if obj.lineno is None or obj.filepath is None:
        return None
    try:
        lines = obj.lines_collection[obj.filepath]  # type: ignore[index]
    except (KeyError, TypeError):
        return None
    found: List[str] = []
    i = obj.lineno - 2  # lineno is 1-based: the line above the assignment
    while i >= 0:
        text = lines[i].strip()
        if text == "#:" or text.startswith("#: "):
            found.append(text[3:])
            i -= 1
        else:
            break
    return "\n".join(reversed(found)) or None


def markdown(text: str, scope: griffe.Object, loader: griffe.GriffeLoader) -> str:
    """A reST-flavoured docstring as Markdown, cross-references resolved from ``scope``."""
    out: List[str] = []
    for is_code, block in _blocks(text):
        if is_code:
            out.append(block)
        else:
            block = _ROLE.sub(lambda m: _reference(m["role"], m["body"], scope, loader), block)
            out.append(_LITERAL.sub(lambda m: _code(m["text"]), block))
    return "".join(out)


def _blocks(text: str) -> Iterator[tuple]:
    """Split ``text`` into (is_code, chunk): reST literal blocks and doctests become fences."""
    lines = text.split("\n")
    prose: List[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith(">>>") and (not prose or not prose[-1].strip()):
            indent = _indent(line)
            code = []
            while i < len(lines) and lines[i].strip():
                code.append(lines[i][indent:])
                i += 1
            yield False, "\n".join(prose) + ("\n" if prose else "")
            prose = []
            yield True, _fence(code, "pycon", indent)
            continue
        if stripped.endswith("::") and not stripped.startswith(".."):
            # "text::" ends the paragraph with "text:"; a lone "::" disappears.
            base = _indent(line)
            head = line.rstrip()[:-1] if stripped != "::" else ""
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j < len(lines) and _indent(lines[j]) > base:
                block_indent = _indent(lines[j])
                code = []
                k = j
                while k < len(lines) and (not lines[k].strip() or _indent(lines[k]) > base):
                    code.append(lines[k][block_indent:])
                    k += 1
                while code and not code[-1].strip():
                    code.pop()
                if head:
                    prose.append(head)
                yield False, "\n".join(prose) + "\n"
                prose = []
                yield True, _fence(code, "", base) + ("\n" if k < len(lines) else "")
                i = k
                continue
        prose.append(line)
        i += 1
    yield False, "\n".join(prose)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _fence(code: List[str], language: str, indent: int) -> str:
    pad = " " * indent
    body = "\n".join(pad + line if line.strip() else "" for line in code)
    return f"\n{pad}```{language}\n{body}\n{pad}```\n"


def _code(text: str) -> str:
    """Markdown inline code for ``text`` (a longer fence when it holds a backtick)."""
    text = " ".join(text.split("\n")) if "\n" in text else text
    if "`" in text:
        return f"`` {text} ``"
    return f"`{text}`"


def _reference(role: str, body: str, scope: griffe.Object, loader: griffe.GriffeLoader) -> str:
    """A Sphinx role as an optional cross-reference (plain code when the target is unknown)."""
    body = body.strip()
    title: Optional[str] = None
    explicit = re.fullmatch(r"(?P<title>.+?)\s*<(?P<target>[^<>]+)>", body)
    if explicit:
        title, body = explicit["title"], explicit["target"]
    short = body.startswith("~")
    target = body.lstrip("~.")
    if title is None:
        title = target.rsplit(".", 1)[-1] if short else target
    label = f"<code>{html.escape(title)}</code>"
    path = _resolve(target, role, scope, loader)
    if path is None:
        return _code(title)
    return f'<autoref identifier="{html.escape(path)}" optional>{label}</autoref>'


def _resolve(
    target: str, role: str, scope: griffe.Object, loader: griffe.GriffeLoader
) -> Optional[str]:
    """The canonical path of ``target`` as seen from ``scope``, or None."""
    first, _, rest = target.partition(".")
    candidates: List[str] = []
    if first == PACKAGE:
        candidates.append(target)
    else:
        for where in (scope, *_parents(scope), loader.modules_collection[PACKAGE]):
            try:
                base = where.resolve(first)
            except (griffe.NameResolutionError, AttributeError, KeyError):
                continue
            candidates.append(f"{base}.{rest}" if rest else base)
    for candidate in candidates:
        obj = _lookup(candidate, loader)
        if obj is None:
            continue
        # A module may have a member of its own name (webds.stages.decode and the stage decode):
        # a reference that asks for no module means the member.
        name = obj.name
        if obj.is_module and role != "mod" and name in obj.members:
            obj = obj.members[name]
        try:
            return obj.canonical_path if not obj.is_alias else obj.final_target.path
        except Exception:  # an alias to something outside the loaded packages
            return None
    return None


def _parents(obj: griffe.Object) -> Iterator[griffe.Object]:
    parent = obj.parent
    while parent is not None:
        yield parent
        parent = parent.parent


def _lookup(path: str, loader: griffe.GriffeLoader) -> Optional[Any]:
    try:
        return loader.modules_collection[path]
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def _is_stage(func: griffe.Function) -> bool:
    return (
        func.parent is not None
        and func.parent.is_module
        and any(_STAGE_DECORATOR.match(str(d.value)) for d in func.decorators)
    )


def _stage_signature(func: griffe.Function) -> None:
    """The signature users call, ``shuffle(bufsize=1000, ...) -> Stage``, not the generator's.

    A stage factory curries the source iterator (the generator's first parameter) and the
    parameters the pipeline injects (``epoch``, ``pipeline_seed``) out of its public signature,
    and a factory class may reshape it further (``detshuffle``). Where the module imports, that
    public signature is read with ``inspect``, keeping the source's annotations and defaults for
    the parameters it shares; otherwise (no torch, say) the usual currying is applied statically.
    """
    static = {p.name: p for p in func.parameters}
    params: Optional[List[griffe.Parameter]] = None
    try:
        factory = getattr(importlib.import_module(func.module.path), func.name)
        signature = inspect.signature(factory)
    except Exception:  # the package's dependencies are not installed: the static rule below
        signature = None
    if signature is not None and hasattr(factory, "fn"):
        params = []
        for p in signature.parameters.values():
            kind = griffe.ParameterKind(p.kind.description)
            same = static.get(p.name)
            if same is not None and same.kind is not kind:
                same = None  # detshuffle's own "epoch" is not the injected one
            annotation: Any = None
            if same is not None:
                annotation = same.annotation
            elif p.annotation is not p.empty:
                annotation = p.annotation if isinstance(p.annotation, str) else str(p.annotation)
            if same is not None:
                default = same.default
            else:
                default = None if p.default is p.empty else repr(p.default)
            params.append(
                griffe.Parameter(p.name, annotation=annotation, kind=kind, default=default)
            )
    if params is None:
        params = [p for p in list(func.parameters)[1:] if p.name not in _INJECTED]
    func.parameters = griffe.Parameters(*params)
    func.returns = griffe.ExprName("Stage", parent=func.modules_collection["webds.stages"])


def _fluent_methods(cls: griffe.Class, loader: griffe.GriffeLoader) -> None:
    """Turn ``shuffle = _chain(filters.shuffle)`` into a documented method of ``cls``."""
    for name, member in list(cls.members.items()):
        if member.is_alias or not member.is_attribute:
            continue
        found = _FLUENT.match(str(member.value)) if member.value is not None else None
        if not found:
            continue
        path = _resolve(found["target"], "func", cls, loader)
        stage = _lookup(path, loader) if path else None
        if stage is None or not stage.is_function:
            continue
        self_param = griffe.Parameter("self", kind=griffe.ParameterKind.positional_only)
        params = [
            griffe.Parameter(p.name, annotation=p.annotation, kind=p.kind, default=p.default)
            for p in stage.parameters
        ]
        method = griffe.Function(
            name,
            lineno=member.lineno,
            endlineno=member.endlineno,
            parameters=griffe.Parameters(self_param, *params),
            returns=None,
        )
        summary = stage.docstring.value.split("\n\n", 1)[0] if stage.docstring else ""
        # The stage's docstring is Markdown already (rewritten before this runs).
        text = (
            f'Append the stage <autoref identifier="{path}" optional><code>{name}</code>'
            f"</autoref> and return the new pipeline: `self.compose({name}(...))`, "
            "with the same arguments.\n\n" + summary
        )
        method.docstring = griffe.Docstring(text, parent=method)
        cls.set_member(name, method)
