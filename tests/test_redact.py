"""No secrets in what webds shows: reprs, error messages, tracebacks and log lines.

Unit tests of :func:`webds.base.redact.redact` over many shapes of URL and mapping (a property
test: a random secret in each credential place never comes out; host, path and shard name always
do), then end to end: reprs of the public objects built with storage_options secrets, and real
failing reads from loopback servers (HTTP 404, a connection cut mid-body with retries logged, S3
on moto) whose errors, tracebacks and log records are searched for the secrets.
"""

from __future__ import annotations

import ast
import logging
import traceback
import warnings
from pathlib import Path
from typing import Any, Dict, List, Tuple
from urllib.parse import quote

import pytest
from conftest import sample_members, write_tar
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import webds
from webds.base.redact import MASK, is_secret_name, redact, redact_exception
from webds.errors import NotFoundError, OpenError, ShardReadError

# Query parameters that carry credentials, as the brief and the clouds spell them.
CREDENTIAL_PARAMS = [
    "X-Amz-Signature",
    "X-Amz-Credential",
    "X-Amz-Security-Token",
    "X-Goog-Signature",
    "X-Goog-Credential",
    "sig",
    "token",
    "access_token",
    "api_key",
    "apikey",
    "key",
    "signature",
    "password",
    "secret",
]
# Keys of storage_options and headers whose values are secrets.
SECRET_KEYS = [
    "key",
    "secret",
    "token",
    "password",
    "client_secret",
    "aws_secret_access_key",
    "aws_session_token",
    "Authorization",
    "session_token",
    "sas_token",
    "account_key",
    "credentials",
    "passphrase",
    "secretAccessKey",
    "sessionToken",
    "apiKey",
    "clientSecret",
    "accessKey",
]
# Where a URL's fragment carries a token (OAuth's implicit flow).
FRAGMENT_PARAMS = ["token", "access_token", "id_token"]
_TOKEN_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"
# A whole user info that is a token: GitHub's, GitLab's and Slack's prefixes, or 20+ characters.
user_tokens = st.one_of(
    st.text(_TOKEN_CHARS, min_size=20, max_size=60),
    st.builds(
        lambda prefix, rest: prefix + rest,
        st.sampled_from(["ghp_", "gho_", "ghs_", "github_pat_", "glpat-", "xoxb-", "xoxp-"]),
        st.text(_TOKEN_CHARS, min_size=1, max_size=40),
    ),
)

