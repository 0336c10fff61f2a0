"""Tests for webds.handlers: the five handlers, ErrorPolicy and the shared loop apply_each."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import pytest
from conftest import Tracked, write_tar

from webds.base.handlers import (
    ErrorPolicy,
    apply_each,
    ignore_and_continue,
    ignore_and_stop,
    reraise_exception,
    warn_and_continue,
    warn_and_stop,
)
from webds.fluent import WebDataset


def fail_on_multiples_of_three(x):
    if x % 3 == 0:
        raise KeyError(f"bad {x}")
    return x * 10


def parse_cls(sample):
    return int(sample["cls"])


def none_for_odd(x):
    return None if x % 2 else x


# -- the handlers ----------------------------------------------------------------------------------


def test_reraise_exception_raises_the_same_exception():
    exn = KeyError("k")
    with pytest.raises(KeyError) as info:
        reraise_exception(exn)
    assert info.value is exn


def test_ignore_handlers_decide_quietly():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning would fail the test
        assert ignore_and_continue(ValueError("v")) is True
        assert ignore_and_stop(ValueError("v")) is False


@pytest.mark.parametrize(
    "handler, verdict, verb",
    [(warn_and_continue, True, "skipping"), (warn_and_stop, False, "stopping")],
)
def test_warn_handlers_name_the_error(handler, verdict, verb):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert handler(ValueError("broken sample")) is verdict
    assert len(caught) == 1
    assert str(caught[0].message) == f"webds: {verb} after ValueError: broken sample"


def _from_this_file(caught) -> bool:
    return all(Path(w.filename).resolve() == Path(__file__).resolve() for w in caught)


def test_warnings_point_at_the_caller_not_at_webds():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_and_continue(ValueError("v"))
        warn_and_stop(ValueError("v"))
    assert len(caught) == 2 and _from_this_file(caught)


@pytest.mark.parametrize(
    "handler, verb", [(warn_and_continue, "skipping"), (warn_and_stop, "stopping")]
)
def test_warnings_from_a_pipeline_name_the_loop_stage_sample_and_shard(tmp_path, handler, verb):
    members = [(f"{i:04d}.cls", b"x" if i == 2 else str(i).encode()) for i in range(4)]
    url = str(write_tar(tmp_path / "a.tar", members))
    dataset = WebDataset(url, shardshuffle=False).map(parse_cls, handler=handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [x for x in dataset]  # the line the warning points at
    assert got == ([0, 1, 3] if verb == "skipping" else [0, 1])
    assert len(caught) == 1 and _from_this_file(caught)
    assert caught[0].lineno == sys._getframe().f_lineno - 3
    message = str(caught[0].message)
    assert message.startswith(f"webds: {verb} after ValueError: invalid literal for int()")
    if sys.version_info >= (3, 11):  # where exceptions take notes
        assert message.endswith(f" (in map(parse_cls) on sample '0002' of {url!r})")


# -- ErrorPolicy -----------------------------------------------------------------------------------


def test_error_policy_counts_and_reports_once(caplog):
    policy = ErrorPolicy(ignore_and_continue, "mystage")
    first = KeyError("one")
    assert policy(first) and policy(ValueError("two"))
    assert policy.skipped == 2 and not policy.stopped and policy.first is first
    with caplog.at_level(logging.WARNING, logger="webds"):
        policy.report()
    assert caplog.messages == [
        "webds: mystage skipped 2 item(s) after errors; first: KeyError: 'one'"
    ]


def test_error_policy_stop_and_silence(caplog):
    policy = ErrorPolicy(ignore_and_stop, "mystage")
    assert policy(ValueError("v")) is False
    with caplog.at_level(logging.WARNING, logger="webds"):
        policy.report()
        ErrorPolicy(ignore_and_continue, "clean").report()  # nothing happened: no line
    assert caplog.messages == [
        "webds: mystage skipped 0 item(s) and stopped after errors; first: ValueError: v"
    ]


def test_error_policy_without_a_handler_reraises():
    policy = ErrorPolicy(None, "mystage")
    with pytest.raises(KeyError):
        policy(KeyError("k"))
    assert policy.skipped == 0 and not policy.stopped


# -- apply_each ------------------------------------------------------------------------------------


def test_apply_each_maps_lazily():
    src = Tracked(100)
    out = apply_each(src, str, None, "s")
    assert src.pulled == 0
    assert next(out) == "0" and src.pulled == 1
    assert list(out) == [str(i) for i in range(1, 100)]


def test_apply_each_skip_logs_the_count(caplog):
    with caplog.at_level(logging.WARNING, logger="webds"):
        out = list(apply_each(range(10), fail_on_multiples_of_three, ignore_and_continue, "st"))
    assert out == [10, 20, 40, 50, 70, 80]
    assert caplog.messages == ["webds: st skipped 4 item(s) after errors; first: KeyError: 'bad 0'"]


def test_apply_each_warn_and_continue_warns_per_item():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = list(apply_each(range(7), fail_on_multiples_of_three, warn_and_continue, "st"))
    assert out == [10, 20, 40, 50]
    assert [str(w.message) for w in caught] == [
        f"webds: skipping after KeyError: 'bad {i}'" for i in (0, 3, 6)
    ]


def test_apply_each_stop_ends_the_stream_and_reads_no_further(caplog):
    src = Tracked(100)
    with caplog.at_level(logging.WARNING, logger="webds"):
        out = list(apply_each(src, lambda x: 1 // (5 - x), ignore_and_stop, "st"))
    assert out == [0, 0, 0, 0, 1]
    assert src.pulled == 6  # the failing item is the last one read
    assert caplog.messages == [
        "webds: st skipped 0 item(s) and stopped after errors; first: "
        "ZeroDivisionError: integer division or modulo by zero"
    ]


@pytest.mark.parametrize("handler", [None, reraise_exception])
def test_apply_each_raise_passes_the_exception_through_unchanged(handler, caplog):
    seen = []

    def annotate(exn, stage, item):
        seen.append((type(exn), stage, item))
        exn.where = f"in {stage} on {item}"

    out = apply_each(range(10), fail_on_multiples_of_three, handler, "st", annotate=annotate)
    with caplog.at_level(logging.WARNING, logger="webds"):
        with pytest.raises(KeyError) as info:
            list(out)
    assert info.value.args == ("bad 0",)
    assert info.value.where == "in st on 0"  # annotated before the handler saw it
    assert seen == [(KeyError, "st", 0)]
    assert caplog.messages == []  # raising is not skipping: nothing to report


def test_apply_each_does_not_handle_errors_of_the_source():
    def source():
        yield 1
        raise OSError("upstream broke")

    with pytest.raises(OSError, match="upstream broke"):
        list(apply_each(source(), str, ignore_and_continue, "st"))


def test_apply_each_drop_none_drops_and_counts(caplog):
    with caplog.at_level(logging.DEBUG, logger="webds"):
        out = list(apply_each(range(7), none_for_odd, None, "st", drop_none=True))
    assert out == [0, 2, 4, 6]
    assert caplog.messages == ["webds: st returned None for 3 item(s), which were dropped"]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="webds"):
        assert list(apply_each(range(3), none_for_odd, None, "st")) == [0, None, 2]
    assert caplog.messages == []


def test_apply_each_reports_when_closed_early(caplog):
    out = apply_each(range(100), fail_on_multiples_of_three, ignore_and_continue, "st")
    assert [next(out) for _ in range(3)] == [10, 20, 40]
    with caplog.at_level(logging.WARNING, logger="webds"):
        out.close()
    assert caplog.messages == ["webds: st skipped 2 item(s) after errors; first: KeyError: 'bad 0'"]
