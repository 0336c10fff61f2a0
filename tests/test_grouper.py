"""webds.tar.grouper: the one grouping of members into samples, as both readers use it."""

import logging

import pytest

from webds.base.handlers import ErrorPolicy, ignore_and_continue, ignore_and_stop
from webds.errors import SampleError
from webds.pipeline import DataPipeline
from webds.tar.grouper import (
    ALL_FILTERED,
    END,
    Grouping,
    ShardNotes,
    base_plus_ext,
    group_members,
)
from webds.tar.grouping import group_by_keys, tar_file_expander, url_opener
from webds.tar.reader import EndWithoutMarker
from webds.tar.samples import tarfile_samples


def members(*names):
    """(name, data, offset) per name, 1024 bytes apart; the data is the name."""
    return [(name, name.encode(), 1024 * i) for i, name in enumerate(names)]


def grouped(items, rules=None, handler=None, local_path=None):
    rules = Grouping() if rules is None else rules
    notes = ShardNotes()
    policy = ErrorPolicy(handler, "test")
    return list(group_members(iter(items), "u.tar", rules, policy, notes, local_path)), notes


def test_each_sample_comes_with_the_start_of_the_next():
    got, _ = grouped(members("a.jpg", "a.cls", "b.jpg", "c.jpg"))
    assert got == [
        (None, 0),
        ({"__key__": "a", "__url__": "u.tar", "jpg": b"a.jpg", "cls": b"a.cls"}, 2048),
        ({"__key__": "b", "__url__": "u.tar", "jpg": b"b.jpg"}, 3072),
        ({"__key__": "c", "__url__": "u.tar", "jpg": b"c.jpg"}, END),
    ]
    assert grouped([])[0] == [(None, END)]


def test_folders_case_metadata_and_dotless_names(caplog):
    items = members("__meta__", "d.v/x.SEG.PNG", "d.v/x.jpg", "README", "dir.v2/file", "y.a")
    got, notes = grouped(items, local_path="/p/u.tar")
    samples = [s for s, _ in got if s is not None]
    assert [(s["__key__"], sorted(s)) for s in samples] == [
        ("d.v/x", ["__key__", "__local_path__", "__url__", "jpg", "seg.png"]),
        ("y", ["__key__", "__local_path__", "__url__", "a"]),
    ]
    assert (notes.dotless, notes.first_dotless) == (2, "README")
    with caplog.at_level(logging.WARNING, logger="webds"):
        notes.warn_dotless("u.tar")
        notes.warn_dotless("u.tar")  # counted again from zero: no second line
    assert [r.getMessage().count("skipped 2 member") for r in caplog.records] == [1]


def test_a_duplicate_is_an_error_naming_the_member_as_renamed():
    rules = Grouping(rename_files=lambda name: name.replace("x", "y"))
    with pytest.raises(SampleError) as info:
        grouped(members("a.y", "a.x"), rules)  # "a.x" is renamed "a.y"
    assert info.value.member == "a.y" and info.value.offset == 1024
    got, _ = grouped(members("a.x", "a.y", "a.z", "b.x"), rules, handler=ignore_and_continue)
    assert [s and s["__key__"] for s, _ in got] == [None, None, "b"]  # a dropped whole


def test_a_handler_that_stops_ends_without_the_last_sample():
    got, _ = grouped(members("a.x", "a.x", "b.x"), handler=ignore_and_stop)
    assert got == [(None, 0)]
    rules = Grouping(keys=lambda name: 1 / 0)
    assert grouped(members("a.x"), rules, handler=ignore_and_stop)[0] == []


def test_count_raw_counts_a_sample_filtered_out_and_keys_it_by_its_first_kept_member():
    rules = Grouping(
        select_files=lambda name: not name.endswith(".cls"),
        rename_files=lambda name: "k/" + name,
        count_raw=True,
    )
    got, _ = grouped(members("a.cls", "b.cls", "b.jpg", "c.cls"), rules)
    assert [s if s in (None, ALL_FILTERED) else s["__key__"] for s, _ in got] == [
        None,
        ALL_FILTERED,  # a: counted, nothing kept
        "k/b",
        ALL_FILTERED,
    ]
    assert [start for _, start in got] == [0, 1024, 3072, END]


def test_an_end_without_the_marker_gives_the_last_sample_only_if_asked():
    def cut():
        yield from members("a.x", "b.x")
        raise EndWithoutMarker("cut", url="u.tar")

    with pytest.raises(EndWithoutMarker):
        grouped(cut())
    got, notes = grouped(cut(), Grouping(unmarked_end=True))
    assert got[-1] == ({"__key__": "b", "__url__": "u.tar", "x": b"b.x"}, END)
    assert isinstance(notes.unmarked, EndWithoutMarker)


def test_group_by_keys_custom_keys_suffixes_and_errors(caplog):
    def keys(name):
        if name.startswith("bad"):
            raise ValueError(name)
        return base_plus_ext(name)

    src = [
        {"fname": n, "data": d, "__url__": "u", "__offset__": o}
        for n, d, o in members("a.jpg", "a.cls", "bad.x", "b.jpg", "c")
    ]
    stage = group_by_keys(keys=keys, suffixes=["cls"], handler=ignore_and_continue)
    with caplog.at_level(logging.WARNING, logger="webds"):
        got = list(stage(iter(src)))
    assert got == [
        {"__key__": "a", "__url__": "u", "cls": b"a.cls"},
        {"__key__": "b", "__url__": "u"},
    ]
    assert any("skipped 1 member" in r.getMessage() for r in caplog.records)
    # Members fed to group_by_keys directly are grouped as given: metadata names included.
    meta = [{"fname": "__index__/x.json", "data": b"[]", "__url__": "u"}]
    assert [s["__key__"] for s in group_by_keys()(iter(meta))] == ["__index__/x"]


def test_group_by_keys_gives_each_shards_last_sample_before_reading_on():
    pulled = []

    def src():
        for item in (
            {"fname": "a.x", "data": b"1", "__url__": "s1"},
            {},
            {"fname": "a.x", "data": b"2", "__url__": "s2"},
            {"fname": "a.y", "data": b"3", "__url__": "s3"},  # a new shard, no marker
            {"__bad__": True, "__url__": "s3"},  # broken: its sample in flight is dropped
        ):
            pulled.append(item)
            yield item

    got = []
    for sample in group_by_keys()(src()):
        got.append((sample["__url__"], len(pulled)))
    assert got == [("s1", 2), ("s2", 4)]


def test_both_readers_group_alike(tar_factory):
    names = ["__meta__", "a/x.JPG", "a/x.cls", "b.seg.png", "b.jpg", "noext", "c.jpg", "b.cls"]
    path = tar_factory("s.tar", [(name, name.encode()) for name in names])
    streamed = list(tarfile_samples([{"url": str(path)}]))
    stepped = list(
        DataPipeline(({"url": str(path)},), url_opener(), tar_file_expander(), group_by_keys())
    )
    assert streamed == stepped
    assert [s["__key__"] for s in streamed] == ["a/x", "b", "c", "b"]