_SECRET_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZabcdefghjkmnpqrstuvwxyz23456789+/=_-.~!$&'()*,;:@?#%"
secrets = st.text(_SECRET_CHARS, min_size=8, max_size=40)
hosts = st.sampled_from(
    ["example.com", "127.0.0.1:8080", "bucket.s3.us-east-1.amazonaws.com", "[::1]:9000", "h"]
)
schemes = st.sampled_from(["http", "https", "s3", "gs", "az", "ftp", "sftp"])
segments = st.lists(
    st.text("abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=8), max_size=3
)
shard_numbers = st.integers(0, 999999)


def _case(name: str, flips: List[bool]) -> str:
    return "".join(c.swapcase() if flip else c for c, flip in zip(name, flips + [False] * 40))


@st.composite
def secret_urls(draw: Any) -> Dict[str, Any]:
    """A URL with one secret in userinfo (a password, or a token as the whole user info), a
    credential query parameter or a token in the fragment, and the parts that must stay
    readable."""
    places = ["userinfo", "token_userinfo", "fragment"] + CREDENTIAL_PARAMS
    place = draw(st.sampled_from(places))
    secret = draw(user_tokens if place == "token_userinfo" else secrets)
    host, scheme = draw(hosts), draw(schemes)
    path = "/".join(draw(segments))
    shard = f"shard-{draw(shard_numbers):06d}.tar"
    encoded = quote(secret, safe="")
    user = draw(st.sampled_from(["user", "AKIA", "me.name"]))
    netloc = {"userinfo": f"{user}:{{0}}@{host}", "token_userinfo": f"{{0}}@{host}"}.get(
        place, host
    )
    query = [f"part={draw(st.integers(0, 9))}"]
    fragment = ""
    if place == "fragment":
        name = draw(st.sampled_from(FRAGMENT_PARAMS))
        fragment = f"#{_case(name, draw(st.lists(st.booleans(), max_size=len(name))))}={{0}}"
        fragment += draw(st.sampled_from(["", "&token_type=bearer", "&expires_in=3600"]))
    elif place in CREDENTIAL_PARAMS:
        name = _case(place, draw(st.lists(st.booleans(), max_size=len(place))))
        query.insert(draw(st.integers(0, 1)), f"{name}={{0}}")
    full_path = f"/{path}/{shard}" if path else f"/{shard}"
    template = f"{scheme}://{netloc}{full_path}?{'&'.join(query)}{fragment}"
    return {
        "url": template.format(encoded),
        "readable": template.format(""),
        "secret": secret,
        "encoded": encoded,
        "host": host,
        "path": full_path,
    }


@settings(max_examples=300, deadline=None)
@given(
    secret_urls(), st.sampled_from(["{}", "failed reading {!r}: boom", "[shard '{}'] x", "a {} b"])
)
def test_a_secret_in_any_credential_place_never_comes_out(case: Dict[str, Any], frame: str) -> None:
    url = case["url"]
    # The secret must not be part of what stays readable (a host "h" inside a secret, say).
    readable = case["readable"]
    assume(case["encoded"] not in readable and case["secret"] not in readable)
    out = redact(frame.format(url))
    assert case["encoded"] not in out and case["secret"] not in out, out
    assert MASK in out
    assert case["host"] in out and case["path"] in out and "part=" in out


# A secret in each place of a shell command that carries one (shlex-quoted as a shell needs it:
# without quotes or backslashes, which a repr would escape), and how messages show the command.
SHELL_PLACES = [
    ("-u {}", "user:{}"),
    ("--user={}", "me:{}"),
    ("-u{}", "me:{}"),
    ("-H {}", "X-Api-Key: {}"),
    ("--header {}", "Authorization: Bearer {}"),
    ("-H {}", "Cookie: session={}"),
    ("-H {}", "Private-Token:{}"),
    ("--oauth2-bearer {}", "{}"),
    ("--password {}", "{}"),
    ("--password={}", "{}"),
    ("AWS_SECRET_ACCESS_KEY={}", "{}"),
    ("env TOKEN={}", "{}"),
    ("GITHUB_TOKEN={}", "{}"),
]
shell_secrets = st.text(_SECRET_CHARS.replace("'", "").replace('"', ""), min_size=8, max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(SHELL_PLACES),
    shell_secrets,
    hosts,
    shard_numbers,
    st.sampled_from(["pipe:{}", "command {!r} exited with status 22", "<Pipe {}>", "[{}]"]),
)
def test_a_secret_in_any_shell_place_of_a_pipe_command_never_comes_out(
    place: Tuple[str, str], secret: str, host: str, number: int, frame: str
) -> None:
    import shlex

    shard = f"shard-{number:06d}.tar"
    word = place[0].format(shlex.quote(place[1].format(secret)))  # as shlex.join writes it
    url = f"https://{host}/d/{shard}"
    # An option goes after the program, an environment variable before it.
    command = f"curl -s {word} {url}" if word[0] == "-" else f"{word} curl -s {url}"
    assume(secret not in command.replace(secret, "", 1))  # one copy: the one to hide
    shown = frame.format(shlex.split(command) if frame == "<Pipe {}>" else command)
    out = redact(shown)
    assert secret not in out and shlex.quote(secret) not in out, out
    assert MASK in out and f"{host}/d/{shard}" in out, out


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(SECRET_KEYS),
    secrets,
    st.sampled_from(["top", "client_kwargs", "headers"]),
    st.booleans(),
)
def test_a_secret_in_any_mapping_key_never_comes_out(
    key: str, secret: str, where: str, upper: bool
) -> None:
    key = key.upper() if upper else key
    endpoint = "http://minio.local:9000"
    options: Dict[str, Any] = {"endpoint_url": endpoint, "anon": False, "region": "us-east-1"}
    if where == "top":
        options[key] = secret
    else:
        options[where] = {key: secret, "endpoint_url": endpoint}
    shown = repr(redact(options))
    assert secret not in shown and repr(secret) not in shown, shown
    assert endpoint in shown and "us-east-1" in shown and "'anon': False" in shown
    # The same mapping already formatted into a text (a message, a repr) is redacted as text.
    text = redact(f"bad options {options!r} for {endpoint}")
    assert repr(secret)[1:-1] not in text, text
    assert endpoint in text and "us-east-1" in text


