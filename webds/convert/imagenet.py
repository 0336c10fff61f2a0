"""ImageNet's tar of tars -> uniformly shuffled WebDataset shards: :func:`convert_imagenet`.

ImageNet's training tar holds one tar per class; shards written in that order hold one class
each, which wrecks training, so the converter writes a uniformly random permutation of all
samples with bounded memory, without extracting the original layout to disk. The shuffle itself
(two passes through temporary bucket files) is :mod:`webds.convert.imagenet_shuffle`; the flat
validation tar is written in its own order, labelled by :mod:`webds.convert.imagenet_labels`.
Temporary files, bounds, label formats, errors: docs/convert-imagenet.md.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import ArgumentError, EncodeError, ShardReadError
from ..io.urls import local_path, open_url, url_scheme
from ..shards.index import default_index_name
from ..shardwriter import ShardWriter
from ..tar.reader import read_members
from ..tarwriter import check_key
from .folders import write_classes
from .imagenet_labels import _Labels, _read_labels
from .imagenet_shuffle import _gather, _input_size, _plan_buckets, _scatter, _split_image_name

__all__ = ["convert_imagenet"]


def convert_imagenet(
    train_tar: Optional[str],
    pattern: Optional[str] = None,
    *,
    val_tar: Optional[str] = None,
    val_labels: Optional[str] = None,
    val_pattern: Optional[str] = None,
    classes: Union[str, Sequence[str], None] = None,
    maxcount: int = 10000,
    maxsize: float = 3e9,
    seed: int = 0,
    memory: float = 2e9,
    tmpdir: Optional[str] = None,
    with_json: bool = False,
    storage_options: Optional[Mapping[str, Any]] = None,
    progress: bool = True,
) -> Dict[str, Any]:
    """Convert ImageNet's training tar of class tars (and its validation tar) into shuffled shards.

    ``train_tar`` (a path, URL, ``-`` or ``pipe:CMD``; None: validation set only) is read once, as
    a stream; its images go, as their original bytes, to ``pattern`` (``"out/train-%06d.tar"``,
    local or remote; ``maxcount`` / ``maxsize`` per shard) in a uniformly random order fixed by
    ``seed``, using about ``memory`` bytes of RAM and the dataset's size in temporary files under
    ``tmpdir``; ``classes.json`` and ``train.index.json`` go beside them. ``val_tar`` (flat) is
    written in its own order to ``val_pattern`` (default: ``pattern`` with ``train`` in its file
    name replaced by ``val``), labelled from the file ``val_labels``; without ``train_tar``,
    ``classes`` (synsets, or a ``classes.json``) numbers the classes. ``with_json`` adds ``"json":
    {"synset": ...}``; ``storage_options`` go to fsspec; ``progress`` shows bars on stderr.

    Returns ``{"classes": n, "classes_json": path, "train": {"samples", "shards", "index",
    "buckets", "splits", "temp_bytes"}, "val": {...}, "seconds": s}`` (None: not converted). Bad
    input raises :class:`~webds.errors.ShardReadError`, a bad argument or label file
    :class:`~webds.errors.ArgumentError`. See [Converting ImageNet](../convert-imagenet.md)::

        convert_imagenet("ILSVRC2012_img_train.tar", "/data/in1k/train-%06d.tar", memory=8e9)
    """
    options = dict(storage_options or {})
    if val_tar is not None and not val_pattern and pattern:
        val_pattern = default_val_pattern(pattern)
    _check_arguments(
        train_tar, pattern, val_tar, val_labels, val_pattern, classes, maxcount, maxsize, seed
    )
    if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not memory > 0:
        raise ArgumentError(f"memory must be a positive number of bytes, got {memory!r}")
    started = time.perf_counter()
    labels = _read_labels(val_labels, options) if val_tar is not None else None
    summary: Dict[str, Any] = {"classes": None, "classes_json": None, "train": None, "val": None}
    if train_tar is not None:
        assert pattern is not None
        synsets, summary["train"] = _convert_train(
            train_tar,
            pattern,
            labels=labels,
            maxcount=maxcount,
            maxsize=maxsize,
            seed=seed,
            memory=memory,
            tmpdir=tmpdir,
            with_json=with_json,
            options=options,
            progress=progress,
        )
        summary["classes_json"] = _write_classes(pattern, synsets, options)
    else:
        synsets = _load_classes(classes, options)
    summary["classes"] = len(synsets)
    if val_tar is not None:
        assert labels is not None and val_pattern is not None
        summary["val"] = _convert_val(
            val_tar,
            val_pattern,
            labels,
            maxcount=maxcount,
            maxsize=maxsize,
            synsets=synsets,
            with_json=with_json,
            options=options,
            progress=progress,
        )
    summary["seconds"] = time.perf_counter() - started
    return summary


def default_val_pattern(pattern: str) -> Optional[str]:
    """The validation shards beside the training shards: the last ``train`` in the file name
    becomes ``val`` (``out/train-%06d.tar`` -> ``out/val-%06d.tar``); None if there is none."""
    head, sep, name = pattern.rpartition("/")
    at = name.rfind("train")
    if at < 0:
        return None
    return head + sep + name[:at] + "val" + name[at + len("train") :]


def _check_arguments(
    train_tar: Any,
    pattern: Any,
    val_tar: Any,
    val_labels: Any,
    val_pattern: Any,
    classes: Any,
    maxcount: Any,
    maxsize: Any,
    seed: Any,
) -> None:
    if train_tar is None and val_tar is None:
        raise ArgumentError("nothing to convert: give a training tar, a validation tar or both")
    if train_tar is not None:
        if not pattern:
            raise ArgumentError(
                "give the output shard pattern for the training set, e.g. 'out/train-%06d.tar'"
            )
        if classes is not None:
            raise ArgumentError(
                "classes= is for converting a validation set alone; with a training tar the "
                "classes are its synsets, sorted"
            )
    elif classes is None:
        raise ArgumentError(
            "without a training tar, give classes= (the classes.json written with the training "
            "shards, or a list of synsets) so validation labels map to the same indices"
        )
    if val_tar is not None:
        if val_labels is None:
            raise ArgumentError(
                "the validation tar needs a label file (val_labels / --val-labels), e.g. "
                "Kaggle's LOC_val_solution.csv"
            )
        if not val_pattern:
            raise ArgumentError(
                "give the output shard pattern for the validation set (val_pattern / "
                "--val-output), e.g. 'out/val-%06d.tar' (it defaults to the training pattern "
                "with 'train' in its file name replaced by 'val')"
            )
        if val_pattern == pattern:
            raise ArgumentError("the training and validation shard patterns must differ")
    elif val_labels is not None or val_pattern is not None:
        raise ArgumentError("val_labels and val_pattern need a validation tar (val_tar / --val)")
    if isinstance(maxcount, bool) or not isinstance(maxcount, int) or maxcount < 1:
        raise ArgumentError(f"maxcount must be a positive int, got {maxcount!r}")
    if isinstance(maxsize, bool) or not isinstance(maxsize, (int, float)) or not maxsize > 0:
        raise ArgumentError(f"maxsize must be a positive number of bytes, got {maxsize!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ArgumentError(f"seed must be an int, got {seed!r}")


# ---------------------------------------------------------------------------------------------
# The training set, its output and temporary folders
# ---------------------------------------------------------------------------------------------


def _convert_train(
    train_tar: str,
    pattern: str,
    *,
    labels: Optional[_Labels],
    maxcount: int,
    maxsize: float,
    seed: int,
    memory: float,
    tmpdir: Optional[str],
    with_json: bool,
    options: Dict[str, Any],
    progress: bool,
) -> Tuple[List[str], Dict[str, Any]]:
    k = _plan_buckets(_input_size(train_tar), memory)
    _make_output_folder(pattern)
    work = tempfile.mkdtemp(prefix=".webds-imagenet-", dir=_temp_root(tmpdir, pattern))
    try:
        with open_url(train_tar, "rb", **options) as stream:
            with _bar(progress, f"reading {train_tar}") as bar:
                scatter = _scatter(stream, train_tar, work, k, memory, seed, bar)
        synsets = sorted(scatter.synsets)
        if labels is not None:
            labels.resolve(synsets)  # a bad label file fails now, not after the shards
        writer = ShardWriter(
            pattern, maxcount=maxcount, maxsize=maxsize, encoder=False, storage_options=options
        )
        with writer, _bar(progress, f"writing {pattern}", scatter.samples) as bar:
            splits = _gather(scatter, writer, work, memory, with_json, bar)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return synsets, {
        "samples": writer.total,
        "shards": list(writer.shards),
        "index": default_index_name(pattern) if writer.index is not None else None,
        "buckets": k,
        "splits": splits,
        "temp_bytes": scatter.nbytes,
    }


def _temp_root(tmpdir: Optional[str], pattern: str) -> str:
    if tmpdir is not None:
        try:
            os.makedirs(tmpdir, exist_ok=True)
        except OSError as exn:
            raise ArgumentError(f"cannot use tmpdir {tmpdir!r}: {exn}") from None
        return tmpdir
    path = _local_pattern_path(pattern)
    if path is not None:
        return os.path.dirname(os.path.abspath(path))
    return tempfile.gettempdir()


def _local_pattern_path(pattern: str) -> Optional[str]:
    if pattern == "-" or url_scheme(pattern) == "pipe":
        return None
    return local_path(pattern)


def _make_output_folder(pattern: str) -> None:
    path = _local_pattern_path(pattern)
    if path is not None:
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exn:
            raise ArgumentError(f"cannot create the output folder {folder!r}: {exn}") from None


class _NoBar:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _bar(progress: bool, desc: str, total: Optional[int] = None) -> Any:
    if not progress:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(desc=desc, total=total, unit=" samples", file=sys.stderr, leave=False)


# ---------------------------------------------------------------------------------------------
# classes.json
# ---------------------------------------------------------------------------------------------


def _write_classes(pattern: str, synsets: List[str], options: Dict[str, Any]) -> Optional[str]:
    """classes.json beside the shards (none for shards written into a pipe)."""
    if _local_pattern_path(pattern) is None and (pattern == "-" or url_scheme(pattern) == "pipe"):
        return None
    return write_classes(pattern, synsets, options)


def _load_classes(classes: Union[str, Sequence[str], None], options: Dict[str, Any]) -> List[str]:
    if isinstance(classes, (str, os.PathLike)):
        source = os.fspath(classes)
        try:
            with open_url(source, "rb", **options) as f:
                doc = json.loads(f.read().decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as exn:
            raise ArgumentError(f"{source!r} is not a classes.json file: {exn}") from None
        names = doc.get("classes") if isinstance(doc, dict) else doc
    else:
        source, names = "classes", classes
    if (
        not isinstance(names, (list, tuple))
        or not names
        or not all(isinstance(n, str) and n for n in names)
        or len(set(names)) != len(names)
    ):
        raise ArgumentError(
            f"{source!r} must be a non-empty list of distinct class names, or a classes.json "
            'with {"classes": [...]}'
        )
    return list(names)


# ---------------------------------------------------------------------------------------------
# The flat validation tar
# ---------------------------------------------------------------------------------------------


def _convert_val(
    val_tar: str,
    pattern: str,
    label_file: _Labels,
    *,
    maxcount: int,
    maxsize: float,
    synsets: List[str],
    with_json: bool,
    options: Dict[str, Any],
    progress: bool,
) -> Dict[str, Any]:
    labels = label_file.resolve(synsets)
    positional = isinstance(labels, list)
    cls_of = [str(i).encode() for i in range(len(synsets))]
    json_of = [json.dumps({"synset": s}).encode() for s in synsets]
    _make_output_folder(pattern)
    seen = set()
    previous: Optional[str] = None
    count = 0
    writer = ShardWriter(
        pattern, maxcount=maxcount, maxsize=maxsize, encoder=False, storage_options=options
    )
    with open_url(val_tar, "rb", **options) as stream, writer:
        with _bar(progress, f"writing {pattern}") as bar:
            for name, data, _ in read_members(stream, url=val_tar):
                stem, field = _split_image_name(name)
                if field is None:
                    raise ShardReadError(
                        f"{name!r} in the validation tar is not a JPEG; the validation tar "
                        "must hold only images (ILSVRC2012_val_00000001.JPEG ...)",
                        url=val_tar,
                        member=name,
                    )
                try:
                    check_key(stem)
                except EncodeError as exn:
                    raise ShardReadError(
                        f"{name!r} cannot be a sample key: {exn.message}",
                        url=val_tar,
                        member=name,
                    ) from None
                base = name.rsplit("/", 1)[-1]
                if positional:
                    if previous is not None and base <= previous:
                        raise ArgumentError(
                            f"the validation tar is not in sorted file-name order ({base!r} "
                            f"after {previous!r}), but the label file {label_file.source!r} "
                            "gives one label per line in that order; use a label file that "
                            "names the files (LOC_val_solution.csv, or 'FILE LABEL' lines)"
                        )
                    if count >= len(labels):
                        raise ArgumentError(
                            f"the label file {label_file.source!r} has {len(labels)} labels but "
                            f"the validation tar holds more images ({name!r} has none)"
                        )
                    idx = labels[count]  # type: ignore[index]
                else:
                    if stem in seen:
                        raise ShardReadError(
                            f"the validation tar holds {stem!r} twice",
                            url=val_tar,
                            member=name,
                        )
                    seen.add(stem)
                    found = labels.get(stem)  # type: ignore[union-attr]
                    if found is None:
                        raise ArgumentError(
                            f"the label file {label_file.source!r} has no label for {stem!r} "
                            f"(member {name!r} of {val_tar!r}); give the label file of this "
                            "validation set"
                        )
                    idx = found
                previous = base
                sample = {"__key__": stem, field: data, "cls": cls_of[idx]}
                if with_json:
                    sample["json"] = json_of[idx]
                writer.write(sample)
                count += 1
                if bar is not None:
                    bar.update(1)
            if count == 0:
                raise ShardReadError("the validation tar holds no images", url=val_tar)
            if positional and count != len(labels):
                raise ArgumentError(
                    f"the label file {label_file.source!r} has {len(labels)} labels but the "
                    f"validation tar holds {count} images; labels by position need exactly "
                    "one per image (the validation shards written are incomplete)"
                )
    return {
        "samples": writer.total,
        "shards": list(writer.shards),
        "index": default_index_name(pattern) if writer.index is not None else None,
    }
