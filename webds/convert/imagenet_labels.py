"""ImageNet's validation label files, read for
:func:`~webds.convert.imagenet.convert_imagenet`.

A label file (path or URL) is in one of these forms:

- Kaggle's ``LOC_val_solution.csv``: ``ImageId,PredictionString``, the synset first;
- ``FILE LABEL`` per line (space or comma between), e.g. ``ILSVRC2012_val_00000001.JPEG
  n01751748``, or Caffe's ``val.txt`` with 0-based class indices;
- one ``LABEL`` per line for the images in sorted file-name order.

A LABEL is a synset or a 0-based index into the sorted synsets. The devkit's
``ILSVRC2012_validation_ground_truth.txt`` is refused, with a message that says why: its
1-based ILSVRC2012 ids follow the devkit's own class order, which only the devkit's ``meta.mat``
maps to synsets. Every problem raises :class:`~webds.errors.ArgumentError` naming the file and
the line.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

from ..errors import ArgumentError
from ..io.urls import open_url


def _image_stem(name: str) -> str:
    base = name.rsplit("/", 1)[-1]
    stem, dot, _ = base.rpartition(".")
    return stem if dot and stem else base


@dataclass
class _Labels:
    source: str
    named: bool  # entries name their image; else they follow sorted file-name order
    entries: List[Tuple[int, Optional[str], str]]  # (line number, image stem, label)

    def resolve(self, synsets: List[str]) -> Union[List[int], Dict[str, int]]:
        """The labels as class indices: a list (positional) or a dict by image stem."""
        index_of = {s: i for i, s in enumerate(synsets)}
        n = len(synsets)
        values = []
        for line, _, label in self.entries:
            idx = index_of.get(label)
            if idx is None and label.isdigit():
                idx = int(label)
                if idx >= n:
                    raise ArgumentError(
                        f"line {line} of {self.source!r}: class index {idx} is out of range "
                        f"0..{n - 1}. Integer labels are 0-based indices into the sorted "
                        "synsets; ILSVRC2012_validation_ground_truth.txt holds 1-based "
                        "ILSVRC2012 ids in the devkit's order, which need the devkit to map: "
                        "use LOC_val_solution.csv or a file of synsets instead"
                    )
            if idx is None:
                raise ArgumentError(
                    f"line {line} of {self.source!r}: unknown class {label!r}; it is not one "
                    f"of the {n} training classes (e.g. {synsets[0]!r}): the validation labels "
                    "must use the training set's synsets (or 0-based indices)"
                )
            values.append(idx)
        if not self.named:
            return values
        by_name: Dict[str, int] = {}
        for (line, stem, _), idx in zip(self.entries, values):
            assert stem is not None
            if stem in by_name:
                raise ArgumentError(f"line {line} of {self.source!r}: {stem!r} is labelled twice")
            by_name[stem] = idx
        return by_name


_KAGGLE_HEADER = "imageid,predictionstring"


def _read_labels(source: Optional[str], options: Dict[str, Any]) -> _Labels:
    assert source is not None
    source = os.fspath(source)
    with open_url(source, "rb", **options) as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ArgumentError(f"label file {source!r} is not UTF-8 text") from None
    lines = [
        (n, line.strip())
        for n, line in enumerate(text.splitlines(), 1)
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not lines:
        raise ArgumentError(f"label file {source!r} is empty")
    entries: List[Tuple[int, Optional[str], str]] = []
    if re.sub(r"\s", "", lines[0][1]).lower().startswith(_KAGGLE_HEADER):
        for n, line in lines[1:]:
            image, comma, prediction = line.partition(",")
            words = prediction.split()
            if not comma or not image.strip() or not words:
                raise ArgumentError(
                    f"line {n} of {source!r}: expected 'ImageId,PredictionString' with the "
                    f"synset first (Kaggle's LOC_val_solution.csv), got {line[:80]!r}"
                )
            entries.append((n, _image_stem(image.strip()), words[0]))
        if not entries:
            raise ArgumentError(f"label file {source!r} has a header but no labels")
        return _Labels(source, True, entries)
    for n, line in lines:
        words = re.split(r"[\s,]+", line)
        if len(words) == 1:
            entries.append((n, None, words[0]))
        elif len(words) == 2:
            entries.append((n, _image_stem(words[0]), words[1]))
        else:
            raise ArgumentError(
                f"line {n} of {source!r}: expected one label (a synset such as n01440764, or a "
                f"0-based class index) or 'FILE LABEL', got {line[:80]!r}"
            )
    named = entries[0][1] is not None
    for n, stem, _ in entries:
        if (stem is not None) != named:
            raise ArgumentError(
                f"line {n} of {source!r}: mixes 'LABEL' and 'FILE LABEL' lines; use one form"
            )
    if (
        not named
        and "ground_truth" in source.rsplit("/", 1)[-1].lower()
        and all(label.isdigit() for _, _, label in entries)
    ):
        raise ArgumentError(
            f"{source!r} looks like ILSVRC2012_validation_ground_truth.txt: its 1-based "
            "ILSVRC2012 ids follow the devkit's class order, which only the devkit's meta.mat "
            "maps to synsets. Use Kaggle's LOC_val_solution.csv, or a file with one synset "
            "per line"
        )
    return _Labels(source, named, entries)