@pytest.mark.parametrize(
    "url, expected",
    [
        ("https://user:pw@host/a/b.tar", "https://user:***@host/a/b.tar"),
        ("https://user:p%40ss@host:8443/x.tar", "https://user:***@host:8443/x.tar"),
        ("http://u:p@ss@h/x", "http://u:***@h/x"),  # an unencoded "@": up to the last one
        ("https://user@host/x.tar", "https://user@host/x.tar"),  # no password: nothing to hide
        (
            "https://b.s3.amazonaws.com/k/s-0001.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256"
            "&X-Amz-Credential=AKIA%2F2024&X-Amz-Date=20240101T000000Z&X-Amz-Expires=3600"
            "&X-Amz-SignedHeaders=host&X-Amz-Signature=abcdef0123",
            "https://b.s3.amazonaws.com/k/s-0001.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256"
            "&X-Amz-Credential=***&X-Amz-Date=20240101T000000Z&X-Amz-Expires=3600"
            "&X-Amz-SignedHeaders=host&X-Amz-Signature=***",
        ),
        (
            "https://acct.blob.core.windows.net/c/s.tar?sv=2022-11-02&se=2030&sp=r&sig=AbC%3D",
            "https://acct.blob.core.windows.net/c/s.tar?sv=2022-11-02&se=2030&sp=r&sig=***",
        ),
        (
            "gs://b/s.tar?x-goog-signature=ff&X-Goog-Credential=a",
            "gs://b/s.tar?x-goog-signature=***&X-Goog-Credential=***",
        ),
        ("https://h/s.tar?TOKEN=t&page=2#frag", "https://h/s.tar?TOKEN=***&page=2#frag"),
        ("https://h/s.tar?key=&x=1", "https://h/s.tar?key=&x=1"),  # empty: nothing to hide
        (
            "s3://bucket/train/shard-{000000..000099}.tar",
            "s3://bucket/train/shard-{000000..000099}.tar",
        ),
        ("pipe:curl -s -u me:pw https://h/x.tar", "pipe:curl -s -u me:*** https://h/x.tar"),
        ("pipe:curl -s https://me:pw@h/x.tar", "pipe:curl -s https://me:***@h/x.tar"),
        ("/data/shards/train-0001.tar", "/data/shards/train-0001.tar"),
        ("Authorization: Bearer abc.def", "Authorization: ***"),
        ("BasicAuth(login='u', password='pw')", "BasicAuth(login='u', password='***')"),
        ("{'token': 'anon', 'project': 'p'}", "{'token': 'anon', 'project': 'p'}"),
        ("{'__key__': '0001', 'cls': b'3'}", "{'__key__': '0001', 'cls': b'3'}"),
        ("--storage-option takes KEY=VALUE, got 'x'", "--storage-option takes KEY=VALUE, got 'x'"),
        ('pipe:TOKEN="$T" curl -H "Token: $T" h', 'pipe:TOKEN="***" curl -H "Token: ***" h'),
        ("sort(key=<function f at 0x1>)", "sort(key=<function f at 0x1>)"),
        # A token in the fragment (OAuth's implicit flow), or as the whole user info (GitHub).
        ("https://h/s.tar#token=abc", "https://h/s.tar#token=***"),
        (
            "https://h/cb#access_token=abc&token_type=bearer&expires_in=60",
            "https://h/cb#access_token=***&token_type=bearer&expires_in=60",
        ),
        ("https://ghp_0123456789abcdefghijABCDEFGHIJ@github.com/o/r", "https://***@github.com/o/r"),
        ("https://glpat-x1y2@gitlab.com/g/s.tar", "https://***@gitlab.com/g/s.tar"),
        ("https://xoxb-12-34@h/x.tar", "https://***@h/x.tar"),
        ("https://Ab0_Cd1-Ef2_Gh3-Ij4_@h/x.tar", "https://***@h/x.tar"),  # 20 token characters
        ("https://gho_abc:x-oauth-basic@github.com/o/r", "https://***:***@github.com/o/r"),
        ("https://alice@host/x.tar", "https://alice@host/x.tar"),  # a plain name stays readable
        ("https://me.name_99@host/x.tar", "https://me.name_99@host/x.tar"),
        # pipe: commands: options, headers and environment variables that carry secrets.
        ("pipe:curl -u user:S3 https://h/x.tar", "pipe:curl -u user:*** https://h/x.tar"),
        ("pipe:curl --user=me:S3 https://h/x", "pipe:curl --user=me:*** https://h/x"),
        ("pipe:curl -ume:S3 https://h/x", "pipe:curl -ume:*** https://h/x"),
        ("pipe:curl -u me https://h/x.tar", "pipe:curl -u me https://h/x.tar"),  # prompts
        ("pipe:python -u f.py h/x.tar", "pipe:python -u f.py h/x.tar"),
        (
            "pipe:curl -H 'X-Api-Key: S3' -H 'Accept: */*' https://h/x",
            "pipe:curl -H 'X-Api-Key: ***' -H 'Accept: */*' https://h/x",
        ),
        ('pipe:curl --header "Cookie: a=b; c=d" h/x', 'pipe:curl --header "Cookie: ***" h/x'),
        ("pipe:curl -H Private-Token:S3 h/x", "pipe:curl -H Private-Token:*** h/x"),
        ("pipe:curl --oauth2-bearer S3 https://h/x", "pipe:curl --oauth2-bearer *** https://h/x"),
        ("pipe:wget --password=S3 -O - https://h/x", "pipe:wget --password=*** -O - https://h/x"),
        ("pipe:curl --password 'a b' h/x", "pipe:curl --password '***' h/x"),
        (
            "pipe:AWS_SECRET_ACCESS_KEY=S3 aws s3 cp s3://b/x.tar -",
            "pipe:AWS_SECRET_ACCESS_KEY=*** aws s3 cp s3://b/x.tar -",
        ),
        (
            "pipe:env TOKEN=S3 AWS_REGION=eu-1 hf download x.tar",
            "pipe:env TOKEN=*** AWS_REGION=eu-1 hf download x.tar",
        ),
        (
            "<Pipe ['curl', '-u', 'me:S3', '-H', 'X-Api-Key: S3', 'https://h/x.tar']>",
            "<Pipe ['curl', '-u', 'me:***', '-H', 'X-Api-Key: ***', 'https://h/x.tar']>",
        ),
        (
            "command \"curl -H 'Token: S3' h/x.tar\" exited with status 22",
            "command \"curl -H 'Token: ***' h/x.tar\" exited with status 22",
        ),
        (
            "{'passphrase': 'pw', 'secretAccessKey': 'S3'}",
            "{'passphrase': '***', 'secretAccessKey': '***'}",
        ),
    ],
)
def test_redact_shapes(url: str, expected: str) -> None:
    assert redact(url) == expected
    assert redact(expected) == expected  # redacting twice changes nothing


