"""Hiding credentials in what webds shows: error messages, reprs and log lines.

URLs carry secrets (``https://user:password@host/...``, ``https://TOKEN@github.com/...``,
presigned ``?X-Amz-Signature=...``, an Azure SAS ``&sig=...``, ``#access_token=...``) and so do
``storage_options`` and headers (``{"secret": ...}``, ``{"Authorization": "Bearer ..."}``) and
``pipe:`` commands (``curl -u user:pw``, ``-H 'X-Api-Key: ...'``, ``TOKEN=... cmd``). Anything
webds prints goes through :func:`redact`, which replaces the secret parts with ``***`` and
leaves the rest readable (scheme, host, path, the shard and member names), so an error still
says which shard failed. Code that must reopen a URL keeps the raw one (``WebdsError.url``, the
stages' arguments); only what is displayed is redacted.

This module imports nothing of webds: :mod:`webds.errors` uses it, and everything uses errors.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, Dict, List, Mapping, Match, Optional, TypeVar, overload
from urllib.parse import unquote

__all__ = ["MASK", "redact", "is_secret_name", "redact_exception", "RedactedError"]

#: What a hidden value is shown as.
MASK = "***"

# Names (of a mapping key, a query parameter, a keyword, a header, an environment variable, a
# command-line option) whose values are secrets, compared in snake case: lower case, "-" read as
# "_", camelCase split (secretAccessKey: secret_access_key): storage_options of
# s3fs/gcsfs/adlfs/sftp, HTTP headers, presigned-URL parameters (AWS SigV4 X-Amz-*, GCS
# X-Goog-*, Azure SAS ``sig``).
_SECRET_NAMES = frozenset(
    """key secret token password passwd pwd passphrase sig signature auth authorization
    proxy_authorization cookie set_cookie credential credentials client_secret api_key apikey
    access_token refresh_token id_token session_token security_token sas_token account_key
    aws_access_key_id aws_secret_access_key aws_session_token connection_string private_key
    """.split()
)
# ...and any name ending so (x_amz_signature, x_amz_credential, x_goog_signature,
# x_amz_security_token, aws_secret_access_key, my_api_key, ...).
_SECRET_SUFFIXES = (
    "secret",
    "password",
    "passwd",
    "token",
    "signature",
    "credential",
    "credentials",
    "_key",
    "apikey",
    "accesskey",
    "passphrase",
    "bearer",
    "access_key_id",
)
# Word boundaries inside camelCase names: "secretAccessKey", "APIKey".
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
# Values of a secret-named field that are settings, not secrets (gcsfs's token="anon", ...):
# shown as they are, so a repr still says how the backend authenticates.
_PUBLIC_VALUES = frozenset({"anon", "google_default", "cache", "cloud", "browser", ""})


def is_secret_name(name: str) -> bool:
    """Whether a field called ``name`` holds a secret (``"secret"``, ``"X-Amz-Signature"``,
    ``"Authorization"``, ``"aws_session_token"``, ``"secretAccessKey"``, ``"passphrase"``: yes;
    ``"endpoint_url"``, ``"region"``: no)."""
    name = name.strip()
    # As written ("aPikey", "SAS_TOKEN") and with camelCase split ("secretAccessKey").
    for norm in {name.lower().replace("-", "_"), _CAMEL.sub("_", name).lower().replace("-", "_")}:
        if norm in _SECRET_NAMES or norm.endswith(_SECRET_SUFFIXES):
            return True
    return False


# -- text -----------------------------------------------------------------------------------------

# scheme://userinfo@ : the userinfo runs to the last "@" before the host's end ("/?#", a quote, a
# space), as urllib splits it.
_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.\-]*://)([^/?#\s'\"<>@]*(?:@[^/?#\s'\"<>@]*)*)@")
# A whole user info that is a token (GitHub's https://TOKEN@github.com/...): GitHub's, GitLab's
# and Slack's prefixes, or 20 and more token characters. A plain user name stays readable.
_TOKEN_USER = re.compile(r"(?:gh[pousr]_|github_pat_|glpat-|xox[a-z]-)\S*|[\w\-]{20,}", re.ASCII)
# ?name=value or &name=value (or ;) in a URL's query, #name=value in its fragment.
_QUERY = re.compile(r"([?&;#])([^=&#;\s'\"?]+)=([^&#;\s'\"]*)")
_QUOTED = r"""[bBrRuU]{0,2}(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")"""
# 'name': value in the repr of a mapping (value quoted, or bare up to the next item).
_MAPPING_ITEM = re.compile(
    r"""(['"])([^'"\s]{1,64})\1(\s*:\s*)(""" + _QUOTED + r"""|[^,{}\[\]()\s'"][^,}\]\s]*)"""
)
# name='value' in a repr's keyword arguments.
_KEYWORD = re.compile(r"\b([A-Za-z_][\w\-]{0,63})(\s*=\s*)(" + _QUOTED + ")")
# Authorization: Basic ... in a dump of HTTP headers.
_HEADER = re.compile(r"(?im)\b((?:proxy-)?authorization)(\s*:\s*)(?!\s*['\"])([^\r\n,}'\"]+)")

# -- shell commands (pipe:) ---------------------------------------------------------------------
# One shell word as a message shows it: quoted; bare, then quoted, then white space
# (user:'p w'); or bare up to white space or a quote (so "'-u', 'user:pw'" in the repr of an
# argument list is two words).
_WORD = r"""(?:'[^']*'|"(?:[^"\\]|\\.)*"|[^\s'"]*(?:'[^']*'|"(?:[^"\\]|\\.)*")(?=\s|$)|[^\s'"]+)"""
# An option and its value: "-u user:pw", "--user=user:pw", "-uuser:pw", "-H 'Name: value'",
# "--oauth2-bearer X", and in the repr of an argument list "'-u', 'user:pw'".
_OPTION = re.compile(
    r"(?<![\w\-])(-[uUH]|--[A-Za-z][\w\-]*)(=|\s+|['\"],\s*|(?<=-[uUH])(?=[^\s'\"]|['\"][^,]))("
    + _WORD
    + ")"
)
# NAME=VALUE where a shell word starts: "TOKEN=x cmd", "env TOKEN=x cmd", "pipe:TOKEN=x cmd".
_ASSIGNMENT = re.compile(r"""(?<![^\s'"(\[|`:])([A-Za-z_]\w*)=(""" + _WORD + ")")
_USER_OPTIONS = {"-u", "-U", "--user", "--proxy-user"}  # USER:PASSWORD
_HEADER_OPTIONS = {"-H", "--header", "--proxy-header"}  # 'Name: value'
_SECRET_OPTIONS = {"--pass"}  # curl's passphrase of a private key; and any secret name
# What an assignment's value shows that is no secret: a repr (key=<function f>), the placeholder
# of a usage text (KEY=VALUE). A variable ($TOKEN) is hidden too: in an argument list it is text.
_NOT_A_VALUE = re.compile(r"<|(?:VALUE|\.\.\.),?$")


def _userinfo(m: Match[str]) -> str:
    user, colon, password = m.group(2).partition(":")
    shown = MASK if _TOKEN_USER.fullmatch(unquote(user)) else user
    if colon and password:
        return f"{m.group(1)}{shown}:{MASK}@"
    return f"{m.group(1)}{shown}{colon}@"


def _query(m: Match[str]) -> str:
    if m.group(3) and is_secret_name(unquote(m.group(2))):
        return f"{m.group(1)}{m.group(2)}={MASK}"
    return m.group(0)


def _item(m: Match[str]) -> str:
    value = m.group(4)
    if not is_secret_name(m.group(2)) or _shown_as_is(value):
        return m.group(0)
    return f"{m.group(1)}{m.group(2)}{m.group(1)}{m.group(3)}'{MASK}'"


def _keyword(m: Match[str]) -> str:
    if not is_secret_name(m.group(1)) or _shown_as_is(m.group(3)):
        return m.group(0)
    return f"{m.group(1)}{m.group(2)}'{MASK}'"


def _header(m: Match[str]) -> str:
    return f"{m.group(1)}{m.group(2)}{MASK}"


def _option(m: Match[str]) -> str:
    option, sep, word = m.groups()
    quote = _quote_of(word)
    inner = word[1:-1] if quote else word
    if option in _USER_OPTIONS or option in _HEADER_OPTIONS:
        # user:password; or Name: value, of a header whose name is secret-looking.
        name, colon, rest = inner.partition(":")
        if option in _HEADER_OPTIONS and not is_secret_name(name.strip("'\"")):
            return m.group(0)
        if not rest.strip() or rest.strip().strip("'\"") == MASK:
            return m.group(0)
        blank = rest[: len(rest) - len(rest.lstrip())]
        return f"{option}{sep}{quote}{name}{colon}{blank}{MASK}{quote}"
    secret = option in _SECRET_OPTIONS or is_secret_name(option.lstrip("-"))
    if not sep or not secret or inner == MASK:
        return m.group(0)
    return f"{option}{sep}{quote}{MASK}{quote}"


def _quote_of(word: str) -> str:
    """The quote around a whole shell word (``'a b'``: ``'``), or ``""``."""
    return word[0] if len(word) > 1 and word[0] in "'\"" and word[-1] == word[0] else ""


def _assignment(m: Match[str]) -> str:
    name, word = m.groups()
    if not is_secret_name(name) or _shown_as_is(word) or _NOT_A_VALUE.match(word):
        return m.group(0)
    return f"{name}={MASK}" if not _quote_of(word) else f"{name}={word[0]}{MASK}{word[0]}"


def _shown_as_is(value: str) -> bool:
    """A displayed value that is no secret: None, a bool, ``'anon'``, or already masked."""
    if value in ("None", "True", "False"):
        return True
    inner = value.lstrip("bBrRuU")[1:-1] if value[-1:] in "'\"" else value
    return inner in _PUBLIC_VALUES or inner == MASK


_TEXT_RULES = (
    # Commands first: a secret option's value is hidden whole, whatever it looks like.
    (_OPTION, _option),
    (_ASSIGNMENT, _assignment),
    (_USERINFO, _userinfo),
    (_QUERY, _query),
    (_MAPPING_ITEM, _item),
    (_KEYWORD, _keyword),
    (_HEADER, _header),
)


def _redact_text(text: str) -> str:
    # The cheap test first: most messages name no URL with secrets and no mapping.
    if "@" not in text and "=" not in text and ":" not in text and "--" not in text:
        return text
    for pattern, replace in _TEXT_RULES:
        text = pattern.sub(replace, text)
    return text


# -- values ---------------------------------------------------------------------------------------

T = TypeVar("T")


def _masked(value: Any) -> Any:
    if (
        value is None
        or isinstance(value, bool)
        or (isinstance(value, str) and value in _PUBLIC_VALUES)
    ):
        return value
    return MASK


@overload
def redact(value: str) -> str: ...
@overload
def redact(value: Mapping[Any, Any]) -> Dict[Any, Any]: ...
@overload
def redact(value: T) -> T: ...
def redact(value: Any) -> Any:
    """``value`` fit to show: credentials replaced by ``***``, the rest as it was.

    A string (a URL, a message, a repr) loses the password of each URL's userinfo, the values of
    query parameters that carry credentials, and the values of secret-named items and keywords
    it displays; a mapping (``storage_options``, headers) becomes a copy whose secret-named
    values are ``***`` (nested mappings and lists alike); anything else is returned as it is.

    >>> redact("https://user:pw@host/a/shard-0001.tar?X-Amz-Signature=abc&part=1")
    'https://user:***@host/a/shard-0001.tar?X-Amz-Signature=***&part=1'
    >>> redact({"key": "AKID", "secret": "S", "endpoint_url": "http://minio:9000"})
    {'key': '***', 'secret': '***', 'endpoint_url': 'http://minio:9000'}
    """
    if isinstance(value, str):
        return _redact_text(value)
    if isinstance(value, Mapping):
        return {
            k: _masked(v) if isinstance(k, str) and is_secret_name(k) else redact(v)
            for k, v in value.items()
        }
    if type(value) in (list, tuple):
        return type(value)(redact(v) for v in value)
    return value


# -- exceptions -----------------------------------------------------------------------------------


class RedactedError(Exception):
    """What an exception whose text had to be redacted in place becomes when pickled: its
    class's name and its redacted text (the original's arguments hold the secrets)."""


def redact_exception(exn: BaseException) -> BaseException:
    """Hide credentials in the text of ``exn`` and of the exceptions chained to it, in place;
    returns ``exn``.

    A traceback shows every exception of the chain (``raise ... from exn``): a client's error
    names the URL it fetched, signature and all. Each one keeps its class and attributes (code
    that looks at ``__cause__`` still sees a 404), only its string arguments and notes are
    redacted; one whose ``str()`` still shows a secret (it builds its text from other fields, as
    aiohttp's ``ClientResponseError`` does) gets a subclass of the same name that shows the
    redacted text. Exceptions that redact themselves (``WebdsError``) are left as they are.
    """
    seen: List[BaseException] = []
    todo: List[Optional[BaseException]] = [exn]
    while todo and len(seen) < 32:
        cur = todo.pop()
        if cur is None or any(cur is s for s in seen):
            continue
        seen.append(cur)
        _redact_one(cur)
        todo += [cur.__context__, cur.__cause__]
    return exn


def _redact_one(exn: BaseException) -> None:
    notes = getattr(exn, "__notes__", None)
    if isinstance(notes, list):
        notes[:] = [redact(n) if isinstance(n, str) else n for n in notes]
    if getattr(type(exn), "redacts_itself", False):
        return
    text = _text(exn)
    if text is None or _redact_text(text) == text:
        return
    exn.args = tuple(_redact_text(a) if isinstance(a, str) else a for a in exn.args)
    for name in ("filename", "filename2", "strerror", "msg"):  # OSError's fields, and others'
        value = getattr(exn, name, None)
        if isinstance(value, str):
            try:
                setattr(exn, name, _redact_text(value))
            except (AttributeError, TypeError):
                pass
    text = _text(exn)
    if text is not None and _redact_text(text) != text:
        _show_as(exn, _redact_text(text))


def _text(exn: BaseException) -> Optional[str]:
    try:
        return str(exn)
    except Exception:  # a broken __str__ is the traceback module's to report
        return None


def _show_as(exn: BaseException, text: str) -> None:
    """Make ``exn`` display ``text``: Python looks ``__str__`` up on the class, so it gets a
    subclass of the same name (and module) whose ``__str__`` gives ``text``."""
    cls = type(exn)
    if not cls.__flags__ & (1 << 9):  # Py_TPFLAGS_HEAPTYPE: a builtin class cannot be swapped
        return
    try:
        exn.__dict__["_webds_redacted"] = text
        exn.__class__ = _redacted_class(cls)
    except (AttributeError, TypeError):
        pass


def _stored_text(self: BaseException) -> str:
    return self.__dict__["_webds_redacted"]


def _stored_repr(self: BaseException) -> str:
    return f"{type(self).__name__}({_stored_text(self)!r})"


def _reduced(self: BaseException) -> Any:
    return (RedactedError, (f"{type(self).__qualname__}: {_stored_text(self)}",))


@functools.cache
def _redacted_class(cls: type) -> type:
    body: Dict[str, Callable[..., Any]] = {
        "__str__": _stored_text,
        "__repr__": _stored_repr,
        "__reduce__": _reduced,
    }
    sub = type(cls.__name__, (cls,), body)
    sub.__module__, sub.__qualname__ = cls.__module__, cls.__qualname__
    return sub