def test_redact_mappings_and_other_values() -> None:
    options = {
        "key": "AKID",
        "secret": "S3CR3T",
        "token": None,
        "client_kwargs": {"endpoint_url": "http://u:pw@minio:9000", "aws_session_token": "T"},
        "headers": {"Authorization": "Bearer X", "User-Agent": "webds"},
        "urls": ["https://h/a.tar?sig=Z", "https://h/b.tar"],
        "block_size": 2**20,
    }
    assert redact(options) == {
        "key": MASK,
        "secret": MASK,
        "token": None,
        "client_kwargs": {"endpoint_url": "http://u:***@minio:9000", "aws_session_token": MASK},
        "headers": {"Authorization": MASK, "User-Agent": "webds"},
        "urls": ["https://h/a.tar?sig=***", "https://h/b.tar"],
        "block_size": 2**20,
    }
    assert options["secret"] == "S3CR3T"  # a copy: the caller's options still work
    assert (
        redact(7) == 7
        and redact(None) is None
        and redact(("a", "s://u:p@h")) == ("a", "s://u:***@h")
    )
    assert is_secret_name("X-Amz-Security-Token") and is_secret_name("Proxy-Authorization")
    assert not is_secret_name("endpoint_url") and not is_secret_name("__key__")


@pytest.mark.parametrize(
    "name",
    [
        "passphrase",
        "accessKey",
        "secretAccessKey",
        "sessionToken",
        "apiKey",
        "APIKey",
        "clientSecret",
        "accessKeyId",
        "SAS_TOKEN",
        "X-Api-Key",
        "Cookie",
        "oauth2Bearer",
    ],
)
def test_camel_case_and_sftp_secret_names(name: str) -> None:
    assert is_secret_name(name)
    assert redact({name: "S3CR3T"}) == {name: MASK}


@pytest.mark.parametrize(
    "name",
    ["endpointUrl", "regionName", "userName", "username", "__key__", "tokenType", "keyPrefix"],
)
def test_names_that_are_no_secret(name: str) -> None:
    assert not is_secret_name(name)


# ---------------------------------------------------------------------------------------------
# Errors: the message, the URL shown, repr, the chain a traceback shows; the raw URL kept


SIGNED = "http://user:secretpw@127.0.0.1:1/data/missing.tar?X-Amz-Signature=SIG0SIG"
LEAKS = ("secretpw", "SIG0SIG")


def _shown(exn: BaseException) -> str:
    """Everything a user may see of ``exn``: str, repr, the formatted traceback with its chain."""
    return "\n".join([str(exn), repr(exn), "".join(traceback.format_exception(exn))])


def _assert_clean(text: str, *leaks: str) -> None:
    for leak in leaks or LEAKS:
        assert leak not in text, f"{leak!r} shown in:\n{text}"


def test_error_shows_the_shard_without_its_secrets_and_keeps_the_raw_url() -> None:
    class ClientError(Exception):  # a client's error that builds its text from a field
        def __init__(self, url: str) -> None:
            super().__init__()
            self.url = url

        def __str__(self) -> str:
            return f"404, message='Not Found', url={self.url!r}"

    try:
        try:
            raise ClientError(SIGNED)
        except ClientError as inner:
            raise NotFoundError(f"cannot open {SIGNED}: {inner}", url=SIGNED) from inner
    except NotFoundError as caught:
        exn = caught
    shown = _shown(exn)
    _assert_clean(shown)
    assert "missing.tar" in str(exn) and "127.0.0.1:1/data/missing.tar" in shown
    assert exn.url == SIGNED  # code that reopens the shard has the URL it was given
    assert isinstance(exn.__cause__, ClientError) and exn.__cause__.url == SIGNED
    # Pickled across a DataLoader worker, it stays clean.
    import pickle

    again = pickle.loads(pickle.dumps(exn))
    _assert_clean(_shown(again))
    assert again.url == SIGNED


def test_redact_exception_keeps_the_class_and_cleans_builtin_errors() -> None:
    exn = FileNotFoundError(SIGNED)
    exn.add_note(f"webds: in map(f) on sample '0001' of {SIGNED!r}")
    assert redact_exception(exn) is exn
    _assert_clean(_shown(exn))
    assert type(exn) is FileNotFoundError and "missing.tar" in str(exn)


# ---------------------------------------------------------------------------------------------
# Reprs of the public objects


OPTIONS = {"key": "AKIDLEAK", "secret": "S3CRETLEAK", "client_kwargs": {"region_name": "eu-1"}}
OPTION_LEAKS = ("AKIDLEAK", "S3CRETLEAK")


def test_reprs_show_shards_not_secrets(tmp_path: Path) -> None:
    url = "s3://bucket/train/shard-000001.tar"
    dataset = webds.WebDataset(url, storage_options=OPTIONS, shardshuffle=False)
    pipeline = webds.DataPipeline(
        webds.SimpleShardList(SIGNED), webds.tarfile_to_samples(**OPTIONS), webds.shuffle(10)
    )
    loader = webds.WebLoader(dataset, num_workers=0, batch_size=None)
    writer = webds.ShardWriter(
        "ftp://user:secretpw@127.0.0.1:1/out/shard-%06d.tar", storage_options=OPTIONS, index=False
    )
    for obj, name in [
        (webds.tarfile_to_samples(**OPTIONS), "tarfile_to_samples"),
        (dataset, "shard-000001.tar"),
        (pipeline, "tarfile_to_samples"),
        (loader, "shard-000001.tar"),
        (writer, "shard-%06d.tar"),
    ]:
        text = repr(obj)
        _assert_clean(text, *OPTION_LEAKS, "secretpw")
        assert name in text, text
    assert "eu-1" in repr(pipeline)  # what is no secret stays readable


def test_a_pipe_shows_its_command_without_the_password() -> None:
    from webds.compat.openers import Pipe

    pipe = Pipe(["echo", SIGNED], mode="rb")
    try:
        assert pipe.read().decode().strip() == SIGNED  # the command got the real URL
        _assert_clean(str(pipe))
        assert "missing.tar" in str(pipe)
    finally:
        pipe.close()


def test_a_warning_about_a_users_error_hides_the_url_it_names(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shard = tmp_path / "shard-000000.tar"
    write_tar(shard, sample_members(2))

    def fetch(sample: Dict[str, Any]) -> Any:
        raise ValueError(f"cannot fetch {SIGNED}")

    caplog.set_level(logging.WARNING, logger="webds")
    dataset = webds.WebDataset(str(shard), shardshuffle=False, empty_check=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _read_all(dataset.map(fetch, handler=webds.warn_and_continue))
    said = "\n".join(str(w.message) for w in caught) + _logged(caplog)
    assert said.count("missing.tar") == 3, said  # two warnings, one summary line
    _assert_clean(said)


# ---------------------------------------------------------------------------------------------
# Real failing reads


def _read_all(dataset: Any) -> None:
    for _ in dataset:
        pass


def _signed(server: Any, name: str) -> str:
    return f"http://user:secretpw@127.0.0.1:{server.port}/{name}?X-Amz-Signature=SIG0SIG"


def _logged(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(
        f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records if r.name.startswith("webds")
    )


def test_http_404_error_and_logs_hide_the_password_and_signature(
    flaky_http_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="webds")
    url = _signed(flaky_http_server, "missing.tar")
    with pytest.raises(NotFoundError) as info:
        _read_all(webds.WebDataset(url, shardshuffle=False))
    _assert_clean(_shown(info.value))
    _assert_clean(_logged(caplog))
    assert "missing.tar" in str(info.value) and "127.0.0.1" in str(info.value)
    assert info.value.url == url
    # A handler that warns and skips shows the same error: clean too.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _read_all(
            webds.WebDataset(
                url, shardshuffle=False, handler=webds.warn_and_continue, empty_check=False
            )
        )
    said = "\n".join(str(w.message) for w in caught) + _logged(caplog)
    assert "missing.tar" in said
    _assert_clean(said)


def test_http_cut_mid_body_retries_log_and_fail_without_secrets(
    flaky_http_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    write_tar(flaky_http_server.root / "cut.tar", sample_members(20))
    # The first response breaks off after 1000 bytes, every later one at once: no progress.
    flaky_http_server.cut_each([1000])
    flaky_http_server.cut_after(0, times=100)
    caplog.set_level(logging.DEBUG, logger="webds")
    url = _signed(flaky_http_server, "cut.tar")
    options = {"retries": 2, "retry_backoff": 0.001}
    with pytest.raises(ShardReadError) as info:
        _read_all(webds.WebDataset(url, shardshuffle=False, storage_options=options))
    retries = [r for r in caplog.records if "retry" in r.getMessage()]
    assert len(retries) == 2, _logged(caplog)
    assert all("cut.tar" in r.getMessage() for r in retries)
    _assert_clean(_logged(caplog))
    _assert_clean(_shown(info.value))
    assert "cut.tar" in str(info.value) and info.value.url == url


def test_s3_errors_reprs_and_logs_hide_storage_options(
    s3: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="webds")
    secret = "moto-s3cret-LEAK"
    options = dict(s3.storage_options, secret=secret, key="AKIDLEAK", retries=0)
    dataset = webds.WebDataset(s3.url("train/missing-000.tar"), storage_options=options)
    with pytest.raises(OpenError) as info:
        _read_all(dataset)
    shown = _shown(info.value) + repr(dataset) + _logged(caplog)
    _assert_clean(shown, secret, "AKIDLEAK")
    assert "missing-000.tar" in str(info.value) and "missing-000.tar" in repr(dataset)


# ---------------------------------------------------------------------------------------------
# Every log line in webds that formats a URL passes it through redact()

_URLISH = ("url", "urls", "fname", "pattern", "command", "stale", "location")
_LOGGING = {"debug", "info", "warning", "error", "exception", "critical"}


def _unredacted_log_args(source: str) -> List[str]:
    """``name`` for each URL-ish argument of a ``log.<level>(...)`` call not wrapped in
    ``redact(...)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _LOGGING
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in ("log", "logger")
        ):
            continue
        for arg in node.args[1:]:
            if isinstance(arg, ast.Call) and getattr(arg.func, "id", None) in ("redact", "len"):
                continue
            names = {n.id for n in ast.walk(arg) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(arg) if isinstance(n, ast.Attribute)}
            hit = sorted(n for n in names if any(n == u or n.endswith("_" + u) for u in _URLISH))
            if hit:
                found.append(f"line {arg.lineno}: {', '.join(hit)}")
    return found


def test_the_log_check_sees_an_unredacted_url() -> None:
    planted = 'log.warning("x %s %s", self.url, redact(index_url))\nlog.info("%s", n)\n'
    assert _unredacted_log_args(planted) == ["line 1: url"]


def test_every_logged_url_is_redacted() -> None:
    package = Path(webds.__file__).parent
    bad = {}
    for path in sorted(package.rglob("*.py")):
        found = _unredacted_log_args(path.read_text())
        if found:
            bad[str(path.relative_to(package))] = found
    assert not bad, f"log calls formatting a URL without redact(): {bad}"
